"""Packaging: gpuwatch installs as one import package, both ways, and CI runs the README's tests.

The package is built and installed for real into fresh virtual environments
(`pip install .` and `pip install -e .`, with --no-deps; the build itself gets
setuptools from the package index through pip's build isolation), then imported
from a directory outside the checkout.
"""
from __future__ import annotations

import csv
import re
import shutil
import subprocess
import sys
import venv
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("agent", "probes", "exporters", "detectors")
SUBPACKAGES = tuple(f"gpuwatch.{d}" for d in SOURCE_DIRS)
BARE = {"agent", "probes", "exporters", "detectors", "tests"}


# --- README <-> CI -----------------------------------------------------------------------


def readme_test_command() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(r"^```(?:sh|bash|shell)\s*\n(.*?)^```", text, re.S | re.M)
    assert m, "README.md has no ```sh code block with the setup and test commands"
    lines = [line.strip() for line in m.group(1).splitlines() if "pytest" in line]
    assert lines, "README.md's first ```sh block has no line running pytest"
    return lines[0]


def test_ci_runs_the_readme_test_command():
    cmd = readme_test_command()
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    ci_commands = [line.strip() for line in ci.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert cmd in ci_commands, f".ci/run must run the README's test command verbatim: {cmd!r}"


def test_ci_script_is_strict_bash():
    ci = ROOT / ".ci" / "run"
    assert ci.read_text().startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in ci.read_text()
    assert subprocess.run(["bash", "-n", str(ci)], check=False).returncode == 0


# --- real installs -----------------------------------------------------------------------


def _copy_source(dst: Path) -> Path:
    """What a clean checkout would build from, so builds leave nothing in the working tree."""
    dst.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, dst / name)
    for d in SOURCE_DIRS:
        shutil.copytree(ROOT / d, dst / d, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dst


def _install(base: Path, editable: bool) -> dict:
    src = _copy_source(base / "src")
    env_dir = base / "venv"
    # No pip inside: the running pip installs into it with --python, which saves bootstrapping one.
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env_dir)
    py = env_dir / "bin" / "python"
    cmd = [sys.executable, "-m", "pip", "--python", str(py), "--disable-pip-version-check", "install",
           "--no-deps", "-q", *(["-e"] if editable else []), str(src)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=base, timeout=300)
    assert out.returncode == 0, f"{' '.join(cmd)}\n{out.stdout}\n{out.stderr}"
    purelib = subprocess.run([str(py), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    return {"src": src, "env": env_dir, "py": py, "site": Path(purelib), "cwd": base}


@pytest.fixture(scope="module")
def installs(tmp_path_factory):
    """Both installs, built side by side to halve the wait."""
    base = tmp_path_factory.mktemp("packaging")
    (base / "regular").mkdir()
    (base / "editable").mkdir()
    with ThreadPoolExecutor(2) as pool:
        regular = pool.submit(_install, base / "regular", False)
        editable = pool.submit(_install, base / "editable", True)
        return {"regular": regular.result(), "editable": editable.result()}


MODES = ["regular", "editable"]


@pytest.mark.parametrize("mode", MODES)
def test_subpackages_import_from_outside_the_checkout(installs, mode):
    inst = installs[mode]
    code = ("import gpuwatch.agent, gpuwatch.probes, gpuwatch.exporters, gpuwatch.detectors\n"
            "for m in (gpuwatch.agent, gpuwatch.probes, gpuwatch.exporters, gpuwatch.detectors):\n"
            "    print(m.__file__)\n")
    out = subprocess.run([str(inst["py"]), "-I", "-c", code], capture_output=True, text=True,
                         check=False, cwd=inst["cwd"])
    assert out.returncode == 0, out.stderr
    files = [Path(p) for p in out.stdout.split()]
    expected_root = inst["site"] / "gpuwatch" if mode == "regular" else inst["src"]
    for f in files:
        assert f.is_relative_to(expected_root), f"{f} not under {expected_root}"


@pytest.mark.parametrize("mode", MODES)
def test_no_bare_top_level_modules(installs, mode):
    inst = installs[mode]
    site = inst["site"]
    stray = sorted(p.name for p in site.iterdir() if p.name.removesuffix(".py") in BARE)
    assert not stray, f"bare top-level entries in site-packages: {stray}"
    for name in sorted(BARE):
        out = subprocess.run([str(inst["py"]), "-I", "-c", f"import {name}"], capture_output=True, text=True,
                             check=False, cwd=inst["cwd"])
        assert out.returncode != 0 and "ModuleNotFoundError" in out.stderr, f"`import {name}` must fail"


def _record(site: Path) -> list[str]:
    records = list(site.glob("gpuwatch-*.dist-info/RECORD"))
    assert len(records) == 1, records
    with records[0].open(newline="") as f:
        return [row[0] for row in csv.reader(f)]


def test_wheel_record_holds_only_gpuwatch(installs):
    site = installs["regular"]["site"]
    for path in _record(site):
        first = Path(path).parts[0]
        assert first == "gpuwatch" or first.startswith("gpuwatch-") or first == "..", path


def test_wheel_contains_every_source_file(installs):
    """A subpackage missing from pyproject's `packages`, or a data file (*.bpf.c) without
    package-data, would be silently left out of the wheel."""
    src = installs["regular"]["src"]
    recorded = set(_record(installs["regular"]["site"]))
    missing = sorted(
        f"{p.relative_to(src)}"
        for d in SOURCE_DIRS for p in (src / d).rglob("*")
        if p.is_file() and not p.name.startswith(".") and f"gpuwatch/{p.relative_to(src).as_posix()}" not in recorded
    )
    assert not missing, f"source files not in the wheel (fix [tool.setuptools] in pyproject.toml): {missing}"


@pytest.mark.parametrize("mode", MODES)
def test_console_script(installs, mode):
    inst = installs[mode]
    script = inst["env"] / "bin" / "gpuwatch"
    assert script.is_file(), "the gpuwatch console script was not installed"
    assert script.stat().st_mode & 0o111, "gpuwatch console script is not executable"
    text = script.read_text()
    assert text.startswith(f"#!{inst['py']}"), text.splitlines()[0]
    assert "from gpuwatch.agent.entry import main" in text  # status before click; the rest: click
