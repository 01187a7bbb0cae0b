"""Which Kubernetes namespace, pod and container a process belongs to, without the API server.

Two sources on the node, both plain files:

1. /proc/PID/cgroup holds the pod UID and the container ID in the cgroup path the kubelet and the
   container runtime made (parse_cgroup). The formats seen in the wild:

     cgroup v2, systemd driver (kubeadm, EKS, GKE; containerd, CRI-O, cri-dockerd):
       0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid, _ for ->.slice/cri-containerd-<id>.scope
       (crio-<id>.scope, docker-<id>.scope; Guaranteed pods have no QoS slice: kubepods-pod<uid>.slice)
     cgroup v1: the same paths, one line per controller (12:memory:/kubepods.slice/...)
     cgroupfs driver (k3s, older docker nodes), v1 or v2:
       0::/kubepods/besteffort/pod<uid>/<id>      (Guaranteed: /kubepods/pod<uid>/<id>)
     kind and other nested nodes: /kubelet.slice/kubelet-kubepods.slice/.../kubelet-kubepods-besteffort-pod<uid>.slice/cri-containerd-<id>.scope
     containerd's "slice:prefix:name" form: /system.slice/containerd.service/kubepods-burstable-pod<uid>.slice:cri-containerd:<id>
     seen from inside a private cgroup namespace, with a relative prefix: 0::/../../kubepods-besteffort-pod<uid>.slice/...

   Static pods (kube-apiserver and friends) have a 32-hex-digit UID (the hash of their manifest)
   instead of a UUID.

2. The kubelet's log layout, which a DaemonSet mounts read-only from the host (names_from_logs):

     /var/log/containers/<pod>_<namespace>_<container>-<container id>.log   (a symlink per container)
     /var/log/pods/<namespace>_<pod>_<pod uid>/<container>/<restart>.log

   Pod names, namespaces and container names are DNS labels or subdomains, which cannot contain
   "_", so the names split cleanly.

PodResolver reads both for a pid once and caches the answer: a process does not change pods.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from typing import Callable, Iterable

_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}|[0-9a-f]{32}"
# One path component holding the pod UID: pod<uid> (cgroupfs) or <...>-pod<uid>.slice (systemd).
_POD_PART = re.compile(rf"^(?:[\w-]*-)?pod(?P<uid>{_UID})(?:\.slice)?$")
# One path component holding the container ID: <runtime>-<id>.scope (systemd) or <id> (cgroupfs).
_CONTAINER_PART = re.compile(r"^(?:(?:cri-containerd|containerd|crio|docker|libpod)-)?(?P<id>[0-9a-f]{64})(?:\.scope)?$")
_CONTAINER_LOG = re.compile(r"^(?P<pod>[^_]+)_(?P<namespace>[^_]+)_(?P<container>[^_]+)-(?P<id>[0-9a-f]{64})\.log$")
_POD_LOG_DIR = re.compile(rf"^(?P<namespace>[^_]+)_(?P<pod>[^_]+)_(?P<uid>{_UID})$")


@dataclass(frozen=True)
class KubernetesContainer:
    pod_uid: str
    container_id: str = ""  # empty: the process sits in the pod's cgroup, not a container's
    namespace: str = ""     # namespace, pod and container are empty until the log layout names them
    pod: str = ""
    container: str = ""

    @property
    def named(self) -> bool:
        return bool(self.namespace and self.pod and self.container)


def parse_cgroup(text: str) -> tuple[str | None, str | None]:
    """(pod UID with dashes, container ID) from the text of /proc/PID/cgroup; None where absent.

    The first line that names a pod wins (on cgroup v1 every controller's line says the same);
    without a pod, the first container ID (a plain docker or podman container)."""
    container_only = None
    for line in text.splitlines():
        parts = line.split(":", 2)  # hierarchy-ID:controllers:path, and the path may hold ":"
        if len(parts) != 3:
            continue
        pod_uid = container_id = None
        for part in re.split(r"[/:]", parts[2]):
            m = _POD_PART.match(part)
            if m and pod_uid is None:
                pod_uid = m.group("uid").replace("_", "-")
                continue
            m = _CONTAINER_PART.match(part)
            if m and container_id is None:
                container_id = m.group("id")
        if pod_uid:
            return pod_uid, container_id
        container_only = container_only or container_id
    return None, container_only


def parse_container_log_name(name: str) -> tuple[str, str, str, str] | None:
    """(namespace, pod, container, container ID) from a /var/log/containers entry's name."""
    m = _CONTAINER_LOG.match(name)
    return (m["namespace"], m["pod"], m["container"], m["id"]) if m else None


def parse_pod_log_dir(name: str) -> tuple[str, str, str] | None:
    """(namespace, pod, pod UID) from a /var/log/pods entry's name."""
    m = _POD_LOG_DIR.match(name)
    return (m["namespace"], m["pod"], m["uid"].replace("_", "-")) if m else None


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:  # not mounted, or not a Kubernetes node
        return []


def names_from_logs(log_root: str, pod_uid: str, container_id: str | None) -> tuple[str, str, str] | None:
    """(namespace, pod, container) from the kubelet's log layout under log_root (/var/log).

    The container's symlink in containers/ names all three. Without it (a runtime that has not
    linked it yet, or containers/ not mounted), the pod's directory in pods/ names the namespace
    and pod, and the container when the pod has one container or its log files are symlinks
    naming the container ID (dockershim's layout); otherwise container is ""."""
    if container_id:
        suffix = f"-{container_id}.log"
        for name in _listdir(os.path.join(log_root, "containers")):
            if name.endswith(suffix):
                parsed = parse_container_log_name(name)
                if parsed:
                    return parsed[:3]
    pods = os.path.join(log_root, "pods")
    for name in _listdir(pods):
        parsed = parse_pod_log_dir(name)
        if not parsed or parsed[2] != pod_uid:
            continue
        namespace, pod, _ = parsed
        containers = sorted(c for c in _listdir(os.path.join(pods, name)) if os.path.isdir(os.path.join(pods, name, c)))
        if len(containers) == 1:
            return namespace, pod, containers[0]
        for container in containers:
            directory = os.path.join(pods, name, container)
            for log in _listdir(directory):
                try:
                    if container_id and container_id in os.readlink(os.path.join(directory, log)):
                        return namespace, pod, container
                except OSError:  # a regular file (containerd, CRI-O write the logs themselves)
                    continue
        return namespace, pod, ""
    return None


class PodResolver:
    """pid -> KubernetesContainer (None outside a pod), read once per pid and cached.

    A pod whose names the log layout does not give yet is looked up again after retry_seconds;
    retain() forgets the pids no longer seen, since a pid number is reused by new processes."""

    def __init__(self, proc_root: str = "/proc", log_root: str = "/var/log", retry_seconds: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.proc_root = proc_root
        self.log_root = log_root
        self.retry_seconds = retry_seconds
        self._clock = clock
        self._cache: dict[int, tuple[KubernetesContainer | None, float]] = {}

    def lookup(self, pid: int) -> KubernetesContainer | None:
        now = self._clock()
        cached = self._cache.get(pid)
        if cached is not None:
            found, checked = cached
            if found is None or found.named or now - checked < self.retry_seconds:
                return found
            pod_uid, container_id = found.pod_uid, found.container_id or None
        else:
            try:
                with open(os.path.join(self.proc_root, str(pid), "cgroup"), encoding="utf-8",
                          errors="replace") as f:
                    pod_uid, container_id = parse_cgroup(f.read())
            except OSError:  # gone already, or /proc not the host's (no hostPID)
                pod_uid = container_id = None
            if pod_uid is None:
                self._cache[pid] = (None, now)
                return None
        names = names_from_logs(self.log_root, pod_uid, container_id) or ("", "", "")
        found = KubernetesContainer(pod_uid, container_id or "", *names)
        self._cache[pid] = (found, now)
        return found

    def retain(self, pids: Iterable[int]) -> None:
        keep = set(pids)
        for pid in self._cache.keys() - keep:
            del self._cache[pid]
