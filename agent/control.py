"""The control socket: JSON requests from the CLI to the running agent, over a Unix socket.

One JSON object per line each way. Request: {"method": "status", "params": {...}};
reply: {"ok": true, "result": ...} or {"ok": false, "error": "..."}. A connection
may carry several requests. Access to the socket itself is file permissions (0660,
root and control.group); the kernel tells us who is calling.

The caller is a process, not a PID: at accept the server takes a pidfd of the peer
(SO_PEERPIDFD) or, on older kernels, its PID and start time, and before every request
it checks that this same process still runs. A connection whose process has exited
(its descriptor inherited or passed on) is refused and closed, even once the PID names
another process; so is one whose PID names, by the time the server accepts it, a process
without the uid the kernel recorded at connect. Handlers get that identity (`PeerCred.identity`).

Nothing a client sends can take the server down, and no user can crowd out another:
malformed, oversized, slow and vanishing clients get an error reply or a closed
connection; each connection has its own thread and deadline; at most `max_clients`
are served at once, of which an ordinary user holds at most `per_uid` and
`root_slots` are kept for root; a connection with no request for `idle_timeout` is
closed. Every request and refusal is counted (gpuwatch_control_requests_total) and
each refusal of the socket's own (malformed, bad params, busy, gone, idle) is logged once per
user and cause; a handler's refusals are logged, once per cause, by the module that decides them.
"""
from __future__ import annotations

import contextlib
import errno
import grp
import json
import logging
import os
import select
import socket
import stat
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from gpuwatch.agent import wire
from gpuwatch.agent.api import Probe, Sample
# the client, here too for the server's callers and its own refusals
from gpuwatch.agent.control_client import (MAX_REQUEST, SCAN_ROOT_ENV, TIMEOUT, ControlError,  # noqa: F401
                                           _closed_to_us, _encode, call, running_agents)
from gpuwatch.probes.process import identity as ident
from gpuwatch.probes.process.identity import ProcessIdentity

log = logging.getLogger("gpuwatch.control")

MAX_CLIENTS = 16
ROOT_SLOTS = 4  # of MAX_CLIENTS, kept for root: `gpuwatch status` gets in whatever users hold
PER_UID = 4  # connections one ordinary user may hold open at once
IDLE_TIMEOUT = 2.0  # a connection with no request in progress is closed after this
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux >= 6.5
# result label of gpuwatch_control_requests_total; method "none" where no request was read
RESULTS = ("ok", "refused", "error", "busy", "gone", "idle", "timeout")
BACKLOG = 1024  # pending connections the kernel queues for accept()
_BUSY_WAIT = 0.2  # how long a connection over the total limit waits for a slot being released
_MAX_LOGGED = 4096  # distinct (uid, cause) refusals logged; past that they are only counted
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path is 108 bytes with the terminating NUL


@dataclass(frozen=True)
class PeerCred:
    """Who is on the other end of a connection: the kernel's pid, uid and gid from connect(),
    and the identity of that process (pid and start time) the server took at accept."""

    pid: int
    uid: int
    gid: int
    identity: ProcessIdentity | None = None
    # A pidfd of the peer process (SO_PEERPIDFD); the server closes it with the connection.
    pidfd: int | None = field(default=None, compare=False, repr=False)

    @property
    def is_root(self) -> bool:
        return self.uid == 0

    def alive(self) -> bool:
        """Does the process that opened the connection still run? With a pidfd the kernel says
        (it is readable once that process exits); otherwise its PID must still carry the start
        time seen at accept."""
        if self.identity is None:
            return False
        if self.pidfd is not None:
            return not _readable(self.pidfd, 0)
        return ident.is_alive(self.identity)


def _readable(fd: int, timeout_ms: int) -> bool:
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(timeout_ms))


def _peercred(conn: socket.socket) -> PeerCred:
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCred(pid=pid, uid=uid, gid=gid)


# getsockopt(SO_PEERPIDFD) errors that mean "this kernel cannot": the server falls back to the
# peer's PID and start time. Any other (ESRCH, or EINVAL before Linux 6.16) means the process that
# connected has exited and been reaped: it is gone, whatever process has its PID now.
_NO_PEERPIDFD = (errno.ENOPROTOOPT, errno.EOPNOTSUPP, errno.ENODATA)
_GONE = -1  # _peer_pidfd's answer for a peer that has been reaped


def _sockopt_pidfd(conn: socket.socket) -> int:
    return struct.unpack("i", conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD, 4))[0]


def _peer_pidfd(conn: socket.socket) -> int | None:
    """A pidfd of the process that connect()ed; None where the kernel has no SO_PEERPIDFD; _GONE
    when that process has been reaped (its PID may name another process already)."""
    try:
        fd = _sockopt_pidfd(conn)
    except OSError as e:
        return None if e.errno in _NO_PEERPIDFD else _GONE
    os.set_inheritable(fd, False)  # the agent starts children (baseline, CUPTI sampler)
    return fd


def _peer_identity(cred: PeerCred) -> ProcessIdentity | None:
    """The process that has the peer's PID now, if it can be the one that connected: its uids must
    hold the uid the kernel recorded at connect, else the PID names another user's process (the
    peer exited and its PID was reused before the server got to it). None: not that process."""
    who = ident.identify(cred.pid) if cred.pid > 0 else None
    return who if who is not None and cred.uid in who.uids else None


def _gid(group: str) -> int:
    try:
        return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise ControlError(f"no such group {group!r} for the control socket (control.group)") from None


def parse_params(method: str, raw: Any, types: Mapping[str, type[wire.Message]] = wire.METHODS) -> wire.Message:
    """`raw` as the wire type of `method`'s params; ControlError naming the field that is wrong."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ControlError("malformed request: params must be a JSON object")
    try:
        return types[method].parse(raw)
    except wire.WireError as e:
        raise ControlError(f"{method} refused: {e}") from None


# A handler gets its method's params parsed into their wire type (agent/wire.py), never raw JSON.
Handler = Callable[[wire.Message, PeerCred], Any]


class ControlServer:
    def __init__(self, path: str, handlers: dict[str, Handler], group: str | None = None, *,
                 timeout: float = TIMEOUT, max_clients: int = MAX_CLIENTS, per_uid: int = PER_UID,
                 root_slots: int = ROOT_SLOTS, idle_timeout: float = IDLE_TIMEOUT,
                 max_request: int = MAX_REQUEST, types: Mapping[str, type[wire.Message]] = wire.METHODS) -> None:
        untyped = sorted(set(handlers) - set(types))
        if untyped:  # a method without a wire type would get unchecked input
            raise ValueError(f"control methods without a wire type: {', '.join(untyped)}")
        self.path = path
        self.handlers = dict(handlers)
        self.types = {m: types[m] for m in handlers}
        self.group = group or None
        self.timeout = timeout
        self.idle_timeout = min(idle_timeout, timeout)
        self.max_request = max_request
        self.max_clients = max_clients
        self.per_uid = per_uid
        self.root_slots = min(root_slots, max_clients // 2)  # a small server still serves its users
        self._held: Counter[int] = Counter()  # uid -> connections being served
        self._counts: Counter[tuple[str, str]] = Counter()  # (method, result) -> requests
        self._logged: set[tuple[int, str]] = set()  # (uid, cause) of refusals logged already
        self._stats_lock = threading.Lock()
        self._slot_freed = threading.Condition(self._stats_lock)
        self._sock: socket.socket | None = None
        self._ino: int | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._stopping = False

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Bind and start serving in a thread. Raises ControlError if the path is unusable or taken."""
        if len(os.fsencode(self.path)) > _SUN_PATH_MAX:
            raise ControlError(f"control socket path is too long for a Unix socket "
                               f"(over {_SUN_PATH_MAX} bytes): {self.path}")
        gid = _gid(self.group) if self.group else None
        directory = os.path.dirname(os.path.abspath(self.path))
        self._make_dir(directory, gid)
        try:
            self._clear_stale()
        except PermissionError:  # a directory another user (root, an earlier run) made and keeps closed
            raise ControlError(f"cannot use the control socket {self.path}: {_closed_to_us(directory)}; run "
                               "as its owner, or give this agent a directory of its own (--runtime-dir DIR, "
                               "or control.socket)") from None
        # Bind under a temporary name, set mode and group, then rename into place: the socket
        # is never reachable with the umask's permissions, and clients never see a half-made one.
        tmp = os.path.join(directory, f".gw{os.getpid()}.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if os.path.lexists(tmp):
                os.unlink(tmp)
            sock.bind(tmp)
            os.chmod(tmp, 0o660)
            if gid is not None:
                os.chown(tmp, -1, gid)
            # A deep queue (the kernel caps it at net.core.somaxconn): one user must hold over a
            # thousand connections at once to fill it, and the accept loop sheds load fast.
            sock.listen(BACKLOG)
            os.rename(tmp, self.path)
        except OSError as e:
            sock.close()
            if os.path.lexists(tmp):
                os.unlink(tmp)
            raise ControlError(f"cannot create the control socket {self.path}: {e.strerror or e}") from None
        self._ino = os.stat(self.path).st_ino
        self._sock = sock
        self._stopping = False
        self._thread = threading.Thread(target=self._accept_loop, name="control-accept", daemon=True)
        self._thread.start()
        log.info("control socket listening on %s", self.path)

    def stop(self) -> None:
        """Stop accepting, close open connections, remove the socket file if it is still ours."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        self._stopping = True
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        sock.close()
        with self._conns_lock:
            for c in list(self._conns):
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(2.0)
        with contextlib.suppress(FileNotFoundError):
            if os.stat(self.path).st_ino == self._ino:  # not a socket a newer agent put there
                os.unlink(self.path)

    def _make_dir(self, directory: str, gid: int | None) -> None:
        if os.path.isdir(directory):
            st = os.stat(directory)
            if gid is not None and not (st.st_mode & stat.S_IXOTH) and not (
                    st.st_gid == gid and st.st_mode & stat.S_IXGRP):
                log.warning("members of group %s cannot reach the control socket: its directory %s "
                            "is mode %o, group %d; make it traversable for them (e.g. chmod o+x, "
                            "or chgrp %s and chmod g+x)", self.group, directory,
                            stat.S_IMODE(st.st_mode), st.st_gid, self.group)
            return
        try:
            os.makedirs(directory, mode=0o750)
            os.chmod(directory, 0o750)  # makedirs' mode is masked by the umask
            if gid is not None:
                os.chown(directory, -1, gid)  # the group's members must get through to the socket
        except OSError as e:
            raise ControlError(f"cannot create {directory} for the control socket: {e.strerror or e}") from None

    def _clear_stale(self) -> None:
        """Remove a socket left by a dead agent; refuse if an agent answers on it."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise ControlError(f"{self.path} exists and is not a socket; remove it or set control.socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(self.path)
        except (ConnectionRefusedError, FileNotFoundError):
            log.info("removing stale control socket %s (left by an agent that is gone)", self.path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            return
        except OSError as e:
            raise ControlError(f"cannot check the existing control socket {self.path}: {e.strerror or e}") from None
        finally:
            probe.close()
        raise ControlError(f"another gpuwatch agent is already listening on {self.path}; "
                           f"stop it first, or give this one another control.socket")

    # -- serving --------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        sock = self._sock
        assert sock is not None
        while not self._stopping:
            try:
                conn, _ = sock.accept()
            except OSError as e:
                if self._stopping:
                    return
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("control socket: cannot accept: %s", e)
                    threading.Event().wait(0.1)  # let descriptors free up instead of spinning
                continue
            try:
                cred = _peercred(conn)
            except OSError as e:
                log.warning("control socket: cannot read peer credentials: %s", e)
                conn.close()
                continue
            # Decided at once, without waiting: a connection held here would hold up everyone's.
            cause, busy = self._take_slot(cred.uid)
            if busy:
                self._refused("none", "busy", cred.uid, cause, busy)
                _send_error(conn, busy, 0.5)
                conn.close()
                continue
            with self._conns_lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn, cred), name="control-conn", daemon=True).start()

    def _take_slot(self, uid: int) -> tuple[str, str]:
        """Take a connection slot for `uid`: ("", "") when taken, else (cause, the busy reply).

        Over the whole limit it waits a moment for a slot (a client that has closed may not be
        released yet); a user over their own limit is refused at once, so one user's flood of
        connections cannot slow the accept loop for the others."""
        deadline = time.monotonic() + _BUSY_WAIT
        with self._slot_freed:
            while True:
                total = sum(self._held.values())
                mine = self._held[uid]
                if uid != 0 and mine >= self.per_uid:
                    return "busy: user", (f"you (uid {uid}) already have {mine} connections open to the gpuwatch "
                                          f"agent, the most one user may; close one and try again")
                users = total - self._held[0]
                if total < self.max_clients and (uid == 0 or users < self.max_clients - self.root_slots):
                    self._held[uid] += 1
                    return "", ""
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._slot_freed.wait(remaining)
        if total >= self.max_clients:
            return "busy: all", f"the agent is busy with {self.max_clients} control clients; try again"
        return "busy: users", (f"the agent is busy: ordinary users hold all {users} of their connections "
                               f"({self.root_slots} more are kept for root); try again")

    def _release_slot(self, uid: int) -> None:
        with self._slot_freed:
            self._held[uid] -= 1
            if self._held[uid] <= 0:
                del self._held[uid]
            self._slot_freed.notify()

    # -- counting ------------------------------------------------------------------------------
    def _count(self, method: str, result: str) -> None:
        with self._stats_lock:
            self._counts[(method, result)] += 1

    def _refused(self, method: str, result: str, uid: int, cause: str, text: str) -> None:
        """Count a refusal; log it the first time this user meets this cause, not every time."""
        with self._stats_lock:
            self._counts[(method, result)] += 1
            key = (uid, cause)
            first = key not in self._logged and len(self._logged) < _MAX_LOGGED
            if first:
                self._logged.add(key)
        if first:
            log.warning("control socket: uid %d, %s (%s): %s (logged once per user and cause; "
                        "gpuwatch_control_requests_total counts every one)", uid, result, method, text)

    def stats(self) -> dict[tuple[str, str], int]:
        """Requests so far by (method, result): method is a known method, "unknown" (none could be
        read, or no such method) or "none" (no request: refused at connect, idle, the peer gone)."""
        with self._stats_lock:
            return dict(self._counts)

    def _serve(self, conn: socket.socket, cred: PeerCred) -> None:
        pidfd = None
        try:
            # The identity is read before the pidfd is asked: if that process still runs when the
            # pidfd is taken, its PID cannot have been reused meanwhile.
            identity = _peer_identity(cred)
            pidfd = _peer_pidfd(conn)
            if pidfd == _GONE:
                identity, pidfd = None, None  # alive() is False: the connection is refused as gone
            peer = PeerCred(cred.pid, cred.uid, cred.gid, identity, pidfd)
            buf = b""
            while True:
                if not peer.alive():
                    return self._gone(conn, peer, self._method_label(buf))
                line, buf, error, result = self._read_request(conn, buf, peer)
                if line is None:
                    if result == "gone":
                        return self._gone(conn, peer, "none")
                    if error:
                        self._refused("unknown" if result != "idle" else "none", result, peer.uid, result, error)
                        _send_error(conn, error)
                    return
                if not peer.alive():  # recheck: a request from a process that has exited is refused
                    return self._gone(conn, peer, self._method_label(line))
                reply = self._dispatch(line, peer)
                conn.settimeout(self.timeout)  # a client that does not read its reply is dropped
                conn.sendall(reply)
        except OSError:
            pass  # the client went away while we answered
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()
            if pidfd is not None:
                os.close(pidfd)
            self._release_slot(cred.uid)

    def _gone(self, conn: socket.socket, peer: PeerCred, method: str) -> None:
        text = (f"the process that opened this connection (pid {peer.pid}) has exited; "
                f"a connection speaks only for the process that opened it")
        self._refused(method, "gone", peer.uid, "gone", text)
        _send_error(conn, text)

    def _method_label(self, line: bytes) -> str:
        """The method a request names, for counting: a known one, "unknown", or "none" (no request)."""
        if not line.strip():
            return "none"
        try:
            method = json.loads(line.partition(b"\n")[0], parse_constant=_no_constant).get("method")
        except (ValueError, RecursionError, AttributeError):
            return "unknown"
        return method if isinstance(method, str) and method in self.handlers else "unknown"

    def _read_request(self, conn: socket.socket, buf: bytes,
                      peer: PeerCred) -> tuple[bytes | None, bytes, str, str]:
        """The next request line, the bytes after it, and when there is none an error for the
        client and the result to count ("idle", "timeout", "refused", "gone"; "" at EOF).

        Waiting for a request to start is idle (`idle_timeout`); once it has begun it has
        `timeout` to arrive whole. The wait also ends when the peer process exits (its pidfd)."""
        started = time.monotonic() if buf else None
        fds = select.poll()
        fds.register(conn, select.POLLIN)
        if peer.pidfd is not None:
            fds.register(peer.pidfd, select.POLLIN)
        idle_since = time.monotonic()
        while b"\n" not in buf:
            if len(buf) > self.max_request:
                return None, b"", f"request too large (over {self.max_request} bytes)", "refused"
            now = time.monotonic()
            if started is None:
                remaining = idle_since + self.idle_timeout - now
                if remaining <= 0:
                    return None, b"", (f"closed: no request within {self.idle_timeout:g} s (idle "
                                       f"connections are closed)"), "idle"
            else:
                remaining = started + self.timeout - now
                if remaining <= 0:
                    return None, b"", f"no complete request within {self.timeout:g} s", "timeout"
            ready = dict(fds.poll(max(1, int(remaining * 1000))))
            if peer.pidfd is not None and ready.get(peer.pidfd):
                return None, b"", "", "gone"
            if not ready:
                continue
            conn.settimeout(0)
            try:
                chunk = conn.recv(65536)
            except (BlockingIOError, InterruptedError):
                continue
            if not chunk:
                # EOF: a client may half-close after a last request without a newline.
                return (buf, b"", "", "") if buf.strip() else (None, b"", "", "")
            if started is None:
                started = time.monotonic()
            buf += chunk
        line, _, rest = buf.partition(b"\n")
        if len(line) > self.max_request:
            return None, b"", f"request too large (over {self.max_request} bytes)", "refused"
        return line, rest, "", ""

    def _dispatch(self, line: bytes, peer: PeerCred) -> bytes:
        method = "unknown"
        try:
            method, result = self._handle(line, peer)
        except _Refused as e:
            if e.handler:  # the handler's own decision: its module logs what matters, once per cause
                self._count(e.method, e.result)
            else:
                self._refused(e.method, e.result, peer.uid, f"{e.result} {e.method}", str(e))
            return _encode({"ok": False, "error": str(e)})
        try:
            reply = _encode({"ok": True, "result": result})
        except (TypeError, ValueError) as e:  # a handler bug: say so instead of dropping the client
            log.error("control handler returned a result that is not JSON: %s", e)
            self._count(method, "error")
            return _encode({"ok": False, "error": f"the agent's result is not JSON: {e}"})
        self._count(method, "ok")
        return reply

    def _handle(self, line: bytes, peer: PeerCred) -> tuple[str, Any]:
        """The method and its handler's result; _Refused with the reply's error text otherwise."""
        try:
            req = json.loads(line, parse_constant=_no_constant)
        except ValueError as e:
            raise _Refused("unknown", f"malformed request: not JSON ({e})") from None
        except RecursionError:  # json recurses once per nested array or object
            raise _Refused("unknown", "malformed request: JSON nested too deeply") from None
        if not isinstance(req, dict):
            raise _Refused("unknown", "malformed request: expected a JSON object")
        method = req.get("method")
        handler = self.handlers.get(method) if isinstance(method, str) else None
        if handler is None:
            raise _Refused("unknown", f"unknown method {method!r}; known methods: {', '.join(sorted(self.handlers))}")
        try:
            params = parse_params(method, req.get("params"), self.types)
        except ControlError as e:
            raise _Refused(method, str(e)) from None
        try:
            return method, handler(params, peer)
        except ControlError as e:
            raise _Refused(method, str(e), handler=True) from None
        except Exception as e:
            log.exception("control method %s failed (caller pid %d uid %d)", method, peer.pid, peer.uid)
            raise _Refused(method, f"{method} failed in the agent: {type(e).__name__}: {e}", "error") from None


class _Refused(ControlError):
    """A request answered with an error: which method (for counting) and result."""

    def __init__(self, method: str, text: str, result: str = "refused", handler: bool = False) -> None:
        super().__init__(text)
        self.method = method
        self.result = result
        self.handler = handler  # refused by the method's handler (not by the socket or the wire type)


class ControlStatsProbe(Probe):
    """What the control socket served: gpuwatch_control_requests_total{method,result}."""

    name = "control"
    interval = 1.0

    def __init__(self, server: ControlServer) -> None:
        self.server = server

    def collect(self) -> list[Sample]:
        return [Sample("gpuwatch.control.requests", v, "", {"method": m, "result": r})
                for (m, r), v in sorted(self.server.stats().items())]


def _no_constant(name: str) -> Any:
    # Python's json reads NaN and Infinity; JSON has no such numbers, and no field takes them.
    raise ValueError(f"{name} is not a JSON number")


def _send_error(conn: socket.socket, text: str, timeout: float = 1.0) -> None:
    """A refusal's reply, sent if the client still reads (it may have gone: nothing to do then)."""
    with contextlib.suppress(OSError):
        conn.settimeout(timeout)
        conn.sendall(_encode({"ok": False, "error": text}))
