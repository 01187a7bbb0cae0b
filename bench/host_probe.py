"""What one collection of the host probe costs: N child processes with T threads each (busy or
idle), read by HostProcessProbe as the daemon would read N GPU processes.

  python3 bench/host_probe.py [--processes 16] [--threads 32] [--repeat 21]

Prints the median wall and CPU time per collection (docs/host.md).
"""
import argparse
import statistics
import subprocess
import sys
import time

from gpuwatch.probes.process.host import HostProcessProbe

CHILD = """
import threading, time, sys
for _ in range(int(sys.argv[1]) - 1):
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
print("ready", flush=True)
time.sleep(600)
"""

ap = argparse.ArgumentParser()
ap.add_argument("--processes", type=int, default=16)
ap.add_argument("--threads", type=int, default=32)
ap.add_argument("--repeat", type=int, default=21)
a = ap.parse_args()
kids = [subprocess.Popen([sys.executable, "-c", CHILD, str(a.threads)], stdout=subprocess.PIPE, text=True)
        for _ in range(a.processes)]
try:
    for k in kids:
        k.stdout.readline()
    probe = HostProcessProbe(lambda: {k.pid: "bench" for k in kids})
    probe.collect()
    wall, cpu, n = [], [], 0
    for _ in range(a.repeat):
        w, c = time.perf_counter(), time.process_time()
        n = len(probe.collect())
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    print(f"{a.processes} processes x {a.threads} threads: {n} samples per collection; median wall "
          f"{statistics.median(wall) * 1e3:.1f} ms, CPU {statistics.median(cpu) * 1e3:.1f} ms "
          f"({a.repeat} collections)")
finally:
    for k in kids:
        k.kill()
        k.wait()
