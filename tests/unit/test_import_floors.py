"""gpuwatch's imports go one way (docs/ARCHITECTURE.md): the core below everything imports only the
core; probes the core and probes; exporters the core, probes and exporters; detectors only the core;
the application (the rest of agent/) anything. Every import counts, inside functions too; those
under `if TYPE_CHECKING:` do not (they are never run)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"agent": "gpuwatch.agent", "probes": "gpuwatch.probes", "exporters": "gpuwatch.exporters",
            "detectors": "gpuwatch.detectors"}

# The core: what every part may import. Each imports only the core.
CORE = {
    "gpuwatch.agent",  # __version__, package_dirs()
    "gpuwatch.agent.api", "gpuwatch.agent.history", "gpuwatch.agent.snapshot", "gpuwatch.agent.metrics",
    "gpuwatch.agent.wire", "gpuwatch.agent.config", "gpuwatch.agent.safefile", "gpuwatch.agent.registry",
    "gpuwatch.agent.budget", "gpuwatch.agent.logs", "gpuwatch.agent.own", "gpuwatch.agent.allocators",
    "gpuwatch.agent.kernel_headers", "gpuwatch.agent.events",
    "gpuwatch.agent.control", "gpuwatch.agent.control_client",  # the control socket's two ends: the in-process agent (probes/cupti) is a client
    "gpuwatch.probes", "gpuwatch.detectors", "gpuwatch.exporters",  # the packages themselves
    # who a process is: its identity, pod, CUDA devices, what its user may open
    "gpuwatch.probes.process.identity", "gpuwatch.probes.process.kubernetes",
    "gpuwatch.probes.process.cuda_devices", "gpuwatch.probes.process.access",
    "gpuwatch.probes.baseline.verdict",  # the reference workload's verdicts: judged by the probe, read by detectors
}

def modules() -> dict[str, Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts))
            out[name.removesuffix(".__init__")] = path
    return out


ALL = modules()


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports(name: str, top_level_only: bool = False) -> set[str]:
    """The gpuwatch modules `name` imports ("from P import N" is P.N where that is a module)."""
    found: set[str] = set()
    is_package = ALL[name].name == "__init__.py"

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for sub in child.orelse:
                    visit(ast.Module(body=[sub], type_ignores=[]), top)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name.startswith("gpuwatch"))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from the package (or the module's own package)
                    pkg = name if is_package else name.rsplit(".", 1)[0]
                    pkg = ".".join(pkg.split(".")[:len(pkg.split(".")) - child.level + 1])
                    base = f"{pkg}.{base}" if base else pkg
                if base.startswith("gpuwatch"):
                    for a in child.names:
                        found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in ALL else base)
            if top and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            visit(child, top)

    visit(ast.parse(ALL[name].read_text()), top_level_only)
    return found


def floor(name: str) -> str:
    if name in CORE:
        return "core"
    return {"probes": "probe", "exporters": "exporter", "detectors": "detector"}.get(name.split(".")[1], "application")


MAY_IMPORT = {"core": {"core"}, "probe": {"core", "probe"}, "exporter": {"core", "probe", "exporter"},
              "detector": {"core"}, "application": {"core", "probe", "exporter", "detector", "application"}}


def test_every_import_goes_down_or_sideways_on_its_floor():
    wrong = sorted((name, target, floor(name), floor(target)) for name in ALL for target in imports(name)
                   if target in ALL and floor(target) not in MAY_IMPORT[floor(name)])
    assert wrong == [], "\n".join(f"{n} ({f}) imports {t} ({g})" for n, t, f, g in wrong)


def test_importing_the_core_runs_only_the_core():
    """A core module's packages run their __init__ first: those import only the core at import time."""
    wrong = []
    for name in CORE:
        parts = name.split(".")
        for i in range(2, len(parts)):
            package = ".".join(parts[:i])
            wrong += [(package, t) for t in imports(package, top_level_only=True) if t in ALL and t not in CORE]
    assert sorted(set(wrong)) == []


def test_the_floors_know_every_module():
    assert set(CORE) <= set(ALL)
    assert {floor(n) for n in ALL} == set(MAY_IMPORT)
