"""The traced program of bench/trace_compare.py: a training step, an eager decode loop, and
work whose CUDA calls are known, driven over stdin/stdout.

Prints "ready PID" after warm-up (kernels loaded, cuBLAS set up, the Triton kernel compiled, the
CUDA graph captured), then answers each line on stdin with one JSON line:
  ping    one training step and 4 tokens (what a tracer sees first: it names the kernels then)
  time    --train-steps training steps, then --decode-steps tokens of the decode loop, each timed
          on its own (synchronised: loss.item() / the next token's .item(), as real loops do)
  cover   known work: --tritons launches of a Triton kernel, --matmuls cuBLAS GEMMs of a shape used
          nowhere else, --graph-replays of a CUDA graph of 3 kernels, one --expand-bytes tensor
          under expandable segments (PYTORCH_CUDA_ALLOC_CONF, set by trace_compare.py)
The workloads:
  train   a 4-layer transformer encoder (d 2048, 16 heads, FFN 8192), 8 x 1024 tokens, bf16,
          forward, backward, AdamW: GPU-bound, ~27 ms on an H200
  decode  a Llama-style decoder (16 layers, d 2048, 16 heads, SwiGLU 5632, vocab 32000, bf16,
          KV cache), batch 1, one token per step in eager mode: ~280 kernels per token,
          launch-bound, as eager inference loops are
--profiler wraps each command in torch.profiler.profile(activities=[CUDA]) and adds what the
profiler recorded; under `gpuwatch run` each answer adds what the in-process agent recorded during
that command (read from the agent in this process, after a flush).

  python3 bench/trace_workload.py [--profiler] [--device cpu --small]   (run by trace_compare.py)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cuda")
ap.add_argument("--small", action="store_true", help="tiny models (a CPU check of the plumbing)")
ap.add_argument("--profiler", action="store_true")
ap.add_argument("--train-steps", type=int, default=60)
ap.add_argument("--decode-steps", type=int, default=200)
ap.add_argument("--tritons", type=int, default=300)
ap.add_argument("--matmuls", type=int, default=50)
ap.add_argument("--graph-replays", type=int, default=97)
ap.add_argument("--expand-bytes", type=int, default=1 << 30)
ap.add_argument("--load-library", help="a libcuda to load (tests/ebpf's fake one: the trace plumbing without a GPU)")
a = ap.parse_args()
if a.load_library:
    import ctypes

    ctypes.CDLL(a.load_library)
dev = torch.device(a.device)
cuda = dev.type == "cuda"
dtype = torch.bfloat16 if cuda else torch.float32
torch.manual_seed(0)


def sync() -> None:
    if cuda:
        torch.cuda.synchronize()


# -- train: GPU-bound, like real training --------------------------------------------------------
D, HEADS, FFN, LAYERS, TOKENS = (2048, 16, 8192, 4, (8, 1024)) if not a.small else (64, 4, 128, 2, (2, 16))
with dev:  # parameters made (and initialised) on the GPU: a billion on the CPU would take seconds
    encoder = torch.nn.Sequential(*[torch.nn.TransformerEncoderLayer(D, HEADS, FFN, batch_first=True,
                                                                     norm_first=True)
                                    for _ in range(LAYERS)]).to(dtype)
opt = torch.optim.AdamW(encoder.parameters(), lr=1e-5)
x_train = torch.randn(*TOKENS, D, device=dev, dtype=dtype)


def train_step() -> None:
    opt.zero_grad(set_to_none=True)
    loss = encoder(x_train).float().square().mean()
    loss.backward()
    opt.step()
    loss.item()


# -- decode: launch-bound eager inference ---------------------------------------------------------
class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int, ffn: int, max_len: int) -> None:
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.n1, self.n2 = torch.nn.RMSNorm(d), torch.nn.RMSNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.o = torch.nn.Linear(d, d, bias=False)
        self.up = torch.nn.Linear(d, 2 * ffn, bias=False)
        self.down = torch.nn.Linear(ffn, d, bias=False)
        self.register_buffer("k", torch.zeros(1, heads, max_len, self.hd))
        self.register_buffer("v", torch.zeros(1, heads, max_len, self.hd))

    def forward(self, x: torch.Tensor, pos: int, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.n1(x)).view(1, 1, 3, self.heads, self.hd).transpose(1, 3).unbind(2)
        self.k[:, :, pos:pos + 1] = k
        self.v[:, :, pos:pos + 1] = v
        # The whole cache under a mask, as static-cache decoders do: the same shapes at every step.
        # (A cache sliced to pos+1 changes shape each token, and PyTorch 2.11's cuDNN attention on
        # Hopper then builds a new graph per token: 45 ms a token on the H200.)
        att = F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask)
        x = x + self.o(att.transpose(1, 2).reshape(1, 1, -1))
        gate, up = self.up(self.n2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Decoder(torch.nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, ffn: int, max_len: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads, ffn, max_len) for _ in range(layers))
        self.norm = torch.nn.RMSNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.register_buffer("positions", torch.arange(max_len))

    @torch.no_grad()
    def step(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        x = self.emb(token).view(1, 1, -1)
        mask = (self.positions <= pos).view(1, 1, 1, -1)
        for b in self.blocks:
            x = b(x, pos, mask)
        return self.head(self.norm(x)).argmax(-1).view(1)


MAX_LEN = max(a.decode_steps, 8)
with dev:
    decoder = Decoder(*((32000, 2048, 16, 16, 5632) if not a.small else (100, 64, 2, 4, 128)), MAX_LEN).to(dtype)


def decode(steps: int) -> list[float]:
    """One token per step from position 0 (the same work every time), each step timed."""
    token, times = torch.zeros(1, dtype=torch.long, device=dev), []
    for pos in range(steps):
        t = time.perf_counter()
        token = decoder.step(token, pos)
        token.item()  # the loop looks at each token (end of sequence?), as real ones do
        times.append(time.perf_counter() - t)
    return times


def timed_train(steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        train_step()
        times.append(time.perf_counter() - t)
    return times


# -- cover: known counts ---------------------------------------------------------------------------
if cuda:
    import triton
    import triton.language as tl

    @triton.jit
    def gw_cover_kernel(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * 0.5 + 1.0, mask=i < n)

    tri = torch.ones(4096, device=dev)
    gw_cover_kernel[(4,)](tri, 4096, BLOCK=1024)  # compiled and loaded before any tracer
    # A GEMM shape used nowhere else, so its kernels are told apart from the models'.
    mA = torch.randn(704, 1344, device=dev, dtype=dtype)
    mB = torch.randn(1344, 832, device=dev, dtype=dtype)
    mA @ mB
    g_in = torch.ones(1 << 16, device=dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # 3 kernels no other work launches
        g_in.sin_()
        g_in.cos_()
        g_in.exp_()
GRAPH_KERNELS = 3


def cover() -> dict:
    out = {"tritons": a.tritons, "matmuls": a.matmuls, "graph_replays": a.graph_replays,
           "graph_kernels": a.graph_replays * GRAPH_KERNELS, "expand_bytes": a.expand_bytes}
    if not cuda:
        return out
    for _ in range(a.tritons):
        gw_cover_kernel[(4,)](tri, 4096, BLOCK=1024)
    for _ in range(a.matmuls):
        mA @ mB
    for _ in range(a.graph_replays):
        graph.replay()
    sync()
    reserved0 = torch.cuda.memory_reserved()
    big = torch.empty(a.expand_bytes, dtype=torch.uint8, device=dev)
    big.fill_(1)
    sync()
    out["reserved_growth_bytes"] = torch.cuda.memory_reserved() - reserved0
    time.sleep(1.3)  # longer than `gpuwatch run`'s report interval: its agent reads memory while the tensor lives
    agent = _agent()
    if agent is not None:
        out["agent_memory_while_held"] = agent.memory
    del big
    return out


# -- what the tools in this process saw ---------------------------------------------------------
def _agent():
    """The in-process agent when running under `gpuwatch run`, else None."""
    if not os.environ.get("GPUWATCH_RUN"):
        return None
    try:
        from gpuwatch.probes.cupti import inprocess
    except ImportError:
        return None
    return inprocess.agent()


def agent_snapshot() -> dict | None:
    agent = _agent()
    if agent is None:
        return None
    sync()
    agent._flush()  # records of kernels that ended are in CUPTI's buffers until flushed
    # Every variant the agent holds, not its report's top 50 by GPU time (which folds the rest).
    names: dict[str, int] = {}
    with agent.tables.lock:
        variants = list(agent.tables.kernels.values())
        other, records = agent.tables.other_launches, agent.tables.records
    for v in variants:
        names[v.name] = names.get(v.name, 0) + v.launches
    return {"kernels": names, "other": other, "records": records, "dropped": agent.dropped, "state": agent.state,
            "mode": agent._mode(time.monotonic())}


def agent_delta(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return after
    names = {n: c - before["kernels"].get(n, 0) for n, c in after["kernels"].items()}
    names = {n: c for n, c in names.items() if c}
    return {"kernels": names, "launches": sum(names.values()) + after["other"] - before["other"],
            "records": after["records"] - before["records"], "dropped": after["dropped"] - before["dropped"],
            "state": after["state"], "mode": after["mode"]}


def profiler_counts(prof) -> dict:
    """Kernels (by name) and the CUDA API calls torch.profiler recorded."""
    from torch.autograd import DeviceType

    kernels: dict[str, int] = {}
    copies: dict[str, int] = {}  # memcpy and memset: GPU activity, but no kernel launch
    apis: dict[str, int] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            into = copies if e.name.startswith(("Memcpy", "Memset")) else kernels
            into[e.name] = into.get(e.name, 0) + 1
        elif e.name.startswith(("cuda", "cu")):
            apis[e.name] = apis.get(e.name, 0) + 1
    return {"kernels": kernels, "launches": sum(kernels.values()), "copies": copies, "apis": apis}


def stats(xs: list[float]) -> dict:
    return {"n": len(xs), "median": statistics.median(xs), "mean": statistics.fmean(xs), "min": min(xs),
            "max": max(xs), "all": xs}


def ping() -> dict:
    """A little of each workload: a tracer that attached sees (and names) their kernels once."""
    timed_train(1)
    decode(4)
    return {}


def timed() -> dict:
    return {"train": stats(timed_train(a.train_steps)), "decode": stats(decode(a.decode_steps))}


# -- warm-up, then commands -------------------------------------------------------------------------
timed_train(3)
decode(8)
sync()
print(f"ready {os.getpid()}", flush=True)
for line in sys.stdin:
    what = line.strip()
    work = {"time": timed, "cover": cover, "ping": ping}.get(what)
    if work is None:
        print(json.dumps({"error": f"unknown command {what!r}"}), flush=True)
        continue
    before = agent_snapshot()
    if a.profiler:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            result = work()
            sync()
        counts = profiler_counts(prof)
        result["profiler"] = counts if what == "cover" else \
            {"launches": counts["launches"], "copies": sum(counts["copies"].values()), "apis": counts["apis"]}
    else:
        result = work()
    result["agent"] = agent_delta(before, agent_snapshot())
    print(json.dumps({"command": what, **result}), flush=True)
