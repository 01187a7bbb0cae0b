"""What the CLI's client commands share, without click: the running agent's socket from the
configuration, one call to it, and `gpuwatch status` itself (which agent/entry.py answers before
click is imported; agent/cli.py's `status` is the same function)."""
from __future__ import annotations

import json
import os
import sys
from typing import Any


def client_config(config_path: str | None):
    """The configuration a client command reads: the file, and the agent's directories from the
    same GPUWATCH_RUNTIME_DIR / GPUWATCH_STATE_DIR an agent started in this environment took, so
    that the CLI finds that agent's socket."""
    from gpuwatch.agent import config as config_mod  # not for `status --socket PATH`

    env = {"agent.runtime_dir": "GPUWATCH_RUNTIME_DIR", "agent.state_dir": "GPUWATCH_STATE_DIR"}
    return config_mod.load(config_path, {k: os.environ.get(v) or None for k, v in env.items()})


def ask(config_path: str | None, socket_path: str | None, method: str, params: dict, timeout: float = 5.0,
        result_type=None) -> Any:
    """Call the running agent; its refusals are ControlErrors (GpuwatchErrors: the CLI prints them)."""
    from gpuwatch.agent.control_client import call

    return call(socket_path or client_config(config_path).control.socket, method, params, timeout=timeout,
                result_type=result_type, explain=True)


def dumps(obj: Any) -> str:
    """JSON for scripts, as every `--json` prints it."""
    return json.dumps(obj, indent=2, sort_keys=True, default=str)


def status(config_path: str | None, socket_path: str | None, as_json: bool) -> None:
    """`gpuwatch status`: ask the running agent how it is doing, print it."""
    from gpuwatch.agent.wire import StatusResult

    st = ask(config_path, socket_path, "status", {}, result_type=StatusResult).to_json()
    if as_json:
        text = dumps(st)
    else:
        from gpuwatch.agent import textview

        text = "\n".join(textview.status_lines(st, textview.use_color(sys.stdout)))
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
