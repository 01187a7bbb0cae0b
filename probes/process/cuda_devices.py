"""Which GPU a CUDA device ordinal names inside a process, from outside it.

Inside a process CUDA numbers its devices 0, 1, ... in the order CUDA_VISIBLE_DEVICES lists them,
so ordinal 0 of a process started with CUDA_VISIBLE_DEVICES=1,0 is NVML's GPU 1. gpuwatch names a
GPU by NVML's UUID. The best source of an ordinal's UUID is the process itself (the in-process
agent asks CUDA: probes/cupti/inprocess.py); this module is the fallback for an ordinal that comes
without one: the process's CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER, read from
/proc/PID/environ, resolved against NVML's GPUs as CUDA resolves them.

What CUDA does with the value (CUDA C Programming Guide, "CUDA Environment Variables"): a comma-
separated list of device indexes, GPU UUIDs ("GPU-8a3f...", any unique prefix of one) or MIG UUIDs;
devices are numbered in the list's order, and an entry that names no device ends the list (the
ones before it stay visible): "-1", "" and "1,x,0" leave none, none and one. What we do beside it,
where CUDA's choice is not ours to know, is name nothing rather than guess:

- an index needs CUDA's enumeration order. CUDA_DEVICE_ORDER=PCI_BUS_ID is PCI bus order, which we
  take from NVML's PCI bus ids. The default, FASTEST_FIRST, puts the fastest device first and
  leaves "the order of the rest unspecified" (the guide's words): identical GPUs come in bus order
  in practice, but a node of two models (an H100 NVL beside an H100 PCIe has the same compute
  capability) is guessed at, and a wrong GPU is worse than none. So an index is resolved only with
  PCI_BUS_ID, or on a node of one GPU;
- a GPU in MIG mode is seen by CUDA as MIG instances, which NVML's probe does not enumerate: an
  entry that names one (by index or UUID) and MIG UUIDs are not resolved;
- an entry we cannot resolve ends what we name (the devices after it would be numbered by it), and
  so does a GPU named twice (whether CUDA then ends the list or skips the repeat we have not seen).

/proc/PID/environ is the environment the process was started with: a program that sets
os.environ["CUDA_VISIBLE_DEVICES"] before it initialises CUDA changes only its own copy, which
/proc does not show. Another reason the process's own word comes first. Everything read here is
the process's own (untrusted) text: bounded, and what does not parse names nothing.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

MAX_GPUS = 64  # entries looked at: no node has more GPUs (wire.MAX_GPUS bounds ordinals at 1024)
MAX_VALUE = 4096  # characters of CUDA_VISIBLE_DEVICES looked at: 64 full MIG UUIDs fit
MAX_ENTRY = 96  # a MIG-GPU-<uuid>/<gi>/<ci> is 60: longer is no device
MAX_ENVIRON = 1 << 20  # bytes of /proc/PID/environ read; beyond, the variables are unknown, not unset
VARIABLES = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")
_INDEX = re.compile(r"[0-9]{1,4}")
_GPU_UUID = re.compile(r"GPU-[0-9a-fA-F-]{1,36}")


@dataclass(frozen=True)
class NvmlGpu:
    """A GPU as NVML's probe reports it (its "gpuwatch.gpu" info series)."""

    uuid: str
    name: str = ""
    pci_bus_id: str = ""
    mig: bool = False  # MIG mode on: CUDA sees its instances, not the GPU


def nvml_gpus(samples: Iterable) -> list[NvmlGpu]:
    """NVML's GPUs from the NVML probe's samples (the info series "gpuwatch.gpu" with its name and
    PCI bus id labels; "gpuwatch.gpu.mig.mode" current), in PCI bus order."""
    info: dict[str, tuple[str, str]] = {}
    mig: set[str] = set()
    for s in samples:
        if s.metric == "gpuwatch.gpu" and s.resource:
            info[s.resource] = (s.labels.get("name", ""), s.labels.get("pci_bus_id", ""))
        elif s.metric == "gpuwatch.gpu.mig.mode" and s.labels.get("state") == "current" and s.value:
            mig.add(s.resource)
    gpus = [NvmlGpu(uuid, name, bus, uuid in mig) for uuid, (name, bus) in info.items()]
    return sorted(gpus, key=lambda g: (g.pci_bus_id.lower(), g.uuid))


def parse_visible_devices(value: str) -> list[str]:
    """CUDA_VISIBLE_DEVICES's entries, stripped, up to the first that cannot name a device as
    written (CUDA ends the list there); at most MAX_GPUS. Whether an entry names a device of this
    node is resolve()'s question."""
    cut = value[:MAX_VALUE + 1]
    parts = cut.split(",")
    if len(cut) > MAX_VALUE:
        parts = parts[:-1]  # the last one was cut short: it is not what the process wrote
    out = []
    for part in parts[:MAX_GPUS]:
        entry = part.strip()
        if not entry or len(entry) > MAX_ENTRY or not (_INDEX.fullmatch(entry) or entry.startswith(("GPU-", "MIG-"))):
            break
        out.append(entry)
    return out


def cuda_order(gpus: Sequence[NvmlGpu], device_order: str | None) -> list[NvmlGpu] | None:
    """The GPUs in the order CUDA numbers them for a process, or None when that is not known (see
    the module docstring): bus order with CUDA_DEVICE_ORDER=PCI_BUS_ID (bus ids from NVML), or the
    one GPU of a node that has one."""
    if len(gpus) == 1:
        return list(gpus)
    if (device_order or "").strip() == "PCI_BUS_ID" and all(g.pci_bus_id for g in gpus):
        return sorted(gpus, key=lambda g: g.pci_bus_id.lower())
    return None


def _by_uuid(entry: str, gpus: Sequence[NvmlGpu]) -> NvmlGpu | None:
    """The GPU whose UUID `entry` is, or is the unique prefix of (as CUDA accepts it)."""
    if not _GPU_UUID.fullmatch(entry):
        return None
    want = entry.lower()
    found = [g for g in gpus if g.uuid.lower().startswith(want)]
    return found[0] if len(found) == 1 else None


def visible_uuids(env: Mapping[str, str] | None, gpus: Sequence[NvmlGpu]) -> tuple[str, ...]:
    """NVML's UUID of each CUDA ordinal of a process with this environment: position i is ordinal
    i's GPU. It ends at the first ordinal that cannot be named for sure; env None (unknown) names
    none."""
    if env is None:
        return ()
    order = cuda_order(gpus, env.get("CUDA_DEVICE_ORDER"))
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:  # unset: every GPU, in CUDA's order
        if order is None or any(g.mig for g in order):
            return ()
        return tuple(g.uuid for g in order[:MAX_GPUS])
    out: list[str] = []
    for entry in parse_visible_devices(value):
        if _INDEX.fullmatch(entry):
            gpu = order[int(entry)] if order is not None and int(entry) < len(order) else None
        else:
            gpu = _by_uuid(entry, gpus)  # MIG-... resolves to nothing: NVML's probe lists no instances
        if gpu is None or gpu.mig or gpu.uuid in out:
            break
        out.append(gpu.uuid)
    return tuple(out)


def read_cuda_environment(pid: int, proc: str = "/proc") -> dict[str, str] | None:
    """CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER as the process was started with them (only those
    it has), or None when they cannot be known: no such process, no permission, an empty environment
    (a process exiting or in exec reads so), or one longer than MAX_ENVIRON where they were not
    found before the end of what was read."""
    try:
        with open(f"{proc}/{int(pid)}/environ", "rb") as f:
            raw = f.read(MAX_ENVIRON + 1)
    except (OSError, ValueError):
        return None
    if not raw:
        return None  # a process exiting (or exec'ing) reads as empty: that is not "unset"
    complete = len(raw) <= MAX_ENVIRON
    items = raw[:MAX_ENVIRON].split(b"\0")
    if not complete:
        items = items[:-1]  # cut short
    out: dict[str, str] = {}
    for item in items:
        name, eq, value = item.partition(b"=")
        key = name.decode("ascii", errors="replace")
        if eq and key in VARIABLES and key not in out:  # the C library's getenv takes the first
            out[key] = value[:MAX_VALUE + 1].decode("utf-8", errors="replace")
    if not complete and len(out) < len(VARIABLES):
        return None
    return out
