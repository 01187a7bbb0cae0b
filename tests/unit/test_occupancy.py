"""Theoretical occupancy (gpuwatch.probes.cupti.occupancy): cases worked out by hand from the
documented rules, and, when tests/gpu/occupancy_check.py has been run on the H200, every case the
driver answered there (tests/fixtures/occupancy-h200.json)."""
import dataclasses
import json
from pathlib import Path

import pytest

from gpuwatch.probes.cupti.occupancy import (
    Device, Launch, UnsupportedDevice, theoretical,
)

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "occupancy-h200.json"
KB = 1024

# H100/H200 (sm_90) as the driver reports it.
H200 = Device(major=9, minor=0, sm_count=132, warp_size=32, max_threads_per_sm=2048,
              max_blocks_per_sm=32, registers_per_sm=65536, max_registers_per_block=65536,
              shared_memory_per_sm=233472, shared_memory_per_block_optin=232448,
              reserved_shared_memory_per_block=1024)
A100 = Device.for_compute_capability(8, 0, sm_count=108)
GA102 = Device.for_compute_capability(8, 6, sm_count=84)


def occ(device, block, regs, static=0, dynamic=0, carveout=None):
    return theoretical(device, Launch(block, regs, static, dynamic, carveout))


def expect(o, blocks, warps, ratio, limiter):
    assert (o.blocks_per_sm, o.warps_per_sm, o.limiter) == (blocks, warps, limiter), o
    assert o.ratio == pytest.approx(ratio)
    assert o.reason == ""


# --- sm_90: 64 warp slots, 32 blocks, 65536 registers in 4 sub-partitions of 16384,
# 228 KB shared memory (configs 0/8/16/32/64/100/132/164/196/228 KB), 1 KB reserved per block.

def test_full_sm_reads_warps():
    # 8 warps/block: warps allow 64/8 = 8; registers 32x32 = 1024/warp, 16 warps per
    # sub-partition = 64 warps = 8 blocks too. A tie at full occupancy is "warps".
    expect(occ(H200, 256, 32), 8, 64, 1.0, "warps")


def test_small_blocks_hit_block_limit():
    # 1 warp/block: warps would allow 64, registers 128, shared memory 228 (1 KB reserved each).
    expect(occ(H200, 32, 16), 32, 32, 0.5, "blocks")


def test_registers_limit():
    # 128 x 32 = 4096 registers/warp: 4 warps per sub-partition, 16 per SM, 2 blocks of 8 warps.
    expect(occ(H200, 256, 128), 2, 16, 0.25, "registers")


def test_registers_round_up_to_allocation_unit():
    # 33 registers/thread = 1056/warp, allocated as 1280 (8 per thread): 16384 // 1280 = 12
    # warps per sub-partition, 48 per SM, 12 blocks of 4 warps. 40 registers cost the same.
    expect(occ(H200, 128, 33), 12, 48, 0.75, "registers")
    assert occ(H200, 128, 40).blocks_per_sm == 12
    assert occ(H200, 128, 32).blocks_per_sm == 16


def test_registers_are_split_per_sub_partition():
    # 80 registers = 2560/warp: 6 warps per sub-partition (16384 // 2560), so 24 per SM, not
    # the 25 that 65536 // 2560 would give.
    expect(occ(H200, 32, 80), 24, 24, 0.375, "registers")


def test_most_registers_one_block_of_256():
    # 255 registers → 256 × 32 = 8192/warp: 2 warps per sub-partition, 8 per SM.
    expect(occ(H200, 256, 255), 1, 8, 0.125, "registers")


def test_too_many_registers_for_one_block():
    o = occ(H200, 288, 255)  # 9 warps x 8192 > 65536
    assert (o.blocks_per_sm, o.warps_per_sm, o.ratio, o.limiter) == (0, 0, 0.0, "cannot_launch")
    assert "registers per block" in o.reason and "65536" in o.reason
    # 192 registers (6144/warp), 10 warps: 61440 fits, but the hardware check rounds the
    # warps up to 12 (4 sub-partitions): 73728 does not.
    o = occ(H200, 320, 192)
    assert o.limiter == "cannot_launch" and "rounded up to 12" in o.reason, o.reason


def test_static_shared_memory_limit():
    # 48 KB + 1 KB reserved = 50176 per block: 233472 // 50176 = 4 blocks.
    o = occ(H200, 128, 32, static=48 * KB)
    expect(o, 4, 16, 0.25, "shared_memory")
    assert o.shared_memory_per_block == 50176 and o.shared_memory_per_sm == 233472


def test_dynamic_shared_memory_limit():
    # 100 KB + 1 KB = 103424 per block: 2 blocks.
    expect(occ(H200, 256, 32, dynamic=100 * KB), 2, 16, 0.25, "shared_memory")


def test_shared_memory_rounds_to_granularity():
    # 10000 + 1024 = 11024 bytes, allocated as 11136 (128-byte units): 233472 // 11136 = 20
    # blocks (21 without the rounding).
    o = occ(H200, 64, 32, dynamic=10000)
    expect(o, 20, 40, 0.625, "shared_memory")
    assert o.shared_memory_per_block == 11136


def test_carveout_preference():
    # 16 KB dynamic + 1 KB = 17408 per block.
    # default: the whole 228 KB → 13 blocks
    expect(occ(H200, 128, 32, dynamic=16 * KB), 13, 52, 0.8125, "shared_memory")
    # 50 %: 116736 bytes → next configuration 132 KB (135168) → 7 blocks
    o = occ(H200, 128, 32, dynamic=16 * KB, carveout=50)
    expect(o, 7, 28, 0.4375, "shared_memory")
    assert o.shared_memory_per_sm == 132 * KB
    # 25 %: 58368 → 64 KB → 3 blocks; 100 % is the default; -1 means default
    assert occ(H200, 128, 32, dynamic=16 * KB, carveout=25).blocks_per_sm == 3
    assert occ(H200, 128, 32, dynamic=16 * KB, carveout=100).blocks_per_sm == 13
    assert occ(H200, 128, 32, dynamic=16 * KB, carveout=-1).blocks_per_sm == 13


def test_carveout_zero_still_holds_reserved_shared_memory():
    # Max L1 (0 %) asks for 0 KB, but each block holds 1 KB reserved: the SM takes the 8 KB
    # configuration, room for 8 blocks.
    o = occ(H200, 64, 16, carveout=0)
    expect(o, 8, 16, 0.25, "shared_memory")
    assert o.shared_memory_per_sm == 8 * KB


def test_carveout_is_only_a_hint():
    # 0 % but one block needs 101 KB: the smallest configuration holding it, 132 KB, 1 block.
    o = occ(H200, 256, 32, dynamic=100 * KB, carveout=0)
    expect(o, 1, 8, 0.125, "shared_memory")
    assert o.shared_memory_per_sm == 132 * KB


def test_opt_in_shared_memory_maximum():
    # 227 KB dynamic + 1 KB reserved = the whole 228 KB: exactly one block.
    expect(occ(H200, 128, 32, dynamic=232448), 1, 4, 0.0625, "shared_memory")
    o = occ(H200, 128, 32, dynamic=232449)
    assert (o.blocks_per_sm, o.limiter) == (0, "cannot_launch")
    assert "shared memory" in o.reason and "232449" in o.reason
    o = occ(H200, 128, 32, static=48 * KB, dynamic=200 * KB)
    assert o.limiter == "cannot_launch"


def test_warps_limit():
    # 24 warps/block: 64 // 24 = 2 blocks, 48 warps.
    expect(occ(H200, 768, 16), 2, 48, 0.75, "warps")
    # 33 threads take 2 warps.
    expect(occ(H200, 33, 16), 32, 64, 1.0, "warps")


def test_limits_are_reported():
    o = occ(H200, 256, 128, static=16 * KB)
    assert dict(o.limits) == {"warps": 8, "registers": 2, "shared_memory": 13, "blocks": 32}
    assert o.registers_per_block == 4096 * 8


# --- sm_80 (A100: 164 KB, configs up to 164 KB) and sm_86 (48 warps, 16 blocks, 100 KB)

def test_a100():
    # 48 KB + 1 KB per block in 164 KB (167936): 3 blocks.
    expect(occ(A100, 128, 32, dynamic=48 * KB), 3, 12, 0.1875, "shared_memory")
    # 50 % of 164 KB = 83968 → 100 KB configuration; 17408 per block → 5 blocks.
    expect(occ(A100, 128, 32, dynamic=16 * KB, carveout=50), 5, 20, 0.3125, "shared_memory")


def test_ga10x():
    expect(occ(GA102, 32, 16), 16, 16, 1 / 3, "blocks")
    expect(occ(GA102, 512, 32), 3, 48, 1.0, "warps")
    # 99 KB dynamic + 1 KB = the whole 100 KB; one byte more cannot launch.
    expect(occ(GA102, 256, 32, dynamic=101376), 1, 8, 1 / 6, "shared_memory")
    assert occ(GA102, 256, 32, dynamic=101377).limiter == "cannot_launch"


@pytest.mark.parametrize("cc", [(7, 0), (7, 5), (8, 0), (8, 6), (8, 7), (8, 9), (9, 0), (10, 0),
                                (12, 0)])
def test_every_architecture_computes(cc):
    d = Device.for_compute_capability(*cc)
    o = occ(d, 256, 64, static=8 * KB, dynamic=4 * KB, carveout=50)
    assert 0 < o.blocks_per_sm <= d.max_blocks_per_sm and 0 < o.ratio <= 1


# --- device description

def test_from_attributes():
    attrs = {
        "compute_capability_major": 9, "compute_capability_minor": 0,
        "multiprocessor_count": 132, "warp_size": 32, "max_threads_per_block": 1024,
        "max_threads_per_multiprocessor": 2048, "max_blocks_per_multiprocessor": 32,
        "max_registers_per_multiprocessor": 65536, "max_registers_per_block": 65536,
        "max_shared_memory_per_multiprocessor": 233472, "max_shared_memory_per_block": 49152,
        "max_shared_memory_per_block_optin": 232448, "reserved_shared_memory_per_block": 1024,
        "name": "ignored",
    }
    assert set(Device.ATTRIBUTES) <= set(attrs)
    assert Device.from_attributes(attrs) == H200 == Device.for_compute_capability(9, 0, 132)
    del attrs["reserved_shared_memory_per_block"]
    with pytest.raises(ValueError, match="reserved_shared_memory_per_block"):
        Device.from_attributes(attrs)


# --- bad input

@pytest.mark.parametrize("launch, message", [
    (Launch(0, 32), "block of 0 threads"),
    (Launch(1025, 32), "block of 1025 threads"),
    (Launch(128, -1), "registers_per_thread"),
    (Launch(128, 32, static_shared_memory=-1), "static_shared_memory"),
    (Launch(128, 32, dynamic_shared_memory=-5), "dynamic_shared_memory"),
    (Launch(128, 32, carveout_percent=101), "carveout_percent"),
])
def test_bad_launch(launch, message):
    with pytest.raises(ValueError, match=message):
        theoretical(H200, launch)


def test_unknown_architecture():
    with pytest.raises(UnsupportedDevice, match="6.1"):
        theoretical(dataclasses.replace(H200, major=6, minor=1), Launch(128, 32))
    with pytest.raises(ValueError, match="13.0"):
        Device.for_compute_capability(13, 0)


# --- against the driver on the H200

def test_matches_driver_on_h200():
    if not FIXTURE.exists():
        pytest.skip(f"{FIXTURE.name} missing: run tests/gpu/occupancy_check.py on the H200 "
                    f"and save its --out there")
    data = json.loads(FIXTURE.read_text())
    device = Device.from_attributes(data["device"])
    checked, bad = 0, []
    for row in data["cases"]:
        c = dict(zip(data["columns"], row))
        c["kernel"] = "case"
        o = theoretical(device, Launch(c["block"], c["registers"], c["static_smem"],
                                       c["dynamic_smem"], c["carveout"]))
        checked += 1
        if o.blocks_per_sm != c["cuda_blocks"]:
            bad.append(f"{c['kernel']} regs {c['registers']} static {c['static_smem']} block "
                       f"{c['block']} dyn {c['dynamic_smem']} carveout {c['carveout']}: driver "
                       f"{c['cuda_blocks']}, ours {o.blocks_per_sm} ({o.limiter})")
    assert checked, "the fixture has no case the driver answered"
    assert not bad, f"{len(bad)} of {checked} cases differ from the driver:\n" + "\n".join(bad[:20])
