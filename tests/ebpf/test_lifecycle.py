"""What the faster stop and end of a trace must still do (issue 36; timings are in bench/lifecycle.py,
never asserted here): a snapshot names every stack from one symbolising child and names the same
frames as one stack at a time; an agent stopped by SIGTERM, its probes shut down all at once,
still detaches every uprobe and leaves its store whole."""
from __future__ import annotations

import signal
import sqlite3

from gpuwatch.probes.ebpf import compiler
from gpuwatch.probes.ebpf.probe import EbpfCudaProbe
from tests.conftest import FIXTURE, wait_for

from .test_ebpf_cuda import EXPECTED, _uprobes_installed

REPLAY = ("--nvml-replay", str(FIXTURE), "--no-cupti-sampling", "--no-baseline")


def _frames(snap: dict) -> list[list[str]]:
    return [s["frames"] for k in snap["kernels"] for s in k.get("stacks", [])] + [s["frames"] for s in snap["stacks"]]


def _spy_symbolise(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = compiler.symbolise

    def counted(pid, addrs, *a, **k):
        calls.append(len(addrs))
        return real(pid, addrs, *a, **k)
    monkeypatch.setattr(compiler, "symbolise", counted)
    return calls


def test_a_snapshot_names_every_stack_from_one_child_as_one_stack_at_a_time_would(fake_cuda, drivers, monkeypatch):
    calls = _spy_symbolise(monkeypatch)
    d = drivers()
    probe = EbpfCudaProbe(libraries=[fake_cuda["lib"]], pid=d.pid, driver_names=False)
    probe.start()
    try:
        d.go()
        snap = probe.snapshot(d.pid)
        stacks = _frames(snap)
        assert len(stacks) >= 3 and len(calls) == 1  # several stacks, one child
        assert all(f.startswith("cu") for f in (s[0] for s in stacks))  # named, not addresses
        ld = probe._loader
        ld._symbols.clear()  # each stack again, in a child of its own
        again = _frames(probe.snapshot(d.pid, wait_symbols=False))  # addresses now ...
        ld._symbolise(d.pid, sorted({int(f, 16) for s in again for f in s if f.startswith("0x")}))
        assert _frames(probe.snapshot(d.pid, wait_symbols=False)) == stacks  # ... the same names
        if ld._symboliser is not None:  # the live view's background naming (wait_symbols=False) is done
            ld._symboliser.join(30)
        calls.clear()
        assert _frames(probe.snapshot(d.pid)) == stacks and calls == []  # all named already: no child
        # the process exits: bcc cannot read its maps any more, so no child is started for it, and
        # the counts are still exactly the workload's
        ld._symbols.clear()
        assert d.finish() == 0
        final = probe.snapshot(d.pid)
        assert calls == []
        assert {api: (a["calls"], a["errors"], a["bytes"]) for api, a in final["apis"].items()} == EXPECTED
        assert all(f.startswith("0x") for s in _frames(final) for f in s)
    finally:
        probe.shutdown()


def test_sigterm_with_ebpf_on_detaches_every_uprobe_and_leaves_the_store_whole(agent_factory, fake_cuda_private,
                                                                                drivers):
    lib = fake_cuda_private["lib"]
    d = drivers(fake_cuda_private["driver"])
    agent = agent_factory(*REPLAY, "--ebpf-library", lib)
    agent.metrics()
    wait_for(lambda: all(_uprobes_installed(d.pid, lib)), 60)
    d.go()
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(30) == 0, agent.output()
    out = agent.output()
    assert "Traceback" not in out and "shutdown failed" not in out, out
    assert not any(_uprobes_installed(d.pid, lib)), "a uprobe was left in the traced process"
    assert "uprobes (links) in" in out or "uprobes (perf-events) in" in out, out  # the detach ran to its end
    with sqlite3.connect(agent.state / "gpuwatch.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert db.execute("SELECT pid FROM agent_runs").fetchall() == [(agent.proc.pid,)]
    assert d.finish() == 0
