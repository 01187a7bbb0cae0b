"""`gpuwatch run -- CMD [ARGS]...`: run CMD with the in-process CUPTI agent loaded into its Pythons.

gpuwatch sets the agent's GPUWATCH_RUN_* variables, puts its bootstrap directory first on
PYTHONPATH and exec()s CMD: CMD keeps gpuwatch's pid, and its exit status, signals, stdin, stdout
and terminal are its own. Every Python process CMD starts (CMD itself, torchrun's workers,
multiprocessing children) inherits the environment and so imports the bootstrap's
`sitecustomize`, which runs the sitecustomize that would have run without us and then calls
`gpuwatch.probes.cupti.inprocess.start_from_environment()`. A CMD that is not Python, and starts
no Python, runs unchanged.

Where the bootstrap lives: it is package data (probes/cupti/bootstrap/sitecustomize.py), used in
place from the installed package, and the `gpuwatch` package is found by a small import finder
in that sitecustomize from the directories named in GPUWATCH_RUN_PACKAGES, not through a
directory of symlinks. So nothing is written per run: no temporary directory to leak or clean up,
no shared /tmp path a symlink could be planted at, and the same works for root, ordinary users and
a read-only home. The only requirement is that the job can read the gpuwatch installation.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import sys
from typing import Mapping, NoReturn, Sequence

import gpuwatch.probes.cupti as _cupti_pkg
from gpuwatch.agent import package_dirs
from gpuwatch.agent.api import GpuwatchError
from gpuwatch.probes.cupti import MIN_CUPTI, cupti_lib_dir, version_tuple

KERNEL_MODES = ("sampled", "continuous", "off")
BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(_cupti_pkg.__file__)), "bootstrap")
BOOTSTRAP_FILE = os.path.join(BOOTSTRAP_DIR, "sitecustomize.py")

# The environment contract with gpuwatch.probes.cupti.inprocess and the bootstrap.
ENV_MARK = "GPUWATCH_RUN"  # set in every process below `gpuwatch run`
ENV_PACKAGES = "GPUWATCH_RUN_PACKAGES"  # JSON {"agent": DIR, "probes": DIR, ...} for the bootstrap
ENV_SOCKET = "GPUWATCH_RUN_SOCKET"
ENV_REPORT_DIR = "GPUWATCH_RUN_REPORT_DIR"
ENV_INTERVAL = "GPUWATCH_RUN_INTERVAL"
ENV_KERNELS = "GPUWATCH_RUN_KERNELS"
ENV_DUTY_CYCLE = "GPUWATCH_RUN_DUTY_CYCLE"
ENV_QUIET = "GPUWATCH_RUN_QUIET"


class RunError(GpuwatchError):
    """gpuwatch itself cannot prepare the run (broken installation)."""


def _fmt_number(v: float) -> str:
    return repr(float(v)) if v != int(v) else str(int(v))


def build_env(environ: Mapping[str, str], *, socket: str, report_dir: str | None = None,
              interval: float | None = None, kernels: str | None = None,
              duty_cycle: float | None = None, quiet: bool = False) -> dict[str, str]:
    """The environment CMD runs with: `environ` plus the agent's variables and the bootstrap path.

    Settings left None are not set, so the in-process agent's own defaults apply (any value
    inherited from `environ` was already read by the CLI as the option's mirror, and is kept).
    """
    if not os.path.isfile(BOOTSTRAP_FILE):
        raise RunError(f"the gpuwatch installation is incomplete: {BOOTSTRAP_FILE} is missing "
                       "(reinstall gpuwatch)")
    dirs = package_dirs()
    if "agent" not in dirs or "probes" not in dirs:
        raise RunError(f"cannot locate the gpuwatch packages (found {sorted(dirs)}); reinstall gpuwatch")
    env = dict(environ)
    env[ENV_MARK] = "1"
    env[ENV_PACKAGES] = json.dumps(dirs, sort_keys=True)
    env[ENV_SOCKET] = socket
    for name, value in ((ENV_REPORT_DIR, report_dir), (ENV_INTERVAL, interval), (ENV_KERNELS, kernels),
                        (ENV_DUTY_CYCLE, duty_cycle)):
        if value is not None:
            env[name] = value if isinstance(value, str) else _fmt_number(value)
    env[ENV_QUIET] = "1" if quiet else "0"
    # Ours first, the user's entries after it in their order; ours only once (a `gpuwatch run`
    # inside a job). An empty PYTHONPATH stays empty: a trailing ':' would add the working directory.
    user = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p != BOOTSTRAP_DIR] \
        if env.get("PYTHONPATH") else []
    env["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR, *user])
    # PyTorch links its profiler against libcupti: the one the dynamic linker finds first is the
    # one the process gets, and the agent needs ≥ 13.4 (older ones decode ~80x slower). When
    # gpuwatch's own environment has nvidia-cuda-cupti ≥ 13.4, its library goes first.
    found = cupti_lib_dir()  # (version, lib directory) of the newest nvidia-cuda-cupti here
    if found and version_tuple(found[0])[:2] >= MIN_CUPTI:
        paths = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p and p != found[1]]
        env["LD_LIBRARY_PATH"] = os.pathsep.join([found[1], *paths])
    return env


def _restore_signals() -> None:
    # Python ignores SIGPIPE and SIGXFSZ for itself; ignored signals stay ignored across exec, so
    # CMD would not die of a closed pipe (`gpuwatch run -- yes | head`). subprocess does the same.
    for name in ("SIGPIPE", "SIGXFSZ"):
        sig = getattr(signal, name, None)
        if sig is not None:
            signal.signal(sig, signal.SIG_DFL)


def _fail(command: str, reason: str, code: int) -> NoReturn:
    sys.stderr.write(f"gpuwatch run: {command}: {reason}\n")
    sys.exit(code)


def exec_command(argv: Sequence[str], env: Mapping[str, str]) -> NoReturn:
    """Replace this process by argv[0] (looked up on env's PATH), as a shell would.

    Not found: 127; found but not executable: 126, each with one line on stderr. A file without
    a #! line that the kernel refuses (ENOEXEC) is run by /bin/sh, as execvp(3) and shells do.
    """
    argv = list(argv)
    cmd = argv[0]
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            f.flush()
    _restore_signals()
    try:
        os.execvpe(cmd, argv, env)
    except OSError as e:
        err = e
    if err.errno in (errno.ENOENT, errno.ENOTDIR) or not cmd:
        _fail(cmd, "command not found" if "/" not in cmd else "No such file or directory", 127)
    if err.errno == errno.ENOEXEC:
        path = cmd if "/" in cmd else shutil.which(cmd, path=env.get("PATH", os.defpath))
        if path:
            try:
                os.execve("/bin/sh", ["/bin/sh", path, *argv[1:]], env)
            except OSError as e2:
                err = e2
    if os.path.isdir(cmd) and "/" in cmd:
        _fail(cmd, "Is a directory", 126)
    _fail(cmd, err.strerror or str(err), 126)
