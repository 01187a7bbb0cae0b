"""One exception base for what a person may see (GpuwatchError), caught once by the CLI: every
command prints it as `Error: TEXT` with exit status 1, a bad configuration as
`Error: bad configuration: TEXT`, and anything else keeps its traceback (a bug)."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from gpuwatch.agent import cli
from gpuwatch.agent.api import GpuwatchError, ProbeUnavailable
from gpuwatch.agent.config import ConfigError
from gpuwatch.agent.control import ControlError
from gpuwatch.agent.daemon import DaemonError
from gpuwatch.agent.run import RunError
from gpuwatch.agent.store import StoreError
from gpuwatch.agent.trace.errors import TraceError
from gpuwatch.probes.cupti.occupancy import UnsupportedDevice
from gpuwatch.probes.nvml.backend import LibraryUnavailable, NvmlError


@pytest.mark.parametrize("error", [ProbeUnavailable, ConfigError, ControlError, DaemonError, RunError, StoreError,
                                   TraceError, NvmlError, LibraryUnavailable, UnsupportedDevice])
def test_every_error_root_a_person_may_see_is_a_gpuwatch_error(error):
    assert issubclass(error, GpuwatchError)


def test_unsupported_device_is_still_a_value_error():  # callers catch it as one
    assert issubclass(UnsupportedDevice, ValueError)


def _invoke(*args: str):
    return CliRunner().invoke(cli.main, list(args), catch_exceptions=False)


def test_a_refusal_of_the_agent_is_one_line_and_exit_1(tmp_path):
    r = _invoke("status", "--socket", str(tmp_path / "none.sock"))
    assert r.exit_code == 1
    assert r.output == (f"Error: no gpuwatch agent is listening on {tmp_path}/none.sock (is `gpuwatch agent` / "
                        f"the gpuwatch service running?)\n")


def test_a_bad_configuration_says_so(tmp_path):
    bad = tmp_path / "gpuwatch.toml"
    bad.write_text("[nvml]\ninterval = -1\n")
    for args in (["status"], ["baseline", "show"], ["doctor"]):  # subgroups go through the same catch
        r = _invoke(*args, "--config", str(bad))
        assert r.exit_code == 1, (args, r.output)
        assert r.output.startswith(f"Error: bad configuration: {bad}: nvml.interval: "), (args, r.output)


def test_a_gpuwatch_error_from_a_command_is_printed_once(tmp_path, monkeypatch):
    from gpuwatch.agent import run as run_mod

    r = _invoke("trace", "--pid", "0")
    assert (r.exit_code, r.output) == (1, "Error: PID must be a positive integer (got 0)\n")
    monkeypatch.setattr(run_mod, "BOOTSTRAP_FILE", str(tmp_path / "sitecustomize.py"))  # a broken installation
    r = _invoke("run", "--socket", "/x.sock", "--", "true")
    assert (r.exit_code, r.output) == (1, f"Error: the gpuwatch installation is incomplete: {tmp_path}/"
                                          f"sitecustomize.py is missing (reinstall gpuwatch)\n")


def test_anything_else_is_a_bug_and_not_hidden(monkeypatch):
    from gpuwatch.agent import run as run_mod

    def broken(*a, **k):
        raise KeyError("a bug")

    monkeypatch.setattr(run_mod, "build_env", broken)
    with pytest.raises(KeyError):
        _invoke("run", "--socket", "/x.sock", "--", "true")
