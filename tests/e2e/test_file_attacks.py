"""What a local user can make a root agent say about files, through the page-cache probe (issue 31,
breaks 6 and 8), against a real agent: NVML (replayed from the H200) lists processes of user nobody
as GPU processes, and each holds a file the way an attacker would.

- an O_PATH handle on root's 0600 file: no read access, yet the old probe showed its path, size and
  page-cache residency, which followed root reading the file (a side channel);
- a readable fd, inherited from root, on another user's file under that user's 0700 directory: the
  process may read it, but its user could not have opened that path, so the path is not shown;
- its own file, under its own 0700 directory, read: shown, as before;
- its own file whose name holds C1 and bidi controls (U+009B CSI, U+202E RLO, ...): shown with "?".

One agent plays all four (a collection every 10 s); each test fails on the old probe.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import Agent, nvml_listing, series

NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
VICTIM = 4242  # another user: owns a 0700 directory
MIB = 1 << 20
SIZE = 8 * MIB
CONTROLS = "\u009b\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c\x85"
BIDI_NAME = f"w\u202egnp.\u009b[31mexe\u2066x\u200f.bin"

# argv: mode, path (or an inherited fd's number). Prints "ready" once it holds the file.
HOLD = r"""
import os, sys, time
mode, what = sys.argv[1], sys.argv[2]
if mode == "opath":
    fd = os.open(what, os.O_PATH)
elif mode == "inherited":
    fd = int(what)
    os.pread(fd, 1 << 20, 0)
else:
    fd = os.open(what, os.O_RDONLY)
    while os.read(fd, 1 << 20):
        pass
print("ready", flush=True)
time.sleep(600)
"""


def _write(path: Path, uid: int, mode: int) -> Path:
    path.write_bytes(os.urandom(MIB) * (SIZE // MIB))
    os.chown(path, uid, uid)
    path.chmod(mode)
    return path


def _hold(mode: str, what: str, pass_fds=()) -> subprocess.Popen:
    p = subprocess.Popen([*NOBODY, sys.executable, "-c", HOLD, mode, what], stdout=subprocess.PIPE, text=True,
                         cwd="/", pass_fds=pass_fds)
    assert p.stdout.readline().strip() == "ready"
    return p


def _files(text: str, pid: int, under: Path) -> dict[str, float]:
    """The process's files under `under` on /metrics (the interpreter it maps is shown too)."""
    return {k: v for k, v in series(text, "gpuwatch_process_file_size_bytes").items()
            if f'pid="{pid}"' in k and f'file="{under}/' in k}


def _collections(agent: Agent) -> float:
    return series(agent.metrics(), "gpuwatch_probe_duration_seconds").get('{probe="pagecache"}', -1.0)


@pytest.fixture(scope="module")
def played():
    top = Path(tempfile.mkdtemp(prefix="gw-files-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    top.chmod(0o755)
    procs: list[subprocess.Popen] = []
    agent = None
    try:
        secret = _write(top / "root-only.bin", 0, 0o600)
        victim = top / "victim"
        victim.mkdir(mode=0o700)
        os.chown(victim, VICTIM, VICTIM)
        hidden = _write(victim / "victims-weights.bin", VICTIM, 0o644)
        mine = top / "mine"
        mine.mkdir(mode=0o700)
        os.chown(mine, 65534, 65534)
        own = _write(mine / "weights.bin", 65534, 0o600)
        bidi = _write(mine / BIDI_NAME, 65534, 0o600)
        fd = os.open(hidden, os.O_RDONLY)
        try:
            procs = [_hold("opath", str(secret)), _hold("inherited", str(fd), pass_fds=(fd,)),
                     _hold("read", str(own)), _hold("read", str(bidi))]
        finally:
            os.close(fd)
        agent = Agent(top / "agent", "--nvml-replay", str(nvml_listing(top, [p.pid for p in procs], rate=0)),
                      "--nvml-slow-interval", "1", "--page-cache-min-bytes", str(SIZE // 2), "--no-ebpf",
                      "--no-baseline", "--no-cupti-sampling")
        deadline = time.monotonic() + 40
        while not _files(text := agent.metrics(), procs[2].pid, top):  # the positive case: one collection passed
            assert time.monotonic() < deadline, f"no page-cache series after 40 s:\n{agent.output()[-3000:]}"
            time.sleep(0.5)
        yield agent, text, dict(zip(("opath", "inherited", "own", "bidi"), procs)), \
            {"top": top, "secret": secret, "hidden": hidden, "own": own, "bidi": bidi}
    finally:
        if agent is not None:
            agent.stop()
        for p in procs:
            p.kill()
            p.wait()
        shutil.rmtree(top, ignore_errors=True)


def test_an_o_path_handle_on_roots_file_shows_nothing_and_roots_reads_change_nothing(played):
    agent, text, procs, paths = played
    secret = str(paths["secret"])
    assert secret not in text and not _files(text, procs["opath"].pid, paths["top"])
    # root reads its file from disk: the old probe's residency followed (a side channel)
    fd = os.open(secret, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        before = _collections(agent)
        while os.read(fd, MIB):
            pass
    finally:
        os.close(fd)
    deadline = time.monotonic() + 15
    while _collections(agent) == before and time.monotonic() < deadline:
        time.sleep(0.5)
    after = agent.metrics()
    assert secret not in after and not _files(after, procs["opath"].pid, paths["top"])
    assert secret not in agent.output()


def test_a_readable_fd_on_a_file_its_user_could_not_reach_is_not_shown(played):
    agent, text, procs, paths = played
    # nobody may read the inherited fd, but not traverse the victim's 0700 directory: not its file to show
    assert str(paths["hidden"]) not in text and "victim" not in text
    assert not _files(text, procs["inherited"].pid, paths["top"])


def test_its_own_file_under_its_own_0700_directory_is_shown(played):
    agent, text, procs, paths = played
    pid = procs["own"].pid
    (size,) = [v for k, v in _files(text, pid, paths["top"]).items() if f'file="{paths["own"]}"' in k]
    assert size == SIZE
    (resident,) = [v for k, v in series(text, "gpuwatch_process_file_cache_resident_bytes").items()
                   if f'pid="{pid}"' in k and f'file="{paths["own"]}"' in k]
    assert 0 < resident <= SIZE  # just read


def test_c1_and_bidi_controls_in_a_file_name_never_reach_a_label(played):
    agent, text, procs, paths = played
    shown = [k for k in _files(text, procs["bidi"].pid, paths["top"]) if "gnp" in k]
    label = str(paths["bidi"].parent / "w?gnp.?[31mexe?x?.bin")
    assert shown and all(f'file="{label}"' in k for k in shown), shown
    assert not set(text) & set(CONTROLS)
