"""A torch.distributed job with known NCCL collectives, for tests/gpu/nccl_check.py.

Run alone (world size 1) or under torchrun (one rank per GPU). Each rank imports torch, takes its
GPU, writes WORK/rank-R.ready ("pid gpu_uuid"), waits for WORK/go (the agent attached meanwhile),
then makes the process group (eager init: ncclCommInitRankConfig) and runs:

  counts: 50 x all_reduce(float32 x 1,048,576), 20 x all_reduce(bfloat16 x 12,345),
          10 x broadcast(float32 x 1,000), 5 x all_gather_into_tensor(float16 x 4,096 per rank),
          7 x reduce_scatter_tensor(float32 x 1,000 per rank)
  late:   (--late-seconds > 0) late-seconds / late-delay steps of one all_reduce(float32 x 1,048,576)
          and a synchronize (a training step's boundary), rank --late-rank sleeping --late-delay s before each

and writes WORK/rank-R.json: what it did (pid, GPU, counts and bytes per NCCL function as
count x element size, steps of the late phase), then waits for WORK/stop and exits. NVLink
multicast stays off (NCCL_NVLS_ENABLE=0 and the others, set by the checker).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

COUNTS = {  # NCCL function -> [(calls, elements, element bytes)] per rank and world size W
    "ncclAllReduce": lambda w: [(50, 1 << 20, 4), (20, 12345, 2)],
    "ncclBroadcast": lambda w: [(10, 1000, 4)],
    "ncclAllGather": lambda w: [(5, 4096, 2)],        # the send count (per rank)
    "ncclReduceScatter": lambda w: [(7, 1000, 4)],    # the receive count (per rank)
}


def wait_for(path: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise SystemExit(f"{path} did not appear within {timeout:.0f} s")
        time.sleep(0.05)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--late-seconds", type=float, default=0.0)
    ap.add_argument("--late-rank", type=int, default=1)
    ap.add_argument("--late-delay", type=float, default=0.05)
    a = ap.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    torch.zeros(1, device=dev)  # the CUDA context: the agent sees the process's first driver calls
    uuid = "GPU-" + str(torch.cuda.get_device_properties(dev).uuid)
    with open(os.path.join(a.work, f"rank-{rank}.ready"), "w") as f:
        f.write(f"{os.getpid()} {uuid}\n")
    wait_for(os.path.join(a.work, "go"), 300)

    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    big = torch.ones(1 << 20, device=dev, dtype=torch.float32)
    small = torch.ones(12345, device=dev, dtype=torch.bfloat16)
    for _ in range(50):
        dist.all_reduce(big)
    for _ in range(20):
        dist.all_reduce(small)
    b = torch.ones(1000, device=dev)
    for _ in range(10):
        dist.broadcast(b, src=0)
    part = torch.ones(4096, device=dev, dtype=torch.float16)
    gathered = torch.empty(world * 4096, device=dev, dtype=torch.float16)
    for _ in range(5):
        dist.all_gather_into_tensor(gathered, part)
    whole = torch.ones(world * 1000, device=dev)
    mine = torch.empty(1000, device=dev)
    for _ in range(7):
        dist.reduce_scatter_tensor(mine, whole)
    torch.cuda.synchronize()
    steps = 0
    t_late = time.monotonic()
    if a.late_seconds > 0:
        with open(os.path.join(a.work, f"rank-{rank}.late"), "w") as f:
            f.write(f"{time.time()}\n")
        # the same number of steps in every rank (a collective to agree on it would be one more
        # collective the late rank enters in step)
        for _ in range(max(1, round(a.late_seconds / max(a.late_delay, 0.001)))):
            if rank == a.late_rank:
                time.sleep(a.late_delay)
            dist.all_reduce(big)
            torch.cuda.synchronize()
            steps += 1
    counts = {op: [sum(n for n, _e, _s in f(world)), sum(n * e * s for n, e, s in f(world))] for op, f in COUNTS.items()}
    counts["ncclAllReduce"][0] += steps
    counts["ncclAllReduce"][1] += steps * (1 << 20) * 4
    out = {"pid": os.getpid(), "rank": rank, "world": world, "gpu": uuid, "counts": counts, "late_steps": steps,
           "late_phase_seconds": time.monotonic() - t_late, "nccl_version": ".".join(map(str, torch.cuda.nccl.version())),
           "torch": torch.__version__}
    with open(os.path.join(a.work, f"rank-{rank}.json"), "w") as f:
        json.dump(out, f)
    wait_for(os.path.join(a.work, "stop"), 300)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
