"""agent/safefile.py against real attackers: another uid swapping directories and planting links
while root writes (the in-process agent's fallback reports, trace outputs)."""
import errno
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from gpuwatch.agent import safefile

NOBODY = 65534
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (files of other uids)")

# Swaps DIR/a and DIR/b (a directory and a symlink) with renameat2(RENAME_EXCHANGE) as fast as it
# can until killed: each name is, at any instant, the directory or the link.
SWAPPER = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD, RENAME_EXCHANGE, SYS_renameat2 = -100, 2, 316
a, b = (p.encode() for p in sys.argv[1:3])
print("swapping", flush=True)
while True:
    libc.syscall(SYS_renameat2, AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE)
"""


def _shared_dir(owner: int) -> Path:
    """A directory under /tmp (reachable by `owner`, unlike pytest's 0700 tmp_path) owned by owner."""
    d = Path(tempfile.mkdtemp(prefix="gw-safefile-"))
    d.chmod(0o755)
    os.chown(d, owner, owner)
    return d


def _swapper(a: Path, b: Path) -> subprocess.Popen:
    # The system Python: the venv's may not be readable by nobody; the swapper needs ctypes only.
    p = subprocess.Popen(["/usr/bin/python3", "-c", SWAPPER, str(a), str(b)], stdout=subprocess.PIPE,
                         user=NOBODY, group=NOBODY, extra_groups=[])
    assert p.stdout.readline() == b"swapping\n"
    return p


@root_only
def test_inprocess_reports_never_land_through_a_swapped_directory(tmp_path, monkeypatch):
    """$XDG_RUNTIME_DIR belongs to a user; root's in-process agent falls back to report files in
    $XDG_RUNTIME_DIR/gpuwatch while that user swaps gpuwatch/ with a symlink to a root-only
    directory. The old code (check the path, then mkstemp in it) wrote 223 .tmp files there."""
    from gpuwatch.probes.cupti.inprocess import InProcessAgent, Settings

    xdg = _shared_dir(NOBODY)
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    agent = InProcessAgent(Settings(socket=str(tmp_path / "no.sock")))
    notes = []
    agent._once = notes.append
    agent._write_file(agent.build_report())  # root makes $XDG_RUNTIME_DIR/gpuwatch (0700) and opens it
    real = xdg / "gpuwatch"
    assert real.is_dir() and not real.is_symlink()
    os.symlink(victim, xdg / "link")
    os.lchown(xdg / "link", NOBODY, NOBODY)
    swapper = _swapper(real, xdg / "link")
    try:
        for _ in range(2000):
            agent._write_file(agent.build_report())
    finally:
        swapper.kill()
        swapper.wait()
    assert sorted(os.listdir(victim)) == []
    # Every report went where the directory is now, whichever name it has at the end.
    landed = [p for p in (xdg / "gpuwatch", xdg / "link") if p.is_dir() and not p.is_symlink()]
    assert [sorted(os.listdir(d)) for d in landed] == [[f"gpuwatch-run-{os.getpid()}.json"]]
    assert notes == []


@root_only
def test_inprocess_report_dir_opened_through_a_planted_link_is_refused(tmp_path, monkeypatch):
    """Before the first report: the user has put gpuwatch -> a root-only directory. One note, no file."""
    from gpuwatch.probes.cupti.inprocess import InProcessAgent, Settings

    xdg = _shared_dir(NOBODY)
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    os.symlink(victim, xdg / "gpuwatch")
    os.lchown(xdg / "gpuwatch", NOBODY, NOBODY)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    agent = InProcessAgent(Settings(socket=str(tmp_path / "no.sock")))
    notes: list[str] = []
    agent._once = notes.append
    for _ in range(3):
        agent._write_file(agent.build_report())
    assert os.listdir(victim) == []
    assert len(notes) == 3 and len(set(notes)) == 1  # _once prints a text once
    assert "is a symbolic link" in notes[0] and "not following it" in notes[0], notes


def test_dir_refuses_writable_by_others_and_not_owned(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(safefile.SafeFileError, match="others may write in it"):
        safefile.Dir(str(d))
    safefile.Dir("/tmp").close()  # root's sticky directory: accepted (names are created O_EXCL)


@root_only
def test_dir_refuses_a_directory_of_another_user(tmp_path):
    d = tmp_path / "theirs"
    d.mkdir(mode=0o755)
    os.chown(d, NOBODY, NOBODY)
    with pytest.raises(safefile.SafeFileError, match="belongs to nobody"):
        safefile.write_atomic(str(d / "x"), b"x")
    assert os.listdir(d) == []


def test_write_atomic_replaces_a_link_never_writes_through_it(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("root only\n")
    (tmp_path / "out").symlink_to(secret)
    safefile.write_atomic(str(tmp_path / "out"), b"new\n")
    assert secret.read_text() == "root only\n"
    assert not (tmp_path / "out").is_symlink() and (tmp_path / "out").read_text() == "new\n"
    assert sorted(os.listdir(tmp_path)) == ["out", "secret"]


def test_create_removes_a_planted_link_and_makes_a_new_file(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("keep")
    (tmp_path / "x.events").symlink_to(secret)
    with safefile.Dir(str(tmp_path)) as d:
        fd = d.create("x.events", 0o600, os.O_RDWR)
        os.write(fd, b"abc")
        back = d.reopen("x.events", fd)
        assert os.read(back, 10) == b"abc"
        os.close(back)
        os.close(fd)
    assert secret.read_text() == "keep" and not (tmp_path / "x.events").is_symlink()


def test_symlinks_in_trusted_directories_are_followed(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "via").symlink_to("real")
    safefile.write_atomic(str(tmp_path / "via" / "f"), b"1")
    assert (tmp_path / "real" / "f").read_bytes() == b"1"


# -- gpuwatch trace's outputs (agent/trace/output.py TraceOutputs), with real links and real uids ------

def _records(n: int) -> bytes:
    from gpuwatch.probes.ebpf.events import RECORD

    return b"".join(RECORD.pack(1000 * i, 500, 0, 0, 42, 42, 0, 0, 0, 0, 0, 0, 0, 0) for i in range(n))


def _finish(outs, summary: dict | None = None, records: bytes = b"") -> None:
    """What run_trace does with its outputs at the end: records written while tracing, the summary,
    the Chrome trace from the records."""
    from rich.console import Console

    from gpuwatch.agent.trace import output as trace

    if outs.events_fd >= 0:
        with outs.events_writer() as f:
            f.write(records)
    if outs.summary is not None:
        outs.summary.file.write(json_dumps(summary or {}))
        outs.summary.commit()
    if outs.trace is not None:
        target = trace.Target(pid=42, process="p", start_time=0)
        trace._write_output(outs, {}, target, {"recorded": len(records) // 72, "not_written": 0},
                            Console(stderr=True))
    outs.close()


def json_dumps(v) -> str:
    import json

    return json.dumps(v)


def test_trace_outputs_replace_links_to_a_secret_never_write_through_them(tmp_path):
    """run.json -> the secret, run.trace.json -> the secret, run.trace.json.events -> the secret: the
    old code opened each path and overwrote the secret."""
    from gpuwatch.agent.trace import output as trace

    secret = tmp_path / "secret"
    secret.write_text("root only\n")
    secret.chmod(0o600)
    out = tmp_path / "out"
    out.mkdir()
    for name in ("run.json", "run.trace.json", "run.trace.json.events"):
        (out / name).symlink_to(secret)
    outs = trace.TraceOutputs(str(out / "run.json"), str(out / "run.trace.json"))
    _finish(outs, {"calls": 3}, _records(3))
    assert secret.read_text() == "root only\n"
    assert sorted(os.listdir(out)) == ["run.json", "run.trace.json"]
    assert not any((out / n).is_symlink() for n in os.listdir(out))
    assert json_loads((out / "run.json").read_text()) == {"calls": 3}
    events = json_loads((out / "run.trace.json").read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == 3


def json_loads(text: str):
    import json

    return json.loads(text)


@root_only
def test_trace_outputs_under_sudo_are_the_sudo_users(tmp_path, monkeypatch):
    """sudo gpuwatch trace --output: the files are created as SUDO_UID (theirs, not root's), and only
    where that user may write."""
    from gpuwatch.agent.trace import output as trace

    monkeypatch.setenv("SUDO_UID", str(NOBODY))
    monkeypatch.setenv("SUDO_GID", str(NOBODY))
    home = _shared_dir(NOBODY)
    outs = trace.TraceOutputs(str(home / "run.json"), str(home / "run.trace.json"))
    assert os.geteuid() == 0  # back to root once the files are open
    _finish(outs, {"calls": 1}, _records(1))
    owners = {n: (os.stat(home / n).st_uid, os.stat(home / n).st_gid) for n in os.listdir(home)}
    assert owners == {"run.json": (NOBODY, NOBODY), "run.trace.json": (NOBODY, NOBODY)}
    # A root-only directory: refused up front with one line naming the option and the path.
    rootdir = _shared_dir(0)
    with pytest.raises(trace.TraceError) as e:
        trace.validate_output_path(str(rootdir / "run.json"), "--summary-json")
    assert str(e.value) == f"--summary-json {rootdir}/run.json: not writable"
    with pytest.raises(trace.TraceError, match=r"^--output cannot create a file in .*: Permission denied$"):
        trace.TraceOutputs(None, str(rootdir / "t.json"))
    assert os.listdir(rootdir) == [] and os.geteuid() == 0 and os.getegid() == 0


@root_only
def test_trace_output_in_a_directory_another_user_controls_is_refused(tmp_path):
    """Root, no sudo, --output into nobody's directory: nobody could swap names under it."""
    from gpuwatch.agent.trace import output as trace

    theirs = _shared_dir(NOBODY)
    with pytest.raises(trace.TraceError, match=r"^--output .*: not a safe directory to write in: it belongs to nobody"):
        trace.validate_output_path(str(theirs / "t.json"), "--output")
    with pytest.raises(trace.TraceError, match="belongs to nobody"):
        trace.TraceOutputs(None, str(theirs / "t.json"))
    assert os.listdir(theirs) == []


def test_trace_outputs_not_committed_leave_nothing(tmp_path):
    from gpuwatch.agent.trace import output as trace

    outs = trace.TraceOutputs(str(tmp_path / "s.json"), str(tmp_path / "t.json"))
    outs.close()
    assert os.listdir(tmp_path) == []


def test_open_regular_opens_only_a_regular_file_and_never_a_terminal_or_fifo(tmp_path):
    """What a user's process holds at /proc/PID/fd/N may be swapped for anything: a pty's open would
    give a session leader without a terminal (the agent under systemd) that pty as its own, a FIFO's
    would block. open_regular opens neither; a file, even deleted, it opens read-only."""
    import sys

    # A session leader without a terminal, as systemd starts the agent: it takes the first tty it opens
    # without O_NOCTTY (the old code's open of /proc/PID/fd/N). It reports its tty_nr after the tries.
    code = r"""
import os, sys
from gpuwatch.agent.safefile import open_regular
master, slave = os.openpty()
fifo = sys.argv[1]
os.mkfifo(fifo)
rd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
for fd in (slave, rd):
    try:
        open_regular(f"/proc/self/fd/{fd}")
        print("opened", fd)
    except OSError as e:
        print("refused", e.errno)
print(open(f"/proc/self/stat").read().rsplit(")", 1)[1].split()[4])
"""
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "fifo")], capture_output=True, text=True,
                         timeout=20, start_new_session=True, stdin=subprocess.DEVNULL)
    assert out.stdout.split("\n")[:3] == [f"refused {errno.EINVAL}", f"refused {errno.EINVAL}", "0"], out.stderr
    f = tmp_path / "data"
    f.write_bytes(b"x" * 10)
    with open(f, "rb") as held:
        f.unlink()
        fd = safefile.open_regular(f"/proc/self/fd/{held.fileno()}", noatime=True)
        try:
            assert os.read(fd, 100) == b"x" * 10
            assert os.fstat(fd).st_ino == os.fstat(held.fileno()).st_ino
        finally:
            os.close(fd)


def _swapped_output_dir() -> tuple[Path, Path, subprocess.Popen]:
    """(DIR, victim, swapper): nobody's DIR/a (their directory) swapped with DIR/b, a link to root's
    0700 victim directory, as fast as renameat2 goes."""
    top = _shared_dir(NOBODY)
    (top / "a").mkdir()
    os.chown(top / "a", NOBODY, NOBODY)
    victim = Path(tempfile.mkdtemp(prefix="gw-victim-"))
    os.symlink(victim, top / "b")
    os.lchown(top / "b", NOBODY, NOBODY)
    return top, victim, _swapper(top / "a", top / "b")


@root_only
def test_trace_outputs_in_a_swapped_directory_are_refused_in_one_line(monkeypatch):
    """Issue 31 break 7: `sudo gpuwatch trace --summary-json DIR/a/s.json` while the sudo user swaps
    DIR/a with a link: the old code let readlink's EINVAL (the link was a directory again) out as a
    traceback in about a third of the tries. Now a TraceError (one line), and nothing in root's
    directory."""
    from gpuwatch.agent.trace.errors import TraceError
    from gpuwatch.agent.trace.output import TraceOutputs, validate_output_path

    top, victim, swapper = _swapped_output_dir()
    monkeypatch.setenv("SUDO_UID", str(NOBODY))
    monkeypatch.setenv("SUDO_GID", str(NOBODY))
    written = refused = 0
    try:
        for _ in range(600):
            path = str(top / "a" / "s.json")
            try:
                validate_output_path(path, "--summary-json")
                outputs = TraceOutputs(path, str(top / "a" / "t.json"))
                outputs.summary.file.write("{}\n")
                outputs.summary.commit()
                outputs.close()
                written += 1
            except TraceError:
                refused += 1
    finally:
        swapper.kill()
        swapper.wait()
    assert os.listdir(victim) == []
    assert written + refused == 600


@root_only
def test_trace_cli_with_a_swapped_output_directory_says_one_line(tmp_path):
    import sys

    top, victim, swapper = _swapped_output_dir()
    sleeper = subprocess.Popen(["sleep", "60"])
    env = dict(os.environ, SUDO_UID=str(NOBODY), SUDO_GID=str(NOBODY))
    try:
        for _ in range(8):
            r = subprocess.run([sys.executable, "-m", "gpuwatch.agent.cli", "trace", "--pid", str(sleeper.pid),
                                "--summary-json", str(top / "a" / "s.json")], capture_output=True, text=True,
                               env=env, timeout=60)
            assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
            assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("Error: "), r.stderr
    finally:
        swapper.kill()
        swapper.wait()
        sleeper.kill()
        sleeper.wait()
    assert os.listdir(victim) == []
