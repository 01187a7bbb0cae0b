"""The control socket's client: one request to the running agent, its reply parsed, and, when the
agent cannot be reached, a reason a person can act on (which agents run here, where they listen).

Kept apart from the server (agent/control.py, which re-exports these names) so that a client such
as `gpuwatch status` imports what it needs and no more: sockets, JSON and the wire types.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import time
from typing import Any, TypeVar

from gpuwatch.agent import wire
from gpuwatch.agent.api import GpuwatchError

MAX_REQUEST = 64 * 1024
TIMEOUT = 5.0  # for a request in progress, and for the client to read its reply


class ControlError(GpuwatchError):
    """A control socket problem, phrased for the person at the terminal.

    Handlers may raise it to refuse a request; its text is the reply's error.
    """


def _encode(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


R = TypeVar("R", bound=wire.Message)


def call(path: str, method: str, params: dict | None = None, timeout: float = TIMEOUT,
         result_type: type[R] | None = None, explain: bool = False) -> Any:
    """Send one request to the agent and return its result, parsed as `result_type` when given
    (agent/wire.py). Raises ControlError with a readable reason; with explain (the CLI, for a
    person), an agent it cannot reach is looked for among the host's processes to say where one
    listens, or that none runs. Not for the in-process agent: that scan is the CLI's, once."""
    request = _encode({"method": method, "params": params or {}})
    if len(request) > MAX_REQUEST:
        raise ControlError(f"request too large for the control socket ({len(request)} bytes, "
                           f"the limit is {MAX_REQUEST})")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        deadline = time.monotonic() + timeout
        try:
            _connect(sock, path, deadline)
        except (FileNotFoundError, ConnectionRefusedError):
            raise ControlError(_not_listening(path) if explain else f"no gpuwatch agent is listening on {path} "
                               "(is `gpuwatch agent` / the gpuwatch service running?)") from None
        except PermissionError:
            raise ControlError(_not_reachable(path) if explain else f"permission denied on {path}: run as root "
                               "or as a member of the socket's group") from None
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
            # the agent may have answered (busy) and closed before reading: read that
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(request)
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
    if result_type is None:
        return reply.get("result")
    try:
        return result_type.parse(reply.get("result"), "result")
    except wire.WireError as e:
        raise ControlError(f"unexpected reply to {method!r} from {path}: {e}") from None


def _closed_to_us(directory: str) -> str:
    """Why this user cannot get at a path in `directory`, for a person."""
    try:
        st = os.stat(directory)
    except OSError as e:
        return f"{directory}: {e.strerror or e}"
    from gpuwatch.agent.safefile import user_name

    return (f"{directory} is mode {stat.S_IMODE(st.st_mode):o}, owned by {user_name(st.st_uid)}:"
            f"{_group_name(st.st_gid)}, and not open to {user_name(os.geteuid())}")


def _group_name(gid: int) -> str:
    import grp

    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


# Set to a PID, the scan sees only the agents that process started (its descendants): the tests
# set it to pytest's own, so a run never sees (nor names) an agent it did not start.
SCAN_ROOT_ENV = "GPUWATCH_SCAN_ROOT_PID"


def running_agents() -> list[tuple[int, str, str]]:
    """(pid, user, control socket) of the `gpuwatch agent` processes on this host, from their
    command lines: which says, when the socket cannot be reached, whether there is an agent to reach
    at all, and where one started with --runtime-dir or --socket listens ("" when its command line
    does not say: its config file's, or the default). With GPUWATCH_SCAN_ROOT_PID, only that
    process's descendants."""
    import psutil

    root = os.environ.get(SCAN_ROOT_ENV, "")
    root_pid = int(root) if root.isdigit() else None
    found = []
    for p in psutil.process_iter(["cmdline", "username"]):
        try:
            cmd = p.info["cmdline"] or []
        except (psutil.Error, KeyError):
            continue
        # `gpuwatch agent ...`, or `python -m gpuwatch.agent.cli agent ...`
        words = [os.path.basename(w) for w in cmd[:4]]
        if "agent" in cmd[1:4] and ("gpuwatch" in words or "gpuwatch.agent.cli" in cmd[:4]):
            if root_pid is not None and not _descends_from(p, root_pid):
                continue
            found.append((p.pid, p.info.get("username") or "?", _socket_in(cmd)))
    return found


def _descends_from(p, ancestor: int) -> bool:
    import psutil

    try:
        return any(a.pid == ancestor for a in p.parents())
    except psutil.Error:  # it exited meanwhile
        return False


def _socket_in(cmd: list[str]) -> str:
    """The control socket an agent's command line gives (--socket, else --runtime-dir), or ""."""
    flags: dict[str, str] = {}
    for i, word in enumerate(cmd):
        for flag in ("--socket", "--runtime-dir"):
            if word == flag and i + 1 < len(cmd):
                flags[flag] = cmd[i + 1]
            elif word.startswith(flag + "="):
                flags[flag] = word.split("=", 1)[1]
    if flags.get("--socket"):
        return flags["--socket"]
    return os.path.join(flags["--runtime-dir"], "control.sock") if flags.get("--runtime-dir") else ""


def _not_listening(path: str) -> str:
    """The error for no agent on `path`, with where the agents that do run listen."""
    text = f"no gpuwatch agent is listening on {path}"
    elsewhere = [(pid, sock) for pid, _, sock in running_agents()
                 if pid != os.getpid() and sock and os.path.abspath(sock) != os.path.abspath(path)]
    if len(elsewhere) == 1:
        pid, sock = elsewhere[0]
        return (f"{text}; the agent pid {pid} listens on {sock}: pass --socket {sock}, or "
                f"export GPUWATCH_SOCKET={sock}")
    if elsewhere:
        where = ", ".join(f"{sock} (pid {pid})" for pid, sock in elsewhere[:4])
        return f"{text}; gpuwatch agents listen on {where}: pass one with --socket, or export GPUWATCH_SOCKET"
    return text + " (is `gpuwatch agent` / the gpuwatch service running?)"


def _not_reachable(path: str) -> str:
    """The error for a socket this user may not open. Its directory open to us: the socket's own
    mode refused us. Closed: we cannot see whether there is a socket, so whether an agent runs says
    what to do."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.access(directory, os.X_OK):
        return f"permission denied on {path}: run as root or as a member of the socket's group"
    why = _closed_to_us(directory)
    agents = [(pid, user) for pid, user, _ in running_agents() if pid != os.getpid()]
    if not agents:
        return (f"no gpuwatch agent is running here (no `gpuwatch agent` process is visible, and {path} is "
                f"not reachable for you: {why}); start one (`systemctl start gpuwatch`, or `gpuwatch agent`)")
    who = ", ".join(f"pid {pid} as {user}" for pid, user in agents[:4])
    return (f"permission denied on {path} ({why}); a gpuwatch agent runs ({who}): run as root, or as a member "
            "of its control.group")


def _connect(sock: socket.socket, path: str, deadline: float) -> None:
    """connect(), waiting while the agent's listen backlog is full (a burst of other clients):
    with a timeout set the socket does not block, and the kernel answers EAGAIN at once."""
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.01)
