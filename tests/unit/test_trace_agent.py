"""`gpuwatch trace` through the agent, without eBPF: the arithmetic that counts from the start of a
trace (since()), the client (AgentTrace) against a real control socket with a scripted agent, and
the agent's trace.snapshot handler with a stand-in for the eBPF probe (who may read what) and with
the real probe down or busy (what it says then). tests/ebpf/test_trace_daemon.py does it for real.
"""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from types import SimpleNamespace

import pytest

from gpuwatch.agent import config as config_mod
from gpuwatch.agent import daemon as daemon_mod
from gpuwatch.agent import handlers as handlers_mod
from gpuwatch.agent.trace import session, summary
from gpuwatch.agent.trace.errors import TraceError
from gpuwatch.agent.trace.pids import Target, pid_max
from gpuwatch.agent.api import Probe, ProbeNotRunning
from gpuwatch.agent.registry import ProbeEntry
from gpuwatch.agent.control import ControlError, ControlServer, PeerCred, parse_params
from gpuwatch.agent.wire import PidParams
from gpuwatch.probes.ebpf import loader
from gpuwatch.probes.process import identity
from gpuwatch.probes.ebpf.probe import STARTING, EbpfCudaProbe, ProcessQuery


def _api(calls, errors=0, nbytes=0, ns=0, hist=None, by_code=None):
    return {"calls": calls, "errors": errors, "bytes": nbytes, "seconds": ns * 1e-9,
            "mean_latency_s": ns * 1e-9 / calls if calls else 0.0, "histogram": hist or {}, "timed": True,
            "errors_by_code": by_code or {}}


START = {
    "pid": 7,
    "apis": {"cuMemAlloc_v2": _api(10, 2, 1000, 5000, {"10": 8, "12": 2}, {"CUDA_ERROR_OUT_OF_MEMORY": 2}),
             "cuCtxSynchronize": _api(4, ns=400, hist={"7": 4})},
    "memory": {"live_bytes": 600, "live_allocations": 6, "allocations": 8, "frees": 2},
    "kernels": [{"handle": "0xa000", "name": None, "launches": 50, "degenerate_launches": 1, "grid": [1, 1, 1],
                 "block": [32, 1, 1], "shared_mem_bytes": 0, "stream": "0x1", "name_source": None}],
    "dropped_events": 3,
    "libraries": [{"path": "/usr/lib/libcuda.so.1", "attached": ["cuMemAlloc_v2"], "skipped": [], "uprobes": 2}],
}
NOW = {
    "pid": 7,
    "apis": {"cuMemAlloc_v2": _api(15, 3, 1500, 8000, {"10": 11, "12": 2, "13": 2},
                                   {"CUDA_ERROR_OUT_OF_MEMORY": 2, "CUDA_ERROR_INVALID_VALUE": 1}),
             "cuCtxSynchronize": _api(4, ns=400, hist={"7": 4}),
             "cuMemFree_v2": _api(3, nbytes=300, ns=300, hist={"6": 3})},
    "memory": {"live_bytes": 800, "live_allocations": 5, "allocations": 12, "frees": 5},
    "kernels": [{"handle": "0xb000", "name": "gemm", "launches": 9, "degenerate_launches": 0, "grid": [4, 1, 1],
                 "block": [64, 1, 1], "shared_mem_bytes": 16, "stream": "0x2", "name_source": "hook"},
                {"handle": "0xa000", "name": "add", "launches": 57, "degenerate_launches": 3, "grid": [2, 1, 1],
                 "block": [32, 1, 1], "shared_mem_bytes": 0, "stream": "0x1", "name_source": "hook"}],
    "dropped_events": 3,
    "libraries": START["libraries"],
    "stacks": [{"bytes": 800, "frames": ["a", "b"]}],
}


# ---- since(): counted from the start of the trace -------------------------------------------------
def test_since_subtracts_counts_and_keeps_state():
    d = summary.since(NOW, START)
    alloc = d["apis"]["cuMemAlloc_v2"]
    assert (alloc["calls"], alloc["errors"], alloc["bytes"]) == (5, 1, 500)
    assert alloc["seconds"] == pytest.approx(3000e-9) and alloc["mean_latency_s"] == pytest.approx(600e-9)
    assert alloc["histogram"] == {10: 3, 13: 2}  # slots back as integers, empty ones left out
    assert alloc["errors_by_code"] == {"CUDA_ERROR_INVALID_VALUE": 1}
    assert alloc["timed"] is True
    assert "cuCtxSynchronize" not in d["apis"]  # not called during the trace
    assert d["apis"]["cuMemFree_v2"]["calls"] == 3 and d["apis"]["cuMemFree_v2"]["histogram"] == {6: 3}
    # live memory is the process's state now; allocations and frees happened during the trace
    assert d["memory"] == {"live_bytes": 800, "live_allocations": 5, "allocations": 4, "frees": 3}
    assert [(k["handle"], k["launches"], k["degenerate_launches"], k["name"], k["grid"]) for k in d["kernels"]] == [
        ("0xb000", 9, 0, "gemm", [4, 1, 1]), ("0xa000", 7, 2, "add", [2, 1, 1])]
    assert d["dropped_events"] == 0
    assert d["stacks"] == NOW["stacks"] and d["libraries"] == NOW["libraries"] and d["pid"] == 7
    assert NOW["apis"]["cuMemAlloc_v2"]["calls"] == 15  # the inputs are left alone


def test_since_itself_is_nothing_and_summarizes_like_a_fresh_probe():
    d = summary.since(NOW, NOW)
    assert d["apis"] == {} and d["kernels"] == [] and d["dropped_events"] == 0
    assert (d["memory"]["allocations"], d["memory"]["frees"]) == (0, 0)
    s = summary.summarize(summary.since(NOW, START), pid=7, process="x", duration=1.0, ended="duration")
    assert s["apis"]["cuMemAlloc_v2"]["p50_latency_s"] == 2 ** 10 * 1e-9
    assert s["apis"]["cuMemAlloc_v2"]["p99_latency_s"] == 2 ** 13 * 1e-9
    assert summary.totals(summary.since(NOW, START)) == (8, 1)


@pytest.mark.parametrize("now", [
    dict(START, apis={"cuMemAlloc_v2": _api(1), "cuCtxSynchronize": _api(4)}),  # fewer calls than at start
    dict(START, apis={"cuMemAlloc_v2": START["apis"]["cuMemAlloc_v2"]}),  # an API gone
    dict(START, kernels=[dict(START["kernels"][0], launches=3)]),
])
def test_since_counts_going_down_mean_the_agents_probe_restarted(now):
    with pytest.raises(TraceError, match="restarted during the trace"):
        summary.since(now, START)


@pytest.mark.parametrize("now,start,apis", [
    # histogram slots as the probe gives them (integers) against the same slots through JSON (text)
    ({"apis": {"a": {"calls": 5, "histogram": {10: 4, 11: 1}}}},
     {"apis": {"a": {"calls": 2, "histogram": {"10": 2}}}},
     {"a": {"calls": 3, "histogram": {10: 2, 11: 1}, "mean_latency_s": 0.0}}),  # no seconds: mean 0.0, not 1/3
    # a code that was there at the start and is not now is left out (never a negative count)
    ({"apis": {"a": {"calls": 4, "errors_by_code": {"B": 1}}}},
     {"apis": {"a": {"calls": 1, "errors_by_code": {"A": 2, "B": 0}}}},
     {"a": {"calls": 3, "errors_by_code": {"B": 1}, "mean_latency_s": 0.0}}),
    # counts by key may be seconds (floats); dicts of anything else, bools included, are kept as they are
    ({"apis": {"a": {"calls": 2, "s_by_code": {"A": 1.5}, "flags": {"x": True}, "notes": {"x": "y"}}}},
     {"apis": {"a": {"calls": 1, "s_by_code": {"A": 0.5}, "flags": {"x": True}, "notes": {"x": "y"}}}},
     {"a": {"calls": 1, "s_by_code": {"A": 1.0}, "flags": {"x": True}, "notes": {"x": "y"},
            "mean_latency_s": 0.0}}),
    # an API without a call count did nothing; one new since the start counts from zero
    ({"apis": {"a": {"errors": 0}, "b": {"calls": 2, "seconds": 3e-6}}}, {},
     {"b": {"calls": 2, "seconds": 3e-6, "mean_latency_s": 1.5e-6}}),
])
def test_since_per_api_counts_by_key(now, start, apis):
    assert summary.since(now, start)["apis"] == apis


def test_since_kernels_new_unchanged_and_from_a_start_without_any():
    a = {"handle": "0xa", "launches": 4, "degenerate_launches": 1}
    now = {"kernels": [a, {"handle": "0xb", "launches": 2}]}
    # 0xa did not launch during the trace: left out, not an error; 0xb is new and counts from zero
    assert summary.since(now, {"kernels": [a]})["kernels"] == [{"handle": "0xb", "launches": 2}]
    assert summary.since(now, {"kernels": None})["kernels"] == now["kernels"]
    assert summary.since({"kernels": [{"handle": "0xc"}]}, {})["kernels"] == []  # no launch count: no launches
    with pytest.raises(TraceError) as e:
        summary.since({"kernels": [dict(a, launches=3)]}, {"kernels": [a]})
    assert str(e.value) == summary.RESTARTED


def test_since_dropped_events_and_memory_when_keys_are_missing():
    assert summary.since({}, {}) == {"apis": {}, "kernels": [], "dropped_events": 0}  # no memory key made up
    d = summary.since({"dropped_events": 5, "memory": {"live_bytes": 9, "allocations": 3, "frees": 1}}, {})
    assert d["dropped_events"] == 5 and d["memory"] == {"live_bytes": 9, "allocations": 3, "frees": 1}
    assert summary.since({"dropped_events": 5}, {"dropped_events": 2})["dropped_events"] == 3
    # memory by key is state, like live_bytes: kept as it is, only allocations and frees are subtracted
    mem = {"live_bytes_by_device": {"0": 800}, "allocations": 4}
    assert summary.since({"memory": mem}, {"memory": {"live_bytes_by_device": {"0": 600}, "allocations": 1}})[
        "memory"] == {"live_bytes_by_device": {"0": 800}, "allocations": 3}


def test_since_drops_by_kind_count_from_the_start_of_the_trace():
    # the probe's drops are node-wide and run from its start; a trace through the agent reports its own
    now = {"dropped_by_kind": {"stats": 7, "live_allocations": 2, "ring_buffer": 0}}
    start = {"dropped_by_kind": {"stats": 5, "live_allocations": 2}}
    assert summary.since(now, start)["dropped_by_kind"] == {"stats": 2, "live_allocations": 0, "ring_buffer": 0}
    assert summary.since(now, {})["dropped_by_kind"] == now["dropped_by_kind"]
    assert "dropped_by_kind" not in summary.since({}, start)


def test_int_keys_turns_only_integer_text_into_integers():
    assert summary._int_keys({"-3": 1, "7": 2, "CUDA_ERROR_X": 3, 5: 4, "1.5": 6, "X12": 7}) == {
        -3: 1, 7: 2, "CUDA_ERROR_X": 3, 5: 4, "1.5": 6, "X12": 7}


# ---- numbers: percentiles, rates, totals, the summary -----------------------------------------------
NS = 1e-9


def test_percentile_of_an_empty_histogram_is_none():
    assert summary.percentile({}, 0.5) is None
    assert summary.percentile({"5": 0, 6: 0}, 0.99) is None  # empty buckets are no calls


@pytest.mark.parametrize("q", [0.0, 0.5, 0.99, 1.0])
def test_percentile_of_one_call_is_its_bucket_at_every_rank(q):
    assert summary.percentile({"7": 1, "9": 0}, q) == 2.0 ** 7 * NS


def test_percentile_slot_zero_is_zero_seconds_and_slot_one_two_ns():
    h = {"0": 2, "1": 1}  # 3 calls: p50 is rank ceil(1.5) = 2 (slot 0), p99 rank ceil(2.97) = 3 (slot 1)
    assert summary.percentile(h, 0.5) == 0.0
    assert summary.percentile(h, 0.99) == 2.0 * NS


@pytest.mark.parametrize("q,slot", [
    (0.0, 9),  # rank 0 is rank 1: the smallest call
    (1 / 3, 9),  # rank exactly 1
    (0.34, 10),  # rank ceil(1.02) = 2
    (0.5, 10),  # rank ceil(1.5) = 2
    (1.0, 11),
    (2.0, 11),  # a rank past the calls: the last bucket
])
def test_percentile_rank_rounds_up_and_slots_sort_as_numbers(q, slot):
    h = {"10": 1, "9": 1, 11: 1, "12": 0}  # as text "10" < "9": the slots must be compared as numbers
    assert summary.percentile(h, q) == 2.0 ** slot * NS


def test_percentile_at_the_p99_bucket_edge():
    # 100 calls: p99 is rank 99; with 99 calls in slot 3 it is slot 3, with 98 the 99th call is in slot 5
    assert summary.percentile({"3": 99, "5": 1}, 0.99) == 8 * NS
    assert summary.percentile({"3": 98, "5": 2}, 0.99) == 32 * NS
    assert summary.percentile({"3": 98, "5": 1, "7": 1}, 0.99) == 32 * NS


def test_has_latency_from_histogram_or_seconds():
    assert [summary.has_latency(a) for a in ({}, {"histogram": {}, "seconds": 0.0}, {"histogram": {"3": 1}},
                                           {"seconds": 1e-6})] == [False, False, True, True]


def test_rates_per_second_since_the_previous_snapshot():
    snap = {"apis": {"a": {"calls": 30}, "b": {"calls": 7}, "c": {}}}
    prev = {"apis": {"a": {"calls": 10}, "c": {"calls": 0}}}
    # (30 - 10) / 0.5, b new since the previous one: 7 / 0.5, c has no calls at all
    assert summary.rates(snap, prev, 0.5) == {"a": 40.0, "b": 14.0, "c": 0.0}
    assert summary.rates(snap, prev, 2.0) == {"a": 10.0, "b": 3.5, "c": 0.0}
    assert summary.rates(snap, {}, 0.5) == {"a": 60.0, "b": 14.0, "c": 0.0}  # a previous one with no APIs
    # no previous snapshot, or no time between them: no rates (not a division by zero)
    assert summary.rates(snap, None, 0.5) == {} and summary.rates(snap, prev, 0.0) == {}
    assert summary.rates(snap, prev, -1.0) == {}
    assert summary.rates({}, prev, 0.5) == {}


def test_kernel_rates_per_second_since_the_previous_snapshot():
    snap = {"kernels": [{"handle": 1, "launches": 9}, {"handle": 2, "launches": 4}, {"handle": 3}]}
    prev = {"kernels": [{"handle": 1, "launches": 3}, {"handle": 3}]}
    # (9 - 3) / 0.5; kernel 2 is new: 4 / 0.5; kernel 3 never launched
    assert summary.kernel_rates(snap, prev, 0.5) == {1: 12.0, 2: 8.0, 3: 0.0}
    assert summary.kernel_rates(snap, prev, 2.0) == {1: 3.0, 2: 2.0, 3: 0.0}
    assert summary.kernel_rates(snap, {"kernels": None}, 0.5) == {1: 18.0, 2: 8.0, 3: 0.0}
    assert summary.kernel_rates({"kernels": None}, prev, 0.5) == {}
    assert summary.kernel_rates(snap, None, 0.5) == {} and summary.kernel_rates(snap, prev, 0.0) == {}
    assert summary.kernel_rates(snap, prev, -1.0) == {}


def test_totals_sum_calls_and_errors_of_every_api():
    assert summary.totals({"apis": {"a": {"calls": 3, "errors": 1}, "b": {"calls": 2}, "c": {"errors": 4}}}) == (5, 5)
    assert summary.totals({}) == (0, 0)


def test_summarize_exact_document():
    snap = {
        "apis": {
            "cuMemcpyHtoD_v2": {"calls": 4, "errors": 1, "errors_by_code": {"CUDA_ERROR_INVALID_VALUE": 1},
                                "bytes": 4096, "seconds": 1e-5, "mean_latency_s": 2.5e-6,
                                "histogram": {"11": 3, "12": 1}},  # p50 rank 2, p99 rank ceil(3.96) = 4
            "cuCtxSynchronize": {},
            "cuLaunchKernel": {"calls": 2, "seconds": 3e-6, "histogram": None},  # timed, no histogram
            "cuMemAlloc_v2": {"calls": 100, "seconds": 1e-6, "mean_latency_s": 1e-8,
                              "histogram": {"3": 98, "5": 1, "7": 1}},  # p50 slot 3, p99 (rank 99) slot 5
        },
        "kernels": [{"handle": "0xb", "launches": 5}, {"handle": "0xa", "launches": 5}, {"launches": 5},
                    {"handle": "0xz", "launches": 1}, {"handle": "0xc"}, {"handle": "0xd", "launches": 7}],
        "memory": {"live_bytes": 10, "live_allocations": 2, "allocations": 3, "frees": 1, "peak": 99},
        "stacks": [{"bytes": 4}, {"bytes": 3}, {"bytes": 2}, {"bytes": 1}],
        "dropped_events": 2,
        "gpu": {"index": 0},
    }
    s = summary.summarize(snap, pid=42, process="train", duration=12.3456, ended="exited")
    assert list(s["apis"]) == ["cuCtxSynchronize", "cuLaunchKernel", "cuMemAlloc_v2", "cuMemcpyHtoD_v2"]
    assert s == {
        "pid": 42,
        "process": "train",
        "duration_seconds": 12.346,
        "ended": "exited",
        "apis": {
            "cuCtxSynchronize": {"calls": 0, "errors": 0, "errors_by_code": {}, "bytes": 0, "mean_latency_s": None,
                                 "p50_latency_s": None, "p99_latency_s": None},
            "cuLaunchKernel": {"calls": 2, "errors": 0, "errors_by_code": {}, "bytes": 0, "mean_latency_s": 0.0,
                               "p50_latency_s": None, "p99_latency_s": None},
            "cuMemAlloc_v2": {"calls": 100, "errors": 0, "errors_by_code": {}, "bytes": 0, "mean_latency_s": 1e-8,
                              "p50_latency_s": 8 * NS, "p99_latency_s": 32 * NS},
            "cuMemcpyHtoD_v2": {"calls": 4, "errors": 1, "errors_by_code": {"CUDA_ERROR_INVALID_VALUE": 1},
                                "bytes": 4096, "mean_latency_s": 2.5e-6,
                                "p50_latency_s": 2.0 ** 11 * NS, "p99_latency_s": 2.0 ** 12 * NS},
        },
        # most launches first, ties by handle (none sorts as ""), no launch count as 0
        "kernels": [snap["kernels"][i] for i in (5, 2, 1, 0, 3, 4)],
        # a snapshot without "graphs" (an older agent): zeros, every field there
        "graphs": {"launches": 0, "kernel_launches": 0, "unknown_content_launches": 0,
                   "partial_content_launches": 0, "graphs": 0, "executable_graphs": 0},
        "communicators": [],  # no NCCL communicators in the snapshot
        "memory": {"live_bytes": 10, "live_allocations": 2, "allocations": 3, "frees": 1},
        "stacks": snap["stacks"][:3],
        "dropped_events": 2,
        "dropped_by_kind": {},
        "gpu": {"index": 0},
        "latency_resolution": "log2 buckets: p50/p99 are the bucket's upper edge (true value within a factor 2 below)",
    }


def test_summaries_are_their_wire_type_and_read_back_checked(tmp_path):
    from gpuwatch.agent.trace.output import read_summary
    from gpuwatch.agent.wire import TraceSummary

    doc = summary.summarize(START, pid=42, process="train", duration=1.5, ended="exited")
    TraceSummary.parse(doc)
    TraceSummary.parse(summary.summarize({}, pid=1, process="?", duration=0.0, ended="Ctrl-C"))
    path = tmp_path / "run.json"
    path.write_text(json.dumps(doc))
    assert read_summary(str(path)) == doc
    for bad, field in ((dict(doc, pid=0), "pid"), (dict(doc, dropped_events=-1), "dropped_events"),
                       ({k: v for k, v in doc.items() if k != "apis"}, "apis: is required")):
        path.write_text(json.dumps(bad))
        with pytest.raises(TraceError, match=f"is not a gpuwatch trace summary: {field}"):
            read_summary(str(path))
    path.write_text("{")
    with pytest.raises(TraceError, match="is not a gpuwatch trace summary"):
        read_summary(str(path))


def test_summarize_of_an_empty_snapshot():
    s = summary.summarize({"kernels": None, "stacks": None}, pid=1, process="p", duration=0.0004, ended="interrupted")
    assert (s["apis"], s["kernels"], s["stacks"], s["dropped_events"], s["gpu"], s["duration_seconds"]) == (
        {}, [], [], 0, None, 0.0)
    assert s["memory"] == {"live_bytes": 0, "live_allocations": 0, "allocations": 0, "frees": 0}
    assert summary.summarize({}, pid=1, process="p", duration=1.0, ended="x")["kernels"] == []


# ---- AgentTrace: the client, against a scripted agent ----------------------------------------------
@pytest.fixture
def sleeper():
    p = subprocess.Popen(["sleep", "30"])
    yield p
    p.kill()
    p.wait()


@pytest.fixture
def scripted(tmp_path):
    """A control socket whose trace.snapshot answers from a list (the last answer repeats)."""
    answers: list = []
    asked: list[dict] = []

    def snapshot(params, peer):
        asked.append(params)
        a = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(a, Exception):
            raise a
        return a

    server = ControlServer(str(tmp_path / "control.sock"), {"ping": lambda p, c: "pong", "trace.snapshot": snapshot})
    server.start()
    yield SimpleNamespace(path=server.path, answers=answers, asked=asked)
    server.stop()


def _target(p) -> Target:
    return Target(p.pid, "sleep", identity.read_stat(p.pid).start_time)


def test_agent_trace_counts_from_start(scripted, sleeper):
    scripted.answers[:] = [START, NOW]
    t = session.AgentTrace(scripted.path, _target(sleeper))
    t.start()
    assert t.attached() == START["libraries"]
    snap = t.snapshot(sleeper.pid)
    assert snap == summary.since(NOW, START)
    assert scripted.asked == [PidParams(pid=sleeper.pid)] * 2


def test_agent_trace_after_the_process_exits_keeps_the_last_counts(scripted, sleeper):
    scripted.answers[:] = [START, NOW, ControlError(f"no such process: PID {sleeper.pid}")]
    t = session.AgentTrace(scripted.path, _target(sleeper))
    t.start()
    last = t.snapshot(sleeper.pid)
    with pytest.raises(TraceError, match="no such process"):  # while it runs, an error is an error
        t.snapshot(sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    assert t.snapshot(sleeper.pid) == last


def test_agent_trace_refuses_a_reply_outside_its_wire_type(scripted, sleeper):
    # Whatever listens on the socket (a user's own socket given with --socket, a broken agent):
    # counts no real probe can have are an error naming the field, never arithmetic on them.
    hostile = dict(START, apis={"cuMemAlloc_v2": dict(_api(1), calls=10**400)})
    scripted.answers[:] = [hostile]
    with pytest.raises(TraceError, match=r"unexpected reply to 'trace.snapshot'.*"
                                               r"apis\['cuMemAlloc_v2'\].calls: must be an integer"):
        session.AgentTrace(scripted.path, _target(sleeper)).start()


def test_agent_trace_waits_for_the_agent_to_attach_only_with_wait(scripted, sleeper, monkeypatch):
    monkeypatch.setattr(session, "AGENT_ATTACH_POLL_S", 0.01)
    pending = dict(START, libraries=[])
    scripted.answers[:] = [pending]
    with pytest.raises(TraceError, match=r"has not attached to the libcuda of process \d+ \(sleep\) yet.*--wait"):
        session.AgentTrace(scripted.path, _target(sleeper)).start()
    scripted.answers[:] = [pending, pending, START, NOW]
    t = session.AgentTrace(scripted.path, _target(sleeper), wait=True)
    t.start()
    assert t.attached() == START["libraries"] and t.snapshot(sleeper.pid) == summary.since(NOW, START)


def test_unreachable_agent_and_library_say_what_to_do(tmp_path):
    with pytest.raises(TraceError) as e:
        session._agent_socket(4242, None, str(tmp_path / "none.sock"), None)
    assert str(e.value) == (f"attaching eBPF uprobes to process 4242 needs root, and the gpuwatch agent cannot be "
                            f"asked instead (no gpuwatch agent is listening on {tmp_path}/none.sock (is `gpuwatch "
                            f"agent` / the gpuwatch service running?)): {session.NOT_ROOT}")
    assert "start the gpuwatch daemon (systemctl start gpuwatch)" in session.NOT_ROOT
    with pytest.raises(TraceError, match="--library needs root"):
        session._agent_socket(4242, "/x/libcuda.so.1", str(tmp_path / "none.sock"), None)


# ---- the agent's trace.snapshot, with a stand-in probe ----------------------------------------------
class FakeEbpf(Probe):
    """EbpfCudaProbe's query API as trace.snapshot uses it (query, libraries), "attached" to a file
    this test process maps. Down and busy are the real probe's, below; its locking under restarts
    and slow collections is tested on real uprobes (tests/ebpf/test_ebpf_query.py)."""

    name = "ebpf"

    def __init__(self, path: str) -> None:
        self.path = path
        self.libraries: tuple[str, ...] = ()
        self.running = False

    def start(self) -> None:
        self.running = True

    def collect(self):
        return []

    def shutdown(self) -> None:
        self.running = False

    def query(self, pid: int, timeout: float | None = None, exact_launches: float = 0.0) -> ProcessQuery:
        self.exact_launches = exact_launches  # a trace through the daemon asks for every launch
        if not self.running:
            raise ProbeNotRunning(STARTING)
        snap = {"pid": pid, "apis": {"cuLaunchKernel": _api(1)}, "memory": {}, "kernels": [], "dropped_events": 0,
                "libraries": [{"path": self.path, "attached": ["cuLaunchKernel"], "skipped": [], "uprobes": 1}]}
        return ProcessQuery(snap, {self.path: loader.file_id(self.path)})


MINE = loader.mapped_files(os.getpid())[0]  # the python executable, mapped by this process
ME = PeerCred(pid=os.getpid(), uid=os.geteuid(), gid=os.getegid())
MISSING = "/nonexistent/libcuda.so.1"  # the real probe's start fails on it before compiling anything


@pytest.fixture
def agent(tmp_path, monkeypatch):
    """A Daemon (not running: its handlers are called directly) around the probe given."""
    made = []

    def make(probe: Probe | None):
        monkeypatch.setattr(daemon_mod, "probe_entries",
                            lambda: [ProbeEntry("ebpf", "ebpf", 20, lambda ctx: probe)])
        # A state directory each: a Daemon holds its directory's lock (agent.lock) for its life.
        cfg = config_mod.load("", {"agent.state_dir": str(tmp_path / f"state{len(made)}"),
                                   "agent.runtime_dir": str(tmp_path),
                                   "nvml.enabled": False, "prometheus.enabled": False})
        d = daemon_mod.Daemon(cfg, None, {})
        made.append(d)
        return d

    yield make
    for d in made:
        d.runner.shutdown()
        if d.store is not None:
            d.store.close()


def test_snapshot_of_an_own_process_with_its_libraries_as_it_sees_them(agent):
    fake = FakeEbpf(f"/proc/{os.getpid()}/root{MINE}")  # as a rescan finds a library
    d = agent(fake)
    d.runner.tick_once()
    snap = d._trace_snapshot(PidParams(pid=os.getpid()), ME)
    assert snap["apis"]["cuLaunchKernel"]["calls"] == 1
    assert snap["libraries"] == [{"path": MINE, "attached": ["cuLaunchKernel"], "skipped": [], "uprobes": 1}]
    assert fake.exact_launches > 0  # the daemon counts every launch while a trace asks


def test_snapshot_refused_for_another_users_process(agent):
    import pwd

    d = agent(FakeEbpf(MINE))
    d.runner.tick_once()
    other = PeerCred(pid=1, uid=os.geteuid() + 1, gid=os.getegid() + 1)
    with pytest.raises(ControlError) as e:
        d._trace_snapshot(PidParams(pid=os.getpid()), other)
    assert str(e.value) == (f"process {os.getpid()} belongs to user {pwd.getpwuid(os.geteuid()).pw_name}: "
                            f"you can trace only your own processes")


def test_snapshot_errors_say_why(agent, sleeper):
    d = agent(FakeEbpf(MINE))
    d.runner.tick_once()
    for params, message in [({}, "trace.snapshot refused: pid: is required"),
                            ({"pid": True}, "got True"),
                            ({"pid": 0}, "pid: must be an integer from 1 to 4194304, got 0"),
                            ({"pid": pid_max() + 1}, "is above this system's largest PID"),
                            ({"pid": sleeper.pid}, f"process {sleeper.pid} (sleep) does not use CUDA")]:
        with pytest.raises(ControlError, match=message.replace("(", r"\(").replace(")", r"\)")):
            d._trace_snapshot(parse_params("trace.snapshot", params), ME)


def test_snapshot_when_the_probe_is_disabled_or_down(agent):
    with pytest.raises(ControlError, match=r"does not run the eBPF probe \(ebpf.enabled is false"):
        agent(None)._trace_snapshot(PidParams(pid=os.getpid()), ME)
    d = agent(EbpfCudaProbe(libraries=[MISSING]))
    with pytest.raises(ControlError) as e:
        d._trace_snapshot(PidParams(pid=os.getpid()), ME)
    assert str(e.value) == ("the gpuwatch agent's eBPF probe is not running: it is starting (compiling takes a few "
                            "seconds): try again shortly")
    d.runner.tick_once()  # its start fails: the probe keeps why
    with pytest.raises(ControlError) as e:
        d._trace_snapshot(PidParams(pid=os.getpid()), ME)
    assert str(e.value) == (f"the gpuwatch agent's eBPF probe is not running: the configured CUDA driver library "
                            f"{MISSING} does not exist: fix the path, or leave it unset to find libcuda in running "
                            f"processes")
    assert d.runner.snapshot.probes["ebpf"].reason in str(e.value)  # what `gpuwatch status` says too
    assert d._live_stacks(os.getpid()) == []  # a finding goes without stacks


def test_snapshot_while_the_probe_starts_is_busy_not_stuck(agent, monkeypatch):
    monkeypatch.setattr(handlers_mod, "TRACE_LOCK_WAIT", 0.05)
    probe = EbpfCudaProbe(libraries=[MISSING])
    d = agent(probe)
    held, done = threading.Event(), threading.Event()

    def starting():  # what a start (compiling, attaching) does: holds the probe's lock for seconds
        with probe._lock:
            held.set()
            done.wait(10)

    t = threading.Thread(target=starting)
    t.start()
    try:
        held.wait(5)
        t0 = time.monotonic()
        with pytest.raises(ControlError, match="eBPF probe is busy"):
            d._trace_snapshot(PidParams(pid=os.getpid()), ME)
        assert 0.05 <= time.monotonic() - t0 < 2
        assert d._live_stacks(os.getpid()) == []
    finally:
        done.set()
        t.join(5)
    with pytest.raises(ControlError, match="eBPF probe is not running"):  # the lock is free again
        d._trace_snapshot(PidParams(pid=os.getpid()), ME)


def test_snapshots_parse_as_their_wire_result(agent):
    from gpuwatch.agent.wire import TraceSnapshotResult, WireError

    for snap in (START, NOW):
        got = TraceSnapshotResult.parse(snap)
        assert got.apis["cuMemAlloc_v2"].histogram == snap["apis"]["cuMemAlloc_v2"]["histogram"]
        assert got.to_json()["kernels"] == snap["kernels"]
    d = agent(FakeEbpf(MINE))
    d.runner.tick_once(timeout=5)
    got = TraceSnapshotResult.parse(d._trace_snapshot(PidParams(pid=os.getpid()), ME))
    assert got.pid == os.getpid() and got.libraries[0].attached == ("cuLaunchKernel",)
    with pytest.raises(WireError, match=r"apis\['cuMemAlloc_v2'\].calls: must be an integer"):
        TraceSnapshotResult.parse(dict(START, apis={"cuMemAlloc_v2": _api(-1)}))
