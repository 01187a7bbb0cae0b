"""The Grafana dashboards of dashboards/grafana/, one module each, built with the Grafana Foundation SDK's
typed builders on queries named through the metric registry (common.py); scripts/gen_dashboards.py
writes and checks the JSON."""
from __future__ import annotations

import json

from grafana_foundation_sdk.builders.dashboard import Dashboard
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Panel

from . import agent, baselines, cuda_api, gpu_detail, gpu_memory, infra_health, kernels, node_overview

MODULES = (node_overview, gpu_detail, gpu_memory, cuda_api, kernels, baselines, agent, infra_health)


def dashboards() -> list[Dashboard]:
    return [module.dashboard() for module in MODULES]


def file_name(board: Dashboard) -> str:
    return f"{board.build().uid}.json"


def panels(board: Dashboard) -> list[Panel]:
    """The dashboard's panels, its rows left out."""
    return [panel for panel in board.build().panels if panel.type_val != "row"]


def render(board: Dashboard) -> str:
    return json.dumps(board.build(), cls=JSONEncoder, indent=2, ensure_ascii=False) + "\n"
