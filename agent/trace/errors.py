"""The trace's one error: a reason it cannot start (or go on), for the person at the terminal."""
from __future__ import annotations

from gpuwatch.agent.api import GpuwatchError


class TraceError(GpuwatchError):
    """A reason the trace cannot start, meant for the person at the terminal (exit 1)."""
