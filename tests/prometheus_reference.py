"""prometheus_client's own rendering of a snapshot: the reference that tests/unit/test_prometheus_exporter.py
compares exporters/prometheus.render() with, and that bench/bench_render.py measures it against."""
from __future__ import annotations

import itertools
import math

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily

from gpuwatch.agent import metrics as registry
from gpuwatch.agent.snapshot import Snapshot
from gpuwatch.exporters.prometheus import _le


def reference_registry(snapshot: Snapshot):
    """The snapshot as prometheus_client metric families, for the library to render."""
    fams: dict = {}
    for s in snapshot.samples:
        m = registry.REGISTRY[s.metric]
        values = dict(s.labels, **({"gpu": s.resource} if m.per_gpu else {}))
        values = {k: str(values[k]) for k in m.labels}
        if m.name not in fams:
            unit = registry._UNIT_SUFFIX[m.unit]
            if m.kind is registry.Kind.INFO:
                fams[m.name] = InfoMetricFamily(m.prom_name[: -len("_info")], m.help)
            elif m.kind is registry.Kind.COUNTER:
                fams[m.name] = CounterMetricFamily(m.prom_name, m.help, labels=m.labels, unit=unit)
            elif m.kind is registry.Kind.HISTOGRAM:
                fams[m.name] = HistogramMetricFamily(m.prom_name, m.help, labels=m.labels, unit=unit)
            else:
                fams[m.name] = GaugeMetricFamily(m.prom_name, m.help, labels=m.labels, unit=unit)
        if m.kind is registry.Kind.INFO:
            fams[m.name].add_metric([], values)
        elif m.kind is registry.Kind.HISTOGRAM:
            cumulative = itertools.accumulate(s.histogram.counts)
            fams[m.name].add_metric([values[k] for k in m.labels],
                                    [(_le(b), n) for b, n in zip((*m.buckets, math.inf), cumulative)],
                                    s.histogram.sum)
        else:
            fams[m.name].add_metric([values[k] for k in m.labels], s.value)

    class _Collector:
        def collect(self):
            return list(fams.values())

    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector())
    return reg
