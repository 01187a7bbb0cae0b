"""The daemon's probes and detectors come from their own declarations (agent/registry.py): each
probe package's PROBES and each detector module's DETECTOR, found by the daemon, in their order;
a probe's factory says it is off (None) when the config leaves it off."""
from __future__ import annotations

from gpuwatch.agent import budget, daemon
from gpuwatch.agent.config import load
from gpuwatch.agent.registry import Context
from gpuwatch.agent.snapshot import EMPTY
from gpuwatch.probes import cupti, ebpf, nvml
from gpuwatch.probes.cupti.devicewide import CuptiSamplerProbe
from gpuwatch.probes.cupti.reports import InProcessProbe, InProcessReports
from gpuwatch.probes.ebpf import EbpfCudaProbe
from gpuwatch.probes.nvml import NvmlProbe
from tests.conftest import FIXTURE

OFF = {"nvml.enabled": False, "ebpf.enabled": False, "cupti.sampling": False, "host.enabled": False,
       "host.page_cache": False, "baseline.enabled": False}


def context(cfg) -> Context:
    return Context(cfg, None, lambda: EMPTY.inventory, InProcessReports(), budget.from_config(cfg), {})


def test_every_probe_package_and_detector_module_registers_in_order():
    assert [e.name for e in daemon.probe_entries()] == ["nvml", "ebpf", "cupti_sampler", "cupti", "host",
                                                        "pagecache", "baseline"]
    assert [e.name for e in daemon.detector_entries()] == ["leak", "thermal", "launch", "health", "host_bound",
                                                           "straggler", "nvlink"]
    ctx = context(load("", {}))
    for e in daemon.detector_entries():
        made = e.make(ctx)
        assert (made.name, made.kinds) == (e.name, e.kinds)


def test_the_probes_the_config_turns_on_in_the_table_order(tmp_path):
    cfg = load("", dict(OFF, **{"agent.state_dir": str(tmp_path), "ebpf.max_processes": 7, "nvml.enabled": True,
                                "ebpf.enabled": True, "cupti.sampling": True}))
    ctx = context(cfg)
    probes = daemon.build_probes(ctx)
    assert [type(p) for p in probes] == [NvmlProbe, EbpfCudaProbe, CuptiSamplerProbe, InProcessProbe]
    assert probes[1].max_processes == 7 and probes[1].libraries == () and probes[1].deadline == 30.0
    assert probes[1].budgets is ctx.budgets
    assert [p.name for p in daemon.build_probes(context(load("", OFF)))] == ["cupti"]  # always on
    for key, kind in [("nvml.enabled", NvmlProbe), ("ebpf.enabled", EbpfCudaProbe),
                      ("cupti.sampling", CuptiSamplerProbe)]:
        assert [type(p) for p in daemon.build_probes(context(load("", dict(OFF, **{key: True}))))][:1] == [kind]


def test_a_factory_sees_the_probes_made_before_it(tmp_path):
    """The reference workload steps the CUPTI sampler aside (a GpuTenant made before it)."""
    cfg = load("", dict(OFF, **{"agent.state_dir": str(tmp_path), "cupti.sampling": True, "baseline.enabled": True}))
    probes = daemon.build_probes(context(cfg))
    assert [p.name for p in probes] == ["cupti_sampler", "cupti", "baseline"]
    assert probes[2].tenants == (probes[0],)


def test_no_cupti_sampling_while_nvml_is_replayed():
    assert cupti.from_config(load("", {"nvml.replay": str(FIXTURE)})) is None
    assert nvml.from_config(load("", {"nvml.replay": str(FIXTURE)})) is not None
    assert ebpf.from_config(load("", {"ebpf.enabled": False})) is None
