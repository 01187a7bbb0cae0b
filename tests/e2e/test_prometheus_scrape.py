"""End to end: the agent replays the recorded H200, a real Prometheus server scrapes it."""
import base64
import json
import ssl
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from gpuwatch.agent.api import Event
from tests.conftest import FIXTURE, bcrypt_hash, free_port, need_binary, wait_http

pytestmark = pytest.mark.prometheus


def query(base, expr):
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.fixture
def prometheus(tmp_path):
    binary = need_binary("prometheus")
    procs = []

    def start(target, scrape_configs=None):
        port = free_port()
        cfg = tmp_path / "prometheus.yml"
        cfg.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
            "scrape_configs:\n" + (scrape_configs or "  - job_name: gpuwatch\n"
                                    f"    static_configs:\n      - targets: ['{target}']\n"))
        p = subprocess.Popen([binary, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                              f"--web.listen-address=127.0.0.1:{port}"],
                             stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))
        procs.append(p)
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/-/ready", 30, p)
        return base

    yield start
    for p in procs:
        p.terminate()
        p.wait(10)


def wait_query(base, expr, timeout=30):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        res = query(base, expr)
        if res:
            return res
        time.sleep(0.5)
    raise AssertionError(f"Prometheus returned nothing for {expr} within {timeout} s")


def test_prometheus_scrapes_replayed_h200(agent_factory, prometheus):
    agent = agent_factory("--nvml-replay", str(FIXTURE))
    agent.metrics()
    base = prometheus(f"127.0.0.1:{agent.port}")
    assert wait_query(base, 'up{job="gpuwatch"} == 1')
    recording = json.loads(FIXTURE.read_text())
    (info,) = wait_query(base, "gpuwatch_gpu_info")
    uuid = info["metric"]["gpu"]
    assert uuid.startswith("GPU-") and info["metric"]["name"]
    assert uuid in json.dumps(recording), "the exported UUID must be the recorded one"
    assert wait_query(base, 'gpuwatch_probe_up{probe="nvml"} == 1')
    for expr in ('hw_temperature_celsius{sensor="gpu"}', "hw_power_watts", "hw_gpu_memory_limit_bytes",
                 "hw_energy_joules_total", "gpuwatch_gpu_clock_frequency_hertz", 'gpuwatch_gpu_up == 1',
                 "gpuwatch_process_gpu_memory_usage_bytes", "gpuwatch_build_info"):
        res = wait_query(base, expr)
        assert all(r["metric"].get("gpu", uuid) == uuid for r in res), expr
    (limit,) = query(base, "hw_gpu_memory_limit_bytes")
    assert 140e9 < float(limit["value"][1]) < 160e9  # an H200: 143771 MiB
    (temp,) = query(base, 'hw_temperature_celsius{sensor="gpu"}')
    assert 10 < float(temp["value"][1]) < 100


def test_promtool_accepts_the_exposition(agent_factory):
    promtool = need_binary("promtool")
    agent = agent_factory("--nvml-replay", str(FIXTURE), "--nvml-replay-gpus", "8")
    end = time.monotonic() + 20
    text = agent.metrics()
    while "hw_power_watts" not in text and time.monotonic() < end:
        time.sleep(0.2)
        text = agent.metrics()
    assert text.count("hw_power_watts{") == 8
    out = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=30)
    assert out.returncode == 0, out.stdout.decode() + out.stderr.decode()
    assert out.stdout.decode().strip() == "" and out.stderr.decode().strip() == "", \
        "promtool reported lint problems:\n" + out.stdout.decode() + out.stderr.decode()


def test_agent_without_gpu_serves_and_reports_nvml_unavailable(agent_factory):
    # This CI machine has no NVIDIA driver: the real NVML probe must say so, not crash the agent.
    agent = agent_factory()
    end = time.monotonic() + 20
    text = agent.metrics()
    while 'gpuwatch_probe_up{probe="nvml"}' not in text and time.monotonic() < end:
        time.sleep(0.2)
        text = agent.metrics()
    assert 'gpuwatch_probe_up{probe="nvml"} 0.0' in text
    assert agent.proc.poll() is None
    assert "nvml" in agent.output().lower()


def test_prometheus_scrapes_over_tls_with_basic_auth_and_a_client_certificate(agent_factory, prometheus, pki,
                                                                             tmp_path):
    web = tmp_path / "web.yml"
    web.write_text(f"""\
tls_server_config:
  cert_file: {pki.server_cert}
  key_file: {pki.server_key}
  client_auth_type: RequireAndVerifyClientCert
  client_ca_file: {pki.ca}
basic_auth_users:
  prometheus: {bcrypt_hash("s3cret", cost=10)}
http_server_config:
  headers:
    X-Content-Type-Options: nosniff
""")
    agent = agent_factory("--nvml-replay", str(FIXTURE), "--web-config", str(web))
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    ctx.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    end = time.monotonic() + 20
    auth = {"Authorization": "Basic " + base64.b64encode(b"prometheus:s3cret").decode()}
    while True:  # the agent is up when it answers over TLS
        assert agent.proc.poll() is None, agent.output()
        req = urllib.request.Request(f"https://127.0.0.1:{agent.port}/metrics", headers=auth)
        try:
            with urllib.request.urlopen(req, context=ctx, timeout=2) as r:
                assert r.headers["X-Content-Type-Options"] == "nosniff"
                break
        except (OSError, urllib.error.URLError):
            assert time.monotonic() < end, agent.output()
            time.sleep(0.2)
    assert "TLS, client certificate required, basic auth for 1 user" in agent.output()

    def job(name, password):
        return (f"  - job_name: {name}\n    scheme: https\n"
                f"    tls_config:\n      ca_file: {pki.ca}\n      cert_file: {pki.client_cert}\n"
                f"      key_file: {pki.client_key}\n"
                f"    basic_auth:\n      username: prometheus\n      password: {password}\n"
                f"    static_configs:\n      - targets: ['127.0.0.1:{agent.port}']\n")

    base = prometheus(None, job("gpuwatch", "s3cret") + job("wrong_password", "guess"))
    assert wait_query(base, 'up{job="gpuwatch"} == 1')
    assert wait_query(base, 'gpuwatch_gpu_up{job="gpuwatch"} == 1')
    assert wait_query(base, 'up{job="wrong_password"} == 0')
    targets = json.load(urllib.request.urlopen(f"{base}/api/v1/targets", timeout=5))["data"]["activeTargets"]
    wrong = next(t for t in targets if t["labels"]["job"] == "wrong_password")
    assert "401" in wrong["lastError"], wrong


def _oom_recorder_samples():
    """The OomRecorder's series after three OOMs its leak findings had forecast (120 s each): one
    came at 126 s (+5 %), one at 102 s (-15 %), one at 360 s (+200 %)."""
    from gpuwatch.agent.api import Finding
    from gpuwatch.agent.history import History
    from gpuwatch.agent.oom import OomRecorder

    gpu = "GPU-c002ef2a-2a3c-e0e9-4d8a-a58bfd6b0084"
    rec = OomRecorder(History(), started=1_000.0)
    for i, came in enumerate((126.0, 102.0, 360.0)):
        pid, t0 = str(100 + i), 2_000.0 + 1_000 * i
        rec.leak_seen(Finding("memory_leak", gpu, "critical", "leak", {"pid": pid, "process": "leaker",
                                                                       "color": "white", "time_to_oom_seconds": 120.0}), t0)
        ev = rec.framework_oom(Event("framework.oom", "", {"pid": pid, "process": "leaker", "framework": "torch",
                                                           "how": "uncaught"}), t0 + came)
        assert ev is not None and ev.attrs["cause"] == "out_of_memory_error"
    return gpu, rec.samples(time.time())


def test_the_forecast_error_histogram_through_prometheus_and_promtool(prometheus):
    """gpuwatch_oom_forecast_error_ratio as a real Prometheus reads it: buckets, sum and count per
    GPU and `came`, and histogram_quantile() over them; promtool finds nothing to lint."""
    from gpuwatch.agent.snapshot import Snapshot
    from gpuwatch.exporters.prometheus import PrometheusExporter

    gpu, samples = _oom_recorder_samples()
    exp = PrometheusExporter("127.0.0.1:0")
    exp.start()
    try:
        exp.publish(Snapshot(ts=time.time(), samples=tuple(samples)))
        text = urllib.request.urlopen(f"http://127.0.0.1:{exp.port}/metrics", timeout=5).read().decode()
        promtool = need_binary("promtool")
        lint = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=30)
        assert lint.returncode == 0 and not (lint.stdout + lint.stderr).strip(), lint.stdout + lint.stderr
        base = prometheus(f"127.0.0.1:{exp.port}")
        (late,) = wait_query(base, 'gpuwatch_oom_forecast_error_ratio_count{came="late"}')
        assert late["metric"]["gpu"] == gpu and float(late["value"][1]) == 2
        (early_sum,) = wait_query(base, 'gpuwatch_oom_forecast_error_ratio_sum{came="early"}')
        assert float(early_sum["value"][1]) == pytest.approx(0.15)
        buckets = {r["metric"]["le"]: float(r["value"][1])
                   for r in wait_query(base, 'gpuwatch_oom_forecast_error_ratio_bucket{came="late"}')}
        assert buckets == {"0.05": 1, "0.1": 1, "0.2": 1, "0.5": 1, "1.0": 1, "2.0": 2, "+Inf": 2}
        # the median of |error| over the three: the 0.1-0.2 bucket's (-15 %), interpolated within it
        (median,) = wait_query(base, "histogram_quantile(0.5, sum by (le) (gpuwatch_oom_forecast_error_ratio_bucket))")
        assert 0.1 < float(median["value"][1]) <= 0.2
    finally:
        exp.shutdown()
