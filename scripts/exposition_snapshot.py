#!/usr/bin/env python3
"""Print the Prometheus exposition (/metrics, text 0.0.4) of an agent on the replayed H200, the same
bytes on every run of the same code: a refactoring that keeps behaviour keeps this output.

    scripts/exposition_snapshot.py --gpus 1 > before.txt
    scripts/exposition_snapshot.py --gpus 8 > after.txt     # --nvml-replay-gpus 8

The agent is the real Daemon with the default config (no config file), NVML replayed from
tests/fixtures/nvml-h200.json, its state in a temporary directory; its listeners are never opened:
the text is what exporters/prometheus.render makes of the runner's snapshot, as a scrape would get.

What is pinned, because a real agent leaves it to timing:
- the schedule: each round runs every probe once, one at a time in the runner's order, each followed
  by a publish (a real runner starts them together and publishes as each finishes, in whatever order
  they finish), and every detector judges at every publish (their intervals run on the monotonic
  clock). The probes then read the same snapshots every run.

What is normalised, because it measures this run rather than the code:
- the values of gpuwatch_probe_duration_seconds (how long each collection took) and of every
  *_timestamp_seconds (when this run loaded its config),
- the version and python labels of gpuwatch_build_info (the build, not the behaviour),
- the process_* and python_* families, should a collector add them (the agent's own RSS, CPU, start time).
- the value of gpuwatch_history_series (it counts the series dropped below).
Each such value becomes "<normalised>"; the lines stay, so a family that appears or goes shows.
Dropped: the gpuwatch_node_process_* families (the page-cache probe's busiest readers of this node,
any process: whatever else runs beside it). Samples carry no timestamps in this format.

Pointed away from this machine: the eBPF probe attaches to ebpf.library, set to the fixture (not an
ELF file: it attaches nothing), not to whatever libcuda this machine's processes map. Not
normalised, but said on stderr: a recorded pid that names a live process here (the host-side
probes would read it).
"""
from __future__ import annotations

import argparse
import math
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "nvml-h200.json"
ROUNDS = 4  # enough for rates, the host probes (they read the GPU processes of a published snapshot) and detectors
PROBE_WAIT = 120.0  # seconds one collection may take (a first eBPF start compiles)

NORMALISED = "<normalised>"
_TIMED = re.compile(r"^(gpuwatch_probe_duration_seconds|\w+_timestamp_seconds)((?:\{[^}]*\})?) \S+$")
_BUILD = re.compile(r'^gpuwatch_build_info\{.*\}')
_OWN_PROCESS = re.compile(r"^(?:# (?:HELP|TYPE) )?(?:process|python)_")
_NODE_PROCESSES = re.compile(r"^(?:# (?:HELP|TYPE) )?gpuwatch_node_process_")
_COUNTS_THEM = re.compile(r"^gpuwatch_history_series \S+$")


def _tick(runner) -> None:
    """One round: each probe alone, in the runner's order, then a publish; every detector due."""
    for slot in runner.slots:
        others = [(s, s.next_due) for s in runner.slots if s is not slot]
        for s, _ in others:
            s.next_due = math.inf
        slot.next_due = 0.0
        runner._detector_due = [0.0] * len(runner.detectors)
        runner.step()  # starts it
        if not slot.done.wait(PROBE_WAIT):
            sys.exit(f"probe {slot.probe.name} did not finish within {PROBE_WAIT:.0f} s")
        runner._detector_due = [0.0] * len(runner.detectors)
        runner.step()  # takes its result and publishes
        for s, due in others:
            s.next_due = due


def normalise(text: str) -> str:
    out = []
    for line in text.splitlines():
        if _NODE_PROCESSES.match(line):
            continue
        if _COUNTS_THEM.match(line):
            line = f"gpuwatch_history_series {NORMALISED}"
        elif _OWN_PROCESS.match(line):
            line = re.sub(r" \S+$", f" {NORMALISED}", line) if not line.startswith("#") else line
        elif _BUILD.match(line):
            line = re.sub(r'(version|python)="[^"]*"', rf'\1="{NORMALISED}"', line)
        else:
            line = _TIMED.sub(rf"\1\2 {NORMALISED}", line)
        out.append(line)
    return "\n".join(out) + "\n"


def _warn_live_pids(snap) -> None:
    """The host-side probes read /proc for the recorded pids: one that names a live process on this
    machine makes their series this machine's (and this moment's). Said, not hidden."""
    import os

    pids = {s.labels["pid"] for s in snap.samples if s.labels.get("pid", "").isdigit()}
    live = sorted((p for p in pids if os.path.exists(f"/proc/{p}")), key=int)
    if live:
        print(f"warning: replayed pid(s) {', '.join(live)} name live processes here: the host-side series of "
              f"them vary from run to run", file=sys.stderr)


def exposition(gpus: int) -> str:
    from gpuwatch.agent import config, daemon
    from gpuwatch.exporters.prometheus import render

    with tempfile.TemporaryDirectory(prefix="gpuwatch-expo-") as tmp:
        cfg = config.load("", {"nvml.replay": str(FIXTURE), "nvml.replay_gpus": gpus if gpus != 1 else None,
                               "agent.state_dir": f"{tmp}/state", "agent.runtime_dir": tmp,
                               "prometheus.listen": "127.0.0.1:0", "ebpf.library": str(FIXTURE)})
        d = daemon.Daemon(cfg, None, {})
        try:
            for _ in range(ROUNDS):
                _tick(d.runner)
            _warn_live_pids(d.runner.snapshot)
            return normalise(render(d.runner.snapshot, openmetrics=False).decode())
        finally:
            d.runner.shutdown()
            if d.store is not None:
                d.store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=1, help="GPUs replayed (the agent's --nvml-replay-gpus; 1: as recorded)")
    args = ap.parse_args()
    sys.stdout.write(exposition(args.gpus))


if __name__ == "__main__":
    main()
