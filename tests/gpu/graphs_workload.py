"""CUDA-graph workloads with known kernel counts, for tests/gpu/graphs_check.py (run in the plain
environment: no bcc libraries; transformers from --extra when carried).

Protocol: prints "ready PID", then for each line "capture CASE" or "replay CASE N" on stdin does it
and prints one JSON line. A replay runs under torch.profiler (CUPTI, through kineto): the kernels
CUPTI saw in that phase are the ground truth ("cupti_kernels", and by name), with memcpy and
memset records left out (graph nodes of those kinds are not kernels). Cases:

  cudagraph  torch.cuda.CUDAGraph of an MLP (Linear, GELU, Linear, LayerNorm, residual), replayed
  compile    torch.compile(mode="reduce-overhead") of another MLP: CUDA graphs made by cudagraph trees
  decode     a Llama decoder built from a config (random weights, nothing downloaded) decoding one
             token per step with a StaticCache, the step captured into a CUDA graph
"""
from __future__ import annotations

import json
import os
import sys
from collections import Counter

import torch

DEV = "cuda"
state: dict = {}


def _kernel_nodes(g: "torch.cuda.CUDAGraph") -> int | None:
    """The captured graph's kernel nodes, read back through the CUDA runtime (cuda-bindings)."""
    try:
        from cuda.bindings import runtime as rt
        raw = g.raw_cuda_graph()
        err, _, n = rt.cudaGraphGetNodes(raw, numNodes=0)
        err, nodes, n = rt.cudaGraphGetNodes(raw, numNodes=n)
        kinds = [rt.cudaGraphNodeGetType(node)[1] for node in nodes]
        return sum(1 for k in kinds if k == rt.cudaGraphNodeType.cudaGraphNodeTypeKernel)
    except Exception as e:  # torch without raw_cuda_graph, or no cuda-bindings: CUPTI still counts
        print(f"kernel nodes not read: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def _mlp(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                               torch.nn.Linear(4 * width, width), torch.nn.LayerNorm(width)).to(DEV, torch.bfloat16)


def _warm(fn, n: int = 3) -> None:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(n):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()


def capture_cudagraph() -> dict:
    model = _mlp(1024)
    x = torch.randn(64, 1024, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        step = lambda: model(x) + x  # noqa: E731
        _warm(step)
        try:
            g = torch.cuda.CUDAGraph(keep_graph=True)  # the graph kept, to count its nodes
        except TypeError:
            g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = step()
    torch.cuda.synchronize()
    nodes = _kernel_nodes(g)
    if hasattr(g, "instantiate"):
        try:
            g.instantiate()
        except Exception:
            pass
    state["cudagraph"] = (lambda: g.replay(), y)
    return {"kernel_nodes": nodes}


def capture_compile() -> dict:
    model = _mlp(768)
    x = torch.randn(32, 768, device=DEV, dtype=torch.bfloat16)
    fn = torch.compile(lambda t: model(t) * 0.5 + t, mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(5):  # compile, warm up, record the graph (cudagraph trees record on the 3rd call)
            fn(x)
    torch.cuda.synchronize()

    def replay():
        with torch.no_grad():
            fn(x)
    state["compile"] = (replay, None)
    return {"kernel_nodes": None}


def capture_decode() -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache
    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(DEV, torch.bfloat16).eval()
    cache = StaticCache(config=cfg, max_cache_len=2048)
    ids = torch.zeros(1, 1, dtype=torch.long, device=DEV)
    pos = torch.zeros(1, dtype=torch.long, device=DEV)
    out: dict = {}

    def step():
        logits = model(input_ids=ids, past_key_values=cache, cache_position=pos, use_cache=True).logits
        out["next"] = logits[:, -1:].argmax(-1)

    with torch.no_grad():
        _warm(step)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
    torch.cuda.synchronize()
    nodes = _kernel_nodes(g)

    def replay():  # one token: the graph, then the next token (a device copy) and position (a direct kernel)
        g.replay()
        ids.copy_(out["next"])
        pos.add_(1)
    state["decode"] = (replay, None)
    return {"kernel_nodes": nodes, "layers": cfg.num_hidden_layers}


CAPTURES = {"cudagraph": capture_cudagraph, "compile": capture_compile, "decode": capture_decode}


def replay(case: str, n: int) -> dict:
    fn, _ = state[case]
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    names: Counter = Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")):
            names[e.name] += 1
    return {"cupti_kernels": sum(names.values()), "cupti_names": dict(names.most_common(40))}


def main() -> None:
    print(f"ready {os.getpid()}", flush=True)
    torch.zeros(1, device=DEV)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        try:
            if words[0] == "capture":
                out = {"done": "capture", "case": words[1], **CAPTURES[words[1]]()}
            elif words[0] == "replay":
                out = {"done": "replay", "case": words[1], "replays": int(words[2]), **replay(words[1], int(words[2]))}
            else:
                out = {"done": words[0], "error": "unknown command"}
        except Exception as e:
            out = {"done": words[0], "case": words[1] if len(words) > 1 else "", "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
