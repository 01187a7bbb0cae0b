"""A server's CUDA graphs for tests/gpu/graphs_server_check.py (plain environment: no bcc libraries).

  once     a small decoder (embedding, 4 pre-norm layers of attention through SDPA and a SwiGLU MLP,
           a norm and the logits; plain torch, static shapes) whose one-token step is captured into
           a CUDA graph right after the first CUDA call's warm-up, and never again;
  batches  the same decoder's step captured for 12 batch sizes, one every 0.4 s (a server warming up
           its graph for each batch size over several seconds).

Protocol: captures, prints "ready PID", then on "replay N" replays (once: N times; batches: N spread
over the batch sizes) under torch.profiler and prints one JSON line: {"cupti_kernels", "replays"}
(kernel records only: memcpy and memset are not kernel nodes). "bye" ends it.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F

DEV, DT = "cuda", torch.bfloat16
WIDTH, HEADS, LAYERS, VOCAB, CTX = 512, 8, 4, 8192, 256
BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


class Decoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.layers = torch.nn.ModuleList(torch.nn.ModuleDict({
            "n1": torch.nn.RMSNorm(WIDTH), "qkv": torch.nn.Linear(WIDTH, 3 * WIDTH, bias=False),
            "o": torch.nn.Linear(WIDTH, WIDTH, bias=False), "n2": torch.nn.RMSNorm(WIDTH),
            "gate_up": torch.nn.Linear(WIDTH, 2 * 4 * WIDTH, bias=False),
            "down": torch.nn.Linear(4 * WIDTH, WIDTH, bias=False)}) for _ in range(LAYERS))
        self.norm = torch.nn.RMSNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)  # (B, 1, W)
        b = x.shape[0]
        for i, l in enumerate(self.layers):
            q, k, v = l["qkv"](l["n1"](x)).view(b, 1, 3, HEADS, WIDTH // HEADS).unbind(2)
            keys = torch.cat([kv[i, 0, :b], k.transpose(1, 2)], 2)  # a static cache of CTX - 1 positions
            vals = torch.cat([kv[i, 1, :b], v.transpose(1, 2)], 2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), keys, vals)
            x = x + l["o"](a.transpose(1, 2).reshape(b, 1, WIDTH))
            g, u = l["gate_up"](l["n2"](x)).chunk(2, -1)
            x = x + l["down"](F.silu(g) * u)
        return self.head(self.norm(x)).argmax(-1)


def capture(model: Decoder, kv: torch.Tensor, b: int):
    ids = torch.zeros(b, 1, dtype=torch.long, device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        for _ in range(2):
            model(ids, kv)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g):
        out = model(ids, kv)
    return g, ids, out


def main() -> None:
    mode = sys.argv[1]
    torch.zeros(1, device=DEV)  # the first CUDA call
    model = Decoder().to(DEV, DT).eval()
    kv = torch.randn(LAYERS, 2, max(BATCHES), HEADS, CTX - 1, WIDTH // HEADS, device=DEV, dtype=DT)
    graphs = []
    for b in (BATCHES if mode == "batches" else (1,)):
        graphs.append(capture(model, kv, b)[0])
        if mode == "batches":
            time.sleep(0.4)
    torch.cuda.synchronize()
    print(f"ready {os.getpid()}", flush=True)
    from torch.profiler import ProfilerActivity, profile
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "bye":
            break
        n = int(words[1])
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(n):
                graphs[i % len(graphs)].replay()
            torch.cuda.synchronize()
        kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and not e.name.startswith(("Memcpy", "Memset")))
        print(json.dumps({"cupti_kernels": kernels, "replays": n, "graphs": len(graphs)}), flush=True)


if __name__ == "__main__":
    main()
