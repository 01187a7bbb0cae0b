"""deploy/kubernetes: the manifests parse, hold the objects and keys the agent needs, and agree with
the agent (its settings, its default paths, its port), with the systemd unit's capabilities and
with the alert rules. Structural only: no API server or schema validator runs here."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpuwatch.agent.config import BY_NAME, SETTINGS, parse_listen
from gpuwatch.probes.process.kubernetes import PodResolver

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
NAMESPACE = "gpuwatch"


def load_all(path: Path) -> list[dict]:
    yaml = pytest.importorskip("yaml")
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


@pytest.fixture(scope="module")
def objects() -> dict[str, dict]:
    docs = load_all(DEPLOY / "daemonset.yaml")
    kinds = [d["kind"] for d in docs]
    assert sorted(kinds) == ["DaemonSet", "Namespace", "Service", "ServiceAccount"], kinds
    return {d["kind"]: d for d in docs}


@pytest.fixture(scope="module")
def pod(objects) -> dict:
    return objects["DaemonSet"]["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def container(pod) -> dict:
    (c,) = pod["containers"]
    return c


def env_of(container) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"]}


def test_objects_and_namespace(objects):
    api = {"Namespace": "v1", "ServiceAccount": "v1", "DaemonSet": "apps/v1", "Service": "v1"}
    for kind, obj in objects.items():
        assert obj["apiVersion"] == api[kind]
        if kind == "Namespace":
            assert obj["metadata"]["name"] == NAMESPACE
            # hostPID and hostPath are refused by the baseline Pod Security Standard.
            assert obj["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
        else:
            assert obj["metadata"]["namespace"] == NAMESPACE


def test_daemonset_selects_its_pods_and_runs_on_the_host(objects, pod):
    ds = objects["DaemonSet"]["spec"]
    labels = ds["template"]["metadata"]["labels"]
    assert ds["selector"]["matchLabels"].items() <= labels.items()
    assert pod["hostPID"] is True
    assert not pod.get("hostNetwork")
    assert pod["serviceAccountName"] == objects["ServiceAccount"]["metadata"]["name"]
    # No API access is needed: no token in the pod.
    assert objects["ServiceAccount"]["automountServiceAccountToken"] is False
    assert pod["automountServiceAccountToken"] is False
    assert pod["runtimeClassName"] == "nvidia"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


def test_env_is_real_settings_and_nvidia_toolkit_variables(container):
    env = env_of(container)
    ours = {s.env for s in SETTINGS}
    for name in env:
        assert name in ours or not name.startswith("GPUWATCH_"), f"{name} is not a gpuwatch setting"
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert {"utility", "compute"} <= set(env["NVIDIA_DRIVER_CAPABILITIES"].split(","))
    assert container["command"] == ["gpuwatch", "agent"]


def test_metrics_listen_on_all_addresses_at_the_container_port(objects, container):
    host, port = parse_listen(env_of(container)["GPUWATCH_LISTEN"])
    assert host == "0.0.0.0"
    (metrics,) = [p for p in container["ports"] if p["name"] == "metrics"]
    assert metrics["containerPort"] == port == parse_listen(BY_NAME["prometheus.listen"].default)[1]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] == "metrics"
    service = objects["Service"]["spec"]
    assert service["clusterIP"] == "None"  # headless: one endpoint per agent
    assert service["selector"].items() <= objects["DaemonSet"]["spec"]["template"]["metadata"]["labels"].items()
    (sp,) = service["ports"]
    assert sp["name"] == "metrics" and sp["targetPort"] == "metrics" and sp["port"] == port


def test_security_context_is_the_systemd_units_capabilities(container):
    sc = container["securityContext"]
    assert sc["runAsUser"] == 0 and not sc.get("privileged")
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    added = set(sc["capabilities"]["add"])
    unit = (ROOT / "systemd" / "gpuwatch.service").read_text()
    bounding = re.search(r"^CapabilityBoundingSet=(.+)$", unit, re.M).group(1).split()
    assert added == {c.removeprefix("CAP_") for c in bounding}
    # The API refuses allowPrivilegeEscalation: false with CAP_SYS_ADMIN (spelled so; SYS_ADMIN slips
    # through its check, but the combination means nothing either way).
    assert "SYS_ADMIN" in added and "allowPrivilegeEscalation" not in sc
    assert sc["seccompProfile"]["type"] == "Unconfined"  # bpf() and perf_event_open()


def test_apparmor_lets_the_agent_read_other_processes(objects, container):
    annotations = objects["DaemonSet"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations[f"container.apparmor.security.beta.kubernetes.io/{container['name']}"] == "unconfined"


def test_mounts(pod, container):
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert {m["name"] for m in mounts.values()} == set(volumes), "every mount has a volume and every volume a mount"

    def host_path(mount_path):
        return volumes[mounts[mount_path]["name"]]["hostPath"]["path"]

    env = env_of(container)
    # State and socket on the host: the store outlives the pod, the socket is usable on the node.
    for setting, path in (("agent.state_dir", "/var/lib/gpuwatch"), ("agent.runtime_dir", "/run/gpuwatch")):
        assert BY_NAME[setting].default == path == env[BY_NAME[setting].env]
        assert host_path(path) == path and not mounts[path].get("readOnly")
    # eBPF: kernel headers and tracefs/debugfs from the host.
    for path in ("/lib/modules", "/usr/src"):
        assert host_path(path) == path and mounts[path]["readOnly"] is True
    for path in ("/sys/kernel/tracing", "/sys/kernel/debug"):
        assert host_path(path) == path
    # Pod attribution reads the kubelet's log layout where PodResolver looks by default, read-only.
    log_root = PodResolver().log_root
    for sub in ("pods", "containers"):
        path = f"{log_root}/{sub}"
        assert host_path(path) == path and mounts[path]["readOnly"] is True
    # A read-only root file system needs somewhere to write: /tmp (bcc) and the JIT caches.
    for path in ("/tmp", env["XDG_CACHE_HOME"]):
        assert "emptyDir" in volumes[mounts[path]["name"]]
    for name in ("CUDA_CACHE_PATH", "TRITON_CACHE_DIR"):
        assert env[name].startswith(env["XDG_CACHE_HOME"] + "/")


def test_service_monitor_scrapes_the_service_as_job_gpuwatch(objects):
    (sm,) = load_all(DEPLOY / "servicemonitor.yaml")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1" and sm["kind"] == "ServiceMonitor"
    assert sm["metadata"]["namespace"] == NAMESPACE
    service = objects["Service"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    # The Prometheus Operator names the job after the Service; GpuwatchAgentDown matches "gpuwatch".
    rules = (ROOT / "dashboards" / "prometheus" / "gpuwatch.rules.yml").read_text()
    job_regex = re.search(r'up\{job=~"([^"]+)"\}', rules).group(1)
    assert re.fullmatch(job_regex, service["metadata"]["name"])
