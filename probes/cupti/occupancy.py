"""Theoretical occupancy: how many blocks of a kernel launch fit on one SM at once.

Our own implementation of what cuOccupancyMaxActiveBlocksPerMultiprocessor computes, from the
rules the CUDA documentation and cuda_occupancy.h describe, so that the in-process agent can
judge every kernel CUPTI reports (block size, registers, shared memory, carveout) without a
CUDA call per kernel. Stdlib only: this module is imported inside users' training processes.

Four resources bound the number of resident blocks per SM; the smallest bound wins:
  warps          warp slots per SM / warps per block
  registers      registers are given to warps in fixed chunks, per SM sub-partition
  shared_memory  the shared-memory size the SM is configured with (carveout) / bytes per block
  blocks         the architecture's limit on resident blocks per SM
A launch that cannot run at all (too many registers or too much shared memory for one block)
gives 0 blocks, limiter "cannot_launch" and a reason.

tests/gpu/occupancy_check.py compares this with the driver on a real GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from gpuwatch.agent.api import GpuwatchError

KB = 1024

# Limiters, in the order a tie is reported: with equal bounds the first one named is the limiter
# (a full SM reads "warps", not "blocks").
LIMITERS = ("warps", "registers", "shared_memory", "blocks")


class UnsupportedDevice(GpuwatchError, ValueError):
    """The compute capability is one whose occupancy rules this module does not know."""


@dataclass(frozen=True)
class Architecture:
    """Per-architecture rules that are not device attributes."""

    max_blocks_per_sm: int
    # Shared-memory sizes (bytes) an SM can be configured with; a carveout preference is rounded
    # up to the next one.
    shared_memory_configs: tuple[int, ...]
    shared_memory_granularity: int = 128  # a block's shared memory is allocated in these units
    register_allocation_unit: int = 256  # registers are allocated per warp in these units
    max_registers_per_thread: int = 255
    sub_partitions: int = 4  # registers are split evenly between the SM's sub-partitions


def _kb(*sizes: int) -> tuple[int, ...]:
    return tuple(s * KB for s in sizes)


_VOLTA_SMEM = _kb(0, 8, 16, 32, 64, 96)
_TURING_SMEM = _kb(32, 64)
_A100_SMEM = _kb(0, 8, 16, 32, 64, 100, 132, 164)
_GA10X_SMEM = _kb(0, 8, 16, 32, 64, 100)
_HOPPER_SMEM = _kb(0, 8, 16, 32, 64, 100, 132, 164, 196, 228)

_ARCHITECTURES: dict[tuple[int, int], Architecture] = {
    (7, 0): Architecture(32, _VOLTA_SMEM, shared_memory_granularity=256),
    (7, 2): Architecture(32, _VOLTA_SMEM, shared_memory_granularity=256),
    (7, 5): Architecture(16, _TURING_SMEM, shared_memory_granularity=256),
    (8, 0): Architecture(32, _A100_SMEM),
    (8, 6): Architecture(16, _GA10X_SMEM),
    (8, 7): Architecture(16, _A100_SMEM),
    (8, 9): Architecture(24, _GA10X_SMEM),
    (9, 0): Architecture(32, _HOPPER_SMEM),
    (10, 0): Architecture(32, _HOPPER_SMEM),
    (10, 1): Architecture(24, _HOPPER_SMEM),  # Thor before CUDA 13 renumbered it 11.0
    (10, 3): Architecture(32, _HOPPER_SMEM),
    (11, 0): Architecture(24, _HOPPER_SMEM),
    (12, 0): Architecture(24, _GA10X_SMEM),
    (12, 1): Architecture(24, _GA10X_SMEM),
}


def architecture(major: int, minor: int) -> Architecture:
    try:
        return _ARCHITECTURES[(major, minor)]
    except KeyError:
        known = ", ".join(f"{a}.{b}" for a, b in sorted(_ARCHITECTURES))
        raise UnsupportedDevice(
            f"no occupancy rules for compute capability {major}.{minor} (known: {known})") from None


# Device attributes (cuda.bindings CU_DEVICE_ATTRIBUTE_* names, lowercased, prefix dropped)
# → Device field.
_ATTRIBUTE_FIELDS = {
    "compute_capability_major": "major",
    "compute_capability_minor": "minor",
    "multiprocessor_count": "sm_count",
    "warp_size": "warp_size",
    "max_threads_per_block": "max_threads_per_block",
    "max_threads_per_multiprocessor": "max_threads_per_sm",
    "max_blocks_per_multiprocessor": "max_blocks_per_sm",
    "max_registers_per_multiprocessor": "registers_per_sm",
    "max_registers_per_block": "max_registers_per_block",
    "max_shared_memory_per_multiprocessor": "shared_memory_per_sm",
    "max_shared_memory_per_block": "shared_memory_per_block",
    "max_shared_memory_per_block_optin": "shared_memory_per_block_optin",
    "reserved_shared_memory_per_block": "reserved_shared_memory_per_block",
}

@dataclass(frozen=True)
class Device:
    """What occupancy depends on, as the device reports it (see from_attributes)."""

    major: int
    minor: int
    sm_count: int
    warp_size: int
    max_threads_per_sm: int
    max_blocks_per_sm: int
    registers_per_sm: int
    max_registers_per_block: int
    shared_memory_per_sm: int
    shared_memory_per_block_optin: int
    reserved_shared_memory_per_block: int
    max_threads_per_block: int = 1024
    shared_memory_per_block: int = 48 * KB  # the limit without opt-in

    # The device attributes from_attributes needs; query each with cuDeviceGetAttribute.
    ATTRIBUTES = tuple(_ATTRIBUTE_FIELDS)

    @classmethod
    def from_attributes(cls, attrs: Mapping[str, int]) -> "Device":
        missing = [name for name in _ATTRIBUTE_FIELDS if name not in attrs]
        if missing:
            raise ValueError(f"device attributes missing: {', '.join(missing)}")
        return cls(**{field: int(attrs[name]) for name, field in _ATTRIBUTE_FIELDS.items()})

    @property
    def max_warps_per_sm(self) -> int:
        return self.max_threads_per_sm // self.warp_size


@dataclass(frozen=True)
class Launch:
    """One kernel launch as CUPTI describes it."""

    block_threads: int
    registers_per_thread: int
    static_shared_memory: int = 0
    dynamic_shared_memory: int = 0
    # Preferred shared-memory carveout in percent of the SM's maximum shared memory; None (or
    # -1, CU_SHAREDMEM_CARVEOUT_DEFAULT) when the kernel did not ask for one.
    carveout_percent: int | None = None


@dataclass(frozen=True)
class Occupancy:
    blocks_per_sm: int
    warps_per_sm: int
    max_warps_per_sm: int
    ratio: float  # active warps / max warps, 0..1
    limiter: str  # one of LIMITERS, or "cannot_launch"
    reason: str = ""  # why the launch cannot run; empty otherwise
    # Blocks per SM each resource alone would allow (name, blocks), for explaining the limiter;
    # a resource the kernel does not use is left out.
    limits: tuple[tuple[str, int], ...] = ()
    registers_per_block: int = 0  # as allocated
    shared_memory_per_block: int = 0  # as allocated, reserved part included
    shared_memory_per_sm: int = 0  # the shared-memory configuration the SM would run with


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def _check(device: Device, launch: Launch) -> Architecture:
    arch = architecture(device.major, device.minor)
    for name in ("warp_size", "max_threads_per_block", "max_threads_per_sm", "max_blocks_per_sm",
                 "registers_per_sm", "max_registers_per_block", "shared_memory_per_sm"):
        if getattr(device, name) <= 0:
            raise ValueError(f"device {name} must be positive, got {getattr(device, name)}")
    for name in ("shared_memory_per_block_optin", "reserved_shared_memory_per_block"):
        if getattr(device, name) < 0:
            raise ValueError(f"device {name} must not be negative, got {getattr(device, name)}")
    b = launch.block_threads
    if not 1 <= b <= device.max_threads_per_block:
        raise ValueError(
            f"block of {b} threads: must be 1..{device.max_threads_per_block} threads")
    for name in ("registers_per_thread", "static_shared_memory", "dynamic_shared_memory"):
        if getattr(launch, name) < 0:
            raise ValueError(f"{name} must not be negative, got {getattr(launch, name)}")
    c = launch.carveout_percent
    if c is not None and not -1 <= c <= 100:
        raise ValueError(f"carveout_percent must be 0..100, -1 or None (default), got {c}")
    return arch


def _config_at_least(arch: Architecture, size: int) -> int:
    """The smallest shared-memory configuration holding size bytes (the largest if none)."""
    for config in arch.shared_memory_configs:
        if config >= size:
            return config
    return arch.shared_memory_configs[-1]


def theoretical(device: Device, launch: Launch) -> Occupancy:
    """Theoretical occupancy of `launch` on `device`. Raises ValueError on impossible input
    (block size out of range, negative sizes) and UnsupportedDevice for unknown architectures."""
    arch = _check(device, launch)
    max_warps = device.max_warps_per_sm
    warps_per_block = -(-launch.block_threads // device.warp_size)

    def cannot(reason: str, regs: int = 0, smem: int = 0) -> Occupancy:
        return Occupancy(0, 0, max_warps, 0.0, "cannot_launch", reason,
                         registers_per_block=regs, shared_memory_per_block=smem)

    # Registers: each warp gets regs/thread x warp size rounded up to the allocation unit.
    # The hardware's per-block check counts warps as if spread over all sub-partitions, so the
    # warp count is rounded up to a multiple of the sub-partitions there.
    regs = launch.registers_per_thread
    regs_per_warp = _round_up(regs * device.warp_size, arch.register_allocation_unit)
    regs_per_block = regs_per_warp * warps_per_block
    if regs > arch.max_registers_per_thread:
        return cannot(f"{regs} registers per thread, over the limit of "
                      f"{arch.max_registers_per_thread}", regs_per_block)
    regs_checked = regs_per_warp * _round_up(warps_per_block, arch.sub_partitions)
    if max(regs_checked, regs_per_block) > device.max_registers_per_block:
        return cannot(
            f"needs {regs_checked} registers per block ({regs} per thread, "
            f"{regs_per_warp} per warp, {warps_per_block} warps rounded up to "
            f"{_round_up(warps_per_block, arch.sub_partitions)} for "
            f"{arch.sub_partitions} sub-partitions), over the limit of "
            f"{device.max_registers_per_block}", regs_per_block)

    # Shared memory: static + dynamic + the driver's reserved part, in allocation units.
    smem_used = (launch.static_shared_memory + launch.dynamic_shared_memory
                 + device.reserved_shared_memory_per_block)
    smem_per_block = _round_up(smem_used, arch.shared_memory_granularity)
    # Beyond the default 48 KB a kernel must opt in (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)
    # up to the opt-in maximum; a launch CUPTI saw did so, so the opt-in maximum is the limit.
    # The reserved part comes on top.
    smem_block_limit = (max(device.shared_memory_per_block_optin, device.shared_memory_per_block)
                        + device.reserved_shared_memory_per_block)
    if smem_per_block > smem_block_limit:
        return cannot(
            f"needs {smem_per_block} bytes of shared memory per block (static "
            f"{launch.static_shared_memory} + dynamic {launch.dynamic_shared_memory} + reserved "
            f"{device.reserved_shared_memory_per_block}, in {arch.shared_memory_granularity}-byte "
            f"units), over the per-block limit of {smem_block_limit}", regs_per_block,
            smem_per_block)

    # The SM's shared-memory size: the carveout preference (percent of the maximum) rounded up
    # to a supported configuration, or the maximum by default. It is only a hint: when one
    # block needs more, the driver picks the smallest configuration that holds it.
    carveout = launch.carveout_percent
    if carveout is None or carveout < 0:
        preferred = device.shared_memory_per_sm
    else:
        preferred = carveout * device.shared_memory_per_sm // 100
    smem_per_sm = min(_config_at_least(arch, preferred), device.shared_memory_per_sm)
    if smem_per_sm < smem_per_block:
        smem_per_sm = min(_config_at_least(arch, smem_per_block), device.shared_memory_per_sm)

    # Blocks per SM each resource allows; a resource the kernel does not use bounds nothing.
    limits = [("warps", max_warps // warps_per_block)]
    if regs_per_warp:
        warps_by_regs = (device.registers_per_sm // arch.sub_partitions // regs_per_warp
                         * arch.sub_partitions)
        limits.append(("registers", warps_by_regs // warps_per_block))
    if smem_per_block:
        limits.append(("shared_memory", smem_per_sm // smem_per_block))
    limits.append(("blocks", device.max_blocks_per_sm))
    blocks = min(n for _, n in limits)
    if blocks == 0:  # only with inconsistent device attributes; say which resource
        short = next(name for name, n in limits if n == 0)
        return cannot(f"not even one block fits the SM's {short}", regs_per_block, smem_per_block)
    limiter = next(name for name, n in limits if n == blocks)
    warps = blocks * warps_per_block
    return Occupancy(blocks, warps, max_warps, warps / max_warps, limiter, "", tuple(limits),
                     regs_per_block, smem_per_block, smem_per_sm)
