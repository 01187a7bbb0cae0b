"""Jobs for tests/gpu/host_check.py: GPU work that waits on its host, and a process that makes it.

  serve  --weights FILE    a serving loop: each request maps the next --shard-mib of its open weights
                           file, copies it to the GPU and unmaps it (as CPU-offloaded and
                           adapter-swapping servers do)
                           and runs --gemms bf16 GEMMs on it; logs each step's time to --log
  train  --loader-ms MS    a training loop fed by one loader thread (named "loader") that spends MS of
                           pure-Python CPU per batch; the GPU step runs --gemms GEMMs. A large MS with
                           few GEMMs is input-bound (the GPU waits on the thread); a small one is not
  evict  --target FILE     an "archiver": drops FILE from the page cache every --every seconds
                           (POSIX_FADV_DONTNEED) and reads through --read FILE from disk meanwhile,
                           so it is the node's top reader (its comm is "archiver")
  make   --path FILE       writes FILE of --gib GiB of incompressible data, fsyncs it, and drops it from
                           the page cache (fallocate would leave unwritten extents that read as zeros
                           without touching the disk)

Every job logs JSON lines ({"event": ..., "t": ..., "pid": ...}) to --log and runs until --seconds
pass or it is killed.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import queue
import threading
import time

MIB = 1 << 20
ap = argparse.ArgumentParser()
ap.add_argument("job", choices=("serve", "train", "evict", "make"))
ap.add_argument("--weights")
ap.add_argument("--shard-mib", type=int, default=256)
ap.add_argument("--gemms", type=int, default=24)
ap.add_argument("--loader-ms", type=float, default=100.0)
ap.add_argument("--target")
ap.add_argument("--read")
ap.add_argument("--every", type=float, default=2.0)
ap.add_argument("--path")
ap.add_argument("--gib", type=float, default=8.0)
ap.add_argument("--seconds", type=float, default=600.0)
ap.add_argument("--log", default="/dev/null")
a = ap.parse_args()
log = open(a.log, "a", buffering=1)


def note(**kw) -> None:
    log.write(json.dumps(dict(kw, t=time.time(), pid=os.getpid(), job=a.job)) + "\n")


def set_comm(name: str) -> None:
    """The calling thread's name as the kernel shows it (/proc/PID/task/TID/comm)."""
    ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


end = time.time() + a.seconds

if a.job == "make":
    block = os.urandom(64 * MIB)
    with open(a.path, "wb") as f:
        for _ in range(int(a.gib * 1024 / 64)):
            f.write(block)
            block = block[1:] + block[:1]  # every block different: no dedup below us
        f.flush()
        os.fsync(f.fileno())
    drop(a.path)
    note(event="made", path=a.path, bytes=os.path.getsize(a.path))
    raise SystemExit(0)

if a.job == "evict":
    set_comm("archiver")
    fd = os.open(a.read, os.O_RDONLY)
    size, off, last = os.fstat(fd).st_size, 0, 0.0
    note(event="evict_start", target=a.target)
    while time.time() < end:
        if time.time() - last >= a.every:
            drop(a.target)
            last = time.time()
        os.pread(fd, 16 * MIB, off)
        off = (off + 16 * MIB) % size
        if off < 16 * MIB:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read it from the disk again next pass
    raise SystemExit(0)

import torch  # noqa: E402 - the GPU jobs only

dev = torch.device("cuda")
x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)


def gpu_work(n: int) -> None:
    y = x
    for _ in range(n):
        y = torch.mm(y, x) * 1e-4
    torch.cuda.synchronize()


if a.job == "serve":
    # Each request maps its shard, copies it to the GPU and unmaps it (as adapter-swapping servers
    # do): pages a process keeps mapped are not dropped by POSIX_FADV_DONTNEED, pages it does not
    # map are, like pages reclaim takes. The file stays open, as a server keeps its weights open.
    fd = os.open(a.weights, os.O_RDONLY)
    size = os.fstat(fd).st_size
    shard = a.shard_mib * MIB
    off = 0
    t0 = time.time()
    for o in range(0, size, 64 * MIB):  # warm: the whole file in the page cache, as after a load
        os.pread(fd, 64 * MIB, o)
    note(event="serve_start", weights=a.weights, bytes=size, warm_seconds=round(time.time() - t0, 2))
    while time.time() < end:
        s = time.perf_counter()
        mm = mmap.mmap(fd, shard, prot=mmap.PROT_READ, offset=off)
        host = torch.frombuffer(mm, dtype=torch.uint8)
        w = host.to(dev)
        del host  # the mapping's last user: it can be closed now
        mm.close()
        gpu_work(a.gemms)
        del w
        note(event="step", seconds=time.perf_counter() - s)
        off = off + shard if off + 2 * shard <= size else 0  # page-aligned shards, all inside the file
    raise SystemExit(0)

# train: a loader thread makes batches in pure Python; the main thread runs the GPU step on each
batches: queue.Queue = queue.Queue(maxsize=2)


def loader() -> None:
    set_comm("loader")
    while time.time() < end:
        t = time.perf_counter()
        acc = 0
        while (time.perf_counter() - t) * 1000 < a.loader_ms:  # decoding and augmenting, in Python
            for i in range(2000):
                acc = (acc * 31 + i) % 1000003
        batches.put(acc)


threading.Thread(target=loader, daemon=True).start()
note(event="train_start", loader_ms=a.loader_ms, gemms=a.gemms)
while time.time() < end:
    s = time.perf_counter()
    try:
        batches.get(timeout=5)
    except queue.Empty:
        continue
    gpu_work(a.gemms)
    note(event="step", seconds=time.perf_counter() - s)
