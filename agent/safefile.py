"""The one way gpuwatch creates files in directories someone else might control.

gpuwatch often runs as root and writes where a person pointed it: a trace's --output under a home
directory, the in-process agent's report under $XDG_RUNTIME_DIR. Whoever can write in such a
directory can swap a name for a symlink between our check and our open, so nothing here checks a
path and then opens it again. Instead:

- The directory is opened once, component by component with O_NOFOLLOW (`Dir`), and everything
  after is relative to that fd (openat, renameat, unlinkat): renaming or swapping the directory's
  path afterwards (even atomically, renameat2 RENAME_EXCHANGE) changes nothing we write.
- A symlink on the way is followed only where it lies in a trusted directory (see `trusted`): only
  its owner or root could have put it there. /var/run -> /run works; a link planted in a user's
  directory does not.
- The directory itself must be trusted: owned by us (the effective uid) or root, and writable by
  no one else. One exception: a root-owned sticky directory (/tmp) is accepted, because there
  others may create names but not rename or remove ours, and every file is created new (O_CREAT|
  O_EXCL|O_NOFOLLOW) and put in place with rename(2), which replaces a name and never writes
  through it: a name planted first makes a create fail, it never redirects one.
- Files are written to a new temporary file and renamed over the target (`AtomicFile`,
  `write_atomic`), or, for files written while a session runs, created new after removing the old
  name (`Dir.create`): an existing file or link at the name is replaced, never opened.

Under sudo (euid 0 with SUDO_UID set) `as_invoking_user()` switches the effective ids to the user
who ran sudo, so a trace's outputs are created, checked and permitted exactly as that user would
be (their files, their directories only). The effective ids are process-wide, so it is used
before any thread starts, and the files are opened then and kept open.

Reading goes the other way: `open_regular` is the one way gpuwatch opens a file a user's process
names (/proc/PID/fd/N, /proc/PID/map_files/..., /proc/PID/root/PATH), which may be a terminal, a
FIFO or a device by the time we open it.
"""
from __future__ import annotations

import contextlib
import errno
import os
import pwd
import stat
from typing import IO, Iterator

from gpuwatch.agent.api import GpuwatchError

_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_LINKS = 40  # as the kernel's own limit on symlinks in one lookup


class SafeFileError(GpuwatchError, OSError):
    """A file cannot be written safely; the text names the path and why. An OSError too, so callers
    that already handle write failures handle this one."""


def trusted(st: os.stat_result, euid: int | None = None) -> bool:
    """May files be created in the directory st describes? Owned by euid or root, and writable by
    no one else, or a root-owned sticky directory like /tmp (see the module's docstring)."""
    euid = os.geteuid() if euid is None else euid
    if st.st_uid not in (euid, 0):
        return False
    return not st.st_mode & 0o022 or bool(st.st_mode & stat.S_ISVTX and st.st_uid == 0)


def user_name(uid: int) -> str:
    """A user's name, for a person ("uid N" when the system has none)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _why_untrusted(st: os.stat_result) -> str:
    if st.st_uid not in (os.geteuid(), 0):
        return f"it belongs to {user_name(st.st_uid)}"
    return "others may write in it"


class Dir:
    """An open, checked directory; every name is relative to its fd. Raises SafeFileError."""

    def __init__(self, path: str, *, create: bool = False, mode: int = 0o700) -> None:
        self.path = os.path.abspath(path)
        self.fd = self._open(create, mode)
        st = os.fstat(self.fd)
        if not trusted(st):
            os.close(self.fd)
            raise SafeFileError(f"{self.path}: not a safe directory to write in: {_why_untrusted(st)} "
                                "(choose a directory of your own)")

    def _open(self, create: bool, mode: int) -> int:
        parts = [p for p in self.path.split("/") if p]
        fd = os.open("/", _DIR_FLAGS)
        where = ""  # the real path walked so far, for messages
        links = 0
        try:
            while parts:
                comp = parts.pop(0)
                if comp == ".":
                    continue
                try:
                    nfd = os.open(comp, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise SafeFileError(f"{self.path}: {where}/{comp} does not exist") from None
                    try:
                        os.mkdir(comp, mode, dir_fd=fd)
                    except FileExistsError:
                        pass  # made meanwhile: opened and checked like any other
                    except OSError as e:
                        raise SafeFileError(f"{self.path}: cannot create {where}/{comp}: {e.strerror}") from None
                    parts.insert(0, comp)
                    continue
                except OSError as e:
                    if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise SafeFileError(f"{self.path}: cannot open {where}/{comp}: {e.strerror}") from None
                    try:
                        lst = os.stat(comp, dir_fd=fd, follow_symlinks=False)
                    except OSError:
                        raise self._changed(where, comp) from None
                    if stat.S_ISDIR(lst.st_mode):  # a link a moment ago: someone renames names here
                        raise self._changed(where, comp)
                    if not stat.S_ISLNK(lst.st_mode):
                        raise SafeFileError(f"{self.path}: {where}/{comp} is not a directory") from None
                    here = os.fstat(fd)
                    link = f"{where}/{comp}"
                    about = "" if link == self.path else f"{self.path}: "
                    if not (trusted(here) and (not here.st_mode & 0o022 or lst.st_uid in (os.geteuid(), 0))):
                        raise SafeFileError(f"{about}{link} is a symbolic link in {where or '/'}, where "
                                            f"{_why_untrusted(here) if not trusted(here) else 'others create names'}: "
                                            "not following it") from None
                    links += 1
                    if links > _MAX_LINKS:
                        raise SafeFileError(f"{self.path}: too many levels of symbolic links") from None
                    try:
                        target = os.readlink(comp, dir_fd=fd)
                    except OSError:  # no longer a link
                        raise self._changed(where, comp) from None
                    parts[:0] = [p for p in target.split("/") if p]
                    if target.startswith("/"):
                        os.close(fd)
                        fd, where = -1, ""
                        fd = os.open("/", _DIR_FLAGS)
                    continue
                os.close(fd)
                fd = nfd
                where = os.path.normpath(f"{where}/{comp}")
            return fd
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise

    def _changed(self, where: str, comp: str) -> SafeFileError:
        return SafeFileError(f"{self.path}: {where}/{comp} was renamed or swapped while gpuwatch opened it "
                             "(someone else changes names in that directory): not writing there")

    def create(self, name: str, mode: int = 0o600, flags: int = os.O_WRONLY, *, replace: bool = True) -> int:
        """A new file `name` (its fd): whatever was at the name (a file, a link) is removed first
        when `replace`, never opened."""
        if replace:
            self.remove(name)
        try:
            return os.open(name, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self.fd)
        except FileExistsError:
            raise SafeFileError(f"{self.join(name)}: something else was created at this name meanwhile") from None
        except OSError as e:
            raise SafeFileError(f"cannot create {self.join(name)}: {e.strerror}") from None

    def create_temp(self, name: str, mode: int = 0o600) -> tuple[str, int]:
        """(temporary name, fd) of a new file beside `name`, to be renamed over it."""
        for _ in range(100):
            tmp = f".{name}.{os.urandom(4).hex()}.tmp"
            try:
                return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                    mode, dir_fd=self.fd)
            except FileExistsError:
                continue
            except OSError as e:
                raise SafeFileError(f"cannot create a file in {self.path}: {e.strerror}") from None
        raise SafeFileError(f"cannot create a file in {self.path}: every temporary name is taken")

    def reopen(self, name: str, like: int, flags: int = os.O_RDONLY) -> int:
        """`name` opened again, only if it is still the file open as fd `like` (not a link, not
        another file put there since)."""
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError as e:
            raise SafeFileError(f"cannot open {self.join(name)}: {e.strerror}") from None
        a, b = os.fstat(fd), os.fstat(like)
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
            os.close(fd)
            raise SafeFileError(f"{self.join(name)} was replaced by another file while gpuwatch wrote it")
        return fd

    def rename(self, src: str, dst: str) -> None:
        try:
            os.rename(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except OSError as e:
            raise SafeFileError(f"cannot replace {self.join(dst)}: {e.strerror}") from None

    def remove(self, name: str) -> None:
        """Unlink `name` if it is there (a link is removed, not followed)."""
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            raise SafeFileError(f"{self.join(name)} is a directory") from None
        except OSError as e:
            raise SafeFileError(f"cannot replace {self.join(name)}: {e.strerror}") from None

    def write_atomic(self, name: str, data: bytes, mode: int = 0o600, *, fsync: bool = True) -> None:
        """Replace `name` with a file holding `data`, all at once: readers see the old or the new."""
        tmp, fd = self.create_temp(name, mode)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
            self.rename(tmp, name)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.fd)
            raise

    def join(self, name: str) -> str:
        return os.path.join(self.path, name)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Dir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_name(name: str, path: str) -> str:
    """The last component of an output path, refused when it names no file."""
    if not name or name in (".", ".."):
        raise SafeFileError(f"{path}: names a directory, not a file")
    return name


class AtomicFile:
    """A file that replaces `path` when committed: a new temporary file is created now (so that
    the checks and the permissions are those of now, e.g. as the sudo user, and no thread has to
    change ids later) and renamed into place by commit(); discard() removes it. Text mode."""

    def __init__(self, path: str, mode: int = 0o644, *, fsync: bool = True) -> None:
        self.path = path
        head, name = os.path.split(os.path.abspath(path))
        self.name = check_name(name, path)
        self.dir = Dir(head)  # open until commit or discard
        self.fsync = fsync
        try:
            st = os.stat(self.name, dir_fd=self.dir.fd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        except OSError as e:
            self.dir.close()
            raise SafeFileError(f"cannot write {path}: {e.strerror}") from None
        if st is not None and stat.S_ISDIR(st.st_mode):
            self.dir.close()
            raise SafeFileError(f"{path} is a directory")
        # A device or a FIFO at the name (/dev/stdout's target, /dev/null, /dev/full, a pipe a script
        # reads) is what the person asked to write into: written in place, never replaced by a file.
        self.tmp = ""
        try:
            if st is not None and (stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
                fd = self._open_special(path)
            else:
                self.tmp, fd = self.dir.create_temp(self.name, mode)
        except BaseException:
            self.dir.close()
            raise
        self.file: IO[str] = os.fdopen(fd, "w", buffering=1 << 20)
        self.done = False

    def _open_special(self, path: str) -> int:
        try:  # O_NONBLOCK: a FIFO nobody reads is an error (ENXIO), not a hang
            fd = os.open(self.name, os.O_WRONLY | os.O_NOFOLLOW | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=self.dir.fd)
        except OSError as e:
            raise SafeFileError(f"cannot write {path}: {e.strerror}") from None
        st = os.fstat(fd)
        if not (stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode)):  # swapped for a file meanwhile
            os.close(fd)
            raise SafeFileError(f"{path} was replaced while gpuwatch opened it")
        os.set_blocking(fd, True)
        return fd

    def commit(self) -> None:
        try:
            self.file.flush()
            if self.fsync and self.tmp:  # a device or FIFO has nothing to sync
                os.fsync(self.file.fileno())
            self.file.close()
            if self.tmp:
                self.dir.rename(self.tmp, self.name)
        except OSError as e:
            self.discard()
            if isinstance(e, SafeFileError):
                raise
            raise SafeFileError(f"cannot write {self.path}: {e.strerror or e}") from None
        self.done = True
        self.dir.close()

    def discard(self) -> None:
        if self.done:
            return
        self.done = True
        with contextlib.suppress(OSError):
            self.file.close()
        if self.tmp:
            with contextlib.suppress(OSError):
                os.unlink(self.tmp, dir_fd=self.dir.fd)
        self.dir.close()


def write_atomic(path: str, data: bytes, mode: int = 0o600, *, fsync: bool = True) -> None:
    """Replace `path` with `data` (see Dir.write_atomic). Raises SafeFileError."""
    head, name = os.path.split(os.path.abspath(path))
    with Dir(head) as d:
        d.write_atomic(check_name(name, path), data, mode, fsync=fsync)


def sudo_user() -> tuple[int, int] | None:
    """(uid, gid) of the user who ran sudo when we run as root under it; None otherwise."""
    uid, gid = os.environ.get("SUDO_UID", ""), os.environ.get("SUDO_GID", "")
    if os.geteuid() != 0 or not uid.isdigit() or not gid.isdigit() or int(uid) == 0:
        return None
    return int(uid), int(gid)


@contextlib.contextmanager
def as_invoking_user() -> Iterator[None]:
    """Run the block with the effective uid, gid and groups of the user who ran sudo (nothing
    changes without sudo). Process-wide: only while no other thread runs."""
    who = sudo_user()
    if who is None:
        yield
        return
    uid, gid = who
    groups, egid = os.getgroups(), os.getegid()
    try:
        name = pwd.getpwuid(uid).pw_name
        extra = os.getgrouplist(name, gid)
    except KeyError:
        extra = [gid]
    os.setgroups(extra)
    os.setegid(gid)
    os.seteuid(uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(egid)
        os.setgroups(groups)


def open_regular(path: str, *, noatime: bool = False) -> int:
    """An O_RDONLY fd on the regular file at `path`, a path a user's process decides (its fds, its
    mappings, its root); OSError for anything else. The path is resolved once with O_PATH, which
    opens nothing: a terminal, FIFO or device put there is refused before its driver sees an open.
    (A terminal's open would make the agent, a session leader without one under systemd, take it
    as its controlling terminal: whoever holds the other end could then send it ^C. A FIFO's open
    blocks; some devices act on open.) The file itself is opened through that O_PATH fd, so it is
    the very file checked, and with O_NOCTTY regardless. noatime: O_NOATIME where allowed (the
    file's owner or CAP_FOWNER), so that reading it does not change what its owner sees."""
    pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(pfd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        via = f"/proc/self/fd/{pfd}"
        flags = os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC
        if noatime:
            try:
                return os.open(via, flags | os.O_NOATIME)
            except PermissionError:
                pass
        return os.open(via, flags)
    finally:
        os.close(pfd)
