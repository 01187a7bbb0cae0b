"""`gpuwatch top` with the agent's eBPF probe on the fake libcuda: a process's CUDA calls/s, its most
launched kernel, and grey from its pool allocator's driver allocations (no in-process agent)."""
from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from gpuwatch.agent.control import call
from tests.conftest import Agent, nvml_listing, wait_for

pytestmark = pytest.mark.root


def test_calls_per_second_top_kernel_and_grey_from_ebpf(tmp_path, drivers, allocs, fake_cuda):
    driver, pooled = drivers(), allocs()
    agent = Agent(tmp_path / "agent", "--nvml-replay", str(nvml_listing(tmp_path, [driver.pid, pooled.pid], rate=0)),
                  "--ebpf-library", fake_cuda["lib"], "--ebpf-pool-libraries", "libfakepool.so=fakepool",
                  "--no-baseline", "--no-cupti-sampling")
    try:
        deadline = time.monotonic() + 60
        while 'gpuwatch_probe_up{probe="ebpf"} 1' not in agent.metrics():
            assert time.monotonic() < deadline, agent.output()
            time.sleep(0.2)
        driver.go()  # the known workload once: add_kernel is its most launched kernel (1009 launches)
        pooled.send("leak pool 4194304 100")  # a 32 MiB chunk from the pool every 0.8 s: cuMemAlloc calls

        def rows():
            procs = {p["pid"]: p for p in call(str(agent.socket), "top", {})["processes"]}
            d, p = procs.get(driver.pid), procs.get(pooled.pid)
            ok = (d and d["top_kernel"] and p and p["grey"] and (p["calls_per_second"] or 0) > 0)
            return (d, p) if ok else None

        got = wait_for(rows, 40, 0.5)
        assert got, f"{call(str(agent.socket), 'top', {})}\n{agent.output()[-3000:]}"
        d, p = got
        assert d["top_kernel"] == "add_kernel(float*, int)"
        assert 0.3 < p["calls_per_second"] < 20 and p["grey"] >= 32 << 20 and p["white"] is None
        out = subprocess.run([sys.executable, "-m", "gpuwatch.agent.cli", "top", "--socket", str(agent.socket),
                              "--once"], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        (row,) = [line for line in out.stdout.splitlines() if line.split()[:1] == [str(driver.pid)]]
        assert row.endswith(" add_kernel(float*, int)"), row  # piped: 200 columns, the kernel shown
        (row,) = [line for line in out.stdout.splitlines() if line.split()[:1] == [str(pooled.pid)]]
        assert re.search(r" +— +\d+M +1\.0G +\S+ +\S+ +\d+(\.\d)? ", row), row  # white —, grey from eBPF, calls/s
    finally:
        agent.stop()
