"""The control socket: JSON requests from the CLI to the running agent, over a Unix socket.

One JSON object per line each way. Request: {"method": "status", "params": {...}};
reply: {"ok": true, "result": ...} or {"ok": false, "error": "..."}. A connection
may carry several requests. The kernel tells us who is calling (SO_PEERCRED), so
handlers can decide what that caller may see: access to the socket itself is
file permissions (0660, root and control.group).

Nothing a client sends can take the server down: malformed, oversized, slow and
vanishing clients get an error reply or a closed connection, each connection
has its own thread and deadline, and at most `max_clients` are served at once.
"""
from __future__ import annotations

import errno
import grp
import json
import logging
import os
import socket
import stat
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from gpuwatch.agent.api import GpuwatchError

log = logging.getLogger("gpuwatch.control")

MAX_REQUEST = 64 * 1024
MAX_CLIENTS = 16
TIMEOUT = 5.0
_BUSY_WAIT = 0.5  # how long a connection over max_clients waits for a free slot
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path is 108 bytes with the terminating NUL


class ControlError(GpuwatchError):
    """A control socket problem, phrased for the person at the terminal.

    Handlers may raise it to refuse a request; its text is the reply's error.
    """


@dataclass(frozen=True)
class PeerCred:
    """Who is on the other end of a connection, as the kernel saw it at connect()."""

    pid: int
    uid: int
    gid: int

    @property
    def is_root(self) -> bool:
        return self.uid == 0

    def owns(self, pid: int) -> bool:
        """May this caller look inside process `pid`? Root: any. Others: their own processes.

        Like ptrace's check, every uid of the target (real, effective, saved) must be the
        caller's, so a setuid program started by the caller is not theirs to trace.
        """
        if self.is_root:
            return True
        uids = process_uids(pid)
        return uids is not None and all(u == self.uid for u in uids)


def process_uids(pid: int) -> tuple[int, int, int] | None:
    """The (real, effective, saved) uids of a process, or None if it does not exist."""
    try:
        with open(f"/proc/{int(pid)}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    real, eff, saved = (int(x) for x in line.split()[1:4])
                    return real, eff, saved
    except (FileNotFoundError, ProcessLookupError):
        pass
    return None


def _peercred(conn: socket.socket) -> PeerCred:
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCred(pid=pid, uid=uid, gid=gid)


def _gid(group: str) -> int:
    try:
        return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise ControlError(f"no such group {group!r} for the control socket (control.group)") from None


Handler = Callable[[dict, PeerCred], Any]


class ControlServer:
    def __init__(self, path: str, handlers: dict[str, Handler], group: str | None = None, *,
                 timeout: float = TIMEOUT, max_clients: int = MAX_CLIENTS,
                 max_request: int = MAX_REQUEST) -> None:
        self.path = path
        self.handlers = dict(handlers)
        self.group = group or None
        self.timeout = timeout
        self.max_request = max_request
        self._slots = threading.BoundedSemaphore(max_clients)
        self.max_clients = max_clients
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
        self._clear_stale()
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
            sock.listen(128)  # queue bursts; the accept loop sheds load beyond max_clients
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
        try:
            sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        except OSError:
            pass
        sock.close()
        with self._conns_lock:
            for c in list(self._conns):
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        if self._thread is not None:
            self._thread.join(2.0)
        try:
            if os.stat(self.path).st_ino == self._ino:  # not a socket a newer agent put there
                os.unlink(self.path)
        except FileNotFoundError:
            pass

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
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
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
            # A short wait absorbs connections that are finished but not yet released.
            if not self._slots.acquire(timeout=_BUSY_WAIT):
                self._reply_and_close(conn, {"ok": False, "error": f"the agent is busy with "
                                             f"{self.max_clients} control clients; try again"})
                continue
            with self._conns_lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="control-conn", daemon=True).start()

    def _reply_and_close(self, conn: socket.socket, reply: dict) -> None:
        try:
            conn.settimeout(0.5)
            conn.sendall(_encode(reply))
        except OSError:
            pass
        finally:
            conn.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            try:
                peer = _peercred(conn)
            except OSError as e:
                log.warning("control socket: cannot read peer credentials: %s", e)
                return
            buf = b""
            while True:
                line, buf, error = self._read_request(conn, buf)
                if line is None:
                    if error:
                        try:
                            conn.settimeout(1.0)
                            conn.sendall(_encode({"ok": False, "error": error}))
                        except OSError:
                            pass
                    return
                reply = self._dispatch(line, peer)
                conn.settimeout(self.timeout)  # a client that does not read its reply is dropped
                conn.sendall(reply)
        except OSError:
            pass  # the client went away while we answered
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()
            self._slots.release()

    def _read_request(self, conn: socket.socket, buf: bytes) -> tuple[bytes | None, bytes, str]:
        """Next request line, the bytes after it, and an error for the client if there is none."""
        deadline = time.monotonic() + self.timeout
        while b"\n" not in buf:
            if len(buf) > self.max_request:
                return None, b"", f"request too large (over {self.max_request} bytes)"
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None, b"", f"no complete request within {self.timeout:g} s"
            conn.settimeout(remaining)
            try:
                chunk = conn.recv(65536)
            except socket.timeout:
                return None, b"", f"no complete request within {self.timeout:g} s"
            if not chunk:
                # EOF: a client may half-close after a last request without a newline.
                return (buf, b"", "") if buf.strip() else (None, b"", "")
            buf += chunk
        line, _, rest = buf.partition(b"\n")
        if len(line) > self.max_request:
            return None, b"", f"request too large (over {self.max_request} bytes)"
        return line, rest, ""

    def _dispatch(self, line: bytes, peer: PeerCred) -> bytes:
        try:
            result = self._handle(line, peer)
        except ControlError as e:
            return _encode({"ok": False, "error": str(e)})
        try:
            return _encode({"ok": True, "result": result})
        except (TypeError, ValueError) as e:  # a handler bug: say so instead of dropping the client
            log.error("control handler returned a result that is not JSON: %s", e)
            return _encode({"ok": False, "error": f"the agent's result is not JSON: {e}"})

    def _handle(self, line: bytes, peer: PeerCred) -> Any:
        """The handler's result; ControlError with the reply's error text otherwise."""
        try:
            req = json.loads(line)
        except ValueError as e:
            raise ControlError(f"malformed request: not JSON ({e})") from None
        except RecursionError:  # json recurses once per nested array or object
            raise ControlError("malformed request: JSON nested too deeply") from None
        if not isinstance(req, dict):
            raise ControlError("malformed request: expected a JSON object")
        method = req.get("method")
        handler = self.handlers.get(method) if isinstance(method, str) else None
        if handler is None:
            raise ControlError(f"unknown method {method!r}; known methods: {', '.join(sorted(self.handlers))}")
        params = req.get("params")
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise ControlError("malformed request: params must be a JSON object")
        try:
            return handler(params, peer)
        except ControlError:
            raise
        except Exception as e:
            log.exception("control method %s failed (caller pid %d uid %d)", method, peer.pid, peer.uid)
            raise ControlError(f"{method} failed in the agent: {type(e).__name__}: {e}") from None


def _encode(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


# -- client --------------------------------------------------------------------------------

def call(path: str, method: str, params: dict | None = None, timeout: float = TIMEOUT) -> Any:
    """Send one request to the agent and return its result. Raises ControlError with a readable reason."""
    request = _encode({"method": method, "params": params or {}})
    if len(request) > MAX_REQUEST:
        raise ControlError(f"request too large for the control socket ({len(request)} bytes, "
                           f"the limit is {MAX_REQUEST})")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            raise ControlError(f"no gpuwatch agent is listening on {path} "
                               f"(is `gpuwatch agent` / the gpuwatch service running?)") from None
        except PermissionError:
            raise ControlError(f"permission denied on {path}: run as root or as a member "
                               f"of the socket's group") from None
        except BlockingIOError:  # the listen backlog is full
            raise ControlError(f"the gpuwatch agent on {path} is too busy to accept "
                               f"a connection; try again") from None
        except socket.timeout:
            raise ControlError(f"the gpuwatch agent on {path} did not accept the connection "
                               f"within {timeout:g} s") from None
        except OSError as e:
            raise ControlError(f"cannot connect to {path}: {e.strerror or e}") from None
        buf = b""
        try:
            try:
                sock.sendall(request)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the agent may have answered (busy) and closed before reading: read that
            while b"\n" not in buf:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
        except socket.timeout:
            raise ControlError(f"the gpuwatch agent on {path} did not answer {method!r} "
                               f"within {timeout:g} s") from None
        except OSError as e:
            raise ControlError(f"lost the connection to the gpuwatch agent on {path}: "
                               f"{e.strerror or e}") from None
    finally:
        sock.close()
    if not buf.strip():
        raise ControlError(f"the gpuwatch agent on {path} closed the connection without answering")
    try:
        reply = json.loads(buf.partition(b"\n")[0])
    except ValueError as e:
        raise ControlError(f"unreadable reply from {path}: {e}") from None
    if not isinstance(reply, dict) or "ok" not in reply:
        raise ControlError(f"unreadable reply from {path}: {reply!r:.200}")
    if not reply["ok"]:
        raise ControlError(str(reply.get("error", "the agent refused the request")))
    return reply.get("result")
