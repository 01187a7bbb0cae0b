"""The dashboards' eBPF panels (CUDA API calls, latency, errors, launches per kernel, live driver
bytes, pooled or not) through a real Prometheus scraping a real agent whose eBPF probe is attached to
the fake libcuda.so.1 while tests/ebpf/driver.c makes its known calls and tests/ebpf/allocs.c takes
memory from a pool the agent is told of: each such query must return series
(tests/e2e/test_dashboards_prometheus.py runs the rest, where they can only parse)."""
import pytest

from dashboards import generator
from tests.conftest import FIXTURE
from tests.e2e.test_dashboards_prometheus import run_query, substitute
from tests.e2e.test_prometheus_scrape import prometheus, wait_query  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.root, pytest.mark.prometheus]



def test_every_ebpf_panel_returns_series(agent_factory, prometheus, fake_cuda, drivers, allocs):  # noqa: F811
    # the daemon's launch defaults (duty cycle, budget, new processes exact): the driver's one burst of
    # launches is counted because the process is new and the node under budget, and the launch rate
    # panel has its series because the duty cycle is on
    agent = agent_factory("--nvml-replay", str(FIXTURE), "--ebpf-library", fake_cuda["lib"],
                          "--ebpf-pool-libraries", "libfakepool.so=fakepool")
    agent.metrics()
    d = drivers()
    pool = allocs()
    base = prometheus(f"127.0.0.1:{agent.port}")
    wait_query(base, "gpuwatch_probe_up{probe=\"ebpf\"} == 1", timeout=60)
    d.go()  # the driver's calls, then it waits (alive: its series stay)
    pool.send("pool 1048576", "plain 4096")
    wait_query(base, f'sum(gpuwatch_cuda_calls_total{{pid="{d.pid}"}}) > 0', timeout=60)
    wait_query(base, f'count_over_time(gpuwatch_cuda_calls_total{{pid="{d.pid}"}}[1m]) >= 3', timeout=60)
    wait_query(base, f'count_over_time(gpuwatch_process_cuda_memory_pooled_bytes{{pid="{pool.pid}"}}[1m]) >= 3',
               timeout=60)
    values = {"instance": ".*", "gpu": ".*", "process": ".*", "__rate_interval": "1m", "__range": "1h"}
    empty, checked = [], 0
    for dash in generator.dashboards():
        uid = dash.build().uid
        for panel in generator.panels(dash):
            for q in panel.targets:
                if q.needs not in ("ebpf", "ebpf_pool"):
                    continue
                expr = substitute(q.expr, values)
                answer = run_query(base, expr)
                checked += 1
                assert answer.get("status") == "success", (uid, panel.title, expr, answer)
                if not answer["data"]["result"]:
                    empty.append(f"{uid} {panel.title!r}: {expr}")
    assert checked >= 10
    assert not empty, f"{len(empty)} of {checked} eBPF queries returned no series:\n" + "\n".join(empty)
