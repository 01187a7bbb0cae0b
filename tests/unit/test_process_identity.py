"""probes/process/identity.py on real processes: who a PID names, whether it is still that process
(a PID reused by another process is not), and who owns it."""
import os
import shutil
import subprocess
import sys
import time

import pytest

from gpuwatch.probes.process.identity import ProcessIdentity, identify, is_alive, owns, sanitise_process_name

NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (another user's process, a PID namespace)")


def test_this_process():
    me = identify(os.getpid())
    assert me is not None and me.pid == os.getpid()
    assert me.uids == (os.getuid(), os.geteuid(), os.getuid())
    assert me.comm == sanitise_process_name(open("/proc/self/comm").read().strip())
    assert me.root == "/"
    # field 22 of /proc/PID/stat, as the kernel counts it
    assert me.start_time == int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
    assert is_alive(me) and identify(os.getpid()) == me


@pytest.mark.parametrize("pid", [0, -1, 2**22 + 12345, True])
def test_no_such_process(pid):
    assert identify(pid) is None


def test_exited_and_zombie_processes_are_not_alive():
    p = subprocess.Popen(["sleep", "30"])
    ident = identify(p.pid)
    assert ident is not None and ident.comm == "sleep" and is_alive(ident)
    p.kill()
    time.sleep(0.2)  # not reaped yet: a zombie is an exited process
    assert not is_alive(ident) and identify(p.pid) is None
    p.wait()
    assert not is_alive(ident) and identify(p.pid) is None


def test_another_start_time_is_another_process():
    me = identify(os.getpid())
    reused = ProcessIdentity(me.pid, me.start_time - 1, me.uids, me.comm, me.root)
    assert not is_alive(reused)


@root_only
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")
def test_a_reused_pid_is_not_the_same_process():
    # In a new PID namespace /proc/sys/kernel/ns_last_pid picks the next PID: the same PID comes
    # back at once, as it would after the host's PIDs wrap.
    code = """
import os, sys, time
from gpuwatch.probes.process.identity import identify, is_alive
pid = os.fork()
if pid == 0:
    time.sleep(5); os._exit(0)
old = identify(pid)
os.kill(pid, 9); os.waitpid(pid, 0)
time.sleep(0.05)  # start times count clock ticks (10 ms): a later tick
with open("/proc/sys/kernel/ns_last_pid", "w") as f:
    f.write(str(pid - 1))
again = os.fork()
if again == 0:
    time.sleep(5); os._exit(0)
new = identify(again)
print(again == pid, is_alive(old), new is not None and new.start_time != old.start_time, is_alive(new))
os.kill(again, 9)
"""
    out = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=30)
    assert out.stdout.split() == ["True", "False", "True", "True"], out.stderr


def test_process_names_are_sanitised_as_every_probe_labels_them():
    code = ("import ctypes, sys; ctypes.CDLL(None).prctl(15, b'a b\\n\\x1b[31m', 0, 0, 0); "
            "sys.stdout.write('x'); sys.stdout.flush(); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert p.stdout.read(1) == b"x"
        ident = identify(p.pid)
        assert ident.comm == "a_b___31m" == sanitise_process_name("a b\n\x1b[31m")
    finally:
        p.kill()
        p.wait()


@root_only
def test_a_caller_owns_only_its_own_processes():
    # What the control socket and trace decide a caller may see (identity.owns of identify(pid)).
    assert identify(os.getpid()).uids == (os.getuid(), os.geteuid(), os.getuid())
    assert owns(os.getuid(), identify(os.getpid()))
    assert not owns(65534, identify(os.getpid())) or os.getuid() == 65534
    assert not owns(65534, identify(2**22 + 12345))  # no such process
    assert owns(0, identify(1))
    assert identify(2**22 + 12345) is None


def test_owners_are_every_uid_of_the_process():
    p = subprocess.Popen([*NOBODY, "sleep", "30"])
    try:
        time.sleep(0.2)
        nobody = identify(p.pid)
        assert nobody.uids == (65534, 65534, 65534)
        assert owns(65534, nobody) and owns(0, nobody) and not owns(1000, nobody)
        me = identify(os.getpid())
        assert not owns(65534, me)
        # setuid-like: real uid nobody, saved uid root; not nobody's to look inside
        assert not owns(65534, ProcessIdentity(p.pid, nobody.start_time, (65534, 65534, 0), "x", "/"))
        assert not owns(0, None) and not owns(65534, None)
    finally:
        p.kill()
        p.wait()
