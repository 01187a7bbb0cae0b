"""`gpuwatch run -- CMD`: real processes, no GPU, no mocks.

The program must be unharmed (its argv, stdin, stdout, exit status and signals are its own; the
sitecustomize that would have run without us still runs), options are checked before anything
runs, and every Python process below `gpuwatch run` gets the in-process agent, which without a
GPU and without a daemon writes a report saying why CUPTI is unavailable.
"""
from __future__ import annotations

import glob
import json
import os
import pty
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuwatch.agent import run as run_mod

CONSOLE_SCRIPT = Path(sys.executable).with_name("gpuwatch")
BOOTSTRAP = run_mod.BOOTSTRAP_DIR

PROG = r'''
import os, signal, sys, time
what = sys.argv[1]
print("argv", sys.argv[1:])
print("stdin", repr(sys.stdin.read()))
sc = sys.modules.get("sitecustomize")
print("sitecustomize", getattr(sc, "__file__", None))
print("user sitecustomize ran:", os.environ.get("USER_SITECUSTOMIZE_RAN"))
sys.stdout.flush()
if what == "exit3":
    sys.exit(3)
if what == "raise":
    raise RuntimeError("boom from prog")
if what == "kill":
    os.kill(os.getpid(), signal.SIGTERM)
if what == "sleep":
    time.sleep(float(sys.argv[2]))
print("done")
'''

SHOW_ENV = ("import json, os; print(json.dumps({k: v for k, v in os.environ.items() "
            "if k.startswith('GPUWATCH_RUN') or k == 'PYTHONPATH'}))")


def gpuwatch_cmd() -> list[str]:
    if CONSOLE_SCRIPT.exists():
        return [str(CONSOLE_SCRIPT)]
    return [sys.executable, "-m", "gpuwatch.agent.cli"]


@pytest.fixture
def env(tmp_path):
    """A clean environment: no config file, a socket where nothing listens, reports under tmp_path."""
    e = {k: v for k, v in os.environ.items()
         if not k.startswith("GPUWATCH") and k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    e.update(GPUWATCH_CONFIG="", GPUWATCH_RUN_SOCKET=str(tmp_path / "nothing-listens.sock"),
             GPUWATCH_RUN_REPORT_DIR=str(tmp_path / "reports"))
    return e


@pytest.fixture
def prog(tmp_path):
    p = tmp_path / "prog.py"
    p.write_text(PROG)
    return str(p)


def run(args, env, *, input="", cwd=None, timeout=60):
    return subprocess.run([*gpuwatch_cmd(), "run", *args], env=env, input=input, capture_output=True,
                          text=True, cwd=cwd, timeout=timeout)


def direct(args, env, *, input="", cwd=None, timeout=60):
    return subprocess.run(args, env=env, input=input, capture_output=True, text=True, cwd=cwd, timeout=timeout)


def interpreters(pred) -> list[str]:
    """Python interpreters on this machine whose (major, minor) satisfies pred and that start."""
    names = [f"python{v}" for v in ("2.7", "3.6", "3.7", "3.8", "3.9", "3.10", "3.11", "3.12", "3.13")]
    found = [shutil.which(n) for n in (*names, "python3")] + ["/usr/bin/python3"]
    found += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/*/bin/python")))
    out, seen = [], set()
    for exe in filter(None, found):
        try:
            r = subprocess.run([exe, "-c", "import sys; print('%d %d' % sys.version_info[:2])"],
                               capture_output=True, text=True, timeout=20, env={"PATH": os.defpath})
        except (OSError, subprocess.TimeoutExpired):
            continue
        if r.returncode != 0 or not r.stdout.strip():
            continue
        ver = tuple(int(x) for x in r.stdout.split())
        if ver not in seen and pred(ver):
            seen.add(ver)
            out.append(exe)
    return out


# --- the program is unharmed ------------------------------------------------------------------

@pytest.mark.parametrize("what, code", [("ok", 0), ("exit3", 3), ("raise", 1)])
def test_argv_stdin_stdout_and_exit_status_are_the_programs_own(env, prog, what, code):
    args = [sys.executable, prog, what, "two words", "--interval", "-q", "--", "ünïcode"]
    alone = direct(args, env, input="line 1\nline 2\n")
    under = run(["--quiet", "--", *args], env, input="line 1\nline 2\n")
    assert alone.returncode == code, alone.stderr
    assert under.returncode == code, under.stderr
    assert under.stdout == alone.stdout
    assert under.stderr == alone.stderr  # --quiet: not even the agent's notes
    assert f"argv ['{what}', 'two words', '--interval', '-q', '--', 'ünïcode']" in under.stdout
    assert "stdin 'line 1\\nline 2\\n'" in under.stdout
    if what == "raise":
        assert "Traceback (most recent call last)" in under.stderr
        assert under.stderr.rstrip().endswith("RuntimeError: boom from prog")


def test_without_double_dash_the_command_starts_at_the_first_argument(env, prog):
    out = run([sys.executable, prog, "ok", "--kernels", "bogus"], env)
    assert out.returncode == 0, out.stderr
    assert "argv ['ok', '--kernels', 'bogus']" in out.stdout


def test_a_signal_kills_the_program_as_it_would_without_gpuwatch(env, prog):
    out = run(["--", sys.executable, prog, "kill"], env)
    assert out.returncode == -signal.SIGTERM, out.stderr
    # Through a shell: 128 + N, because the program replaced gpuwatch (exec), it is the shell's child.
    sh = subprocess.run(["sh", "-c", '"$@"; echo "status $?"', "sh", *gpuwatch_cmd(), "run", "--",
                         sys.executable, prog, "kill"], env=env, capture_output=True, text=True, timeout=60)
    assert sh.stdout.splitlines()[-1] == f"status {128 + signal.SIGTERM}", sh.stderr


def test_the_program_keeps_gpuwatch_s_pid(env):
    p = subprocess.Popen([*gpuwatch_cmd(), "run", "--", sys.executable, "-c", "import os; print(os.getpid())"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, _ = p.communicate(timeout=60)
    assert p.returncode == 0 and int(stdout) == p.pid


def test_ignored_signals_are_not_passed_on(env):
    # Python ignores SIGPIPE for itself; the program must get the dispositions a shell would give it.
    grep = ["grep", "^SigIgn", "/proc/self/status"]
    assert run(["--", *grep], env).stdout == direct(grep, env).stdout
    # With SIGPIPE ignored, yes(1) would complain "Broken pipe" instead of dying quietly.
    out = subprocess.run(["sh", "-c", '"$@" | head -1', "sh", *gpuwatch_cmd(), "run", "--", "yes"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout == "y\n" and out.stderr == "", out.stderr


def test_stdin_and_stdout_stay_the_terminal(env):
    controller, terminal = pty.openpty()
    try:
        p = subprocess.Popen([*gpuwatch_cmd(), "run", "--", sys.executable, "-c",
                              "import sys; print('tty', sys.stdin.isatty(), sys.stdout.isatty())"],
                             env=env, stdin=terminal, stdout=terminal, stderr=subprocess.DEVNULL)
        os.close(terminal)
        terminal = -1
        data = b""
        end = time.monotonic() + 60
        while time.monotonic() < end:
            if select.select([controller], [], [], 1)[0]:
                try:
                    chunk = os.read(controller, 1024)
                except OSError:  # EIO: the program exited, the terminal's last holder closed it
                    break
                if not chunk:
                    break
                data += chunk
        assert p.wait(60) == 0
        assert b"tty True True" in data, data
    finally:
        os.close(controller)
        if terminal >= 0:
            os.close(terminal)


def test_python_dash_m_with_the_user_s_pythonpath(env, tmp_path):
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "hello_mod.py").write_text(
        "import os, sys\nprint(__name__, sys.argv[1:])\nprint(os.environ['PYTHONPATH'])\n")
    env["PYTHONPATH"] = f"{mods}{os.pathsep}{tmp_path / 'also'}"
    out = run(["--", sys.executable, "-m", "hello_mod", "a", "-b"], env)
    assert out.returncode == 0, out.stderr
    first, pythonpath = out.stdout.splitlines()
    assert first == "__main__ ['a', '-b']"
    assert pythonpath.split(os.pathsep) == [BOOTSTRAP, str(mods), str(tmp_path / "also")]


def test_user_sitecustomize_still_runs(env, prog, tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE_RAN'] = 'yes'\n")
    env["PYTHONPATH"] = str(user)
    alone = direct([sys.executable, prog, "ok"], env)
    under = run(["--", sys.executable, prog, "ok"], env)
    assert under.returncode == 0, under.stderr
    assert under.stdout == alone.stdout
    assert "user sitecustomize ran: yes" in under.stdout
    assert f"sitecustomize {user / 'sitecustomize.py'}" in under.stdout


def test_a_broken_user_sitecustomize_is_reported_as_python_reports_it(env, prog, tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("raise RuntimeError('broken on purpose')\n")
    env["PYTHONPATH"] = str(user)
    alone = direct([sys.executable, prog, "ok"], env)
    under = run(["--quiet", "--", sys.executable, prog, "ok"], env)
    python_says = "Error in sitecustomize; set PYTHONVERBOSE for traceback:\nRuntimeError: broken on purpose\n"
    assert python_says in alone.stderr
    assert under.returncode == 0 and "done" in under.stdout
    assert python_says in under.stderr


def test_a_command_that_is_not_python_runs_unchanged(env):
    assert run(["--", "sh", "-c", "exit 7"], env).returncode == 7
    out = run(["--", "sh", "-c", 'echo "$0|$1|$2"', "zero", "one", "two words"], env)
    assert out.returncode == 0 and out.stdout == "zero|one|two words\n" and out.stderr == ""


# --- commands that cannot run, options that are wrong --------------------------------------------

def test_missing_command_is_127(env, tmp_path):
    out = run(["--", "gpuwatch-no-such-command", "x"], env)
    assert out.returncode == 127
    assert out.stderr == "gpuwatch run: gpuwatch-no-such-command: command not found\n"
    out = run(["--", str(tmp_path / "nope")], env)
    assert out.returncode == 127 and f"gpuwatch run: {tmp_path / 'nope'}: No such file or directory" in out.stderr


def test_not_executable_is_126(env, tmp_path):
    f = tmp_path / "data.txt"
    f.write_text("echo hi\n")
    f.chmod(0o644)
    out = run(["--", str(f)], env)  # no x bit: not even root may execute it
    assert out.returncode == 126 and f"gpuwatch run: {f}: Permission denied" in out.stderr
    out = run(["--", str(tmp_path)], env)
    assert out.returncode == 126 and f"gpuwatch run: {tmp_path}: Is a directory" in out.stderr


def test_a_script_without_a_shebang_runs_with_sh_as_a_shell_would(env, tmp_path):
    f = tmp_path / "plain.sh"
    f.write_text('echo "plain $1"\nexit 4\n')
    f.chmod(0o755)
    out = run(["--", str(f), "arg"], env)
    assert out.returncode == 4 and out.stdout == "plain arg\n"


@pytest.mark.parametrize("opts, says", [
    ([], "Missing argument"),
    (["--bogus"], "--bogus"),
    (["--interval", "0"], "--interval"),
    (["--interval", "nan"], "nan is not a number"),
    (["--interval", "soon"], "--interval"),
    (["--kernels", "sometimes"], "--kernels"),
    (["--duty-cycle", "0"], "--duty-cycle"),
    (["--duty-cycle", "1.5"], "--duty-cycle"),
    (["--duty-cycle", "0.5", "--kernels", "off"], "--duty-cycle applies to --kernels sampled"),
    (["--socket", ""], "--socket"),
    (["--report-dir", "IS_A_FILE"], "--report-dir"),
])
def test_bad_options_are_usage_errors_and_nothing_runs(env, tmp_path, opts, says):
    (tmp_path / "IS_A_FILE").write_text("")
    marker = tmp_path / "ran"
    cmd = ["--", "touch", str(marker)] if opts else []
    out = run([*(str(tmp_path / o) if o == "IS_A_FILE" else o for o in opts), *cmd], env)
    assert out.returncode == 2, out.stderr
    assert "Error:" in out.stderr and says in out.stderr, out.stderr
    assert not marker.exists()


def test_bad_environment_values_are_usage_errors_naming_the_variable(env):
    env["GPUWATCH_RUN_INTERVAL"] = "-1"
    out = run(["--", "true"], env)
    assert out.returncode == 2 and "GPUWATCH_RUN_INTERVAL" in out.stderr


def test_a_bad_config_file_is_an_error_naming_it(env, tmp_path):
    cfg = tmp_path / "gpuwatch.toml"
    cfg.write_text("[control]\nsocket = 3\n")
    env.pop("GPUWATCH_RUN_SOCKET")
    out = run(["--config", str(cfg), "--", "true"], env)
    assert out.returncode == 1 and f"{cfg}: control.socket" in out.stderr


# --- what the agent is given --------------------------------------------------------------------

def test_options_reach_the_agent_as_its_environment(env, tmp_path):
    reports = env.pop("GPUWATCH_RUN_REPORT_DIR")
    out = run(["--interval", "2.5", "--kernels", "CONTINUOUS", "--quiet", "--report-dir", "rel/reports",
               "--socket", "rel.sock", "--", sys.executable, "-c", SHOW_ENV], env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["GPUWATCH_RUN"] == "1"
    assert got["GPUWATCH_RUN_INTERVAL"] == "2.5" and got["GPUWATCH_RUN_KERNELS"] == "continuous"
    assert got["GPUWATCH_RUN_QUIET"] == "1"
    assert got["GPUWATCH_RUN_REPORT_DIR"] == str(tmp_path / "rel" / "reports")  # absolute: the job may chdir
    assert (tmp_path / "rel" / "reports").is_dir()
    assert got["GPUWATCH_RUN_SOCKET"] == str(tmp_path / "rel.sock")
    assert got["PYTHONPATH"] == BOOTSTRAP
    assert set(json.loads(got["GPUWATCH_RUN_PACKAGES"])) >= {"agent", "probes"}
    assert "GPUWATCH_RUN_DUTY_CYCLE" not in got  # not given: the agent's default applies
    env["GPUWATCH_RUN_REPORT_DIR"] = reports
    out = run(["--duty-cycle", "0.25", "--", sys.executable, "-c", SHOW_ENV], env)
    got = json.loads(out.stdout)
    assert got["GPUWATCH_RUN_DUTY_CYCLE"] == "0.25" and got["GPUWATCH_RUN_QUIET"] == "0"


def test_socket_defaults_to_the_config_s_control_socket(env, tmp_path):
    env.pop("GPUWATCH_RUN_SOCKET")
    cfg = tmp_path / "gpuwatch.toml"
    cfg.write_text(f'[agent]\nruntime_dir = "{tmp_path / "rt"}"\n')
    out = run(["--config", str(cfg), "--", sys.executable, "-c", SHOW_ENV], env)
    assert json.loads(out.stdout)["GPUWATCH_RUN_SOCKET"] == str(tmp_path / "rt" / "control.sock")
    cfg.write_text('[control]\nsocket = "/somewhere/else.sock"\n')
    out = run(["--config", str(cfg), "--", sys.executable, "-c", SHOW_ENV], env)
    assert json.loads(out.stdout)["GPUWATCH_RUN_SOCKET"] == "/somewhere/else.sock"
    env["GPUWATCH_SOCKET"] = "/from/status/env.sock"  # the variable `gpuwatch status` and `trace` use
    out = run(["--config", str(cfg), "--", sys.executable, "-c", SHOW_ENV], env)
    assert json.loads(out.stdout)["GPUWATCH_RUN_SOCKET"] == "/from/status/env.sock"


def test_gpuwatch_run_inside_a_job_does_not_stack_bootstraps(env, tmp_path):
    if not CONSOLE_SCRIPT.exists():
        pytest.skip("needs the gpuwatch console script")
    env["PYTHONPATH"] = str(tmp_path / "user")
    env["PATH"] = f"{CONSOLE_SCRIPT.parent}{os.pathsep}{env['PATH']}"
    out = run(["--", "gpuwatch", "run", "--interval", "3", "--", sys.executable, "-c", SHOW_ENV], env)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["PYTHONPATH"].split(os.pathsep) == [BOOTSTRAP, str(tmp_path / "user")]
    assert got["GPUWATCH_RUN_INTERVAL"] == "3"


# --- the bootstrap, on its own ------------------------------------------------------------------

def test_bootstrap_on_pythonpath_outside_gpuwatch_run_only_chains(env, prog):
    alone = direct([sys.executable, prog, "ok"], env)
    env["PYTHONPATH"] = BOOTSTRAP  # e.g. an environment copied out of a job, without GPUWATCH_RUN
    code = "import sys; print(sorted(m for m in sys.modules if m.startswith('gpuwatch')))"
    out = direct([sys.executable, "-c", code], env)
    assert out.returncode == 0 and out.stdout == "[]\n" and out.stderr == ""
    assert direct([sys.executable, prog, "ok"], env).stdout == alone.stdout


def test_a_failing_agent_is_one_note_and_the_program_goes_on(env, prog):
    env.update(PYTHONPATH=BOOTSTRAP, GPUWATCH_RUN="1", GPUWATCH_RUN_PACKAGES="{not json")
    out = direct([sys.executable, prog, "ok"], env)
    assert out.returncode == 0 and out.stdout.endswith("done\n")
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpuwatch: in-process agent not started: JSONDecodeError")
    env["GPUWATCH_RUN_QUIET"] = "1"
    out = direct([sys.executable, prog, "ok"], env)
    assert out.returncode == 0 and out.stderr == ""


def test_bootstrap_parses_on_old_pythons():
    import ast

    source = Path(BOOTSTRAP, "sitecustomize.py").read_text()
    ast.parse(source, feature_version=(3, 4))  # the oldest grammar ast can check; 2.7 is run below


def test_old_python_runs_without_the_agent_and_says_so(env, prog):
    old = interpreters(lambda v: v < (3, 10))
    if not old:
        pytest.skip("no Python older than 3.10 on this machine")
    for exe in old:
        out = run(["--", exe, "-c", "import sys; sys.stdout.write('hello from %d\\n' % sys.version_info[0])"], env)
        assert out.returncode == 0, (exe, out.stderr)
        assert out.stdout.startswith("hello from"), (exe, out.stderr)
        notes = [line for line in out.stderr.splitlines() if line.startswith("gpuwatch:")]
        assert len(notes) == 1 and "needs Python 3.10 or newer" in notes[0], (exe, out.stderr)
        assert "sitecustomize" not in out.stderr.replace(notes[0], ""), (exe, out.stderr)
        out = run(["--quiet", "--", exe, "-c", "print('quiet')"], env)
        assert out.returncode == 0 and out.stdout == "quiet\n" and "gpuwatch:" not in out.stderr, (exe, out.stderr)


# --- the in-process agent's report --------------------------------------------------------------

def _report(report_dir: Path, pid: int) -> dict:
    path = report_dir / f"gpuwatch-run-{pid}.json"
    assert path.is_file(), f"no {path.name} in {sorted(p.name for p in report_dir.glob('*'))}"
    return json.loads(path.read_text())


def test_without_gpu_or_daemon_the_agent_reports_unavailable_to_a_file(env, prog, tmp_path):
    reports = tmp_path / "my-reports"
    args = [sys.executable, prog, "sleep", "1.5"]
    alone = direct(args, env)
    p = subprocess.Popen([*gpuwatch_cmd(), "run", "--report-dir", str(reports), "--socket",
                          str(tmp_path / "nothing-listens.sock"), "--", *args],
                         env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == 0, stderr
    assert stdout == alone.stdout  # the program is unharmed
    rep = _report(reports, p.pid)
    assert rep["version"] == 1 and rep["pid"] == p.pid and rep["process"]
    assert rep["cupti"]["state"] == "unavailable" and rep["cupti"]["reason"].strip()
    assert isinstance(rep["kernels"], list) and isinstance(rep["memory"], list)
    assert all(line.startswith("gpuwatch: ") for line in stderr.splitlines()), stderr


def test_every_python_below_gpuwatch_run_gets_its_own_agent(env, tmp_path):
    # A launcher starting a worker, as torchrun does: the worker inherits the environment.
    launcher = ("import subprocess, sys\n"
                "w = subprocess.run([sys.executable, '-c', 'import os, time; print(os.getpid()); time.sleep(1.2)'],\n"
                "                   stdout=subprocess.PIPE, text=True)\n"
                "print(w.stdout.strip())\n")
    reports = Path(env["GPUWATCH_RUN_REPORT_DIR"])
    p = subprocess.Popen([*gpuwatch_cmd(), "run", "--quiet", "--", sys.executable, "-c", launcher], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == 0 and stderr == "", stderr
    worker = int(stdout)
    assert worker != p.pid
    for pid in (p.pid, worker):
        rep = _report(reports, pid)
        assert rep["pid"] == pid and rep["cupti"]["state"] == "unavailable"


def test_a_python_without_gpuwatch_installed_gets_the_agent(env, tmp_path):
    bare = [exe for exe in interpreters(lambda v: v >= (3, 10))
            if subprocess.run([exe, "-c", "import gpuwatch.agent"], capture_output=True, env=env,
                              timeout=20).returncode != 0]
    if not bare:
        pytest.skip("no Python >= 3.10 without gpuwatch on this machine")
    code = ("import os, sys, time; m = sys.modules.get('gpuwatch.probes.cupti.inprocess'); "
            "print(m.__file__ if m else None); print(os.getpid()); time.sleep(1.2)")
    probes = run_mod.package_dirs()["probes"]
    jobs = {exe: subprocess.Popen([*gpuwatch_cmd(), "run", "--quiet", "--", exe, "-c", code], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for exe in bare}
    for exe, p in jobs.items():
        stdout, stderr = p.communicate(timeout=60)
        assert p.returncode == 0 and stderr == "", (exe, stderr)
        where, pid = stdout.split()
        assert where == os.path.join(probes, "cupti", "inprocess.py"), (exe, stdout)
        assert _report(Path(env["GPUWATCH_RUN_REPORT_DIR"]), int(pid))["cupti"]["state"] == "unavailable"
