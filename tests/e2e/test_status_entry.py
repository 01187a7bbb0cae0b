"""`gpuwatch status` as the console script answers it (agent/entry.py): before click and rich are
imported, with what click's `status` says, byte for byte where nothing moved between the two calls:
its options, environment variables, output and errors. Anything else goes to click. Real agents,
real sockets, the installed console script where there is one."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import FIXTURE, wait_for

CONSOLE_SCRIPT = Path(sys.executable).with_name("gpuwatch")
ENTRY = [str(CONSOLE_SCRIPT)] if CONSOLE_SCRIPT.exists() else [sys.executable, "-m", "gpuwatch.agent.entry"]
CLICK = [sys.executable, "-m", "gpuwatch.agent.cli"]


def run(cmd, *args, env=None, **kw):
    e = {k: v for k, v in os.environ.items() if k not in ("GPUWATCH_SOCKET", "GPUWATCH_CONFIG", "NO_COLOR")}
    e.update(env or {})
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=30, env=e, **kw)


def imported(*args, env=None) -> tuple[subprocess.CompletedProcess, set[str]]:
    """The console script's run, and the top-level packages it imported (-X importtime)."""
    r = run(ENTRY, *args, env={**(env or {}), "PYTHONPROFILEIMPORTTIME": "1"})
    names = {m.group(1).split(".")[0] for m in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)", r.stderr, re.M)}
    assert names, r.stderr[-500:]
    r.stderr = "".join(x for x in r.stderr.splitlines(keepends=True) if not x.startswith("import time:"))
    return r, names


def settled(agent) -> dict:
    """The agent's status once no probe is starting (a state that moves between two calls)."""
    def ready():
        r = run(CLICK, "status", "--json", "--socket", str(agent.socket))
        st = json.loads(r.stdout) if r.returncode == 0 else {}
        return st if st.get("probes") and all(p["state"] != "starting" for p in st["probes"].values()) else None

    st = wait_for(ready, 30, 0.2)
    assert st, agent.output()
    return st


def shape(text: str) -> str:
    """The output with its numbers masked and its column padding collapsed: uptime, durations and
    ages move between two calls, the words and rows do not."""
    return re.sub(r"[ \t]+", " ", re.sub(r"\d+(\.\d+)?", "#", text))


def test_status_skips_click_and_rich_and_prints_what_clicks_status_prints(agent_factory):
    agent = agent_factory("--nvml-replay", str(FIXTURE), "--no-ebpf")
    settled(agent)
    for attempt in range(3):  # a tick between the two calls may add an event: then once more
        fast, names = imported("status", "--socket", str(agent.socket))
        slow = run(CLICK, "status", "--socket", str(agent.socket))
        assert fast.returncode == slow.returncode == 0, (fast.stderr, slow.stderr)
        if shape(fast.stdout) == shape(slow.stdout):
            break
    assert shape(fast.stdout) == shape(slow.stdout), (fast.stdout, slow.stdout)
    assert not names & {"click", "rich", "psutil", "prometheus_client"}, sorted(names)
    assert "NVIDIA H200" in fast.stdout and re.search(r"^nvml +up ", fast.stdout, re.M), fast.stdout
    assert fast.stderr == ""

    fast, names = imported("status", "--json", "--socket", str(agent.socket))
    slow = run(CLICK, "status", "--json", "--socket", str(agent.socket))
    a, b = json.loads(fast.stdout), json.loads(slow.stdout)
    assert a["pid"] == b["pid"] == agent.proc.pid and a.keys() == b.keys()
    assert {k: p["state"] for k, p in a["probes"].items()} == {k: p["state"] for k, p in b["probes"].items()}
    assert not names & {"click", "rich"}, sorted(names)


def test_every_form_of_its_options_and_their_environment_variables(agent_factory, tmp_path):
    agent = agent_factory("--nvml-replay", str(FIXTURE), "--no-ebpf")
    pid = settled(agent)["pid"]
    sock = str(agent.socket)
    cfg = tmp_path / "gpuwatch.toml"
    cfg.write_text(f'[control]\nsocket = "{sock}"\n')
    forms = [
        (("status", "--json", f"--socket={sock}"), {}),
        (("status", "--socket", sock, "--json"), {}),
        (("status", "--json"), {"GPUWATCH_SOCKET": sock}),
        (("status", "--json", "--config", str(cfg)), {}),
        (("status", f"--config={cfg}", "--json"), {}),
        (("status", "--json"), {"GPUWATCH_CONFIG": str(cfg)}),
        (("status", "--json", "--config", str(cfg)), {"GPUWATCH_SOCKET": ""}),  # empty: unset, as click reads it
        (("status", "--json", "--socket", sock), {"GPUWATCH_SOCKET": "/nowhere.sock"}),  # the flag wins
    ]
    for args, env in forms:
        r, names = imported(*args, env=env)
        assert r.returncode == 0, (args, env, r.stderr)
        assert json.loads(r.stdout)["pid"] == pid, (args, env)
        assert "click" not in names, (args, env)


def test_anything_else_goes_to_click(agent_factory):
    agent = agent_factory("--nvml-replay", str(FIXTURE), "--no-ebpf")
    settled(agent)
    sock = str(agent.socket)
    r, names = imported("status", "--help")
    assert r.returncode == 0 and "Usage: gpuwatch status" in r.stdout and "click" in names
    r, names = imported("status", "--bogus", "--socket", sock)
    assert r.returncode == 2 and "No such option '--bogus'" in r.stderr and "click" in names
    r, names = imported("status", "--socket")
    assert r.returncode == 2 and "'--socket' requires an argument" in r.stderr and "click" in names
    r, names = imported("status", "--json", "--json", "--socket", sock)  # twice: click's to judge
    assert r.returncode == 0 and json.loads(r.stdout)["pid"] == agent.proc.pid and "click" in names
    r, names = imported("--version")
    assert r.returncode == 0 and "gpuwatch" in r.stdout and "click" in names


def test_its_errors_are_clicks_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[nvml]\ninterval = -1\n")
    missing = tmp_path / "missing.toml"
    cases = [("status", "--socket", str(tmp_path / "none.sock")),
             ("status", "--json", "--config", str(bad)),
             ("status", "--config", str(missing))]
    for args in cases:
        fast, names = imported(*args)
        slow = run(CLICK, *args)
        assert fast.returncode == slow.returncode == 1, (args, fast.stderr, slow.stderr)
        assert fast.stderr == slow.stderr and fast.stderr.startswith("Error: "), (args, fast.stderr, slow.stderr)
        assert fast.stdout == "" and "click" not in names, args
    assert "bad configuration:" in run(ENTRY, *cases[1]).stderr


def test_a_reader_that_has_gone_is_no_error(agent_factory):
    """`gpuwatch status | head -0`: the pipe is closed before the status is written (EPIPE)."""
    agent = agent_factory("--nvml-replay", str(FIXTURE), "--no-ebpf")
    settled(agent)
    rd, wr = os.pipe()
    os.close(rd)
    try:
        r = subprocess.run([*ENTRY, "status", "--socket", str(agent.socket)], stdout=wr, stderr=subprocess.PIPE,
                           text=True, timeout=30)
    finally:
        os.close(wr)
    assert (r.returncode, r.stderr) == (0, "")


def test_its_environment_variables_are_clicks():
    """entry.py names the variables without importing config or click (that is its point): they
    must stay the ones click's `status` reads."""
    from gpuwatch.agent import cli, config, entry

    envvars = {p.opts[0]: p.envvar for p in cli.status.params if p.envvar}
    assert entry._VALUE_OPTIONS == envvars == {"--socket": "GPUWATCH_SOCKET", "--config": config.CONFIG_ENV}
