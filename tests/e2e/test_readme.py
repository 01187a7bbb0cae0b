"""Issue 35 item 7: the README says what the tool does. Every command in its fenced sh/console
blocks is either run here, on a CPU machine, against a real agent this test starts (NVML replayed
from tests/fixtures), or listed in SKIP with why; a new command fails the test until it is one or
the other. And every relative link and anchor in README.md and docs/*.md leads somewhere."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FIXTURE, Agent

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

# command -> exit statuses that mean it worked here. "live": it runs until stopped (a terminal
# view printing plain frames to a pipe): it must still run after a few seconds and have printed.
RUN = {
    "gpuwatch doctor": (0, 1),  # 1: a check fails on this machine (no NVIDIA driver): said, not a crash
    "gpuwatch gpus": (0,),  # NVML replayed ($GPUWATCH_NVML_REPLAY)
    "gpuwatch status": (0,),
    "gpuwatch top": "live",
    "gpuwatch leaks": (0, 2),  # 2: every detector asked is blind (README: exit status 2)
    "gpuwatch baseline show": (0,),
    "curl -s localhost:10480/metrics | grep '^hw_power_watts{'": (0,),
    ".venv/bin/gpuwatch top --nvml-replay tests/fixtures/nvml-h200.json": "live",
}
SKIP = {
    "scripts/setup && .venv/bin/gpuwatch agent": "installs system packages; the agent it starts is the one this "
                                                 "test starts (tests/e2e/test_first_hour.py runs a fresh one)",
    "scripts/setup --test && .venv/bin/python -m pytest": "the whole suite (CI's own run)",
    "gpuwatch agent": "started by this test, as every command below talks to it",
    "gpuwatch demo": "runs for a minute: tests/e2e/test_first_hour.py plays it",
    ".venv/bin/gpuwatch demo": "runs for a minute: tests/e2e/test_first_hour.py plays it",
    "gpuwatch trace --pid 4242": "needs a CUDA process and root: tests/ebpf/test_trace_cli.py traces the fake libcuda",
    "gpuwatch run -- python train.py": "needs a train.py: tests/e2e/test_run.py runs real programs",
    "gpuwatch baseline run": "needs a GPU (tests/gpu/baseline_check.sh)",
    "install -m 0755 .venv/bin/gpuwatch /usr/local/bin/": "installs into the machine (tests/unit/test_systemd_unit.py)",
    "install -D -m 0644 systemd/gpuwatch.toml /etc/gpuwatch/gpuwatch.toml": "installs into the machine",
    "install -m 0644 systemd/gpuwatch.service /etc/systemd/system/": "installs into the machine",
    "systemctl daemon-reload && systemctl enable --now gpuwatch": "starts the host's service",
}


def readme_commands(text: str) -> list[str]:
    """The commands of the fenced sh and console blocks: every line of an sh block, the prompt
    lines ("$ ", "# ") of a console block; without their trailing comments."""
    out = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S):
        for line in body.splitlines():
            if lang == "console":
                if not line.startswith(("$ ", "# ")):
                    continue
                line = line[2:]
            elif lang not in ("sh", "bash"):
                break
            line = re.split(r"\s{2,}#\s", line)[0].strip()
            if line:
                out.append(line)
    return out


def test_every_readme_command_is_run_or_skipped_with_a_reason():
    commands = readme_commands(README.read_text())
    unclassified = [c for c in commands if c not in RUN and c not in SKIP]
    assert not unclassified, f"README commands neither run nor skipped here (add them to RUN or SKIP): {unclassified}"
    assert not (set(RUN) | set(SKIP)) - set(commands), "RUN/SKIP name commands the README no longer has"


def test_the_readme_commands_run_on_a_cpu_machine(tmp_path):
    agent = Agent(tmp_path / "agent", "--nvml-replay", str(FIXTURE), "--no-ebpf", "--no-baseline")
    try:
        agent.metrics()
        env = dict(os.environ, GPUWATCH_SOCKET=str(agent.socket), GPUWATCH_NVML_REPLAY=str(FIXTURE),
                   PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
        for command, ok in RUN.items():
            cmd = command.replace("localhost:10480", f"localhost:{agent.port}")
            p = subprocess.Popen(["bash", "-c", cmd], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
            if ok == "live":
                with pytest.raises(subprocess.TimeoutExpired):
                    p.wait(4)
                p.terminate()
                out, err = p.communicate(10)
                assert out.startswith("gpuwatch top "), (command, out, err)
            else:
                out, err = p.communicate(timeout=60)
                assert p.returncode in ok, (command, p.returncode, out, err)
            assert "Traceback" not in err, (command, err)
            if command.startswith("curl"):
                assert len(out.splitlines()) == 1 and out.startswith("hw_power_watts{gpu="), out
    finally:
        agent.stop()


# -- links --------------------------------------------------------------------------------------------

def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation but - and _ dropped."""
    h = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    h = re.sub(r"[`*]|<[^>]+>", "", h).lower()
    return re.sub(r"[^\w\- ]", "", h).replace(" ", "-")


def _without_code(text: str) -> str:
    return re.sub(r"`[^`\n]*`", "", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S))


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set(re.findall(r'<a\s+(?:id|name)="([^"]+)"', path.read_text()))
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*$", re.sub(r"^```.*?^```", "", path.read_text(),
                                                                flags=re.M | re.S), re.M):
        s = _slug(heading)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def test_slugs_are_githubs():
    assert _slug("Issue 22 on the H200 (2026-12-02): NCCL") == "issue-22-on-the-h200-2026-12-02-nccl"
    assert _slug("CUDA_VISIBLE_DEVICES") == "cuda_visible_devices"
    assert _slug("`--summary-json`") == "--summary-json"


def test_every_relative_link_and_anchor_in_the_docs_leads_somewhere():
    broken = []
    for md in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", _without_code(md.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            path = (md.parent / file) if file else md
            if not path.exists():
                broken.append(f"{md.relative_to(ROOT)}: {target}: no such file")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{md.relative_to(ROOT)}: {target}: no such heading in {path.name}")
    assert not broken, "\n".join(broken)
