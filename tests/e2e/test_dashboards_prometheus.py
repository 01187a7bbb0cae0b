"""Every query of every Grafana dashboard, and every rule expression, through a real Prometheus scraping
a real agent that replays the H200 as several GPUs, with reference-workload runs (replayed) and an
in-process agent's report (CUPTI records recorded on the H200) behind it.

Each query must parse. Each must also return series, unless the generator marked it as needing something
this machine cannot give the agent (eBPF on CUDA processes, CUPTI PM sampling, a leak, an XID, NVLink,
fans, failing NVML calls): those only parse here.
"""
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
import yaml

from gpuwatch.agent import control
from dashboards import generator
from tests.conftest import FIXTURE, nvml_recording
from tests.e2e.test_baseline_cli import BASELINE, gpuwatch
from tests.e2e.test_cupti_daemon import h200_report
from tests.e2e.test_prometheus_scrape import prometheus, wait_query  # noqa: F401 (a fixture)
from tests.rules.test_rules import RULE_FILES

pytestmark = pytest.mark.prometheus

GPUS = 4
MET_HERE = {"baseline", "inprocess"}  # the needs this test meets; the others only parse


def run_query(base: str, expr: str) -> dict:
    """Prometheus' answer to an instant query, errors included (they come with HTTP 400/422)."""
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        return json.load(e)


def substitute(expr: str, values: dict[str, str]) -> str:
    """What Grafana sends: template variables replaced (longest names first, $__range before $__rate...)."""
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", values[name]).replace("$" + name, values[name])
    assert "$" not in expr, f"a variable left in {expr}"
    return expr


def send_report(sock: str, uuid: str, scale: int) -> None:
    """The in-process agent's report, as recorded on the H200, from this process for GPU `uuid`;
    counts scaled as if the program ran `scale` times as long."""
    report = h200_report(0)
    report["cupti"]["observed_seconds"] *= scale
    for k in report["kernels"]:
        k.update(uuid=uuid, launches=k["launches"] * scale, gpu_seconds=k["gpu_seconds"] * scale)
    for m in report["memory"]:
        m["uuid"] = uuid
    control.call(sock, "cupti.report", report)


def test_every_dashboard_query_and_rule_runs_on_prometheus(agent_factory, prometheus, tmp_path):  # noqa: F811
    # The reference-workload runs were recorded on another H200: give them this recording's GPU 0.
    uuid = json.loads(FIXTURE.read_text())["gpus"][0]["uuid"][0]["value"]
    runs = json.loads(BASELINE.read_text())["runs"][:6]
    for r in runs:
        r["uuid"] = uuid
    replay = tmp_path / "runs.json"
    replay.write_text(json.dumps({"runs": runs}))
    # NVML lists this process on the GPU its report names: its white and grey are verified.
    listing = nvml_recording(tmp_path, [os.getpid()])
    agent = agent_factory("--nvml-replay", str(listing), "--nvml-replay-gpus", str(GPUS), "--no-ebpf",
                          "--baseline-replay", str(replay))
    agent.metrics()
    sock = str(agent.socket)
    for _ in runs:  # from the sixth run on, each GPU is judged against its own history too
        out = gpuwatch("baseline", "run", "--socket", sock)
        assert out.returncode == 0, out.stdout + out.stderr
    send_report(sock, uuid, 1)

    target = f"127.0.0.1:{agent.port}"
    base = prometheus(target)
    wait_query(base, 'count_over_time(up{job="gpuwatch"}[1m]) >= 3')
    wait_query(base, 'gpuwatch_baseline_relative_throughput_ratio{reference="own"}')
    wait_query(base, "gpuwatch_process_kernel_launches_total")
    send_report(sock, uuid, 2)  # the kernel counters grow, so their rates are not 0/0
    wait_query(base, "max_over_time(gpuwatch_cupti_observed_seconds_total[1m]) > 5")
    wait_query(base, f'count(gpuwatch_gpu_info) == {GPUS}')
    time.sleep(2)

    everything = {"instance": ".*", "gpu": ".*", "process": ".*", "__rate_interval": "1m", "__range": "1h"}
    one_gpu = dict(everything, instance=target, gpu=uuid)
    problems, checked, with_series = [], 0, 0
    for d in generator.dashboards():
        for panel in generator.panels(d):
            for q in panel.targets:
                for values in (everything, one_gpu):
                    expr = substitute(q.expr, values)
                    answer = run_query(base, expr)
                    checked += 1
                    where = f"{d.build().uid} {panel.title!r} ({values['gpu']}): {expr}"
                    if answer.get("status") != "success":
                        problems.append(f"{where}\n  does not run: {answer.get('error')}")
                    elif not answer["data"]["result"]:
                        if not q.needs or q.needs in MET_HERE:
                            problems.append(f"{where}\n  returned no series")
                    else:
                        with_series += 1
    assert not problems, f"{len(problems)} of {checked} dashboard queries failed:\n" + "\n".join(problems)

    rules = [rule for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"]
             for rule in group["rules"]]  # the node's alerts and the fleet's recording rules
    for rule in rules:
        answer = run_query(base, rule["expr"])
        assert answer.get("status") == "success", (rule.get("alert") or rule.get("record"), answer)
    assert len(rules) >= 10
    print(f"{checked} dashboard queries ({with_series} with series) and {len(rules)} rule expressions ran",
          file=sys.stderr)
