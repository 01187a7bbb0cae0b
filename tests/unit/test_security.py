"""Security properties that are easy to lose in a refactoring: no shell-outs, loopback by default,
no command lines or environment in labels."""
from __future__ import annotations

import ast
import ipaddress
import socket
from pathlib import Path

import pytest

from gpuwatch.agent import config
from gpuwatch.agent import metrics as registry
from gpuwatch.exporters.prometheus import PrometheusExporter

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("agent", "probes", "detectors", "exporters")


def _python_files():
    for d in PACKAGE_DIRS:
        yield from sorted((ROOT / d).rglob("*.py"))


def shell_outs(source: str) -> list[str]:
    """Calls that hand a string to a shell: subprocess.*(shell=True), os.system, os.popen, and the
    like. (`subprocess.run([...])` with a list runs no shell and is fine.)"""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = (f"{f.value.id}.{f.attr}" if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                else f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else "")
        if name in ("os.system", "os.popen", "system", "popen", "commands.getoutput", "commands.getstatusoutput",
                    "subprocess.getoutput", "subprocess.getstatusoutput", "getoutput", "getstatusoutput",
                    "pty.spawn"):  # os.exec*p take an argument list: no shell
            found.append(f"line {node.lineno}: {name}()")
        for kw in node.keywords:
            if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                found.append(f"line {node.lineno}: {name}(shell=...)")
    return found


def test_the_scanner_finds_shell_outs():
    assert shell_outs("import os\nos.system('ls ' + x)\n") == ["line 2: os.system()"]
    assert shell_outs("import subprocess\nsubprocess.run(cmd, shell=True)\n") == ["line 2: subprocess.run(shell=...)"]
    assert shell_outs("from os import popen\npopen('x')\n") == ["line 2: popen()"]
    assert shell_outs("import subprocess\nsubprocess.run(['ls', x], shell=False)\n") == []


def test_no_shell_outs_in_the_package():
    files = list(_python_files())
    assert len(files) > 30
    problems = [f"{p.relative_to(ROOT)} {hit}" for p in files for hit in shell_outs(p.read_text())]
    assert problems == [], "shell-outs (use an argument list, no shell):\n" + "\n".join(problems)


def test_metrics_listen_on_loopback_by_default():
    listen = config.BY_NAME["prometheus.listen"].default
    host, port = config.parse_listen(listen)
    assert ipaddress.ip_address(host).is_loopback and port == config.DEFAULT_PROMETHEUS_PORT
    sample = (ROOT / "systemd" / "gpuwatch.toml").read_text()
    assert f'#listen = "{listen}"' in sample
    # And the socket the exporter opens with it is bound to loopback only.
    exp = PrometheusExporter(f"{host}:0")
    exp.start()
    try:
        bound = exp._server.socket.getsockname()[0]
        assert ipaddress.ip_address(bound).is_loopback, bound
        other = [a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
                 if not ipaddress.ip_address(a[4][0]).is_loopback]
        for addr in other[:1]:  # a non-loopback address of this host, if it has one
            with pytest.raises(OSError):
                socket.create_connection((addr, exp.port), timeout=2).close()
    finally:
        exp.shutdown()


FORBIDDEN = ("cmdline", "cmd", "command", "argv", "args", "env", "environ", "environment", "exe", "cwd", "user",
             "username", "token", "password", "secret", "path")


@pytest.mark.parametrize("m", registry.METRICS, ids=lambda m: m.name)
def test_no_command_lines_environment_or_secrets_in_labels(m):
    for label in m.labels:
        parts = set(label.split("_"))
        assert not parts & set(FORBIDDEN), f"{m.name}: label {label!r} could carry a command line, environment or secret"
