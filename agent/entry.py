"""The `gpuwatch` console script.

`gpuwatch status` is what scripts, health checks and people run most often, and all it does is
one call to the agent: it is answered here, before click and rich are imported (122 -> 40 ms,
median, on the 2-core CPU machine: the interpreter's start plus ~20 ms; docs/benchmarks.md). Only the
forms `status [--json] [--socket PATH] [--config FILE]` take this path, with the same environment
variables, output and errors as click's `status`, which calls the same function; anything else
(--help, a typo, another command) goes to click, which parses and explains as it always does.
"""
from __future__ import annotations

import os
import sys

# status's options: the value-taking ones with the environment variable click reads for each
_VALUE_OPTIONS = {"--socket": "GPUWATCH_SOCKET", "--config": "GPUWATCH_CONFIG"}


def status_args(args: list[str]) -> dict | None:
    """`gpuwatch status`'s options from argv (after "status"), or None for click to parse: an
    option not listed above, one given twice, one without its value."""
    seen: dict = {}
    i = 0
    while i < len(args):
        word = args[i]
        name, eq, value = word.partition("=")
        if word == "--json":
            key, value = "--json", True
        elif name in _VALUE_OPTIONS and eq:
            key = name
        elif word in _VALUE_OPTIONS and i + 1 < len(args):
            key, value = word, args[i + 1]
            i += 1
        else:
            return None
        if key in seen:
            return None
        seen[key] = value
        i += 1
    # click reads an option's variable when the option is not given, and an empty one as unset
    for opt, env in _VALUE_OPTIONS.items():
        if opt not in seen and os.environ.get(env):
            seen[opt] = os.environ[env]
    return {"config_path": seen.get("--config"), "socket_path": seen.get("--socket"), "as_json": "--json" in seen}


def _fast_status(kwargs: dict) -> int:
    from gpuwatch.agent import client
    from gpuwatch.agent.api import GpuwatchError

    try:
        client.status(**kwargs)
    except GpuwatchError as e:  # as click's `status` says it (agent/cli.py, _GpuwatchGroup)
        from gpuwatch.agent.config import ConfigError

        print(f"Error: {'bad configuration: ' if isinstance(e, ConfigError) else ''}{e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nAborted!", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `gpuwatch status | head -1`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def main() -> None:
    if sys.argv[1:2] == ["status"]:
        kwargs = status_args(sys.argv[2:])
        if kwargs is not None:
            sys.exit(_fast_status(kwargs))
    from gpuwatch.agent.cli import main as click_main

    click_main()


if __name__ == "__main__":
    main()
