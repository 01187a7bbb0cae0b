"""Hostile process names, paths and kernel names never break the Prometheus exposition.

Names come from /proc (any bytes but NUL and "/", undecodable ones as surrogate escapes), from
containers, from CUDA kernel names (C++ templates with quotes, parentheses, spaces) and from the
in-process agent over the control socket. Every rendered exposition here is checked three ways:
prometheus_client's text parser, its OpenMetrics parser, and `promtool check metrics` (the Go
parser Prometheus itself uses; Debian's prometheus package, installed by scripts/setup --test).
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from gpuwatch.agent import metrics as registry
from gpuwatch.agent.api import Sample
from gpuwatch.agent.runner import Runner
from gpuwatch.agent.snapshot import Snapshot
from gpuwatch.agent.api import printable
from gpuwatch.exporters.prometheus import render
from gpuwatch.probes.nvml.probe import NvmlProbe, sanitise_process_name
from gpuwatch.probes.nvml.replay import ReplayBackend

FIXTURE = Path(__file__).parents[1] / "fixtures" / "nvml-h200.json"
GPU = "GPU-8c2e6a2b-0000-1111-2222-333344445555"
PROMTOOL = shutil.which("promtool")

# What /proc gives: any character (surrogates too: undecodable bytes under surrogateescape).
HOSTILE = st.text(st.characters(blacklist_categories=()), max_size=40)
NASTY = ['python3 (deleted)', '/usr/lib/x86_64-linux-gnu/libcuda.so.1 (deleted)', 'my app', 'a"b', 'a\\b',
         'a\\nb', 'line\nbreak', 'cr\rlf', 'tab\there', '(sd-pam)', "it's", '}{,=', '\x00nul', '\udcff\udcfe',
         '\ud800', 'ünïcödé ✓', '\u2028\u2029', '# HELP x y', 'x} 1\nevil_metric 2', '',
         # C1 controls and bidi controls: CSI, NEL, RLO "gnp.exe" shown as "exe.png", isolates, marks, ALM
         '\x9b31mred', 'nel\x85line', 'w\u202egnp.exe', '\u2066iso\u2069', '\u200eltr\u200frtl', 'alm\u061c',
         '\u202a\u202b\u202c\u202d', 'zw\u200bsp\ufeff', '\xe2\x80\xae']
# What no label value may hold once rendered: C0 and C1 controls and the bidi controls.
CONTROLS = frozenset(map(chr, [*range(0x20), *range(0x7f, 0xa0), 0x061c, 0x200e, 0x200f, *range(0x202a, 0x202f),
                               *range(0x2066, 0x206a)]))


def test_promtool_check_catches_a_broken_exposition():
    with pytest.raises(AssertionError):
        promtool_check('x{a="b\nc"} 1\n')


def promtool_check(text: str) -> None:
    if PROMTOOL is None:
        pytest.skip("promtool not installed (scripts/setup --test installs Debian's prometheus package)")
    out = subprocess.run([PROMTOOL, "check", "metrics"], input=text.encode("utf-8"), capture_output=True,
                         timeout=30)
    # Exit 1 with "error while linting" is a parse error; lint remarks (exit 3) would be about our names.
    assert out.returncode == 0, (out.stdout + out.stderr).decode(errors="replace") + "\n---\n" + text


def parsed_both_ways(snapshot: Snapshot) -> list:
    """Render both formats, parse both, promtool the text one; the text parser's samples."""
    text = render(snapshot, openmetrics=False).decode("utf-8")  # strict: must be valid UTF-8
    om = render(snapshot, openmetrics=True).decode("utf-8")
    assert not set(text) & CONTROLS - {"\n"} and not set(om) & CONTROLS - {"\n"}
    samples = [s for f in parse_text(text) for s in f.samples]
    om_samples = [s for f in parse_openmetrics(om) for s in f.samples]
    key = lambda s: (s.name.removesuffix("_info"), sorted(s.labels.items()))  # noqa: E731
    assert sorted(map(key, samples)) == sorted(map(key, om_samples))
    for s in samples:
        for v in s.labels.values():
            v.encode("utf-8")  # no surrogates left
            assert not set(v) & CONTROLS, (s.name, v)  # nor any control, even escaped (a "\\n")
    promtool_check(text)
    return samples


# -- the real path: a name as NVML/psutil gives it, through the NVML probe, to the exposition -------

@functools.lru_cache(maxsize=1)
def _recording() -> dict:
    return json.loads(FIXTURE.read_text())


def _probe_snapshot(tmp_path: Path, name: str) -> Snapshot:
    data = json.loads(json.dumps(_recording()))
    keys = [k for k in data["system"] if k.startswith("process_name ")]
    assert keys, "the recording has no process names"
    for k in keys:
        data["system"][k] = [{"value": name}]
    path = tmp_path / "rec.json"
    path.write_text(json.dumps(data))  # lone surrogates travel as \udcff escapes
    probe = NvmlProbe(functools.partial(ReplayBackend, str(path), gpus=2, processes_per_gpu=3), xid_events=False)
    runner = Runner([probe])
    try:
        return runner.tick_once()
    finally:
        runner.shutdown()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.one_of(HOSTILE, st.sampled_from(NASTY),
                      st.binary(max_size=30).map(lambda b: b.decode("utf-8", "surrogateescape"))))
@example(name="python3 (deleted)")
@example(name="a\nb\"c\\d\udcff")
def test_process_names_through_the_nvml_probe_keep_the_exposition_valid(tmp_path, name):
    samples = parsed_both_ways(_probe_snapshot(tmp_path, name))
    names = {s.labels["process"] for s in samples if s.name == "gpuwatch_process_gpu_memory_usage_bytes"}
    assert names and names <= {sanitise_process_name(name), "other"}
    assert all(len(n) <= 64 for n in names)


@pytest.mark.parametrize("name", NASTY)
def test_sanitised_process_names_are_plain(name):
    got = sanitise_process_name(name)
    assert got and len(got) <= 64 and got.isascii() and got.isprintable()
    assert not set(got) & set(' "\\\n\r{}=,\'()#')


# -- every label that can carry outside text, straight into the renderer ---------------------------

def _samples_with(value: str) -> list[Sample]:
    out = []
    for m in registry.METRICS:
        labels = {k: value for k in m.labels if k != "gpu"}
        v = 1.0 if m.kind is registry.Kind.INFO else 1.5
        hist = None
        if m.kind is registry.Kind.HISTOGRAM:
            h = registry.Histogram(m.name, 0.0)
            h.observe(0.3)
            hist = h.value()
        out.append(Sample(m.name, v, f"GPU-{value}" if m.per_gpu else "", labels, histogram=hist))
    return out


@settings(max_examples=40, deadline=None)
@given(value=st.one_of(HOSTILE, st.sampled_from(NASTY)))
@example(value='void gemm<(int)128, "x">(float*, float const*) (deleted)')
def test_any_label_value_in_every_metric_keeps_the_exposition_valid(value):
    samples = parsed_both_ways(Snapshot(ts=1.0, samples=tuple(_samples_with(value))))
    assert len({s.name for s in samples}) >= len(registry.METRICS)
    if any(0xD800 <= ord(c) <= 0xDFFF for c in value):
        return  # surrogates are replaced, so they do not round-trip
    shown = printable(value)  # every printable character kept, every other one "?"
    for s in samples:
        for k, v in s.labels.items():
            if k == "le" and s.name.endswith("_bucket"):
                continue  # a histogram's bound, ours
            assert v == (f"GPU-{shown}" if k == "gpu" else shown), (s.name, k)


def test_paths_with_spaces_and_deleted_mappings_in_one_snapshot():
    names = ["/opt/my jobs/run (1).py", "/usr/lib/libcuda.so.1 (deleted)", "C:\\weird", 'q"uote', "multi\nline",
             "/data/w\u202egnp.exe\x9b"]
    snap = Snapshot(ts=1.0, samples=tuple(
        Sample("gpuwatch.process.gpu.memory.usage", float(i), GPU, {"pid": str(i), "process": n})
        for i, n in enumerate(names)))
    samples = parsed_both_ways(snap)
    assert sorted(s.labels["process"] for s in samples) == sorted(
        [*names[:4], "multi?line", "/data/w?gnp.exe?"])


@pytest.mark.parametrize("text", ["\x9b", "\x85", "\u202e", "\u202a", "\u2066", "\u2069", "\u200e", "\u200f",
                                  "\u061c", "\x1b", "\n", "\udcff", "\u2028"])
def test_printable_replaces_c0_c1_and_bidi_controls(text):
    assert printable(f"a{text}b") == "a?b"
    assert printable("ünïcödé ✓ 名前 עברית") == "ünïcödé ✓ 名前 עברית"  # letters of any script stay
