"""The daemon's probes come from a table (agent/daemon.py PROBE_FACTORIES): each probe package's
from_config(cfg) makes its probe or says it is off (None); the daemon keeps their order."""
from __future__ import annotations

from gpuwatch.agent import daemon
from gpuwatch.agent.config import load
from gpuwatch.probes import cupti, ebpf, nvml
from gpuwatch.probes.cupti.devicewide import CuptiSamplerProbe
from gpuwatch.probes.ebpf import EbpfCudaProbe
from gpuwatch.probes.nvml import NvmlProbe
from tests.conftest import FIXTURE

OFF = {"nvml.enabled": False, "ebpf.enabled": False, "cupti.sampling": False}


def test_every_probe_package_registers_its_factory_in_order():
    assert daemon.PROBE_FACTORIES == (nvml.from_config, ebpf.from_config, cupti.from_config)


def test_the_probes_the_config_turns_on_in_the_table_order(tmp_path):
    probes = daemon.build_probes(load("", {"agent.state_dir": str(tmp_path), "ebpf.max_processes": 7}))
    assert [type(p) for p in probes] == [NvmlProbe, EbpfCudaProbe, CuptiSamplerProbe]
    assert probes[1].max_processes == 7 and probes[1].libraries == () and probes[1].deadline == 30.0
    assert daemon.build_probes(load("", OFF)) == []
    for key, kind in [("nvml.enabled", NvmlProbe), ("ebpf.enabled", EbpfCudaProbe),
                      ("cupti.sampling", CuptiSamplerProbe)]:
        assert [type(p) for p in daemon.build_probes(load("", dict(OFF, **{key: True})))] == [kind]


def test_no_cupti_sampling_while_nvml_is_replayed():
    assert cupti.from_config(load("", {"nvml.replay": str(FIXTURE)})) is None
