"""gpuwatch agent: daemon core, configuration, store, control socket and CLI."""
import os

__version__ = "0.1.0"
SUBPACKAGES = ("agent", "probes", "exporters", "detectors")


def package_dirs() -> dict[str, str]:
    """{"agent": "/…/agent", ...}: where this gpuwatch's subpackages are, however it is installed."""
    import importlib.util  # not at import: `gpuwatch status` needs none of this

    dirs = {}
    for sub in SUBPACKAGES:
        try:
            spec = importlib.util.find_spec(f"gpuwatch.{sub}")
        except ImportError:
            spec = None
        if spec is not None and spec.submodule_search_locations:
            dirs[sub] = os.path.abspath(list(spec.submodule_search_locations)[0])
    return dirs
