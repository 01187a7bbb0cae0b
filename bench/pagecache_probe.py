"""What one collection of the page-cache probe costs: N files of G GiB held open by a child, read
into the page cache, measured by cachestat(2) and by mincore(2); and one pass over the node's
/proc/PID/io (the top readers); and one listing of the child's files (once a minute per process),
which checks each large file with the credentials of the child's user.

  python3 bench/pagecache_probe.py [--dir /var/tmp] [--files 8] [--gib 1] [--repeat 21]

Prints median wall and CPU time per collection for each method (docs/host.md). The files are
preallocated (fallocate: no data written) and read once, so all their pages are cached. Run as
root, the child runs as user nobody and the files are its own, so the listing takes nobody's
credentials to check them, as it does for any user's process.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

from gpuwatch.probes.process import pagecache
from gpuwatch.probes.process.pagecache import NodeReaders, PageCacheProbe


def cost(fn, repeat):
    walls, cpus = [], []
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return f"wall {statistics.median(walls) * 1e3:8.2f} ms   cpu {statistics.median(cpus) * 1e3:8.2f} ms"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=21)
    a = ap.parse_args()
    size = int(a.gib * (1 << 30))
    paths = [os.path.join(a.dir, f"gpuwatch-bench-{os.getpid()}-{i}.bin") for i in range(a.files)]
    child = None
    try:
        for p in paths:
            fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
            os.posix_fallocate(fd, 0, size)
            while os.read(fd, 16 << 20):  # into the page cache
                pass
            if os.geteuid() == 0:
                os.fchown(fd, 65534, 65534)
            os.close(fd)
        nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
        child = subprocess.Popen([*nobody, sys.executable, "-c", "import sys,time\nfs=[open(p,'rb') for p in sys.argv[1:]]\n"
                                  "print('ready',flush=True)\ntime.sleep(3600)\n", *paths], stdout=subprocess.PIPE)
        child.stdout.readline()
        print(f"kernel {os.uname().release}, {a.files} files x {a.gib:g} GiB, all cached, median of {a.repeat}")
        probe = PageCacheProbe(lambda: {child.pid: "bench"}, 1 << 20)
        probe.readers = NodeReaders(top=0)  # files only here; the readers pass is timed on its own
        n = sum(s.metric == "gpuwatch.process.file.size" for s in probe.collect())
        assert n == a.files, n
        print(f"  cachestat  {cost(probe.collect, a.repeat)}   (cachestat in kernel: {probe._cachestat})")
        pagecache._SYSCALL_NR = 2000  # no such call: ENOSYS, as before Linux 6.5
        probe = PageCacheProbe(lambda: {child.pid: "bench"}, 1 << 20)
        probe.readers = NodeReaders(top=0)
        probe.collect()
        print(f"  mincore    {cost(probe.collect, a.repeat)}")
        listed = pagecache.large_files(child.pid, 1 << 20)
        assert sum(f.path in paths for f in listed) == a.files, listed
        print(f"  listing    {cost(lambda: pagecache.large_files(child.pid, 1 << 20), a.repeat)}   "
              f"(as {'nobody' if nobody else 'this user'}: {len(listed)} files)")
        readers = NodeReaders()
        nproc = sum(e.isdigit() for e in os.listdir("/proc"))
        print(f"  readers    {cost(readers.sample, a.repeat)}   ({nproc} processes)")
    finally:
        if child:
            child.kill()
            child.wait()
        for p in paths:
            if os.path.exists(p):
                os.unlink(p)


if __name__ == "__main__":
    main()
