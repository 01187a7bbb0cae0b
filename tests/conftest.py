import atexit
import contextlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "nvml-h200.json"


def _open_to_all(path: str) -> bool:
    """Whether every directory from / down to `path` lets any user through (o+x)."""
    p = os.path.realpath(path)
    while True:
        if not os.stat(p).st_mode & 0o001:
            return False
        if os.path.dirname(p) == p:
            return True
        p = os.path.dirname(p)


# Tests run programs as nobody (setpriv, subprocess's user=) beneath the temporary directory. Where
# that is closed to other users (a CI machine's /tmp was 1770: 29 tests failed with EACCES), the run
# takes a temporary directory of its own where any user can pass, as /tmp is on Debian. Its name is
# short: agents' control sockets lie beneath it, and a Unix socket's path has at most 107 bytes.
if os.geteuid() == 0 and not _open_to_all(tempfile.gettempdir()):
    for _base in ("/var/tmp", "/dev/shm"):
        if os.path.isdir(_base) and _open_to_all(_base):
            tempfile.tempdir = os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="gw", dir=_base)
            os.chmod(tempfile.tempdir, 0o1777)
            atexit.register(shutil.rmtree, tempfile.tempdir, True)
            break
    else:
        raise SystemExit(f"{tempfile.gettempdir()}, /var/tmp and /dev/shm are closed to other users: the tests that "
                         "run as nobody cannot reach their files (chmod 1777 /tmp)")

# The compiled eBPF probe is cached for the whole run (agents and CLIs started by tests inherit
# this), never in the machine's /var/cache/gpuwatch: the first test that loads it compiles.
os.environ.setdefault("GPUWATCH_BPF_CACHE", tempfile.mkdtemp(prefix="gpuwatch-bpf-cache-"))

# Tests see only what they start (issue 35): the CLI's scan for running agents looks only at this
# run's descendants, and an agent or CLI started without --runtime-dir/--state-dir/--listen/--config
# gets this run's own directories, a free port and no config file, never the host's.
os.environ["GPUWATCH_SCAN_ROOT_PID"] = str(os.getpid())
_OWN = tempfile.mkdtemp(prefix="gpuwatch-tests-")
os.chmod(_OWN, 0o755)  # ordinary users (setpriv tests) reach sockets beneath it
os.environ.setdefault("GPUWATCH_RUNTIME_DIR", os.path.join(_OWN, "run"))
os.environ.setdefault("GPUWATCH_STATE_DIR", os.path.join(_OWN, "state"))
os.environ.setdefault("GPUWATCH_LISTEN", "127.0.0.1:0")
os.environ.setdefault("GPUWATCH_CONFIG", "")

# Tests look in tracefs' uprobe_events for uprobes left behind (gpuwatch itself needs no tracefs).
if os.geteuid() == 0 and not os.path.exists("/sys/kernel/tracing/uprobe_events"):
    subprocess.run(["mount", "-t", "tracefs", "nodev", "/sys/kernel/tracing"], capture_output=True, check=False)


def load_script(name: str, folder: str = "scripts"):
    """FOLDER/NAME.py as a module (scripts/ and bench/ are not packages), e.g. bench/trace_compare.py."""
    spec = importlib.util.spec_from_file_location(name, ROOT / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def ledger_held(ledger, pid: int) -> int:
    """The units a budget Ledger (agent/budget.py) holds for a process."""
    with ledger._lock:
        entry = ledger._held.get(pid)
        return entry[1] if entry is not None else 0


def wait_for(cond, timeout: float, step: float = 0.02):
    """cond()'s first true value within timeout, else its last value."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(step)
    return cond()


def nvml_recording(tmp: Path, pids=()) -> Path:
    """The H200 recording with NVML listing `pids` (each charged 1 GiB) beside its own process (an
    edit, not recorded): the agent then verifies in-process memory those processes report."""
    rec = json.loads(FIXTURE.read_text())
    for tick in rec["gpus"][0]["compute_processes"]:
        tick["value"] = tick["value"] + [{"pid": p, "used_memory": 1 << 30} for p in pids]
    path = tmp / "nvml-listing.json"
    path.write_text(json.dumps(rec))
    return path


NS_LAST_PID = "/proc/sys/kernel/ns_last_pid"


def spawn_at_pid(pid: int, argv: list[str], tries: int = 50, give_up=pytest.skip) -> subprocess.Popen:
    """Start argv under exactly this (free) PID, as root: ns_last_pid = pid - 1, then fork. Another fork
    on the machine may take it first: then that child is killed and we try again. `give_up` (skip,
    or pytest.fail where the test cannot mean anything else) when the PID cannot be had."""
    import fcntl

    for _ in range(tries):
        with open(NS_LAST_PID, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # CRIU's convention: writers of ns_last_pid lock it
            f.write(str(pid - 1))
            f.flush()
            p = subprocess.Popen(argv)
            fcntl.flock(f, fcntl.LOCK_UN)
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
        if os.path.exists(f"/proc/{pid}"):
            give_up(f"PID {pid} was taken by another process")
    give_up(f"could not get PID {pid} back in {tries} tries (a busy machine)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 20.0, proc: subprocess.Popen | None = None) -> bytes:
    end = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.read()
        except Exception as e:  # not up yet
            last = e
            time.sleep(0.1)
    raise AssertionError(f"{url} did not answer within {timeout} s: {last}")


class Agent:
    """`gpuwatch agent` as a real subprocess, with its own state and runtime dirs."""

    def __init__(self, tmp: Path, *args: str, env: dict | None = None, config: str = "", **popen):
        self.port = free_port()
        self.state = tmp / "state"
        self.runtime = tmp / "run"
        tmp.mkdir(parents=True, exist_ok=True)
        self.log = tmp / "agent.log"
        cmd = [sys.executable, "-m", "gpuwatch.agent.cli", "agent", "--config", config,
               "--listen", f"127.0.0.1:{self.port}", "--state-dir", str(self.state),
               "--runtime-dir", str(self.runtime), *args]
        e = dict(os.environ, **(env or {}))
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, env=e, **popen)
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self.socket = self.runtime / "control.sock"

    def metrics(self, timeout: float = 20.0) -> str:
        return wait_http(self.url, timeout, self.proc).decode()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@contextlib.contextmanager
def group_agent(*args: str, prefix: str = "gw-"):
    """A real agent whose control socket ordinary users reach through its group (65534, nobody's),
    under a directory they can traverse (pytest's own tmp_path is private to root)."""
    top = Path(tempfile.mkdtemp(prefix=prefix))
    top.chmod(0o755)
    a = Agent(top / "agent", *args, "--socket-group", "65534")
    try:
        a.metrics()
        yield a
    finally:
        a.stop()
        shutil.rmtree(top, ignore_errors=True)


def nvml_listing(tmp, pids, rate: float = 64 << 20, ticks: int = 600):
    """The H200 recording (FIXTURE) with `pids` listed on its first GPU, each charged 1 GiB + `rate` bytes more
    every tick, for `ticks` replayed seconds: real processes seen as GPU processes."""
    rec = json.loads(FIXTURE.read_text())
    n = rec["ticks"]
    for calls in (rec["system"], *rec["gpus"]):
        for op, answers in calls.items():
            calls[op] = answers + [None] * (ticks - n)  # None: the latest answer again
    gpu = rec["gpus"][0]
    recorded = next(a["value"] for a in reversed(gpu["compute_processes"][:n]) if a is not None)
    gpu["compute_processes"] = [{"value": recorded + [{"pid": pid, "used_memory": int((1 << 30) + rate * t)}
                                                      for pid in pids]} for t in range(ticks)]
    rec["ticks"] = ticks
    path = tmp / "nvml-listing.json"
    path.write_text(json.dumps(rec))
    return path


def series(text: str, name: str) -> dict[str, float]:
    """The samples of one metric in an exposition: {'{labels}': value}."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            out[labels[len(name):]] = float(value)
    return out


@pytest.fixture
def agent_factory(tmp_path):
    agents: list[Agent] = []

    def make(*args, env=None, config=""):
        a = Agent(tmp_path / f"a{len(agents)}", *args, env=env, config=config)
        agents.append(a)
        return a

    yield make
    for a in agents:
        a.stop()


def need_binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        # CI installs Debian's prometheus package (scripts/setup --test); a missing binary is a setup bug.
        pytest.fail(f"{name} not found on PATH: run `scripts/setup --test` (installs Debian's prometheus package)")
    return path


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    """A CA, server and client certificates made for this test run (tests/pki.py)."""
    from tests.pki import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"))


def bcrypt_hash(password: str, cost: int = 4) -> str:
    """A bcrypt hash as `htpasswd -nB` makes; cost 4 (the least) keeps the tests fast."""
    import bcrypt

    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(cost)).decode()


def replay_uuids(path: str, count: int = 1) -> list[str]:
    """The UUIDs `count` GPUs replayed from a baseline recording have (probes/baseline/replay.py)."""
    from gpuwatch.probes.baseline.replay import uuid_for

    with open(path) as f:
        first = next(r for r in json.load(f)["runs"] if "uuid" in r)
    return [uuid_for(first["uuid"], i) for i in range(count)]
