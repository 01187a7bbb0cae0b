"""Host-side views of GPU processes: which Kubernetes pod and container a process belongs to, and
the host side (CPU, memory, I/O, page cache) of the GPU processes in the runner's inventory."""
from gpuwatch.agent.registry import ProbeEntry


def _host(ctx):
    from gpuwatch.probes.process.host import HostProcessProbe

    return HostProcessProbe(lambda: ctx.inventory().gpu_processes, interval=ctx.cfg.host.interval)


def _page_cache(ctx):
    from gpuwatch.probes.process.pagecache import PageCacheProbe

    return PageCacheProbe(lambda: ctx.inventory().gpu_processes, ctx.cfg.host.page_cache_min_bytes,
                          budgets=ctx.budgets)


PROBES = (ProbeEntry("host", "host", 70, lambda ctx: _host(ctx) if ctx.cfg.host.enabled else None),
          ProbeEntry("pagecache", "host", 80, lambda ctx: _page_cache(ctx) if ctx.cfg.host.page_cache else None))
