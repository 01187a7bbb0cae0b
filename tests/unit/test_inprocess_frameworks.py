"""The in-process agent's view of the program's frameworks (probes/cupti/frameworks.py): their
out-of-memory errors, and white and grey where they can be read here. The frameworks are the real
ones where this machine has them (torch's CPU build, JAX's CPU build from scripts/setup --test);
CuPy and every GPU reading need a GPU: tests/gpu/frameworks_leak_check.py, on the H200."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading

import pytest

from gpuwatch.agent import wire
from gpuwatch.probes.cupti import frameworks, inprocess
from gpuwatch.probes.cupti.inprocess import InProcessAgent, Settings

torch = pytest.importorskip("torch")
HAVE_JAX = importlib.util.find_spec("jax") is not None
TORCH_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 3 has a total capacity of 139.72 GiB of which "
             "1.12 GiB is free.")


def test_torch_s_out_of_memory_error_with_the_device_its_message_names():
    assert frameworks.oom_error(torch.cuda.OutOfMemoryError(TORCH_OOM)) == ("torch", 3, None)
    assert frameworks.oom_error(torch.OutOfMemoryError("no device said")) == ("torch", None, None)


def test_an_error_raised_from_an_oom_is_one_and_others_are_not():
    try:
        try:
            raise torch.cuda.OutOfMemoryError(TORCH_OOM)
        except torch.cuda.OutOfMemoryError as e:
            raise RuntimeError("step 12 failed") from e
    except RuntimeError as wrapped:
        assert frameworks.oom_error(wrapped) == ("torch", 3, None)
    try:
        try:
            raise torch.cuda.OutOfMemoryError("x")
        except torch.cuda.OutOfMemoryError:
            raise KeyError("while handling it")  # implicitly chained: __context__
    except KeyError as during:
        assert frameworks.oom_error(during) == ("torch", None, None)
    for other in (MemoryError("host memory"), RuntimeError("CUDA out of memory"), ValueError(), None):
        assert frameworks.oom_error(other) is None  # words alone are not the class


def test_a_loop_of_contexts_and_a_str_that_raises_are_survived():
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__context__, b.__context__ = b, a
    assert frameworks.oom_error(a) is None

    class Nasty(torch.cuda.OutOfMemoryError):
        def __str__(self):
            raise RuntimeError("no")

    assert frameworks.oom_error(Nasty()) == ("torch", None, None)
    e = torch.cuda.OutOfMemoryError("x")
    for _ in range(frameworks.MAX_CHAIN + 2):
        outer = RuntimeError("wrapped")
        outer.__cause__ = e
        e = outer
    assert frameworks.oom_error(e) is None  # followed MAX_CHAIN links, no further


@pytest.mark.skipif(not HAVE_JAX, reason="JAX is not installed (scripts/setup --test installs its CPU build)")
def test_jax_s_resource_exhausted_error_with_the_bytes_it_asked_for():
    import jax

    oom = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1073741824 bytes.")
    assert frameworks.oom_error(oom) == ("jax", None, 1 << 30)
    assert frameworks.oom_error(jax.errors.JaxRuntimeError("INVALID_ARGUMENT: shapes")) is None


def test_torch_without_cuda_has_nothing_to_read_and_no_observer_to_attach():
    assert not torch.cuda.is_initialized()
    assert frameworks.torch_memory(torch) is None
    assert frameworks.attach_torch_observer(torch, lambda *a: None) is False
    assert not torch.cuda.is_initialized()  # and asking started nothing


def test_the_driver_without_libcuda_loaded_answers_none_and_loads_nothing():
    d = frameworks.CudaDriver()
    assert (d.device_count(), d.context_active(0), d.uuid(0)) == (0, False, None)
    with open("/proc/self/maps") as f:
        assert "libcuda.so" not in f.read()


@pytest.mark.skipif(not HAVE_JAX, reason="JAX is not installed (scripts/setup --test installs its CPU build)")
def test_jax_is_read_only_once_its_backends_started_and_cpu_devices_have_no_statistics():
    """In a fresh Python: importing JAX starts no backend, and reading must not start one either
    (on a GPU that would preallocate 75 % of its memory); once the program started them, JAX's
    CPU devices have no memory statistics: nothing to report."""
    code = ("import json, jax; from gpuwatch.probes.cupti import frameworks as f; "
            "from jax._src import xla_bridge as xb; before = f.jax_memory(jax); started = xb.backends_are_initialized(); "
            "jax.numpy.ones(1000).block_until_ready(); "
            "print(json.dumps([before, started, f.jax_memory(jax), [d.memory_stats() for d in jax.local_devices()]]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == [None, False, None, [None]]


def agent() -> InProcessAgent:
    return InProcessAgent(Settings())  # not started: no thread, no hooks


def test_an_uncaught_oom_is_in_the_next_report_and_each_one_is_counted_once():
    a = agent()
    err = torch.cuda.OutOfMemoryError(TORCH_OOM)
    a.uncaught(err)
    a.uncaught(err)  # the excepthook, then the same exception again at exit: one
    a.uncaught(ValueError("not an oom"))
    report = wire.CuptiReport.parse(a.build_report())
    assert report.oom.count == 1 and (report.oom.framework, report.oom.how, report.oom.device) == ("torch", "uncaught", 3)
    assert a._report_now  # sent at the next tick, not the next interval
    a.saw_oom("torch", "allocator", 0, 123)
    oom = wire.CuptiReport.parse(a.build_report()).oom
    assert (oom.count, oom.how, oom.device, oom.requested_bytes) == (2, "allocator", 0, 123)
    # the error PyTorch's allocator told of, reaching the top uncaught: the same OOM, with its bytes kept
    same, later = torch.cuda.OutOfMemoryError(TORCH_OOM), torch.cuda.OutOfMemoryError(TORCH_OOM)  # both alive: two ids
    a.uncaught(same)
    oom = wire.CuptiReport.parse(a.build_report()).oom
    assert (oom.count, oom.how, oom.requested_bytes) == (2, "allocator", 123)
    a.oom["ts"] -= inprocess.SAME_OOM_S  # one a minute later is a new OOM
    a.uncaught(later)
    assert (a.oom_count, a.oom["how"]) == (3, "uncaught")


def test_no_oom_no_field_and_no_framework_no_memory():
    a = agent()
    a._read_memory()
    assert "oom" not in a.build_report() and a.memory == []


def test_the_hooks_chain_to_what_was_there_and_see_thread_exceptions(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *args: seen.append(("sys", args[1])))
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(("thread", args.exc_value)))
    a = agent()
    a._hook_uncaught()
    err = torch.cuda.OutOfMemoryError("in the main thread")
    sys.excepthook(type(err), err, None)
    t = threading.Thread(target=lambda: (_ for _ in ()).throw(torch.cuda.OutOfMemoryError("in a thread")))
    t.start()
    t.join()
    assert [where for where, _ in seen] == ["sys", "thread"]  # theirs still ran, after ours
    assert a.oom_count == 2 and a.oom["how"] == "uncaught"


def test_a_forked_child_reports_nothing():
    a = agent()
    a._forked = True
    a.saw_oom("torch", "uncaught")
    assert a.oom is None
