"""NCCL through a real agent on real GPUs: counts and bytes of a torch.distributed job exact per
rank, its communicator's rank and size, and (two or more GPUs) a rank planted late named.

  python3 tests/gpu/nccl_check.py --gpus 1 --out OUT     (one H200: world size 1, NCCL still runs)
  python3 tests/gpu/nccl_check.py --gpus 8 --out OUT     (torchrun, one rank per GPU, rank 1 late)

bcc importable (tests/gpu/nccl_check.sh sets it up); the job gets the workload's environment
(WORKLOAD_*, tests/gpu/workload.py) with NVLink multicast off. The agent starts first, with real
NVML and eBPF; the ranks wait (WORK/go) until it has attached to their libnccl, so it sees their
communicator being made. Prints OK/BAD lines and a table; writes OUT/nccl.json.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import socket
import subprocess
import sys
import time

import workload  # tests/gpu/workload.py
from agent_proc import start_agent  # tests/gpu/agent_proc.py
from gpuwatch.agent import control

HERE = os.path.dirname(os.path.abspath(__file__))
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
COLLECTIVES = ("ncclAllReduce", "ncclBroadcast", "ncclAllGather", "ncclReduceScatter", "ncclReduce")
# NCCL's own log of each collective it is handed (NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=COLL): the ground truth
COLL_LINE = re.compile(r"NCCL INFO (AllReduce|AllGather|ReduceScatter|Broadcast|Reduce): opCount \S+ sendbuff \S+ "
                       r"recvbuff \S+ count (\d+) datatype (\d+)")
DTYPE_BYTES = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2, 10: 1, 11: 1}


def nccl_log(path: str) -> dict[str, list[int]]:
    """nccl* function -> [calls, bytes] from one process's NCCL_DEBUG_FILE."""
    out: dict[str, list[int]] = {}
    with open(path, errors="replace") as f:
        for line in f:
            m = COLL_LINE.search(line)
            if m:
                acc = out.setdefault("nccl" + m.group(1), [0, 0])
                acc[0] += 1
                acc[1] += int(m.group(2)) * DTYPE_BYTES.get(int(m.group(3)), 0)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(what: str, ok, timeout: float, every: float = 0.2):
    end = time.monotonic() + timeout
    while True:
        got = ok()
        if got:
            return got
        if time.monotonic() > end:
            raise SystemExit(f"BAD {what}: not within {timeout:.0f} s")
        time.sleep(every)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--out", required=True, help="a directory")
    ap.add_argument("--late-seconds", type=float, default=45.0, help="(2+ GPUs) the late phase")
    ap.add_argument("--late-rank", type=int, default=1)
    ap.add_argument("--late-delay", type=float, default=0.05)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    work = os.path.join(a.out, "work")
    os.makedirs(work, exist_ok=True)
    for f in os.listdir(work):
        os.unlink(os.path.join(work, f))
    result: dict = {"gpus": a.gpus, "checks": []}
    bad = 0

    def check(name: str, ok: bool, detail: str = "") -> None:
        nonlocal bad
        bad += not ok
        result["checks"].append({"check": name, "ok": ok, "detail": detail})
        print(f"{'OK ' if ok else 'BAD'} {name}{': ' + detail if detail else ''}", flush=True)

    agent, sock = start_agent(work, free_port(), ebpf=True)
    env = dict(workload.env(), **NO_MULTICAST, MASTER_PORT=str(free_port()), NCCL_DEBUG="INFO",
               NCCL_DEBUG_SUBSYS="COLL", NCCL_DEBUG_FILE=os.path.join(work, "nccl-%p.log"))
    late = a.late_seconds if a.gpus > 1 else 0.0
    args = [os.path.join(HERE, "nccl_workload.py"), "--work", work, "--late-seconds", str(late),
            "--late-rank", str(a.late_rank), "--late-delay", str(a.late_delay)]
    cmd = [sys.executable, *args] if a.gpus == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.gpus}", *args]
    job = subprocess.Popen(cmd, env=env, stdout=open(os.path.join(a.out, "job.log"), "w"), stderr=subprocess.STDOUT)
    try:
        wait("every rank took its GPU", lambda: all(os.path.exists(f"{work}/rank-{r}.ready")
                                                            for r in range(a.gpus)), 180)
        ranks = {}
        for r in range(a.gpus):
            pid, uuid = open(f"{work}/rank-{r}.ready").read().split()
            ranks[r] = {"pid": int(pid), "gpu": uuid}
        t_ready = time.monotonic()

        def nccl_attached():
            for r in ranks.values():
                try:
                    snap = control.call(sock, "trace.snapshot", {"pid": r["pid"]})
                except control.ControlError:
                    return False
                libs = [lib["path"] for lib in snap.get("libraries", []) if "libnccl" in lib["path"]]
                if not libs:
                    return False
                r["libnccl"] = libs[0]
            return True

        wait("the agent attached to every rank's libnccl", nccl_attached, 60)
        result["attach_seconds_after_ready"] = round(time.monotonic() - t_ready, 1)
        check("libnccl attached", True, f"{ranks[0]['libnccl']}, {result['attach_seconds_after_ready']} s after the "
                                         "ranks took their GPUs")
        open(f"{work}/go", "w").close()

        if late:
            wait("the late phase began", lambda: os.path.exists(f"{work}/rank-0.late"), 300)
            t_late = time.monotonic()

            def named():
                try:
                    return control.call(sock, "findings", {"kind": "straggler_rank"})["open"]
                except control.ControlError:
                    return None

            found = wait("a straggler_rank finding", named, a.late_seconds + 30, every=1.0)
            took = time.monotonic() - t_late
            f = found[0]
            lr = ranks[a.late_rank]
            result["straggler"] = {"seconds_to_name": round(took, 1), "finding": f}
            check("the late rank named within 30 s", took <= 30 and len(found) == 1 and f["rank"] == str(a.late_rank)
                  and f["pid"] == str(lr["pid"]) and f["resource"] == lr["gpu"],
                  f"{took:.1f} s: {f['summary']}")
            check("by about the planted sleep", 0.5 * a.late_delay <= f["lateness_seconds"] <= 2 * a.late_delay,
                  f"{f['lateness_seconds'] * 1000:.1f} ms (planted {a.late_delay * 1000:.0f} ms)")

        wait("every rank finished", lambda: all(os.path.exists(f"{work}/rank-{r}.json") for r in ranks), 600)
        rows = []
        for r, info in sorted(ranks.items()):
            did = json.load(open(f"{work}/rank-{r}.json"))
            snap = control.call(sock, "trace.snapshot", {"pid": info["pid"]})
            apis = snap["apis"]
            logged = glob.glob(os.path.join(work, f"nccl-{info['pid']}.log"))
            truth = nccl_log(logged[0]) if logged else {}
            got = {op: [apis.get(op, {}).get("calls", 0), apis.get(op, {}).get("bytes", 0)]
                   for op in sorted(set(truth) | set(COLLECTIVES) & set(apis))}
            check(f"rank {r}: calls and bytes per collective equal NCCL's own log", bool(truth) and got == truth,
                  f"probe {got}, NCCL_DEBUG {truth}")
            asked = {op: v for op, v in did["counts"].items() if v != truth.get(op, [0, 0])}
            if asked:  # what torch asked for but did not hand to NCCL (world size 1 short-cuts)
                print(f"    note: torch was asked for {asked}; NCCL was handed {truth}", flush=True)
            others = {op: a_["calls"] for op, a_ in apis.items() if op.startswith("nccl") and op not in COLLECTIVES}
            comms = [c for c in snap.get("communicators", []) if c["collectives"]]
            want_coll = sum(n for n, _b in truth.values())
            main = max(comms, key=lambda c: c["collectives"]) if comms else {}
            check(f"rank {r}: its communicator's rank, size and collectives",
                  (main.get("rank"), main.get("size"), main.get("collectives")) == (r, did["world"], want_coll),
                  f"{main} (the job: rank {r} of {did['world']}, NCCL logged {want_coll} collectives)")
            mean = {op: apis[op]["mean_latency_s"] for op in COLLECTIVES if op in apis}
            rows.append((r, info["pid"], info["gpu"][:12], got.get("ncclAllReduce"), main.get("comm"), others, mean))
            result.setdefault("ranks", []).append({"rank": r, **info, "did": did, "nccl_log": truth, "apis": apis,
                                                   "communicators": comms})
        result["nccl_version"], result["torch"] = did["nccl_version"], did["torch"]
        metrics = control.call(sock, "status").get("probes", {})
        result["probes"] = metrics
    finally:
        open(f"{work}/stop", "w").close()
        try:
            job.wait(60)
        except subprocess.TimeoutExpired:
            job.kill()
        agent.terminate()
        agent.wait(30)
    with open(os.path.join(a.out, "nccl.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"\nNCCL {result.get('nccl_version')} torch {result.get('torch')}, {a.gpus} GPU(s)")
    print(f"{'rank':>4} {'pid':>7} {'gpu':12} {'ncclAllReduce calls, bytes':>28}  comm              other NCCL calls")
    for r, pid, gpu, ar, comm, others, mean in rows:
        print(f"{r:>4} {pid:>7} {gpu:12} {str(ar):>28}  {comm}  {others}")
        print(f"{'':>4} mean host enqueue time: " + ", ".join(f"{op} {s * 1e6:.1f} us" for op, s in mean.items()))
    if "straggler" in result:
        print(f"late rank named {result['straggler']['seconds_to_name']} s after the late phase began")
    print(f"{'all checks passed' if not bad else f'{bad} checks FAILED'}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
