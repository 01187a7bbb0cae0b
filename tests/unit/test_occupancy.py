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

# Documented limits per compute capability, for devices no test can ask:
# (max threads/SM, max blocks/SM, shared memory/SM, opt-in max per block, reserved per block).
KNOWN_LIMITS: dict[tuple[int, int], tuple[int, int, int, int, int]] = {
    (7, 0): (2048, 32, 96 * KB, 96 * KB, 0),
    (7, 2): (2048, 32, 96 * KB, 96 * KB, 0),
    (7, 5): (1024, 16, 64 * KB, 64 * KB, 0),
    (8, 0): (2048, 32, 164 * KB, 163 * KB, KB),
    (8, 6): (1536, 16, 100 * KB, 99 * KB, KB),
    (8, 7): (1536, 16, 164 * KB, 163 * KB, KB),
    (8, 9): (1536, 24, 100 * KB, 99 * KB, KB),
    (9, 0): (2048, 32, 228 * KB, 227 * KB, KB),
    (10, 0): (2048, 32, 228 * KB, 227 * KB, KB),
    (10, 3): (2048, 32, 228 * KB, 227 * KB, KB),
    (12, 0): (1536, 24, 100 * KB, 99 * KB, KB),
    (12, 1): (1536, 24, 100 * KB, 99 * KB, KB),
}


def device_for(major: int, minor: int, sm_count: int = 0) -> Device:
    """A device with the documented limits of its compute capability (all SKUs of one
    capability share them; only the SM count differs)."""
    threads, blocks, smem, optin, reserved = KNOWN_LIMITS[(major, minor)]
    return Device(major=major, minor=minor, sm_count=sm_count, warp_size=32,
                  max_threads_per_sm=threads, max_blocks_per_sm=blocks, registers_per_sm=65536,
                  max_registers_per_block=65536, shared_memory_per_sm=smem,
                  shared_memory_per_block_optin=optin, reserved_shared_memory_per_block=reserved)


# H100/H200 (sm_90) as the driver reports it.
H200 = Device(major=9, minor=0, sm_count=132, warp_size=32, max_threads_per_sm=2048,
              max_blocks_per_sm=32, registers_per_sm=65536, max_registers_per_block=65536,
              shared_memory_per_sm=233472, shared_memory_per_block_optin=232448,
              reserved_shared_memory_per_block=1024)
A100 = device_for(8, 0, sm_count=108)
GA102 = device_for(8, 6, sm_count=84)


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
    d = device_for(*cc)
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
    assert Device.from_attributes(attrs) == H200 == device_for(9, 0, 132)
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


# --- other architectures, worked out by hand -----------------------------------------------------
# Documented limits (CUDA C++ Programming Guide, "Technical Specifications per Compute Capability";
# allocation rules as cuda_occupancy.h has them). On every architecture here: 65536 registers per
# SM in 4 sub-partitions of 16384, allocated per warp in units of 256, at most 255 per thread.
#   cc    warps/SM  blocks/SM  shared memory/SM (configs)            granularity  reserved/block
#   7.0   64        32         96 KB (0/8/16/32/64/96)                256          0
#   7.5   32        16         64 KB (32/64)                          256          0
#   8.0   64        32         164 KB (0/8/16/32/64/100/132/164)      128          1 KB
#   8.6   48        16         100 KB (0/8/16/32/64/100)              128          1 KB
#   8.7   48        16         164 KB (as 8.0)                        128          1 KB
#   8.9   48        24         100 KB (as 8.6)                        128          1 KB
#   10.0  64        32         228 KB (as 9.0)                        128          1 KB
#   12.0  48        24         100 KB (as 8.6)                        128          1 KB
# Registers per warp = roundup(regs x 32, 256); warps the registers allow = 16384 // that x 4;
# shared memory per block = roundup(static + dynamic + reserved, granularity).

V100 = device_for(7, 0, sm_count=80)
T4 = device_for(7, 5, sm_count=40)
ORIN = device_for(8, 7, sm_count=16)
AD102 = device_for(8, 9, sm_count=128)
B200 = device_for(10, 0, sm_count=148)
GB202 = device_for(12, 0, sm_count=170)


def exact(o, blocks, warps, max_warps, limiter, limits, regs_per_block, smem_per_block, smem_per_sm):
    assert (o.blocks_per_sm, o.warps_per_sm, o.max_warps_per_sm, o.limiter, o.reason) == (
        blocks, warps, max_warps, limiter, ""), o
    assert o.ratio == warps / max_warps
    assert dict(o.limits) == limits and [n for n, _ in o.limits] == list(limits)
    assert all(type(n) is int for _, n in o.limits) and type(o.blocks_per_sm) is int
    assert (o.registers_per_block, o.shared_memory_per_block, o.shared_memory_per_sm) == (
        regs_per_block, smem_per_block, smem_per_sm)


def test_sm70_v100():
    # warps: 768 threads = 24 warps, 64 // 24 = 2 blocks; 16 regs = 512/warp, 16384 // 512 x 4 =
    # 128 warps, 128 // 24 = 5 blocks; no shared memory (Volta reserves none).
    exact(occ(V100, 768, 16), 2, 48, 64, "warps", {"warps": 2, "registers": 5, "blocks": 32}, 512 * 24, 0, 96 * KB)
    # registers: 64 regs = 2048/warp, 8 per sub-partition = 32 warps = 8 blocks of 4 warps
    exact(occ(V100, 128, 64), 8, 32, 64, "registers", {"warps": 16, "registers": 8, "blocks": 32}, 8192, 0, 96 * KB)
    # one more register: 65 x 32 = 2080 -> 2304/warp, 16384 // 2304 = 7 -> 28 warps = 7 blocks
    exact(occ(V100, 128, 65), 7, 28, 64, "registers", {"warps": 16, "registers": 7, "blocks": 32}, 9216, 0, 96 * KB)
    # blocks: 1 warp of 16 regs: warps 64, registers 128, blocks 32
    exact(occ(V100, 32, 16), 32, 32, 64, "blocks", {"warps": 64, "registers": 128, "blocks": 32}, 512, 0, 96 * KB)
    # shared memory in 256-byte units: 13952 bytes (109 x 128) take 14080 (55 x 256); 98304 // 14080
    # = 6 blocks (it would be 7 in 128-byte units: 98304 // 13952)
    exact(occ(V100, 32, 16, dynamic=13952), 6, 6, 64, "shared_memory",
          {"warps": 64, "registers": 128, "shared_memory": 6, "blocks": 32}, 512, 14080, 96 * KB)
    # 96 KB exactly fits one block (no reserved part); one byte more cannot launch
    exact(occ(V100, 128, 32, dynamic=96 * KB), 1, 4, 64, "shared_memory",
          {"warps": 16, "registers": 16, "shared_memory": 1, "blocks": 32}, 4096, 98304, 96 * KB)
    o = occ(V100, 128, 32, dynamic=96 * KB + 1)
    assert (o.limiter, o.registers_per_block, o.shared_memory_per_block, o.max_warps_per_sm) == (
        "cannot_launch", 4096, 98560, 64)
    assert o.reason == ("needs 98560 bytes of shared memory per block (static 0 + dynamic 98305 + reserved 0, "
                        "in 256-byte units), over the per-block limit of 98304")


def test_sm70_carveout():
    # 50 % of 96 KB = 49152 -> the 64 KB configuration; 16 KB per block -> 4 blocks
    exact(occ(V100, 128, 32, dynamic=16 * KB, carveout=50), 4, 16, 64, "shared_memory",
          {"warps": 16, "registers": 16, "shared_memory": 4, "blocks": 32}, 4096, 16384, 64 * KB)
    # 0 % and no shared memory: the 0 KB configuration (nothing reserved on Volta)
    exact(occ(V100, 128, 32, carveout=0), 16, 64, 64, "warps", {"warps": 16, "registers": 16, "blocks": 32},
          4096, 0, 0)
    # 0 % but a block needs 32 KB: the smallest configuration holding it is 32 KB itself -> 1 block
    exact(occ(V100, 128, 32, static=32 * KB, carveout=0), 1, 4, 64, "shared_memory",
          {"warps": 16, "registers": 16, "shared_memory": 1, "blocks": 32}, 4096, 32 * KB, 32 * KB)


def test_sm75_turing():
    # 32 warps per SM: a block of 1024 threads fills it
    exact(occ(T4, 1024, 32), 1, 32, 32, "warps", {"warps": 1, "registers": 2, "blocks": 16}, 1024 * 32, 0, 64 * KB)
    # 64 regs, 8 warps: registers allow 32 warps = 4 blocks, as many as the warp slots: "warps"
    exact(occ(T4, 256, 64), 4, 32, 32, "warps", {"warps": 4, "registers": 4, "blocks": 16}, 16384, 0, 64 * KB)
    # 72 regs = 2304/warp: 7 per sub-partition = 28 warps = 3 blocks of 8
    exact(occ(T4, 256, 72), 3, 24, 32, "registers", {"warps": 4, "registers": 3, "blocks": 16}, 18432, 0, 64 * KB)
    # blocks: 16
    exact(occ(T4, 32, 16), 16, 16, 32, "blocks", {"warps": 32, "registers": 128, "blocks": 16}, 512, 0, 64 * KB)
    # 8 KB per block: 64 KB // 8 KB = 8 blocks; with carveout 0 the smallest Turing
    # configuration is 32 KB: 4 blocks
    exact(occ(T4, 64, 32, dynamic=8 * KB), 8, 16, 32, "shared_memory",
          {"warps": 16, "registers": 32, "shared_memory": 8, "blocks": 16}, 2048, 8192, 64 * KB)
    exact(occ(T4, 64, 32, dynamic=8 * KB, carveout=0), 4, 8, 32, "shared_memory",
          {"warps": 16, "registers": 32, "shared_memory": 4, "blocks": 16}, 2048, 8192, 32 * KB)


def test_sm80_a100_limits():
    # warps: 20 warps/block, 64 // 20 = 3; 16 regs allow 128 warps = 6 blocks; 1 KB reserved per
    # block: 167936 // 1024 = 164 blocks
    exact(occ(A100, 640, 16), 3, 60, 64, "warps",
          {"warps": 3, "registers": 6, "shared_memory": 164, "blocks": 32}, 512 * 20, 1024, 164 * KB)
    # registers: 40 regs = 1280/warp, 12 per sub-partition = 48 warps = 6 blocks of 8
    exact(occ(A100, 256, 40), 6, 48, 64, "registers",
          {"warps": 8, "registers": 6, "shared_memory": 164, "blocks": 32}, 1280 * 8, 1024, 164 * KB)
    # 32 regs = 1024/warp: 64 warps = 8 blocks, a tie with the warp slots
    exact(occ(A100, 256, 32), 8, 64, 64, "warps",
          {"warps": 8, "registers": 8, "shared_memory": 164, "blocks": 32}, 8192, 1024, 164 * KB)
    # blocks
    exact(occ(A100, 32, 16), 32, 32, 64, "blocks",
          {"warps": 64, "registers": 128, "shared_memory": 164, "blocks": 32}, 512, 1024, 164 * KB)
    # shared memory on both sides of 5 blocks: 32512 + 1024 = 33536, 5 x 33536 = 167680 <= 167936;
    # one byte more: 33537 -> 33664, 5 x 33664 = 168320 > 167936: 4 blocks
    exact(occ(A100, 128, 32, dynamic=32512), 5, 20, 64, "shared_memory",
          {"warps": 16, "registers": 16, "shared_memory": 5, "blocks": 32}, 4096, 33536, 164 * KB)
    exact(occ(A100, 128, 32, dynamic=32513), 4, 16, 64, "shared_memory",
          {"warps": 16, "registers": 16, "shared_memory": 4, "blocks": 32}, 4096, 33664, 164 * KB)
    # opt-in maximum: 163 KB + 1 KB reserved = 167936 fits once; one byte more cannot launch
    assert occ(A100, 128, 32, dynamic=163 * KB).blocks_per_sm == 1
    o = occ(A100, 128, 32, dynamic=163 * KB + 1)
    assert (o.limiter, o.shared_memory_per_block, o.registers_per_block) == ("cannot_launch", 168064, 4096)


def test_sm86_limits():
    # registers: 64 regs = 2048/warp, 32 warps = 8 blocks of 4 (warps would allow 48 // 4 = 12)
    exact(occ(GA102, 128, 64), 8, 32, 48, "registers",
          {"warps": 12, "registers": 8, "shared_memory": 100, "blocks": 16}, 8192, 1024, 100 * KB)
    # 56 regs = 1792/warp: 9 per sub-partition, 36 warps, 9 blocks
    exact(occ(GA102, 128, 56), 9, 36, 48, "registers",
          {"warps": 12, "registers": 9, "shared_memory": 100, "blocks": 16}, 7168, 1024, 100 * KB)
    # 40 regs = 1280/warp: 48 warps, 12 blocks, a tie with the 48 warp slots
    exact(occ(GA102, 128, 40), 12, 48, 48, "warps",
          {"warps": 12, "registers": 12, "shared_memory": 100, "blocks": 16}, 5120, 1024, 100 * KB)
    # warps: 32 warps/block, 48 // 32 = 1
    exact(occ(GA102, 1024, 16), 1, 32, 48, "warps",
          {"warps": 1, "registers": 4, "shared_memory": 100, "blocks": 16}, 512 * 32, 1024, 100 * KB)
    # shared memory on both sides of 3 blocks: 33024 + 1024 = 34048, 3 x 34048 = 102144 <= 102400;
    # 33025 -> 34176, 3 x 34176 = 102528 > 102400: 2 blocks
    exact(occ(GA102, 64, 32, dynamic=33024), 3, 6, 48, "shared_memory",
          {"warps": 24, "registers": 32, "shared_memory": 3, "blocks": 16}, 2048, 34048, 100 * KB)
    exact(occ(GA102, 64, 32, dynamic=33025), 2, 4, 48, "shared_memory",
          {"warps": 24, "registers": 32, "shared_memory": 2, "blocks": 16}, 2048, 34176, 100 * KB)
    # carveout 50 %: 51200 -> the 64 KB configuration; 17408 per block: 65536 // 17408 = 3
    # (the default 100 KB: 102400 // 17408 = 5)
    exact(occ(GA102, 128, 32, dynamic=16 * KB, carveout=50), 3, 12, 48, "shared_memory",
          {"warps": 12, "registers": 16, "shared_memory": 3, "blocks": 16}, 4096, 17408, 64 * KB)
    assert occ(GA102, 128, 32, dynamic=16 * KB).blocks_per_sm == 5


def test_sm87_orin():
    # 48 warps and 16 blocks as sm_86, 164 KB as sm_80: 48 KB + 1 KB = 50176, 167936 // 50176 = 3
    exact(occ(ORIN, 128, 32, dynamic=48 * KB), 3, 12, 48, "shared_memory",
          {"warps": 12, "registers": 16, "shared_memory": 3, "blocks": 16}, 4096, 50176, 164 * KB)
    exact(occ(ORIN, 32, 16), 16, 16, 48, "blocks",
          {"warps": 48, "registers": 128, "shared_memory": 164, "blocks": 16}, 512, 1024, 164 * KB)


def test_sm89_ada():
    # 24 blocks, not sm_86's 16
    exact(occ(AD102, 32, 16), 24, 24, 48, "blocks",
          {"warps": 48, "registers": 128, "shared_memory": 100, "blocks": 24}, 512, 1024, 100 * KB)
    # 2 warps/block: 48 // 2 = 24, a tie with the block limit: "warps"
    exact(occ(AD102, 64, 16), 24, 48, 48, "warps",
          {"warps": 24, "registers": 64, "shared_memory": 100, "blocks": 24}, 1024, 1024, 100 * KB)
    # 128 regs = 4096/warp: 4 per sub-partition, 16 warps = 16 blocks of 1
    exact(occ(AD102, 32, 128), 16, 16, 48, "registers",
          {"warps": 48, "registers": 16, "shared_memory": 100, "blocks": 24}, 4096, 1024, 100 * KB)
    # 8 KB + 1 KB = 9216: 102400 // 9216 = 11
    exact(occ(AD102, 32, 16, dynamic=8 * KB), 11, 11, 48, "shared_memory",
          {"warps": 48, "registers": 128, "shared_memory": 11, "blocks": 24}, 512, 9216, 100 * KB)


def test_sm100_b200():
    # 3 warps/block: 64 // 3 = 21 blocks, 63 warps; 10 regs = 320 -> 512/warp, 128 warps = 42 blocks
    exact(occ(B200, 96, 10), 21, 63, 64, "warps",
          {"warps": 21, "registers": 42, "shared_memory": 228, "blocks": 32}, 512 * 3, 1024, 228 * KB)
    # 32 KB + 1 KB = 33792: 233472 // 33792 = 6 by default; carveout 75 %: 175104 -> the 196 KB
    # configuration, 200704 // 33792 = 5
    exact(occ(B200, 128, 32, dynamic=32 * KB), 6, 24, 64, "shared_memory",
          {"warps": 16, "registers": 16, "shared_memory": 6, "blocks": 32}, 4096, 33792, 228 * KB)
    exact(occ(B200, 128, 32, dynamic=32 * KB, carveout=75), 5, 20, 64, "shared_memory",
          {"warps": 16, "registers": 16, "shared_memory": 5, "blocks": 32}, 4096, 33792, 196 * KB)


def test_sm120_blackwell_geforce():
    exact(occ(GB202, 32, 16), 24, 24, 48, "blocks",
          {"warps": 48, "registers": 128, "shared_memory": 100, "blocks": 24}, 512, 1024, 100 * KB)
    # 64 regs, 8 warps: registers allow 32 warps = 4 blocks; warps 48 // 8 = 6
    exact(occ(GB202, 256, 64), 4, 32, 48, "registers",
          {"warps": 6, "registers": 4, "shared_memory": 100, "blocks": 24}, 16384, 1024, 100 * KB)


def test_carveout_just_above_a_configuration():
    # 44 % of 233472 = 102727.68, floored to 102727: just above 100 KB (102400), so 132 KB;
    # 17408 per block -> 135168 // 17408 = 7 (100 KB would give 5)
    o = occ(H200, 128, 32, dynamic=16 * KB, carveout=44)
    assert (o.blocks_per_sm, o.shared_memory_per_sm) == (7, 132 * KB)
    # 43 % = 100392.96: the 100 KB configuration, 5 blocks
    o = occ(H200, 128, 32, dynamic=16 * KB, carveout=43)
    assert (o.blocks_per_sm, o.shared_memory_per_sm) == (5, 100 * KB)


def test_carveout_of_an_odd_shared_memory_size_is_floored():
    # A device reporting 65537 bytes: 50 % is 32768 bytes (floored), the 32 KB configuration,
    # not 32768.5 (which would take 64 KB).
    device = dataclasses.replace(V100, shared_memory_per_sm=65537)
    assert occ(device, 128, 32, dynamic=8 * KB, carveout=50).shared_memory_per_sm == 32 * KB


def test_a_device_with_more_shared_memory_than_any_configuration():
    # Attributes beyond the architecture's table (a newer driver): the largest configuration.
    device = dataclasses.replace(H200, shared_memory_per_sm=256 * KB)
    o = occ(device, 128, 32, dynamic=16 * KB)
    assert (o.shared_memory_per_sm, o.blocks_per_sm) == (228 * KB, 13)


def test_cannot_launch_details():
    o = occ(H200, 128, 256)
    assert (o.blocks_per_sm, o.warps_per_sm, o.max_warps_per_sm, o.ratio, o.limits) == (0, 0, 64, 0.0, ())
    assert (o.registers_per_block, o.shared_memory_per_block, o.shared_memory_per_sm) == (8192 * 4, 0, 0)
    assert o.reason == "256 registers per thread, over the limit of 255"
    o = occ(H200, 320, 192)
    assert (o.registers_per_block, o.shared_memory_per_block) == (6144 * 10, 0)
    assert o.reason == ("needs 73728 registers per block (192 per thread, 6144 per warp, 10 warps rounded up to "
                        "12 for 4 sub-partitions), over the limit of 65536")
    o = occ(H200, 128, 32, dynamic=232449)
    assert (o.registers_per_block, o.shared_memory_per_block, o.max_warps_per_sm) == (4096, 233600, 64)
    assert o.reason == ("needs 233600 bytes of shared memory per block (static 0 + dynamic 232449 + reserved 1024, "
                        "in 128-byte units), over the per-block limit of 233472")


def test_inconsistent_device_attributes_say_which_resource():
    # A device claiming 512 threads per SM with 1024-thread blocks: no block fits the warp slots.
    o = occ(dataclasses.replace(H200, max_threads_per_sm=512), 1024, 32, dynamic=KB)
    assert (o.blocks_per_sm, o.limiter, o.max_warps_per_sm) == (0, "cannot_launch", 16)
    assert o.reason == "not even one block fits the SM's warps"
    assert (o.registers_per_block, o.shared_memory_per_block) == (32768, 2048)
    o = occ(dataclasses.replace(H200, registers_per_sm=8192), 256, 64)
    assert o.reason == "not even one block fits the SM's registers"


def test_smallest_valid_inputs():
    # one thread; a device whose every limit is 1 block
    expect(occ(H200, 1, 16), 32, 32, 0.5, "blocks")
    expect(occ(dataclasses.replace(H200, max_blocks_per_sm=1), 32, 16), 1, 1, 1 / 64, "blocks")
    assert device_for(8, 0).sm_count == 0


@pytest.mark.parametrize("name", ["warp_size", "max_threads_per_block", "max_threads_per_sm", "max_blocks_per_sm",
                                  "registers_per_sm", "max_registers_per_block", "shared_memory_per_sm"])
def test_device_limits_must_be_positive(name):
    with pytest.raises(ValueError) as caught:
        theoretical(dataclasses.replace(H200, **{name: 0}), Launch(32, 16))
    assert str(caught.value) == f"device {name} must be positive, got 0"


@pytest.mark.parametrize("name", ["shared_memory_per_block_optin", "reserved_shared_memory_per_block"])
def test_device_sizes_must_not_be_negative(name):
    with pytest.raises(ValueError) as caught:
        theoretical(dataclasses.replace(H200, **{name: -1}), Launch(32, 16))
    assert str(caught.value) == f"device {name} must not be negative, got -1"


def test_messages_of_bad_input():
    with pytest.raises(UnsupportedDevice) as caught:
        theoretical(dataclasses.replace(H200, major=6, minor=1), Launch(128, 32))
    assert str(caught.value) == ("no occupancy rules for compute capability 6.1 (known: 7.0, 7.2, 7.5, 8.0, 8.6, "
                                 "8.7, 8.9, 9.0, 10.0, 10.1, 10.3, 11.0, 12.0, 12.1)")
    with pytest.raises(ValueError) as caught:
        Device.from_attributes({"warp_size": 32})
    assert str(caught.value).startswith("device attributes missing: compute_capability_major, "
                                        "compute_capability_minor, multiprocessor_count, max_threads_per_block")
    with pytest.raises(ValueError, match="carveout_percent must be 0..100, -1 or None"):
        theoretical(H200, Launch(128, 32, carveout_percent=-2))
