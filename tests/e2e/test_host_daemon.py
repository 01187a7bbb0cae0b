"""The host-side probes through a real agent: NVML (replayed from the H200) lists two real processes
on its GPU, one with a saturated thread named "loader", one holding a 96 MiB file mapped; /metrics
then carries their host side under the same pid/process labels as their GPU series."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.conftest import Agent, nvml_listing, series

BUSY = r"""
import ctypes, threading, time
def burn():
    ctypes.CDLL(None).prctl(15, b"loader", 0, 0, 0)
    while True:
        pass
threading.Thread(target=burn, daemon=True).start()
print("ready", flush=True)
time.sleep(600)
"""
MAPS = r"""
import mmap, sys, time
f = open(sys.argv[1], "rb")
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
m[:4096]
print("ready", flush=True)
time.sleep(600)
"""


def start(code: str, *args: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_gpu_processes_get_their_host_side_under_their_gpu_labels(tmp_path):
    weights = tmp_path / "weights.bin"
    weights.write_bytes(os.urandom(1 << 20) * 96)
    busy, maps = start(BUSY), start(MAPS, str(weights))
    agent = Agent(tmp_path / "agent", "--nvml-replay", str(nvml_listing(tmp_path, [busy.pid, maps.pid], rate=0)),
                  "--nvml-slow-interval", "1", "--host-interval", "1", "--no-ebpf", "--no-baseline",
                  "--no-cupti-sampling")
    try:
        deadline = time.monotonic() + 60
        while True:
            text = agent.metrics()
            threads = series(text, "gpuwatch_process_thread_cpu_utilization_ratio")
            sizes = series(text, "gpuwatch_process_file_size_bytes")
            if any(f'pid="{busy.pid}"' in k for k in threads) and any(f'pid="{maps.pid}"' in k for k in sizes):
                break
            assert time.monotonic() < deadline, f"no host series after 60 s:\n{agent.output()[-3000:]}"
            time.sleep(1)
        (loader,) = [v for k, v in threads.items() if f'pid="{busy.pid}"' in k and 'thread="loader"' in k]
        assert loader >= 0.5
        gpu = series(text, "gpuwatch_process_gpu_memory_usage_bytes")
        name = next(k for k in gpu if f'pid="{busy.pid}"' in k).split('process="', 1)[1].split('"', 1)[0]
        assert any(f'pid="{busy.pid}"' in k and f'process="{name}"' in k
                   for k in series(text, "gpuwatch_process_cpu_time_seconds_total"))  # the GPU series' labels
        (size,) = [v for k, v in sizes.items() if f'pid="{maps.pid}"' in k and str(weights) in k]
        assert size == 96 << 20
        (resident,) = [v for k, v in series(text, "gpuwatch_process_file_cache_resident_bytes").items()
                       if f'pid="{maps.pid}"' in k]
        assert 0 < resident <= size  # just written: cached
        assert 'gpuwatch_probe_up{probe="host"} 1.0' in text and 'gpuwatch_probe_up{probe="pagecache"} 1.0' in text
    finally:
        agent.stop()
        for p in (busy, maps):
            p.kill()
            p.wait()
