"""The daemon's side of the reference workload: when to run it, in a child, and what it said.

One worker thread runs the workload (workload.py) as a child process per GPU, one GPU at a time:
on its schedule (baseline.interval; a GPU with compute processes is skipped - the child checks
and exits 3 - and tried again 10 minutes later) or when `gpuwatch baseline run` asks. A crash,
a hang (killed after baseline.timeout) or a GPU fault in the child cannot take the agent down.

The agent's own GPU work is not a user's: the busy check leaves out the processes the agent's
other probes say are theirs (agent/own.py: the CUPTI sampler's child), and those step aside -
their child stopped, its CUDA context released - from before the check until the run is over, so
the run has the GPU to itself and is not measured beside the sampler.

Each completed run is judged against the GPU's earlier runs from the store (probes/baseline/verdict.py),
stored with its verdict, and exported as the GPU's latest values (collect() never waits on a
child). HealthDetector turns those values into findings.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Sequence

from gpuwatch.agent import own
from gpuwatch.agent.events import EventQueue
from gpuwatch.agent.api import Event, Probe, ProbeDisabled, Sample
from gpuwatch.probes.baseline.verdict import HealthSettings, judge, retake_of, runs_of
from gpuwatch.probes.baseline import missing

log = logging.getLogger("gpuwatch.baseline")

EXIT_SKIPPED = 3  # workload.EXIT_SKIPPED (not imported: that module needs torch)
# A prepared child (workload --serve: torch and Triton imported, no CUDA call made, so no context
# and no GPU memory) is started this long before a GPU's scheduled run and after each run, and let
# go after KEEP_READY s unused: a run then costs its wall time on the GPU, not Python's start-up.
PREPARE_AHEAD = 120.0
KEEP_READY = 600.0
BUSY_RETRY = 600.0
OUTPUT_LIMIT = 1 << 20

# A Python other than the agent's (baseline.python) imports gpuwatch from the agent's installation:
# the subpackages' directories come as JSON in argv[1]; nothing is written anywhere.
BOOT = """import importlib.util, json, sys, types
dirs = json.loads(sys.argv.pop(1))
pkg = types.ModuleType("gpuwatch"); pkg.__path__ = []; sys.modules["gpuwatch"] = pkg
for sub, d in dirs.items():
    spec = importlib.util.spec_from_file_location("gpuwatch." + sub, d + "/__init__.py", submodule_search_locations=[d])
    mod = importlib.util.module_from_spec(spec); sys.modules["gpuwatch." + sub] = mod; spec.loader.exec_module(mod)
    setattr(pkg, sub, mod)
from gpuwatch.probes.baseline import workload
sys.exit(workload.main(sys.argv[1:]))
"""


MAX_IGNORED = 64  # own pids passed to the child's busy check


def child_command(gpu: int, python: str = "", replay: str = "", nth: int = 0, force: bool = False,
                  ignore: Sequence[int] = (), serve: bool = False) -> list[str]:
    """The command that runs the workload (or replays a recorded run) on one GPU; `ignore`: the
    agent's own pids, which its busy check leaves out. serve: a prepared child, told its GPU on stdin."""
    if replay:
        # baseline.python, when set, runs the replay too (it must import gpuwatch): tests give a
        # child that crashes (tests/reliability), as a workload dying in native code would.
        return [python or sys.executable, "-m", "gpuwatch.probes.baseline.replay", replay, "--gpu", str(gpu),
                "--nth", str(nth)]
    args = ["--gpu", str(gpu)] + (["--force"] if force else [])
    pids = sorted({int(p) for p in ignore if int(p) > 0})[:MAX_IGNORED]
    if pids:
        args += ["--ignore-pids", ",".join(map(str, pids))]
    if serve:
        args = ["--serve"]
    if not python or os.path.abspath(python) == os.path.abspath(sys.executable):  # a venv's python is a link
        return [sys.executable, "-m", "gpuwatch.probes.baseline.workload", *args]
    from gpuwatch.agent import package_dirs

    return [python, "-c", BOOT, json.dumps(package_dirs()), *args]


class BaselineProbe(Probe):
    name = "baseline"
    interval = 1.0
    deadline = 2.0

    def __init__(self, store=None, *, gpus: Callable[[], list[str]], every: float = 21600.0, python: str = "",
                 timeout: float = 300.0, replay: str = "", clock: Callable[[], float] = time.time,
                 first_delay: float = 120.0, tenants: Sequence[own.GpuTenant] = (),
                 compute_processes: Callable[[str], frozenset[int] | None] | None = None,
                 pause_timeout: float = 5.0, exists: Callable[[int], bool] | None = None,
                 settings: HealthSettings | None = None) -> None:
        # gpus: the GPUs' UUIDs in NVML's order (the daemon's: what its NVML probe saw last).
        # tenants: the agent's probes whose children hold a CUDA context (they step aside for a run);
        # compute_processes: UUID -> the pids NVML lists on that GPU now (None: it cannot say).
        self.tenants, self.compute_processes, self.pause_timeout = tuple(tenants), compute_processes, pause_timeout
        self.settings = settings or HealthSettings()
        self.exists = exists or (lambda pid: os.path.exists(f"/proc/{pid}"))
        self.store, self.every, self.python, self.timeout, self.replay = store, every, python, timeout, replay
        self.gpus, self.clock, self.first_delay = gpus, clock, first_delay
        self._lock = threading.Lock()
        self._latest: dict[str, dict] = {}  # GPU UUID -> its latest judged run
        self._counts: dict[tuple[str, str], int] = {}
        self._events = EventQueue(None)  # one a run: no bound
        self._requests: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._due: dict[int, float] = {}
        self._uuids: list[str] = []
        self._gpu_error = ""
        self._nth: dict[int, int] = {}
        self._proc: subprocess.Popen | None = None
        self._ready: subprocess.Popen | None = None  # the prepared child (workload --serve)
        self._ready_since = 0.0

    # -- probe interface ------------------------------------------------------------------
    def start(self) -> None:
        if not self.replay and not self.python:
            problem = missing()
            if problem:
                raise ProbeDisabled(f"reference workload: {problem}; or set baseline.python to an "
                                       "interpreter that has them")
        for run in self._past(None, 1000):
            if run.get("uuid"):
                self._latest[run["uuid"]] = run
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._work, name="baseline", daemon=True)
            self._thread.start()

    def collect(self) -> list[Sample]:
        now = self.clock()
        try:  # the GPUs there are now: a GPU gone (swapped, MIG reconfigured) takes its series with it
            present = set(self.gpus())
        except Exception:  # noqa: BLE001 - NVML cannot say now: keep what is known
            present = None
        with self._lock:
            latest = [r for r in self._latest.values() if present is None or r.get("uuid") in present]
            counts = {k: n for k, n in self._counts.items() if present is None or k[0] in present}
        out = [Sample("gpuwatch.baseline.runs", float(n), gpu, {"result": result}, now)
               for (gpu, result), n in counts.items()]
        for run in latest:
            out += samples_of(run, now)
        out += own.samples(self.own_processes(), now)
        return out

    def own_processes(self) -> list[own.OwnProcess]:
        proc = self._proc
        return [own.OwnProcess(proc.pid, "baseline")] if proc is not None and proc.poll() is None else []

    def verdicts(self) -> dict[str, dict]:
        """GPU UUID -> {"result", "ts"} of its latest judged run (what `gpuwatch top` shows)."""
        with self._lock:
            return {uuid: {"result": run.get("result", ""), "ts": run.get("ts", 0.0)}
                    for uuid, run in self._latest.items()}

    def events(self) -> list[Event]:
        return self._events.drain()

    def shutdown(self) -> None:
        self._stop.set()
        self._requests.put(None)
        self._let_go()
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None

    # -- on demand ------------------------------------------------------------------------
    def run_now(self, gpu: int | None = None, force: bool = False, timeout: float | None = None) -> list[dict]:
        """Run on one GPU (None: each GPU) now, after any run in progress; the results as stored.
        Raises TimeoutError when the worker does not finish in time (the runs go on)."""
        done: queue.Queue = queue.Queue()
        self._requests.put((gpu, force, done))
        try:
            return done.get(timeout=timeout if timeout is not None else self.timeout * 2 + 30)
        except queue.Empty:
            raise TimeoutError("the reference workload did not finish in time; see `gpuwatch baseline show` "
                               "later") from None

    # -- worker ---------------------------------------------------------------------------
    def _list_gpus(self) -> int:
        """Refresh the GPUs' UUIDs from NVML; how many there are (0 while NVML cannot say)."""
        try:
            self._uuids = self.gpus()
            self._gpu_error = ""
        except Exception as e:  # noqa: BLE001 - no NVML here, or it went away: try again later
            if str(e) != self._gpu_error:  # said once, not every minute
                log.warning("baseline: cannot list the GPUs (%s); trying again every minute", e)
            self._gpu_error = str(e)
            self._uuids = []
        return len(self._uuids)

    def _work(self) -> None:
        first = self.clock() + self.first_delay  # not in the way of jobs that start with the node
        while not self._stop.is_set():
            now = self.clock()
            count = self._list_gpus()
            for g in range(count):
                self._due.setdefault(g, first)
            due = [g for g in range(count) if self._due.get(g, 0.0) <= now]
            if any(self._due.get(g, 0.0) <= now + PREPARE_AHEAD for g in range(count)):
                self._prepare()
            elif self._ready is not None and now - self._ready_since > KEEP_READY:
                self._let_go()
            if due:
                for g in due:
                    if self._stop.is_set():
                        return
                    self._run_one(g, force=False)
                continue
            wait = max(1.0, min((self._due.get(g, now + 60) for g in range(count)), default=now + 60) - now)
            try:
                req = self._requests.get(timeout=min(wait, 60.0))
            except queue.Empty:
                continue
            if req is None:
                return
            gpu, force, done = req
            count = self._list_gpus()  # as NVML sees them now, not as before the wait (it may have been down)
            if gpu is not None and not 0 <= gpu < count:
                done.put([{"gpu": gpu, "result": "failed", "reason": f"no GPU {gpu}: NVML sees {count}"}])
                continue
            targets = [gpu] if gpu is not None else list(range(count))
            done.put([self._run_one(g, force=force) for g in targets])

    def _ours(self) -> set[int]:
        pids = set()
        for t in self.tenants:
            try:
                pids |= {p.pid for p in t.own_processes()}
            except Exception:  # noqa: BLE001 - a tenant that cannot say: its pids are not left out
                log.exception("baseline: cannot list the agent's own GPU processes")
        return pids

    def _others(self, uuid: str, ours: set[int]) -> list[int] | None:
        """The pids NVML lists on the GPU that are not the agent's own (None: NVML cannot say)."""
        if self.compute_processes is None or not uuid:
            return None
        try:
            listed = self.compute_processes(uuid)
        except Exception:  # noqa: BLE001 - the child's own check still comes
            return None
        return None if listed is None else sorted(set(listed) - ours)

    def _run_one(self, gpu: int, force: bool) -> dict:
        """Run, judge, store, export; returns what happened (a run or {"gpu", "result", "reason"})."""
        started = self.clock()
        ours = self._uuid(gpu)
        mine = self._ours()
        others = None if force else self._others(ours, mine)
        # A pid that is no process here may be our own seen from another PID namespace: that one
        # is settled after the tenants stepped aside, by the child's own check.
        if others and all(self.exists(p) for p in others):
            return self._skipped(gpu, f"GPU {gpu} has compute processes {others}: not running the baseline "
                                      "beside them", started)
        why = f"the reference workload runs on GPU {gpu}"
        try:
            for t in self.tenants:
                if not t.pause(why, self.pause_timeout):
                    log.warning("baseline: %s did not step aside within %.0f s; running beside it",
                                type(t).__name__, self.pause_timeout)
            mine |= self._ours()
            if not force:
                others = self._others(ours, mine)
                if others and all(self.exists(p) for p in others):
                    return self._skipped(gpu, f"GPU {gpu} has compute processes {others}: not running the "
                                              "baseline beside them", started)
            return self._run_child(gpu, force, mine)
        finally:
            for t in self.tenants:
                try:
                    t.resume()
                except Exception:  # noqa: BLE001
                    log.exception("baseline: resuming %s failed", type(t).__name__)

    def _skipped(self, gpu: int, reason: str, started: float) -> dict:
        self._due[gpu] = started + min(self.every, BUSY_RETRY)
        self._count(self._uuid(gpu), "skipped")
        return {"gpu": gpu, "result": "skipped", "reason": reason}

    def _run_child(self, gpu: int, force: bool, mine: set[int]) -> dict:
        started = self.clock()
        kind, got = self._attempt(gpu, force, mine)
        if kind == "skipped":
            return self._skipped(gpu, got, started)
        if kind == "failed":
            return self._failed(gpu, got, started)
        self._due[gpu] = started + self.every
        retakes = self._retakes(gpu, force, mine, got)
        if retakes:
            got["retakes"] = retakes
        return self._judge_and_keep(got, started)

    def _retakes(self, gpu: int, force: bool, mine: set[int], run: dict) -> list[dict]:
        """One run cannot resolve a 3 % slowdown without false alarms (docs/baseline.md): a run judged
        slower is followed at once by up to settings.retakes more, each its own child holding the GPU
        about 1 s, and the GPU is judged on the median of them all (verdict.figure)."""
        if self.settings.retakes <= 0:
            return []
        if not judge(run, self._past(run["uuid"], 200), self.settings)["slower"]:
            return []
        log.info("baseline: GPU %d judged slower on one run; taking up to %d more to judge on their median",
                 gpu, self.settings.retakes)
        out = []
        for _ in range(self.settings.retakes):
            kind, got = self._attempt(gpu, force, mine)
            if kind != "ok":  # a job came, or the run failed: judged on the runs there are
                log.info("baseline: a retake on GPU %d %s (%s); judged on %d run(s)", gpu, kind, got, len(out) + 1)
                break
            out.append(retake_of(got))
        return out

    def _attempt(self, gpu: int, force: bool, mine: set[int]) -> tuple[str, dict | str]:
        """One run in a child: ("ok", the run), or ("skipped" | "failed", why)."""
        nth = self._nth.get(gpu, 0)
        self._nth[gpu] = nth + 1
        ours = self._uuid(gpu)
        env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID", PYTHONUNBUFFERED="1")
        by_uuid = bool(ours) and not self.replay
        if by_uuid:
            # The GPU by its UUID, as its only device: a CUDA_VISIBLE_DEVICES in the agent's own
            # environment would otherwise renumber the child's devices and run it on another GPU.
            env["CUDA_VISIBLE_DEVICES"] = ours
        cmd = child_command(0 if by_uuid else gpu, self.python, self.replay, nth, force, mine)
        log.info("baseline: running the reference workload on GPU %d", gpu)
        request = None
        try:
            if self.replay:
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                        start_new_session=True)
            else:
                proc = self._take()  # the prepared child, or a new one (Python's start-up paid now)
                request = json.dumps({"gpu": 0 if by_uuid else gpu, "force": force, "ignore_pids": sorted(mine),
                                      "visible": ours if by_uuid else None}).encode() + b"\n"
            self._proc = proc
            try:
                out, err = proc.communicate(request, timeout=self.timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                return "failed", f"killed after {self.timeout:.0f} s (baseline.timeout)"
        except OSError as e:
            return "failed", f"cannot start {cmd[0]}: {e.strerror or e}"
        finally:
            self._proc = None
            if not self.replay and not self._stop.is_set():
                self._prepare()  # for the next run (let go after KEEP_READY s unused)
        text = out[-OUTPUT_LIMIT:].decode("utf-8", "replace").strip().splitlines()
        try:
            result = json.loads(text[-1]) if text else {}
        except ValueError:
            result = {}
        if proc.returncode == EXIT_SKIPPED:
            return "skipped", str(result.get("skipped", "the GPU is in use"))
        if proc.returncode != 0 or "uuid" not in result:
            tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
            reason = result.get("error") or f"{_exit_text(proc.returncode)}: {tail[0][:300]}"
            return "failed", reason
        result["gpu"] = gpu  # NVML's index: the child knew it as its device 0
        if ours and result["uuid"] != ours:
            # The agent names the GPU it asked for: a replayed run carries the recording's UUID, and
            # a real child numbering GPUs otherwise than NVML (CUDA_VISIBLE_DEVICES) is worth a word.
            if not self.replay:
                log.warning("baseline: GPU %d is %s to NVML but the workload reported %s (CUDA_VISIBLE_DEVICES "
                            "set for the agent?); kept under %s", gpu, ours, result["uuid"], ours)
            result["uuid"] = ours
        return "ok", result

    # -- the prepared child ----------------------------------------------------------------
    def _spawn_prepared(self) -> subprocess.Popen:
        env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID", PYTHONUNBUFFERED="1")
        return subprocess.Popen(child_command(0, self.python, serve=True), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)

    def _prepare(self) -> None:
        if self.replay or (self._ready is not None and self._ready.poll() is None):
            return
        try:
            self._ready, self._ready_since = self._spawn_prepared(), self.clock()
        except OSError as e:  # said by the run that needs it
            log.debug("baseline: cannot prepare the workload's child: %s", e)
            self._ready = None

    def _take(self) -> subprocess.Popen:
        proc, self._ready = self._ready, None
        if proc is not None and proc.poll() is None:
            return proc
        if proc is not None:
            proc.communicate()  # it died unused (reaped here; a new one is started)
        return self._spawn_prepared()

    def _let_go(self) -> None:
        proc, self._ready = self._ready, None
        if proc is not None and proc.poll() is None:
            try:
                proc.communicate(b"", timeout=2.0)  # an empty request: it exits, having touched no GPU
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()

    def _failed(self, gpu: int, reason: str, started: float) -> dict:
        log.warning("baseline: the run on GPU %d failed: %s", gpu, reason)
        self._due[gpu] = started + min(self.every, BUSY_RETRY)
        self._count(self._uuid(gpu), "failed")
        return {"gpu": gpu, "result": "failed", "reason": reason}

    def _uuid(self, gpu: int) -> str:
        return self._uuids[gpu] if 0 <= gpu < len(self._uuids) else ""

    def _past(self, uuid: str | None, limit: int) -> list[dict]:
        if self.store is None:
            return []
        try:
            return self.store.baseline_runs(uuid, limit)
        except Exception as e:  # noqa: BLE001 - StoreError: judge against what is known (nothing)
            log.warning("baseline: cannot read past runs: %s", e)
            return []

    def _judge_and_keep(self, run: dict, started: float) -> dict:
        uuid = run["uuid"]
        run["ts"] = started
        run["verdict"] = verdict = judge(run, self._past(uuid, 200), self.settings)
        run["result"] = result = ("wrong" if verdict["wrong"] else "slower" if verdict["slower"]
                                  else "below_sku" if verdict["below_sku"] else "ok")
        if self.store is not None:
            self.store.record_baseline(uuid, started, run)
        with self._lock:
            self._latest[uuid] = run
            self._events.put(Event("baseline.run", uuid, {
                "result": result, "gpu_index": run.get("gpu"),
                "fused_flops_per_second": run["gemm_flops_per_second"]["fused"],
                "gemm_flop_per_cycle": run.get("gemm_flop_per_cycle"), "check_ok": run["check"]["ok"]}, started))
        self._count(uuid, result)
        (log.warning if result != "ok" else log.info)("baseline: GPU %s: %s", uuid, summary(run))
        return run

    def _count(self, gpu: str, result: str) -> None:
        with self._lock:
            self._counts[(gpu, result)] = self._counts.get((gpu, result), 0) + 1


def summary(run: dict) -> str:
    f = run["gemm_flops_per_second"]
    line = (f"{run['result']}: fused {f['fused'] / 1e12:.0f} TFLOP/s ({run['fused_vs_cublas']:.0%} of cuBLAS, "
            f"{run['fused_speedup_vs_unfused']:.2f}x unfused), copy {run['memory_bytes_per_second'] / 1e12:.2f} TB/s, "
            f"check {'ok' if run['check']['ok'] else 'WRONG'}")
    own = run.get("verdict", {}).get("metrics", {}).get("gemm_flop_per_cycle", {})
    if own.get("own_ratio") is not None:
        line += f", {own['own_ratio']:.3f} of its own baseline per SM cycle (threshold {own['threshold']:.3f}"
        line += f"; median of {own['runs']} runs)" if own.get("runs", 1) > 1 else ")"
    return line


def samples_of(run: dict, ts: float) -> list[Sample]:
    """A judged run as the GPU's latest values."""
    gpu = run["uuid"]
    out = [Sample("gpuwatch.baseline.gemm.throughput", v, gpu, {"kernel": k}, ts)
           for k, v in run["gemm_flops_per_second"].items()]
    out.append(Sample("gpuwatch.baseline.memory.throughput", run["memory_bytes_per_second"], gpu, {}, ts))
    if run.get("gemm_flop_per_cycle"):
        out.append(Sample("gpuwatch.baseline.gemm.efficiency", run["gemm_flop_per_cycle"], gpu, {}, ts))
    verdict = run.get("verdict", {})
    for metric, workload in (("gemm_flop_per_cycle", "gemm"), ("memory_bytes_per_second", "memory")):
        v = verdict.get("metrics", {}).get(metric)
        if not v:
            continue
        if v.get("own_ratio") is not None:
            labels = {"workload": workload, "reference": "own"}
            out.append(Sample("gpuwatch.baseline.relative_throughput", v["own_ratio"], gpu, labels, ts))
            out.append(Sample("gpuwatch.baseline.threshold", v["threshold"], gpu, labels, ts))
        if v.get("sku_ratio") is not None:
            out.append(Sample("gpuwatch.baseline.relative_throughput", v["sku_ratio"], gpu,
                              {"workload": workload, "reference": "sku"}, ts))
    wrong = sum(r.get("check", {}).get("mismatches", 0) for r in runs_of(run)
                if not r.get("check", {}).get("ok", True)) + (1 if verdict.get("digest_changed") else 0)
    out.append(Sample("gpuwatch.baseline.wrong_answers", float(wrong), gpu, {}, ts))
    out.append(Sample("gpuwatch.baseline.last_run.timestamp", run.get("ts", ts), gpu, {}, ts))
    return out


def _exit_text(code: int) -> str:
    """How a child ended; a crash in native code (torch, the CUDA driver) is named by its signal."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (a crash in the workload or the driver; the agent goes on)"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"
