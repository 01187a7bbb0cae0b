"""The Prometheus exporter translates snapshots using the registry and never calls probes."""
import re
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from gpuwatch.agent.api import Sample
from gpuwatch.agent.snapshot import Snapshot
from gpuwatch.exporters.prometheus import PrometheusExporter, families

GPU = "GPU-8c2e6a2b-0000-1111-2222-333344445555"


def snap(*samples):
    return Snapshot(ts=1.0, samples=tuple(samples))


def exposition(snapshot):
    exp = PrometheusExporter("127.0.0.1:0")
    exp.start()
    try:
        exp.publish(snapshot)
        with urllib.request.urlopen(f"http://127.0.0.1:{exp.port}/metrics", timeout=5) as r:
            return r.read().decode()
    finally:
        exp.shutdown()


def parsed(text):
    return {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}


def test_names_units_and_gpu_label_come_from_the_registry():
    text = exposition(snap(
        Sample("hw.temperature", 41.0, GPU, {"sensor": "gpu"}),
        Sample("hw.energy", 1234.5, GPU),
        Sample("gpuwatch.gpu.up", 1.0, GPU),
    ))
    assert '# TYPE hw_temperature_celsius gauge' in text
    assert f'hw_temperature_celsius{{gpu="{GPU}",sensor="gpu"}} 41.0' in text
    assert f'hw_energy_joules_total{{gpu="{GPU}"}} 1234.5' in text
    assert re.search(r"^# TYPE hw_energy_joules(_total)? counter$", text, re.M)
    assert f'gpuwatch_gpu_up{{gpu="{GPU}"}} 1.0' in text


def test_hostile_label_values_keep_the_exposition_valid():
    name = 'a "b"\\c\nd\udcff(deleted)'
    text = exposition(snap(Sample("gpuwatch.process.gpu.memory.usage", 1e9, GPU,
                                  {"pid": "42", "process": name})))
    fams = list(text_string_to_metric_families(text))
    (s,) = [s for f in fams for s in f.samples]
    assert s.labels["pid"] == "42" and s.labels["process"].startswith('a "b"\\c\nd')
    assert s.value == 1e9


def test_unknown_metric_or_missing_label_is_skipped_not_fatal():
    fams = families(snap(Sample("no.such.metric", 1.0), Sample("hw.temperature", 1.0, GPU),
                         Sample("hw.power", 300.0, GPU)))
    assert [f.name for f in fams] == ["hw_temperature_celsius", "hw_power_watts"]
    assert fams[0].samples == []  # sensor label missing: that sample is dropped
