"""Pod attribution of GPU processes (probes/process/kubernetes.py) from /proc/PID/cgroup and the
kubelet's log layout, over file trees written in tmp.

The cgroup files are in the formats the kubelet and the runtimes write:
- pod cgroups: the kubelet's cgroup manager (kubernetes pkg/kubelet/cm), `pod<uid>` under
  kubepods/<qos>/ with the cgroupfs driver; `kubepods-<qos>-pod<uid>.slice` with the systemd
  driver, where the UID's "-" become "_" (systemd reserves "-" for the slice hierarchy);
- container cgroups: containerd's CRI plugin makes `cri-containerd-<id>.scope`, CRI-O
  `crio-<id>.scope` (its monitor: `crio-conmon-<id>.scope`), docker `docker-<id>.scope`; with
  cgroupfs each runtime makes a directory named by the bare ID;
- the log layout: the kubelet's BuildPodLogsDirectory (/var/log/pods/<ns>_<pod>_<uid>/<container>/
  <restart>.log) and logSymlink (/var/log/containers/<pod>_<ns>_<container>-<id>.log), in
  pkg/kubelet/kuberuntime.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuwatch.agent.metrics import REGISTRY
from gpuwatch.probes.nvml.probe import NvmlProbe
from gpuwatch.probes.nvml.replay import ReplayBackend
from gpuwatch.probes.process.kubernetes import (
    KubernetesContainer, PodResolver, names_from_logs, parse_cgroup, parse_container_log_name, parse_pod_log_dir,
)

FIXTURE = Path(__file__).parents[1] / "fixtures" / "nvml-h200.json"

UID = "3adc37e4-63c0-42af-82b9-69f90208510a"
UID_ = UID.replace("-", "_")
CID = "c43cce061e18f92cc145f6e5f63de001ffec4060283c17e44f62e42e7629b1bd"
STATIC_UID = "0f9a7c41d2c8b6e5a3f1d4c7b8e9a0b1"  # a static pod's UID: the hash of its manifest

# A whole cgroup v1 file (hybrid hierarchy) of a containerd container in a Burstable pod, systemd driver.
V1_SYSTEMD = "".join(f"{n}:{c}:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/"
                     f"cri-containerd-{CID}.scope\n"
                     for n, c in ((12, "pids"), (11, "hugetlb"), (10, "net_cls,net_prio"), (9, "perf_event"),
                                  (8, "devices"), (7, "cpuset"), (6, "freezer"), (5, "blkio"),
                                  (4, "cpu,cpuacct"), (3, "memory"), (2, "rdma"), (1, "name=systemd"))) + "0::/\n"
# The same on docker with cgroupfs (dockershim-era nodes): one line per controller, bare IDs.
V1_CGROUPFS = "".join(f"{n}:{c}:/kubepods/burstable/pod{UID}/{CID}\n"
                      for n, c in ((11, "devices"), (10, "perf_event"), (9, "memory"), (8, "freezer"),
                                   (1, "name=systemd")))

CGROUPS = {
    "v2 systemd containerd, Burstable":
        (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
         UID, CID),
    "v2 systemd containerd, Guaranteed (no QoS slice)":
        (f"0::/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope\n", UID, CID),
    "v2 systemd CRI-O, BestEffort":
        (f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/crio-{CID}.scope\n",
         UID, CID),
    "v2 systemd cri-dockerd":
        (f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/docker-{CID}.scope\n",
         UID, CID),
    "v2 cgroupfs (k3s), BestEffort": (f"0::/kubepods/besteffort/pod{UID}/{CID}\n", UID, CID),
    "v2 cgroupfs, Guaranteed": (f"0::/kubepods/pod{UID}/{CID}\n", UID, CID),
    "v1 systemd containerd": (V1_SYSTEMD, UID, CID),
    "v1 cgroupfs docker": (V1_CGROUPFS, UID, CID),
    "kind node (kubelet cgroup root /kubelet)":
        (f"0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
         f"kubelet-kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope\n", UID, CID),
    "containerd slice:prefix:name form":
        (f"0::/system.slice/containerd.service/kubepods-burstable-pod{UID_}.slice:cri-containerd:{CID}\n", UID, CID),
    "seen from a private cgroup namespace":
        (f"0::/../../kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
         UID, CID),
    "a sub-cgroup the container made": (f"0::/kubepods/burstable/pod{UID}/{CID}/worker\n", UID, CID),
    "static pod": (f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{STATIC_UID}.slice/"
                   f"cri-containerd-{CID}.scope\n", STATIC_UID, CID),
    "CRI-O's conmon: the pod, no container":
        (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/crio-conmon-{CID}.scope\n",
         UID, None),
    "plain docker, systemd (no pod)": (f"0::/system.slice/docker-{CID}.scope\n", None, CID),
    "plain docker, cgroupfs v1 (no pod)": (f"4:memory:/docker/{CID}\n2:cpu:/docker/{CID}\n", None, CID),
    "host service": ("0::/system.slice/gpuwatch.service\n", None, None),
    "login session": ("0::/user.slice/user-1000.slice/session-4.scope\n", None, None),
    "v1 host process": ("12:pids:/user.slice/user-1000.slice\n1:name=systemd:/user.slice/user-1000.slice/session-4.scope\n0::/\n",
                        None, None),
    "empty (a kernel thread)": ("", None, None),
}


@pytest.mark.parametrize("name", CGROUPS)
def test_parse_cgroup(name):
    text, uid, cid = CGROUPS[name]
    assert parse_cgroup(text) == (uid, cid)


def test_log_names_parse_with_dashes_and_dots():
    assert parse_container_log_name(f"trainer-7d9f8c6b5-x2kq4_ml-team_pytorch-main-{CID}.log") == \
        ("ml-team", "trainer-7d9f8c6b5-x2kq4", "pytorch-main", CID)
    assert parse_container_log_name(f"web.example.com_default_app-{CID}.log") == \
        ("default", "web.example.com", "app", CID)
    assert parse_container_log_name("trainer_ml-team_main-abc.log") is None  # not a 64-digit ID
    assert parse_container_log_name(f"trainer_main-{CID}.log") is None
    assert parse_pod_log_dir(f"ml-team_trainer-7d9f8c6b5-x2kq4_{UID}") == ("ml-team", "trainer-7d9f8c6b5-x2kq4", UID)
    assert parse_pod_log_dir(f"kube-system_kube-apiserver-node1_{STATIC_UID}") == \
        ("kube-system", "kube-apiserver-node1", STATIC_UID)
    assert parse_pod_log_dir(UID) is None  # the layout before Kubernetes 1.14


# --- a node in tmp -----------------------------------------------------------------------------


def write_cgroup(proc: Path, pid: int, text: str) -> None:
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "cgroup").write_text(text)


def add_pod(logs: Path, namespace: str, pod: str, uid: str, containers: dict[str, str], link: bool = True,
            dockershim: bool = False) -> None:
    """The kubelet's layout for a pod: its directory, each container's 0.log, and the symlinks in
    containers/. With dockershim the 0.log files are themselves symlinks into docker's directory."""
    pod_dir = logs / "pods" / f"{namespace}_{pod}_{uid}"
    (logs / "containers").mkdir(parents=True, exist_ok=True)
    for container, cid in containers.items():
        (pod_dir / container).mkdir(parents=True)
        log = pod_dir / container / "0.log"
        if dockershim:
            log.symlink_to(f"/var/lib/docker/containers/{cid}/{cid}-json.log")
        else:
            log.write_text("")
        if link:
            (logs / "containers" / f"{pod}_{namespace}_{container}-{cid}.log").symlink_to(log)


CID2 = "9b5e1c4e8a3d2f1b6a8e7c9d0a1b2c3d4e5f60718293a4b5c6d7e8f9a0b1c2d3"


def test_names_from_the_container_symlink(tmp_path):
    add_pod(tmp_path, "ml-team", "trainer-0", UID, {"main": CID, "sidecar": CID2})
    add_pod(tmp_path, "default", "other", "11111111-2222-3333-4444-555555555555", {"main": "a" * 64})
    assert names_from_logs(str(tmp_path), UID, CID) == ("ml-team", "trainer-0", "main")
    assert names_from_logs(str(tmp_path), UID, CID2) == ("ml-team", "trainer-0", "sidecar")


def test_names_from_the_pod_directory_without_symlinks(tmp_path):
    add_pod(tmp_path, "ml-team", "one", UID, {"main": CID}, link=False)
    assert names_from_logs(str(tmp_path), UID, CID) == ("ml-team", "one", "main")
    # Two containers writing their own logs (containerd, CRI-O): the pod, not which container.
    uid2 = "11111111-2222-3333-4444-555555555555"
    add_pod(tmp_path, "ml-team", "two", uid2, {"main": CID2, "sidecar": "b" * 64}, link=False)
    assert names_from_logs(str(tmp_path), uid2, CID2) == ("ml-team", "two", "")
    # dockershim's log files are symlinks naming the container ID.
    uid3 = "66666666-7777-8888-9999-000000000000"
    add_pod(tmp_path, "ml-team", "three", uid3, {"main": "c" * 64, "sidecar": "d" * 64}, link=False, dockershim=True)
    assert names_from_logs(str(tmp_path), uid3, "d" * 64) == ("ml-team", "three", "sidecar")
    assert names_from_logs(str(tmp_path), "99999999-2222-3333-4444-555555555555", None) is None


def test_names_without_the_log_layout(tmp_path):
    assert names_from_logs(str(tmp_path / "missing"), UID, CID) is None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_resolver_reads_each_pid_once_and_forgets_gone_pids(tmp_path):
    proc, logs = tmp_path / "proc", tmp_path / "log"
    write_cgroup(proc, 4242, CGROUPS["v2 systemd containerd, Burstable"][0])
    write_cgroup(proc, 77, CGROUPS["host service"][0])
    add_pod(logs, "ml-team", "trainer-0", UID, {"main": CID})
    resolver = PodResolver(str(proc), str(logs))
    expected = KubernetesContainer(UID, CID, "ml-team", "trainer-0", "main")
    assert resolver.lookup(4242) == expected
    assert resolver.lookup(77) is None
    assert resolver.lookup(5) is None  # no such process
    # Cached: the files are not read again.
    (proc / "4242" / "cgroup").unlink()
    write_cgroup(proc, 77, CGROUPS["v2 cgroupfs (k3s), BestEffort"][0])
    assert resolver.lookup(4242) == expected and resolver.lookup(77) is None
    # A pid no longer seen is forgotten: its number may come back as another process.
    resolver.retain([4242])
    assert resolver.lookup(77) == KubernetesContainer(UID, CID, "ml-team", "trainer-0", "main")


def test_resolver_retries_names_the_log_layout_did_not_give(tmp_path):
    proc, logs, clock = tmp_path / "proc", tmp_path / "log", Clock()
    write_cgroup(proc, 4242, CGROUPS["v1 cgroupfs docker"][0])
    resolver = PodResolver(str(proc), str(logs), retry_seconds=60, clock=clock)
    assert resolver.lookup(4242) == KubernetesContainer(UID, CID)  # the pod UID, no names yet
    add_pod(logs, "ml-team", "trainer-0", UID, {"main": CID})
    clock.now += 59
    assert resolver.lookup(4242) == KubernetesContainer(UID, CID)
    clock.now += 2
    assert resolver.lookup(4242) == KubernetesContainer(UID, CID, "ml-team", "trainer-0", "main")


# --- in the NVML probe -------------------------------------------------------------------------


def collect(resolver, gpus=2):
    backend = ReplayBackend(FIXTURE, gpus=gpus)
    probe = NvmlProbe(lambda: backend, xid_events=False, pods=resolver)
    probe.start()
    try:
        return list(probe.collect())
    finally:
        probe.shutdown()


def test_nvml_probe_names_the_pod_of_each_gpu_process_once(tmp_path):
    pids = sorted({int(s.labels["pid"]) for s in collect(None)
                   if s.metric == "gpuwatch.process.gpu.memory.usage" and s.labels["pid"] != "other"})
    assert pids, "the recording has no GPU processes"
    proc, logs = tmp_path / "proc", tmp_path / "log"
    write_cgroup(proc, pids[0], CGROUPS["v2 systemd containerd, Burstable"][0])
    for pid in pids[1:]:
        write_cgroup(proc, pid, CGROUPS["login session"][0])
    add_pod(logs, "ml-team", "trainer-0", UID, {"main": CID})
    samples = collect(PodResolver(str(proc), str(logs)))
    info = [s for s in samples if s.metric == "gpuwatch.process.kubernetes"]
    # One series for the pid, however many GPUs it is on (the replay shows it on both).
    assert len(info) == 1, info
    process = next(s.labels["process"] for s in samples if s.metric == "gpuwatch.process.gpu.memory.usage"
                   and s.labels["pid"] == str(pids[0]))
    assert dict(info[0].labels) == {"pid": str(pids[0]), "process": process, "namespace": "ml-team",
                                    "pod": "trainer-0", "pod_uid": UID, "container": "main"}
    assert info[0].resource == "" and info[0].value == 1.0
    assert set(info[0].labels) == set(REGISTRY["gpuwatch.process.kubernetes"].labels)


def test_nvml_probe_without_a_resolver_has_no_pod_series():
    assert not [s for s in collect(None) if s.metric == "gpuwatch.process.kubernetes"]


def test_the_agent_asks_for_pods_only_for_real_gpus():
    from gpuwatch.agent.config import load
    from gpuwatch.probes.nvml import from_config

    off = {"ebpf.enabled": False, "cupti.sampling": False}
    real = load("", off)
    replay = load("", {**off, "nvml.replay": str(FIXTURE)})
    nvml = from_config(real)
    assert isinstance(nvml.pods, PodResolver) and nvml.pods.proc_root == "/proc"
    assert from_config(replay).pods is None
    assert os.path.isabs(nvml.pods.log_root)
