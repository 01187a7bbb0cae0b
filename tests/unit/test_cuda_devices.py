"""probes/process/cuda_devices.py: a CUDA ordinal inside a process resolved to NVML's UUID from its
CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER, as CUDA resolves them, naming nothing where unsure."""
import subprocess
import sys

import pytest

from gpuwatch.agent.api import Sample
from gpuwatch.probes.process import cuda_devices
from gpuwatch.probes.process.cuda_devices import (NvmlGpu, cuda_order, nvml_gpus,
                                                  parse_visible_devices, read_cuda_environment, visible_uuids)

# Two H200s, listed by NVML out of bus order on purpose: CUDA's PCI_BUS_ID order is the bus's.
GPU0 = NvmlGpu("GPU-0af39ec1-025b-b990-3dc9-475f5d35d110", "NVIDIA H200", "00000000:18:00.0")
GPU1 = NvmlGpu("GPU-8a3f1c2d-4e5f-6071-8293-a4b5c6d7e8f9", "NVIDIA H200", "00000000:2A:00.0")
GPUS = [GPU1, GPU0]
PCI = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def env(visible=None, order="PCI_BUS_ID"):
    out = {} if order is None else {"CUDA_DEVICE_ORDER": order}
    if visible is not None:
        out["CUDA_VISIBLE_DEVICES"] = visible
    return out


@pytest.mark.parametrize("value, ordinals", [
    ("1,0", (GPU1.uuid, GPU0.uuid)),  # ordinal 0 is NVML's GPU 1
    ("1", (GPU1.uuid,)),
    (" 1 , 0 ", (GPU1.uuid, GPU0.uuid)),
    ("GPU-8a3f", (GPU1.uuid,)),  # a unique prefix, as CUDA accepts it
    ("GPU-8A3F1C2D-4e", (GPU1.uuid,)),  # any case, dashes where the UUID has them
    ("GPU-8a3f,GPU-0af3", (GPU1.uuid, GPU0.uuid)),
    ("GPU-8a3f1c2d-4e5f-6071-8293-a4b5c6d7e8f9,0", (GPU1.uuid, GPU0.uuid)),
    ("1,x,0", (GPU1.uuid,)),  # an invalid entry ends the list; the ones before stay
    ("1,2,0", (GPU1.uuid,)),  # an index this node does not have is invalid too
    ("1,GPU-ffff,0", (GPU1.uuid,)),  # a UUID no GPU here has
    ("GPU-,0", ()),
    ("GPU-8a3fz", ()),
    ("", ()),  # set but empty: CUDA sees no device
    ("-1", ()),  # the usual way to hide every GPU
    ("1,1,0", (GPU1.uuid,)),  # a GPU named twice: what follows is not named
    ("GPU-8a3f,1", (GPU1.uuid,)),  # the same GPU by UUID and index
    ("MIG-4f2a1b3c-5d6e-7f80-9102-a3b4c5d6e7f8", ()),  # MIG instances: NVML's probe lists none
    ("1,MIG-GPU-8a3f1c2d-4e5f-6071-8293-a4b5c6d7e8f9/1/0,0", (GPU1.uuid,)),
])
def test_cuda_visible_devices_with_pci_bus_order(value, ordinals):
    assert visible_uuids(env(value), GPUS) == ordinals


def test_an_ambiguous_uuid_prefix_names_nothing():
    twins = [NvmlGpu("GPU-8a3f0000-0000-0000-0000-000000000000", "H200", "00000000:18:00.0"), GPU1]
    assert visible_uuids(env("GPU-8a3f"), twins) == ()
    assert visible_uuids(env("GPU-8a3f1"), twins) == (GPU1.uuid,)


def test_unset_is_every_gpu_in_bus_order():
    assert visible_uuids(env(None), GPUS) == (GPU0.uuid, GPU1.uuid)


@pytest.mark.parametrize("order", [None, "FASTEST_FIRST", "pci_bus_id", ""])
def test_without_pci_bus_order_indexes_name_nothing_and_uuids_still_do(order):
    """CUDA's default order puts the fastest first and leaves the rest unspecified: an index is not
    mapped on a node of more than one GPU, a UUID needs no order."""
    assert cuda_order(GPUS, order) is None
    assert visible_uuids(env("1,0", order), GPUS) == ()
    assert visible_uuids(env(None, order), GPUS) == ()
    assert visible_uuids(env("GPU-8a3f,0", order), GPUS) == (GPU1.uuid,)


def test_a_node_of_one_gpu_needs_no_order():
    assert visible_uuids(env("0", None), [GPU0]) == (GPU0.uuid,)
    assert visible_uuids(env(None, None), [GPU0]) == (GPU0.uuid,)
    assert visible_uuids(env("1", None), [GPU0]) == ()


def test_a_gpu_in_mig_mode_is_not_named_by_index_or_uuid():
    mig1 = NvmlGpu(GPU1.uuid, GPU1.name, GPU1.pci_bus_id, mig=True)
    assert visible_uuids(env("0,1"), [GPU0, mig1]) == (GPU0.uuid,)
    assert visible_uuids(env("GPU-8a3f"), [GPU0, mig1]) == ()
    assert visible_uuids(env(None), [GPU0, mig1]) == ()


def test_bus_order_needs_every_bus_id():
    assert cuda_order([GPU0, NvmlGpu(GPU1.uuid, GPU1.name, "")], "PCI_BUS_ID") is None


def test_an_unknown_environment_names_nothing():
    assert visible_uuids(None, GPUS) == ()


def test_hostile_values_are_bounded():
    many = ",".join(["0"] * 100_000)
    assert parse_visible_devices(many) == ["0"] * cuda_devices.MAX_GPUS
    assert visible_uuids(env(many), GPUS) == (GPU0.uuid,)  # then GPU 0 again: the rest unnamed
    assert parse_visible_devices("1," + "9" * 10_000) == ["1"]
    assert parse_visible_devices("GPU-" + "a" * 200 + ",0") == []  # no UUID is that long
    assert parse_visible_devices("1,\x00\n0") == ["1"]
    # cut at MAX_VALUE: the entry cut short is not taken for what the process wrote
    value = "1," + " " * (cuda_devices.MAX_VALUE - 2) + "01"
    assert len(value) > cuda_devices.MAX_VALUE and parse_visible_devices(value) == ["1"]
    assert visible_uuids(env("1,\u00e9,0"), GPUS) == (GPU1.uuid,)
    assert visible_uuids(env("99999,0"), GPUS) == ()


def test_nvml_gpus_from_the_nvml_probes_samples_in_bus_order():
    samples = [Sample("gpuwatch.gpu", 1.0, GPU1.uuid, {"gpu_index": "0", "name": "NVIDIA H200",
                                                      "pci_bus_id": "00000000:2A:00.0"}, 1.0),
               Sample("gpuwatch.gpu", 1.0, GPU0.uuid, {"gpu_index": "1", "name": "NVIDIA H200",
                                                      "pci_bus_id": "00000000:18:00.0"}, 1.0),
               Sample("gpuwatch.gpu.mig.mode", 1.0, GPU1.uuid, {"state": "pending"}, 1.0),
               Sample("gpuwatch.gpu.mig.mode", 1.0, GPU0.uuid, {"state": "current"}, 1.0)]
    assert nvml_gpus(samples) == [NvmlGpu(GPU0.uuid, "NVIDIA H200", "00000000:18:00.0", mig=True),
                                  NvmlGpu(GPU1.uuid, "NVIDIA H200", "00000000:2A:00.0")]


# --- /proc/PID/environ of real processes ------------------------------------------------------

def started(environment):
    """A real process with exactly this environment (it sleeps until killed)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
                         env=environment, stdout=subprocess.PIPE)
    assert p.stdout.readline() == b"ready\n"  # past its exec: /proc shows its environment
    return p


@pytest.fixture
def proc():
    ps = []

    def start(environment):
        p = started(environment)
        ps.append(p)
        return p.pid

    yield start
    for p in ps:
        p.kill()
        p.wait()
        p.stdout.close()


def device_uuid(pid, ordinal, gpus):
    """NVML's UUID of the process's CUDA ordinal, from its environment; None when not sure."""
    uuids = visible_uuids(read_cuda_environment(pid), gpus)
    return uuids[ordinal] if 0 <= ordinal < len(uuids) else None


def test_the_environment_a_process_was_started_with(proc):
    pid = proc({"CUDA_VISIBLE_DEVICES": "1,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "OTHER": "x"})
    assert read_cuda_environment(pid) == {"CUDA_VISIBLE_DEVICES": "1,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert device_uuid(pid, 0, GPUS) == GPU1.uuid and device_uuid(pid, 1, GPUS) == GPU0.uuid
    assert device_uuid(pid, 2, GPUS) is None and device_uuid(pid, -1, GPUS) is None
    bare = proc({"PATH": "/usr/bin"})
    assert read_cuda_environment(bare) == {}  # unset, known to be
    assert device_uuid(bare, 0, GPUS) is None  # every GPU, but in an order not known


def test_a_long_environment_is_read_up_to_its_bound(proc):
    """Past MAX_ENVIRON the variables are unknown, not unset: a value there could name any GPU."""
    filler = {f"FILL{i}": "x" * 120_000 for i in range(10)}  # 1.2 MB, each under the kernel's 128 KiB
    late = proc({**filler, "CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert read_cuda_environment(late) is None
    early = proc({"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID", **filler})
    assert read_cuda_environment(early) == {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def test_no_such_process_is_unknown():
    assert read_cuda_environment(2**22 + 1) is None  # above pid_max's largest
