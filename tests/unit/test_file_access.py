"""Which files of a process the page-cache probe may show: those it reads or maps and that its user
could open by their path (probes/process/access.py). Real processes of user nobody (setpriv), real
files, directories and ACLs; the kernel decides, with nobody's credentials taken by one thread."""
from __future__ import annotations

import ctypes
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import pytest

from gpuwatch.probes.process import access
from gpuwatch.probes.process.pagecache import large_files

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="needs root and setpriv (to play user nobody)")

NOBODY = ("setpriv", "--reuid=65534", "--regid=65534")
MIB = 1 << 20
# argv: (mode path)...; modes: opath, wronly, read, inherited (path is an fd number), deleted (open, then unlink)
HOLD = r"""
import os, sys, time
args = sys.argv[1:]
fds = []
for mode, what in zip(args[::2], args[1::2]):
    if mode == "opath":
        fds.append(os.open(what, os.O_PATH))
    elif mode == "wronly":
        fds.append(os.open(what, os.O_WRONLY))
    elif mode == "inherited":
        fds.append(int(what))
    else:
        fds.append(os.open(what, os.O_RDONLY))
        if mode == "deleted":
            os.unlink(what)
print("ready", flush=True)
time.sleep(600)
"""


@pytest.fixture
def top():
    d = Path(tempfile.mkdtemp(prefix="gw-access-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _file(path: Path, uid: int = 0, mode: int = 0o644, size: int = 2 * MIB) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)  # sparse: size is what is listed
    os.chown(path, uid, uid)
    path.chmod(mode)
    return path


def _dir(path: Path, uid: int, mode: int) -> Path:
    path.mkdir()
    os.chown(path, uid, uid)
    path.chmod(mode)
    return path


def _hold(*args: str, groups: str = "--clear-groups", pass_fds=()) -> subprocess.Popen:
    p = subprocess.Popen([*NOBODY, groups, sys.executable, "-c", HOLD, *args], stdout=subprocess.PIPE, text=True,
                         cwd="/", pass_fds=pass_fds)
    assert p.stdout.readline().strip() == "ready"
    return p


def _shown(p: subprocess.Popen, top: Path) -> list[str]:
    return sorted(os.path.relpath(f.path, top) for f in large_files(p.pid, MIB) if f.path.startswith(f"{top}/"))


def _stop(*ps: subprocess.Popen) -> None:
    for p in ps:
        p.kill()
        p.wait()


def test_credentials_are_the_users_who_runs_it():
    p = _hold(groups="--groups=4243,4244")
    try:
        assert access.credentials(p.pid) == access.Credentials(65534, 65534, (4243, 4244))
    finally:
        _stop(p)
    assert access.credentials(p.pid) is None  # gone
    # a setuid program: the user who ran it (real ids), not the one it runs as
    q = subprocess.Popen(["setpriv", "--ruid=65534", "--euid=4242", "--rgid=65534", "--egid=4242", "--clear-groups",
                          sys.executable, "-c", HOLD], stdout=subprocess.PIPE, text=True, cwd="/")
    try:
        assert q.stdout.readline().strip() == "ready"
        assert access.credentials(q.pid) == access.Credentials(65534, 65534, ())
    finally:
        _stop(q)


def test_only_files_it_reads_and_its_user_could_open(top):
    mine = _dir(top / "mine", 65534, 0o700)
    other = _dir(top / "other", 4242, 0o700)
    shown = [_file(mine / "read.bin", 65534, 0o600), _file(top / "world.bin"), _file(mine / "gone.bin", 65534)]
    opath = _file(top / "root-only.bin", 0, 0o600)
    opath_readable = _file(top / "handle-only.bin")  # one it may read, but holds only a handle on
    wronly = _file(mine / "written.bin", 65534, 0o600)
    hidden = _file(other / "secret.bin", 4242, 0o644)
    gone_hidden = _file(other / "gone-secret.bin", 4242, 0o644)
    gone_unreadable = _file(top / "gone-root-only.bin", 0, 0o600)  # its directory searchable, it not readable
    fds = [os.open(hidden, os.O_RDONLY), os.open(gone_hidden, os.O_RDONLY), os.open(gone_unreadable, os.O_RDONLY)]
    os.unlink(gone_hidden)
    os.unlink(gone_unreadable)
    try:
        p = _hold("read", str(shown[0]), "read", str(shown[1]), "deleted", str(shown[2]), "opath", str(opath),
                  "opath", str(opath_readable), "wronly", str(wronly), "inherited", str(fds[0]), "inherited", str(fds[1]),
                  "inherited", str(fds[2]), pass_fds=fds)
    finally:
        for fd in fds:
            os.close(fd)
    try:
        # not: an O_PATH handle (on a file it may read or not), a write-only fd, an fd on a file under
        # another user's 0700 directory (deleted or not), a deleted root-only file: nobody could not
        # have opened those
        assert _shown(p, top) == ["mine/gone.bin (deleted)", "mine/read.bin", "world.bin"]
        assert len(large_files(p.pid, MIB, limit=1)) == 1
    finally:
        _stop(p)


def test_supplementary_groups_count(top):
    shared = _dir(top / "team", 0, 0o750)
    os.chown(shared, 0, 4243)
    data = _file(shared / "data.bin", 0, 0o640)
    os.chown(data, 0, 4243)
    fd = os.open(data, os.O_RDONLY)
    try:
        member = _hold("inherited", str(fd), groups="--groups=4243", pass_fds=(fd,))
        outsider = _hold("inherited", str(fd), pass_fds=(fd,))
    finally:
        os.close(fd)
    try:
        assert _shown(member, top) == ["team/data.bin"]
        assert _shown(outsider, top) == []
    finally:
        _stop(member, outsider)


def _deny_acl(path: Path, uid: int) -> None:
    """A POSIX ACL (the kernel's xattr format: setfacl is not installed) that denies `uid` while
    the mode bits let everyone read: user::rw- user:UID:--- group::r-- mask::r-- other::r--."""
    entries = [(0x01, 6, 0xFFFFFFFF), (0x02, 0, uid), (0x04, 4, 0xFFFFFFFF), (0x10, 4, 0xFFFFFFFF),
               (0x20, 4, 0xFFFFFFFF)]
    os.setxattr(path, "system.posix_acl_access", struct.pack("<I", 2) + b"".join(
        struct.pack("<HHI", *e) for e in entries))


def test_an_acl_that_denies_the_user_is_obeyed(top):
    denied = _file(top / "denied.bin")
    try:
        _deny_acl(denied, 65534)
    except OSError as e:
        pytest.skip(f"no POSIX ACLs on this file system: {e}")
    assert denied.stat().st_mode & 0o777 == 0o644  # the mode bits alone would let nobody read it
    fd = os.open(denied, os.O_RDONLY)
    try:
        p = _hold("inherited", str(fd), pass_fds=(fd,))
    finally:
        os.close(fd)
    try:
        assert _shown(p, top) == []
    finally:
        _stop(p)


def test_a_fifo_swapped_in_at_the_path_is_never_opened(top):
    mine = _dir(top / "mine", 65534, 0o755)
    path = _file(mine / "weights.bin", 65534)
    p = _hold("read", str(path))
    try:
        (f,) = [f for f in large_files(p.pid, MIB) if f.path == str(path)]
        os.rename(path, mine / "moved.bin")
        os.mkfifo(path)
        os.chown(path, 65534, 65534)
        done = []
        t = threading.Thread(target=lambda: done.append(access.openable_by_its_user(p.pid, [f], 8)), daemon=True)
        t.start()
        t.join(10)
        assert done == [[]]  # a FIFO, not the file listed: refused without blocking
    finally:
        _stop(p)


def test_the_agents_other_threads_keep_their_credentials(top):
    secret = _file(top / "root-only.bin", 0, 0o600)
    p = _hold(groups="--groups=4243")

    def ids() -> dict[str, list[str]]:
        with open("/proc/thread-self/status") as f:
            return {k: v.split() for k, v in (line.split(":", 1) for line in f)
                    if k in ("Uid", "Gid", "Groups", "CapEff")}

    try:
        (inside,) = access.as_user(access.credentials(p.pid), lambda: [ids()])
        assert inside["Uid"][3] == inside["Gid"][3] == "65534" and inside["Groups"] == ["4243"]  # fs ids, groups
        assert inside["Uid"][:3] == ["0"] * 3  # only the ids that file access checks change
        assert int(inside["CapEff"][0], 16) == 0  # and no capability in effect
        outside = ids()
        assert outside["Uid"] == outside["Gid"] == ["0"] * 4 and "4243" not in outside["Groups"]
        assert int(outside["CapEff"][0], 16) != 0
        os.close(os.open(secret, os.O_RDONLY))  # root here, still
    finally:
        _stop(p)


def test_a_planted_symlink_cannot_jump_through_another_users_proc_links(top):
    # A user who controls the tree its process's path is walked in (its own mount namespace, say)
    # plants a symlink to another user's /proc/PID/exe: that user's program, in a 0700 directory,
    # world-readable. Walked with CAP_SYS_PTRACE it would be reached; the check has no capability.
    other = _dir(top / "other", 4242, 0o700)
    program = other / "train"
    shutil.copy(shutil.which("sleep"), program)
    os.chown(program, 4242, 4242)
    program.chmod(0o755)
    victim = subprocess.Popen(["setpriv", "--reuid=4242", "--regid=4242", "--clear-groups", str(program), "600"])
    p = _hold()
    try:
        planted = _dir(top / "planted", 65534, 0o755)
        (planted / "weights.bin").symlink_to(f"/proc/{victim.pid}/exe")
        st = program.stat()
        root = os.open(planted, os.O_PATH | os.O_DIRECTORY)
        try:
            assert access.as_user(access.credentials(p.pid), lambda: [
                access.reachable(root, "/weights.bin", (st.st_dev, st.st_ino), None)]) == [False]
        finally:
            os.close(root)
    finally:
        _stop(p, victim)


def test_paths_are_walked_from_the_processs_own_root(top):
    # a process in a container or chroot names its files from its root, not the agent's
    fake = _dir(top / "container", 65534, 0o755)
    _dir(fake / "gw-only-in-the-container", 65534, 0o755)
    inside = _file(fake / "gw-only-in-the-container" / "w.bin", 65534)
    gone = _file(fake / "gone.bin", 65534)
    gone_below = _file(fake / "gw-only-in-the-container" / "gone.bin", 65534)
    p = _hold("deleted", str(gone), "deleted", str(gone_below))
    try:
        (n,) = [e.name for e in os.scandir(f"/proc/{p.pid}/fd") if os.readlink(e.path) == f"{gone} (deleted)"]
        handle = os.open(f"/proc/{p.pid}/fd/{n}", os.O_PATH)
        (m,) = [e.name for e in os.scandir(f"/proc/{p.pid}/fd") if os.readlink(e.path) == f"{gone_below} (deleted)"]
        below = os.open(f"/proc/{p.pid}/fd/{m}", os.O_PATH)
        root = os.open(fake, os.O_PATH | os.O_DIRECTORY)
        key = lambda path: (path.stat().st_dev, path.stat().st_ino)  # noqa: E731
        gone_key = (os.fstat(handle).st_dev, os.fstat(handle).st_ino)
        try:
            got = access.as_user(access.credentials(p.pid), lambda: [
                access.reachable(root, "/gw-only-in-the-container/w.bin", key(inside), None),
                access.reachable(root, str(inside), key(inside), None),  # the agent's path: not in that root
                access.reachable(root, "/gone.bin (deleted)", gone_key, handle),  # deleted at its top
                access.reachable(root, "/gw-only-in-the-container/w.bin", gone_key, None),  # another file there now
                access.reachable(root, "/gw-only-in-the-container/gone.bin (deleted)", (os.fstat(below).st_dev, os.fstat(below).st_ino),
                                 below)])  # deleted from a directory of that root (not in the agent's)
            assert got == [True, False, True, False, True]
        finally:
            os.close(root)
            os.close(handle)
            os.close(below)
    finally:
        _stop(p)


@pytest.mark.parametrize("dropped", ["-setuid,-setgid", "-setuid"])
def test_without_setuid_and_setgid_nothing_is_shown_and_the_reason_is_given(top, dropped):
    # the agent without CAP_SETUID/CAP_SETGID (a unit that drops them, or not root): it cannot check
    # as the process's user, so it shows none of its files and says why
    mine = _dir(top / "mine", 65534, 0o755)
    p = _hold("read", str(_file(mine / "w.bin", 65534)))
    code = ("import sys\nfrom gpuwatch.probes.process.pagecache import large_files\n"
            "try:\n print(large_files(int(sys.argv[1]), 1 << 20))\nexcept PermissionError as e:\n print(e)\n")
    try:
        out = subprocess.run(["setpriv", f"--bounding-set={dropped}", "--inh-caps=-all", sys.executable, "-c",
                              code, str(p.pid)], capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == "setfsuid/setfsgid refused (needs CAP_SETUID and CAP_SETGID)", out
        assert _shown(p, top) == ["mine/w.bin"]  # with them
    finally:
        _stop(p)


# --- edges found by scripts/mutate ---------------------------------------------------------------

NOBODY_CREDS = access.Credentials(65534, 65534, ())


def test_the_check_runs_in_a_daemon_thread_named_for_the_user():
    # daemon: a check stuck on a hung file system must not keep the agent from exiting
    got = access.as_user(NOBODY_CREDS, lambda: [(threading.current_thread().name, threading.current_thread().daemon)])
    assert got == [("access-uid-65534", True)]


def test_without_setgid_in_effect_the_groups_cannot_be_taken_and_that_is_said():
    # in-process (the thread that asks has CAP_SETGID out of its effective set; the check's thread inherits
    # that), so that the reason is read from this module, not from a child's copy of it
    got: list = []

    def without_setgid() -> None:
        head, data = access._CapHeader(access._CAP_VERSION_3, 0), (access._CapData * 2)()
        assert access._libc.capget(ctypes.byref(head), data) == 0
        data[0].effective &= ~(1 << 6)  # CAP_SETGID
        assert access._libc.capset(ctypes.byref(head), data) == 0
        try:
            access.as_user(access.Credentials(65534, 65534, (4243,)), lambda: ["checked"])
        except PermissionError as e:
            got.append(str(e))

    t = threading.Thread(target=without_setgid)
    t.start()
    t.join()
    assert got == ["setgroups: Operation not permitted (needs CAP_SETGID)"]


def test_reachable_refuses_relative_paths_and_a_deleted_file_without_a_handle(top):
    _dir(top / "Xdata", 65534, 0o755)  # a name that starts with what lstrip("/") must leave alone
    kept = _file(top / "Xdata" / "w.bin", 65534)
    top_file = _file(top / "w.bin", 65534)
    gone = _file(top / "Xdata" / "gone.bin", 65534)
    handle = os.open(gone, os.O_PATH)
    os.unlink(gone)
    root = os.open(top, os.O_PATH | os.O_DIRECTORY)
    key = lambda st: (st.st_dev, st.st_ino)  # noqa: E731
    try:
        got = access.as_user(NOBODY_CREDS, lambda: [
            access.reachable(root, "/Xdata/w.bin", key(kept.stat()), None),
            access.reachable(root, "/Xdata/gone.bin (deleted)", key(os.fstat(handle)), handle),
            access.reachable(root, "w.bin", key(top_file.stat()), None),  # not a path from the root: "[heap]" and such
            access.reachable(root, "/Xdata/gone.bin (deleted)", key(os.fstat(handle)), None)])  # its handle not opened
        assert got == [True, True, False, False]
    finally:
        os.close(root)
        os.close(handle)


def test_a_deleted_file_at_the_top_of_a_root_its_user_cannot_search_is_not_reachable(top):
    closed = _dir(top / "closed", 0, 0o700)  # the process's root: not searchable by nobody (the agent's / is)
    gone = _file(closed / "gone.bin", 65534)
    handle = os.open(gone, os.O_PATH)
    os.unlink(gone)
    root = os.open(closed, os.O_PATH | os.O_DIRECTORY)
    key = (os.fstat(handle).st_dev, os.fstat(handle).st_ino)
    try:
        assert access.as_user(NOBODY_CREDS, lambda: [access.reachable(root, "/gone.bin (deleted)", key, handle)]) == [
            False]
        assert access.as_user(access.Credentials(0, 0, tuple(os.getgroups())), lambda: [
            access.reachable(root, "/gone.bin (deleted)", key, handle)]) == [True]  # its owner could
    finally:
        os.close(root)
        os.close(handle)


def test_at_most_64_files_are_checked_and_the_handles_are_closed(top):
    mine = _dir(top / "mine", 65534, 0o755)
    path = _file(mine / "w.bin", 65534)
    gone = _file(mine / "gone.bin", 65534)
    p = _hold("read", str(path), "deleted", str(gone))
    try:
        st = path.stat()
        (n,) = [e.name for e in os.scandir(f"/proc/{p.pid}/fd") if os.readlink(e.path) == f"{gone} (deleted)"]
        gst = os.stat(f"/proc/{p.pid}/fd/{n}")
        listed = types.SimpleNamespace(path=str(path), st_dev=st.st_dev, st_ino=st.st_ino, handle="")
        deleted = types.SimpleNamespace(path=f"{gone} (deleted)", st_dev=gst.st_dev, st_ino=gst.st_ino,
                                        handle=f"/proc/{p.pid}/fd/{n}")
        unopenable = types.SimpleNamespace(path=f"{gone} (deleted)", st_dev=gst.st_dev, st_ino=gst.st_ino,
                                           handle=f"{top}/no-such-handle")
        open_fds = len(os.listdir("/proc/self/fd"))
        assert len(access.openable_by_its_user(p.pid, [listed] * 70, 100)) == 64
        assert access.openable_by_its_user(p.pid, [deleted, unopenable, listed], 100) == [deleted, listed]
        assert len(os.listdir("/proc/self/fd")) == open_fds  # the root's fd and the handles closed
    finally:
        _stop(p)
