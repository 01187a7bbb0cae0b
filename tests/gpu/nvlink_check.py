"""Check the NVML probe's per-link NVLink series against nvidia-smi on a multi-GPU NVLink machine.

For every GPU: the links `nvidia-smi nvlink -s` lists must be the probe's links (same count), each
link active there (a speed) must be up in the probe (gpuwatch.gpu.nvlink.up 1) and each
`<inactive>` one down (0), and every counter of `nvidia-smi nvlink -e` (Replay, Recovery, CRC
Errors) must equal the probe's gpuwatch.gpu.nvlink.errors {type dl_replay, dl_recovery, dl_crc}:
read between two probe collections, it must lie within their two values (a counter may move in
between; on a quiet link they are equal). The probe must read NVLink with one field-value batch
per GPU per collection. It also records an NVML fixture (the recorder of `gpuwatch debug
record-nvml`), so that replays carry the answers of an NVLink machine.

  python3 tests/gpu/nvlink_check.py --record nvml-h200x8.json [--ticks 6] [--out nvlink.json]

Exit status 0 when everything matched, 1 on a mismatch, 2 when there is nothing to check (no
NVLink here, or the probe reads none: a check that saw nothing must not pass).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections import Counter
from typing import Any

from gpuwatch.probes.nvml.backend import Backend, RealBackend
from gpuwatch.probes.nvml.probe import NvmlProbe

# The format, from published outputs (H100 HBM3, 18 links: Stas Bekman's "Machine Learning
# Engineering", "How to check error counters of NVLink links"; an H100 PCIe with `<inactive>`
# links in an HPE DL380a walkthrough): a header line per GPU, then one tab-indented line per link
# (-s) or three per link (-e):
#   GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-abcdefab-cdef-abdc-abcd-abababababab)
#   \t Link 0: 26.562 GB/s            (-s; `<inactive>` for a link that is down)
#   \t Link 0: Replay Errors: 0       (-e; also Recovery Errors, CRC Errors)
GPU_LINE = re.compile(r"^GPU (?P<index>\d+): (?P<name>.*?)(?: \(UUID: (?P<uuid>[^)]+)\))?\s*$")
STATUS_LINE = re.compile(r"^\s+Link (?P<link>\d+): (?P<value>.+?)\s*$")
ERROR_LINE = re.compile(r"^\s+Link (?P<link>\d+): (?P<counter>[A-Za-z ]+?) Errors: (?P<count>\d+)\s*$")
SMI_ERROR_TYPES = {"Replay": "dl_replay", "Recovery": "dl_recovery", "CRC": "dl_crc"}
SPEED = re.compile(r"^(?P<speed>[\d.]+) GB/s$")


def _per_gpu(text: str, link_line: re.Pattern, add) -> dict[int, dict[str, Any]]:
    """nvidia-smi's per-GPU blocks: {gpu index: {"uuid", "links": {...}}}, add(links, match) per link line."""
    gpus: dict[int, dict[str, Any]] = {}
    current = None
    for line in text.splitlines():
        m = GPU_LINE.match(line)
        if m:
            current = gpus.setdefault(int(m["index"]), {"uuid": m["uuid"], "links": {}})
            continue
        m = link_line.match(line)
        if m and current is not None:
            add(current["links"], m)
    return gpus


def parse_status(text: str) -> dict[int, dict[str, Any]]:
    """`nvidia-smi nvlink -s` -> {gpu index: {"uuid", "links": {link: GB/s, None when inactive}}}."""
    def add(links: dict, m: re.Match) -> None:
        speed = SPEED.match(m["value"])
        links[int(m["link"])] = float(speed["speed"]) if speed else None
    return _per_gpu(text, STATUS_LINE, add)


def parse_errors(text: str) -> dict[int, dict[str, Any]]:
    """`nvidia-smi nvlink -e` -> {gpu index: {"uuid", "links": {link: {dl_replay|dl_recovery|dl_crc: n}}}}.
    A counter nvidia-smi names otherwise is kept under its own words (and then compared with nothing)."""
    def add(links: dict, m: re.Match) -> None:
        links.setdefault(int(m["link"]), {})[SMI_ERROR_TYPES.get(m["counter"], m["counter"])] = int(m["count"])
    return _per_gpu(text, ERROR_LINE, add)


class CountingBackend(Backend):
    """RealBackend, counting calls by (op, gpu) per collection: NVLink must be one batch per GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = RealBackend()
        self.calls: Counter = Counter()

    def _call(self, op: str, gpu: int | None, args: tuple) -> Any:
        self.calls[(op, gpu)] += 1
        return self.inner._call(op, gpu, args)

    def begin_tick(self) -> None:
        self.calls.clear()

    def close(self) -> None:
        self.inner.close()


def probe_nvlink(probe: NvmlProbe) -> dict[str, dict]:
    """{uuid: {"up": {link: value}, "errors": {(link, type): value}}} from one collection."""
    out: dict[str, dict] = {}
    for s in probe.collect():
        if s.metric == "gpuwatch.gpu.nvlink.up":
            out.setdefault(s.resource, {"up": {}, "errors": {}})["up"][int(s.labels["link"])] = s.value
        elif s.metric == "gpuwatch.gpu.nvlink.errors":
            out.setdefault(s.resource, {"up": {}, "errors": {}})["errors"][(int(s.labels["link"]), s.labels["type"])] = s.value
    return out


def compare(status: dict, errors: dict, before: dict, after: dict) -> tuple[list[dict], list[str]]:
    """Rows of the table, and the mismatches in words."""
    rows, bad = [], []
    for index, gpu in sorted(status.items()):
        uuid = gpu["uuid"]
        mine_before, mine_after = before.get(uuid, {"up": {}, "errors": {}}), after.get(uuid, {"up": {}, "errors": {}})
        if len(gpu["links"]) != len(mine_after["up"]):
            bad.append(f"GPU {index} ({uuid}): nvidia-smi lists {len(gpu['links'])} links, the probe "
                       f"{len(mine_after['up'])}")
        smi_errors = errors.get(index, {}).get("links", {})
        for link, speed in sorted(gpu["links"].items()):
            up = mine_after["up"].get(link)
            row = {"gpu": index, "link": link, "smi": "inactive" if speed is None else f"{speed} GB/s",
                   "probe_up": up, "ok": True}
            if up != (0.0 if speed is None else 1.0):
                row["ok"] = False
                bad.append(f"GPU {index} link {link}: nvidia-smi {row['smi']}, probe up={up}")
            for kind, n in sorted(smi_errors.get(link, {}).items()):
                lo, hi = mine_before["errors"].get((link, kind)), mine_after["errors"].get((link, kind))
                row[kind] = f"{n}/{'-' if hi is None else f'{hi:.0f}'}"
                if lo is None or hi is None or not min(lo, hi) <= n <= max(lo, hi):
                    row["ok"] = False
                    bad.append(f"GPU {index} link {link} {kind}: nvidia-smi {n}, probe {lo} .. {hi}")
            rows.append(row)
    return rows, bad


def smi(*args: str) -> str:
    return subprocess.run(["nvidia-smi", "nvlink", *args], capture_output=True, text=True, check=True,
                          timeout=60).stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--record", required=True, help="write an NVML recording (replay fixture) here")
    ap.add_argument("--ticks", type=int, default=6, help="collections to record")
    ap.add_argument("--out", help="write the comparison as JSON here")
    a = ap.parse_args()

    from gpuwatch.probes.nvml.replay import record
    summary = record(a.record, ticks=a.ticks, interval=1.0)
    print(f"recorded {summary['gpus']} GPUs x {summary['ticks']} ticks into {summary['out']}")

    backend = CountingBackend()
    probe = NvmlProbe(lambda: backend, xid_events=False)
    probe.start()
    try:
        probe_nvlink(probe)  # the first collection reads the static things (link counts)
        before = probe_nvlink(probe)
        batches = {gpu: n for (op, gpu), n in backend.calls.items() if op == "nvlink_fields"}
        per_call = sum(n for (op, _), n in backend.calls.items()
                       if op in ("nvlink_state", "nvlink_error_counter", "nvlink_throughput"))
        status, errors = parse_status(smi("-s")), parse_errors(smi("-e"))
        after = probe_nvlink(probe)
    finally:
        probe.shutdown()

    rows, bad = compare(status, errors, before, after)
    if set(batches.values()) != {1} or len(batches) != len(before) or per_call:
        bad.append(f"NVLink reads per GPU per collection: batches {batches}, per-value calls {per_call} "
                   f"(expected one batch per GPU with links, no per-value calls)")
    print(f"{'gpu':>3} {'link':>4} {'nvidia-smi':>12} {'up':>3} {'replay':>9} {'recovery':>9} {'crc':>9}  ok")
    for r in rows:
        up = "-" if r["probe_up"] is None else f"{r['probe_up']:.0f}"
        print(f"{r['gpu']:>3} {r['link']:>4} {r['smi']:>12} {up:>3} {r.get('dl_replay', '-'):>9} "
              f"{r.get('dl_recovery', '-'):>9} {r.get('dl_crc', '-'):>9}  {'ok' if r['ok'] else 'MISMATCH'}")
    print("(error columns: nvidia-smi/probe)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"rows": rows, "mismatches": bad, "batches": batches}, f, indent=1)
    if not rows or not any(before.values()):
        print("nothing to check: nvidia-smi lists no NVLink links, or the probe read none")
        return 2
    for line in bad:
        print("MISMATCH", line)
    print(f"{len(rows)} links on {len(status)} GPUs: {'all match' if not bad else f'{len(bad)} mismatches'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
