"""The control socket, over a real Unix socket: protocol, misbehaving clients, permissions, restarts."""
import errno
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest


from gpuwatch.agent import control, wire
from gpuwatch.agent.api import frozen
from gpuwatch.agent.control import ControlError, ControlServer, call
from tests.conftest import spawn_at_pid


@frozen
class EchoParams(wire.Message):
    """The test server's params: two optional fields it echoes back."""

    verbose: bool = wire.wire(wire.Bool(), False)
    a: int = wire.wire(wire.Int(), 0)


TYPES = {"status": EchoParams, "boom": wire.NoParams, "refuse": wire.NoParams, "bad": wire.NoParams}


def status(params, peer):
    return {"up": True, "echo": params.to_json(), "peer": {"pid": peer.pid, "uid": peer.uid, "gid": peer.gid,
                                                  "root": peer.is_root}}


def boom(params, peer):
    raise RuntimeError("NVML exploded")


def refuse(params, peer):
    raise ControlError("pid 1 is not yours to trace")


def not_json(params, peer):
    return {"x": object()}


@pytest.fixture
def sock_path(tmp_path):
    return str(tmp_path / "run" / "control.sock")


@pytest.fixture
def server(sock_path):
    srv = ControlServer(sock_path, {"status": status, "boom": boom, "refuse": refuse, "bad": not_json},
                        timeout=0.5, max_clients=4, types=TYPES)
    srv.start()
    yield srv
    srv.stop()


def serving(srv) -> dict[int, int]:
    """The connections the server is serving now, by uid."""
    with srv._stats_lock:
        return dict(srv._held)


def raw(path, payload: bytes, shut=False, timeout=3.0) -> list[dict]:
    """Send bytes, read reply lines until the server closes or stops talking."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    try:
        s.sendall(payload)
    except BrokenPipeError:
        pass
    if shut:
        s.shutdown(socket.SHUT_WR)
    buf = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
            if shut is False and buf.endswith(b"\n"):
                break
    except (socket.timeout, ConnectionResetError):
        pass
    s.close()
    return [json.loads(line) for line in buf.splitlines() if line.strip()]


def test_status_round_trip_with_peer_credentials(server, sock_path):
    r = call(sock_path, "status", {"verbose": True})
    assert r["up"] is True and r["echo"] == {"verbose": True, "a": 0}
    assert r["peer"] == {"pid": os.getpid(), "uid": os.getuid(), "gid": os.getgid(), "root": os.getuid() == 0}


def test_several_requests_on_one_connection(server, sock_path):
    replies = raw(sock_path, b'{"method":"status"}\n{"method":"status","params":{"a":1}}\n', shut=True)
    assert [r["ok"] for r in replies] == [True, True]
    assert replies[1]["result"]["echo"] == {"verbose": False, "a": 1}


def test_last_request_without_newline_before_half_close(server, sock_path):
    assert raw(sock_path, b'{"method":"status"}', shut=True)[0]["ok"] is True


@pytest.mark.parametrize("payload, error", [
    (b"{not json\n", "malformed request: not JSON"),
    (b"[1, 2]\n", "malformed request: expected a JSON object"),
    (b'{"method": "status", "params": [1]}\n', "params must be a JSON object"),
    (b'{"method": "nope"}\n', "unknown method 'nope'; known methods: bad, boom, refuse, status"),
    (b'{"params": {}}\n', "unknown method None"),
    (b'\xff\xfe\n', "malformed request: not JSON"),
    (b"[" * 50000 + b"\n", "malformed request: JSON nested too deeply"),
])
def test_bad_requests_get_an_error_reply(server, sock_path, payload, error):
    (reply,) = raw(sock_path, payload)
    assert reply["ok"] is False and error in reply["error"]
    assert call(sock_path, "status")["up"]  # and the server is fine


def test_handler_exception_is_an_error_reply(server, sock_path):
    with pytest.raises(ControlError, match="boom failed in the agent: RuntimeError: NVML exploded"):
        call(sock_path, "boom")
    with pytest.raises(ControlError, match="^pid 1 is not yours to trace$"):
        call(sock_path, "refuse")
    with pytest.raises(ControlError, match="result is not JSON"):
        call(sock_path, "bad")
    assert call(sock_path, "status")["up"]


def test_huge_request(server, sock_path):
    (reply,) = raw(sock_path, b'{"method": "status", "params": {"x": "' + b"a" * 200_000 + b'"}}\n')
    assert reply == {"ok": False, "error": "request too large (over 65536 bytes)"}
    with pytest.raises(ControlError, match="request too large"):
        call(sock_path, "status", {"x": "a" * 70_000})
    assert call(sock_path, "status")["up"]


def test_client_disconnecting_mid_request(server, sock_path):
    for _ in range(10):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(sock_path)
        s.sendall(b'{"method": "sta')
        s.close()
    assert call(sock_path, "status")["up"]


def test_slow_client_times_out(server, sock_path):
    t0 = time.monotonic()
    (reply,) = raw(sock_path, b'{"method": "sta')  # never finishes its request
    assert time.monotonic() - t0 < 2.0
    assert reply == {"ok": False, "error": "no complete request within 0.5 s"}
    (reply,) = raw(sock_path, b"")  # never sends anything
    assert reply["ok"] is False


def test_concurrent_clients(sock_path):
    srv = ControlServer(sock_path, {"status": status}, types=TYPES)
    srv.start()
    results, errors = [], []

    def client():
        for _ in range(10):
            try:
                results.append(call(sock_path, "status")["up"])
            except Exception as e:  # pragma: no cover - reported below
                errors.append(e)

    threads = [threading.Thread(target=client) for _ in range(12)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        srv.stop()
    assert errors == [] and results == [True] * 120


def test_clients_over_the_limit_are_told_the_agent_is_busy(sock_path):
    server = ControlServer(sock_path, {"status": status}, types=TYPES, timeout=3.0, max_clients=4)
    server.start()
    idle = []
    try:
        for _ in range(4):  # hold every slot with a client that sends nothing
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(sock_path)
            idle.append(s)
        with pytest.raises(ControlError, match="busy with 4 control clients"):
            call(sock_path, "status")
        for s in idle:
            s.close()
        assert call(sock_path, "status")["up"]
    finally:
        for s in idle:
            s.close()
        server.stop()


def test_socket_and_directory_permissions(server, sock_path):
    st = os.stat(sock_path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
    assert stat.S_IMODE(os.stat(os.path.dirname(sock_path)).st_mode) == 0o750
    assert [n for n in os.listdir(os.path.dirname(sock_path))] == ["control.sock"]  # no temp left


def test_socket_group(tmp_path):
    # Root may give the socket to any group; others only to a group they are in.
    gid = 65534 if os.geteuid() == 0 else (os.getgroups() or [os.getgid()])[-1]
    path = str(tmp_path / "g" / "c.sock")
    srv = ControlServer(path, {"status": status}, types=TYPES, group=str(gid), timeout=0.5)
    srv.start()
    try:
        assert os.stat(path).st_gid == gid
        assert os.stat(os.path.dirname(path)).st_gid == gid
    finally:
        srv.stop()
    with pytest.raises(ControlError, match="no such group 'no-such-group-gw'"):
        ControlServer(path, {}, group="no-such-group-gw").start()


def test_stop_removes_the_socket_and_is_idempotent(server, sock_path):
    server.stop()
    assert not os.path.exists(sock_path)
    server.stop()
    with pytest.raises(ControlError, match="no gpuwatch agent is listening on"):
        call(sock_path, "status")


def test_stale_socket_is_replaced(sock_path):
    os.makedirs(os.path.dirname(sock_path))
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(sock_path)  # what a killed agent leaves behind: a socket file nobody listens on
    dead.close()
    with pytest.raises(ControlError, match="no gpuwatch agent is listening on"):
        call(sock_path, "status")
    srv = ControlServer(sock_path, {"status": status}, types=TYPES)
    srv.start()
    try:
        assert call(sock_path, "status")["up"]
    finally:
        srv.stop()


def test_second_server_on_a_live_socket_is_refused(server, sock_path):
    with pytest.raises(ControlError, match="another gpuwatch agent is already listening on"):
        ControlServer(sock_path, {"status": status}, types=TYPES).start()
    assert call(sock_path, "status")["up"]  # the first one is untouched


def test_a_regular_file_in_the_way_is_not_deleted(tmp_path):
    path = tmp_path / "control.sock"
    path.write_text("precious")
    with pytest.raises(ControlError, match="exists and is not a socket"):
        ControlServer(str(path), {}).start()
    assert path.read_text() == "precious"


def test_client_messages(tmp_path):
    missing = str(tmp_path / "none.sock")
    with pytest.raises(ControlError) as e:
        call(missing, "status")
    assert str(e.value) == (f"no gpuwatch agent is listening on {missing} "
                            "(is `gpuwatch agent` / the gpuwatch service running?)")


_NOBODY_CALL = """
import sys
from gpuwatch.agent.control import ControlError, call
try:
    print(call(sys.argv[1], "status")["peer"])
except ControlError as e:
    print(e)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
@pytest.mark.parametrize("group", [None, "65534"])
def test_access_for_other_users_is_the_socket_group(group):
    import tempfile
    base = tempfile.mkdtemp(prefix="gpuwatch-ctl-")
    os.chmod(base, 0o755)
    path = os.path.join(base, "c.sock")
    srv = ControlServer(path, {"status": status}, types=TYPES, group=group)
    srv.start()
    try:
        # setpriv rather than subprocess's user=: that one cannot exec a venv's python here
        out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                              "-c", _NOBODY_CALL, path], capture_output=True, text=True, timeout=30, cwd="/")
        if group is None:
            assert out.stdout.strip() == (f"permission denied on {path}: run as root or as a member "
                                          "of the socket's group"), out.stderr
        else:  # a member of the socket's group gets in, and is seen as who it is
            assert "'uid': 65534, 'gid': 65534, 'root': False" in out.stdout, out.stdout + out.stderr
    finally:
        srv.stop()
        os.rmdir(base)


def test_agent_that_never_answers(tmp_path):
    path = str(tmp_path / "mute.sock")
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mute.bind(path)
    mute.listen(1)
    try:
        with pytest.raises(ControlError, match="did not answer 'status' within 0.2 s"):
            call(path, "status", timeout=0.2)
    finally:
        mute.close()


# -- the peer is a process; slots; idle connections; counters (issue 17) ------------------------------

def _inherited(path: str) -> tuple[socket.socket, int]:
    """A connection made by a child that has exited since, held by this process."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    child = os.fork()
    if child == 0:
        try:
            s.connect(path)
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    return s, child


def _replies(s: socket.socket, send: bytes = b"", timeout: float = 5.0) -> list[dict]:
    s.settimeout(timeout)
    try:
        if send:
            s.sendall(send)
    except OSError:
        pass
    buf = b""
    try:
        while chunk := s.recv(65536):
            buf += chunk
    except OSError:
        pass
    s.close()
    return [json.loads(line) for line in buf.splitlines()]


@pytest.fixture(params=["pidfd", "pidfd of a running process only", "pid and start time"])
def peer_server(request, sock_path, monkeypatch):
    if request.param == "pid and start time":  # as on kernels before 6.5: no SO_PEERPIDFD
        monkeypatch.setattr("gpuwatch.agent.control.SO_PEERPIDFD", -1)
    elif request.param == "pidfd of a running process only":  # as on 6.5 to 6.15: none once reaped
        real = control._sockopt_pidfd

        def before_6_16(conn):
            fd = real(conn)
            if control._readable(fd, 0):
                os.close(fd)
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
            return fd
        monkeypatch.setattr(control, "_sockopt_pidfd", before_6_16)
    srv = ControlServer(sock_path, {"status": status}, types=TYPES, timeout=3.0, idle_timeout=3.0)
    srv.start()
    yield srv
    srv.stop()


def test_a_connection_whose_process_has_exited_is_refused(peer_server, sock_path):
    s, child = _inherited(sock_path)
    (reply,) = _replies(s, b'{"method": "status"}\n')
    assert reply == {"ok": False, "error": f"the process that opened this connection (pid {child}) has exited; "
                                          f"a connection speaks only for the process that opened it"}
    assert sum(v for (m, r), v in peer_server.stats().items() if r == "gone") == 1
    assert call(sock_path, "status")["up"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to choose the next PID")
def test_a_connection_whose_pid_another_process_has_taken_is_refused(peer_server, sock_path):
    s, child = _inherited(sock_path)
    time.sleep(0.05)  # start times count clock ticks (10 ms): the new process starts on a later one
    other = spawn_at_pid(child, ["sleep", "30"], give_up=pytest.fail)
    try:
        (reply,) = _replies(s, b'{"method": "status"}\n')
        assert reply["ok"] is False and f"(pid {child}) has exited" in reply["error"]
    finally:
        other.kill()
        other.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to choose the next PID and play another user")
def test_a_connection_accepted_after_its_pid_went_to_another_users_process_is_refused(peer_server, sock_path,
                                                                                      monkeypatch):
    # The server reads the peer's credentials only once it accepts: on a busy machine the process
    # that connected may have exited, and its PID gone to another user's process, before that.
    accept = threading.Event()
    real = control._peercred

    def held(conn):
        accept.wait(10)
        return real(conn)
    monkeypatch.setattr(control, "_peercred", held)
    s, child = _inherited(sock_path)
    time.sleep(0.05)  # start times count clock ticks (10 ms): the new process starts on a later one
    other = spawn_at_pid(child, ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sleep", "30"],
                         give_up=pytest.fail)
    try:
        assert wait_until(lambda: os.stat(f"/proc/{child}").st_uid == 65534)  # setpriv has dropped to nobody
        accept.set()
        (reply,) = _replies(s, b'{"method": "status"}\n')
        assert reply == {"ok": False, "error": f"the process that opened this connection (pid {child}) has exited; "
                                              f"a connection speaks only for the process that opened it"}
    finally:
        other.kill()
        other.wait()


def test_the_connection_closes_when_its_process_exits(sock_path):
    # With a pidfd the server hears of the exit at once, idle timeout or not.
    srv = ControlServer(sock_path, {"status": status}, types=TYPES, timeout=30.0, idle_timeout=30.0)
    srv.start()
    try:
        t0 = time.monotonic()
        s, child = _inherited(sock_path)
        (reply,) = _replies(s)
        assert time.monotonic() - t0 < 2.0 and f"(pid {child}) has exited" in reply["error"]
        assert wait_until(lambda: serving(srv) == {})
    finally:
        srv.stop()


def wait_until(cond, timeout: float = 3.0) -> bool:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def test_idle_connections_are_closed_but_a_request_in_progress_has_its_timeout(sock_path):
    srv = ControlServer(sock_path, {"status": status}, types=TYPES, timeout=2.0, idle_timeout=0.3)
    srv.start()
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(sock_path)
        t0 = time.monotonic()
        s.sendall(b'{"method": "status"}\n')  # one request, then nothing
        replies = _replies(s)
        assert 0.3 <= time.monotonic() - t0 < 1.5
        assert replies[0]["ok"] is True
        assert replies[1] == {"ok": False, "error": "closed: no request within 0.3 s (idle connections are closed)"}
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(sock_path)
        s.sendall(b'{"method": "sta')  # begun: it has the request timeout, not the idle one
        t0 = time.monotonic()
        (reply,) = _replies(s)
        assert time.monotonic() - t0 >= 1.5 and reply["error"] == "no complete request within 2 s"
        assert srv.stats()[("none", "idle")] == 1 and srv.stats()[("unknown", "timeout")] == 1
    finally:
        srv.stop()


def _holder(path: str, uid: int, n: int):
    """A process of user `uid` (group 65534) that opens n connections and holds those it got.
    Returns (pid, what each connection got: "held" or the busy reply, a pipe to let it go)."""
    out_r, out_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setresgid(65534, 65534, 65534)
            os.setresuid(uid, uid, uid)
            got, held = [], []
            for _ in range(n):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(path)
                s.settimeout(0.8)
                try:
                    data = s.recv(4096)
                except socket.timeout:
                    data = b""
                got.append(json.loads(data)["error"] if data else "held")
                held.append(s)
            os.write(out_w, json.dumps(got).encode() + b"\n")
            os.read(go_r, 1)
        finally:
            os._exit(0)
    os.close(out_w)
    os.close(go_r)
    with os.fdopen(out_r) as f:
        got = json.loads(f.readline())
    return pid, got, go_w


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to play ordinary users")
def test_slots_per_user_and_kept_for_root():
    import tempfile
    base = tempfile.mkdtemp(prefix="gpuwatch-ctl-")
    os.chmod(base, 0o755)
    path = os.path.join(base, "c.sock")
    srv = ControlServer(path, {"status": status}, types=TYPES, group="65534", timeout=10.0, idle_timeout=10.0,
                        max_clients=8, per_uid=2, root_slots=2)
    srv.start()
    holders = []
    try:
        pid, got, go = _holder(path, 65534, 3)
        holders.append((pid, go))
        assert got == ["held", "held", "you (uid 65534) already have 2 connections open to the gpuwatch agent, "
                                       "the most one user may; close one and try again"]
        for uid in (65533, 65532):
            pid, got, go = _holder(path, uid, 2)
            holders.append((pid, go))
            assert got == ["held", "held"]
        pid, got, go = _holder(path, 65531, 1)  # ordinary users hold their 6 of the 8
        holders.append((pid, go))
        assert got == ["the agent is busy: ordinary users hold all 6 of their connections (2 more are kept "
                       "for root); try again"]
        assert call(path, "status")["up"]  # root gets in
        assert wait_until(lambda: serving(srv) == {65534: 2, 65533: 2, 65532: 2})
        assert srv.stats()[("none", "busy")] == 2
    finally:
        for pid, go in holders:
            os.write(go, b"x")
            os.waitpid(pid, 0)
        srv.stop()
        os.rmdir(base)


def test_requests_are_counted_and_refusals_logged_once(server, sock_path, caplog):
    caplog.set_level("WARNING", "gpuwatch.control")
    for _ in range(5):
        with pytest.raises(ControlError):
            call(sock_path, "refuse")
    for i in range(20):  # any number of method names: one label value
        with pytest.raises(ControlError, match="unknown method"):
            call(sock_path, f"nope{i}")
    with pytest.raises(ControlError):
        call(sock_path, "status", {"a": -1})
    with pytest.raises(ControlError):
        call(sock_path, "boom")
    call(sock_path, "status")
    stats = server.stats()
    assert stats[("refuse", "refused")] == 5 and stats[("unknown", "refused")] == 20
    assert stats[("status", "refused")] == 1 and stats[("boom", "error")] == 1 and stats[("status", "ok")] == 1
    lines = [r.getMessage() for r in caplog.records if "logged once" in r.getMessage()]
    assert len([m for m in lines if "refused (unknown)" in m]) == 1
    assert len([m for m in lines if "refused (status)" in m]) == 1  # its params broke their wire type
    # A handler's refusals are counted here; its own module logs what matters (once per cause).
    assert not [m for m in lines if "refused (refuse)" in m]


def test_results_parse_as_their_wire_type(server, sock_path):
    @frozen
    class Up(wire.Result):
        up: bool = wire.wire(wire.Bool())

    assert call(sock_path, "status", result_type=Up) == Up(up=True)  # the fields it does not read: ignored

    @frozen
    class Down(wire.Result):
        up: int = wire.wire(wire.Int())

    with pytest.raises(ControlError, match=r"unexpected reply to 'status' from .*: result.up: must be an integer"):
        call(sock_path, "status", result_type=Down)
