#!/usr/bin/env python3
"""gpuwatch's theoretical occupancy (gpuwatch.probes.cupti.occupancy) against the driver's
cuOccupancyMaxActiveBlocksPerMultiprocessor, on a real GPU.

Loads the cubins tests/gpu/build_occupancy_kernels.sh built (sm_90; listed in DIR/manifest.json)
and, for every kernel x block size x dynamic shared memory x carveout preference, asks the driver
how many blocks fit per SM and compares with our calculation. Needs cuda-bindings
(`from cuda.bindings import driver`) and gpuwatch importable (a PYTHONPATH directory whose
gpuwatch/probes and gpuwatch/agent link to this repository's probes/ and agent/).

Usage: python3 tests/gpu/occupancy_check.py --kernels .gpu-build/occupancy --out occupancy.json
Prints `OK occupancy: ...` or `BAD occupancy: ...`; exits 1 on any mismatch or CUDA error.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import json
import sys
import time
import traceback
from pathlib import Path

BLOCK_SIZES = (32, 33, 64, 96, 100, 128, 192, 256, 288, 384, 512, 640, 768, 1024)
DYNAMIC_SMEM = (0, 1024, 8 * 1024, 48 * 1024, 100 * 1024, 200 * 1024)
CARVEOUTS = (None, 0, 25, 50, 100)  # None: never set (the default preference)
DEFAULT_SMEM_PER_BLOCK = 48 * 1024  # without opt-in; beyond it MAX_DYNAMIC_SHARED_SIZE_BYTES


class CudaError(Exception):
    pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", required=True, help="directory with manifest.json and the cubins")
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--device", type=int, default=0)
    args = ap.parse_args()

    result: dict = {"device": {}, "kernels": [], "cases": [], "errors": []}
    try:
        return run(args, result)
    except Exception as e:  # report what was gathered so far, never just a traceback
        result["errors"].append(f"aborted: {type(e).__name__}: {e}")
        traceback.print_exc()
        print(f"BAD occupancy: aborted: {type(e).__name__}: {e}")
        return 2
    finally:
        write(args.out, result)


def write(path: str, result: dict) -> None:
    # One case per line: readable, diffable, and a few MB at most.
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    head = {k: v for k, v in result.items() if k != "cases"}
    text = json.dumps(head, indent=1)[:-2]  # reopen the object to append "cases"
    lines = ",\n".join("  " + json.dumps(c, separators=(",", ":")) for c in result["cases"])
    p.write_text(text + ',\n "cases": [\n' + lines + "\n ]\n}\n")


def load_occupancy():
    """gpuwatch's occupancy module; straight from the file when the package will not import
    (occupancy.py is stdlib only, its package may need more than this machine has)."""
    try:
        from gpuwatch.probes.cupti import occupancy
    except ImportError as e:
        import importlib.util
        path = Path(__file__).resolve().parents[2] / "probes" / "cupti" / "occupancy.py"
        print(f"  (gpuwatch not importable: {e}; loading {path})")
        spec = importlib.util.spec_from_file_location("gpuwatch_occupancy", path)
        occupancy = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = occupancy  # dataclasses look their module up
        spec.loader.exec_module(occupancy)
    return occupancy.Device, occupancy.Launch, occupancy.theoretical


def run(args, result: dict) -> int:
    t0 = time.monotonic()
    try:
        from cuda.bindings import driver
    except ImportError as e:
        result["errors"].append(f"cuda.bindings not importable: {e}")
        print(f"BAD occupancy: cuda.bindings not importable: {e}")
        return 2
    Device, Launch, theoretical = load_occupancy()

    ok = driver.CUresult.CUDA_SUCCESS

    def cu(fn, *a):
        """Call a cuda.bindings function; return its value(s) or raise CudaError naming it."""
        res = fn(*a)
        err, rest = res[0], res[1:]
        if err != ok:
            raise CudaError(f"{getattr(fn, '__name__', fn)}: {getattr(err, 'name', err)}")
        return rest[0] if len(rest) == 1 else rest

    manifest_path = Path(args.kernels) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())

    cu(driver.cuInit, 0)
    dev = cu(driver.cuDeviceGet, args.device)
    ctx = cu(driver.cuDevicePrimaryCtxRetain, dev)
    cu(driver.cuCtxSetCurrent, ctx)

    info: dict = {}
    try:
        info["name"] = cu(driver.cuDeviceGetName, 256, dev).split(b"\0")[0].decode(errors="replace")
    except CudaError as e:
        info["name"] = f"? ({e})"
    try:
        info["driver_version"] = cu(driver.cuDriverGetVersion)
    except CudaError as e:
        info["driver_version"] = str(e)
    try:
        from cuda.bindings import __version__ as bindings_version
    except ImportError:
        bindings_version = "?"
    info["cuda_bindings"] = bindings_version
    attrs = {}
    for name in Device.ATTRIBUTES:
        enum = getattr(driver.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_" + name.upper(), None)
        if enum is None:
            raise CudaError(f"cuda.bindings has no CU_DEVICE_ATTRIBUTE_{name.upper()}")
        attrs[name] = int(cu(driver.cuDeviceGetAttribute, enum, dev))
    info.update(attrs)
    result["device"] = info
    device = Device.from_attributes(attrs)
    print(f"device {args.device}: {info['name']}, sm_{device.major}{device.minor}, "
          f"{device.sm_count} SMs, driver {info['driver_version']}, cuda-bindings {bindings_version}")
    print("  " + ", ".join(f"{k}={v}" for k, v in attrs.items()))

    FA = driver.CUfunction_attribute
    A_REGS, A_SMEM = FA.CU_FUNC_ATTRIBUTE_NUM_REGS, FA.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
    A_THREADS = FA.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK
    A_MAXDYN = FA.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    A_CARVE = FA.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    A_LOCAL = FA.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES

    modules: dict[str, object] = {}
    keep_alive = []  # cubin buffers stay valid while their modules live
    cases = result["cases"]
    n_kernels = 0
    for entry in manifest["kernels"]:
        cubin, kname = entry["cubin"], entry["kernel"]
        label = f"{kname}@{cubin}"
        try:
            if cubin not in modules:
                data = (Path(args.kernels) / cubin).read_bytes()
                buf = ctypes.create_string_buffer(data, len(data))
                keep_alive.append(buf)
                modules[cubin] = cu(driver.cuModuleLoadData, ctypes.addressof(buf))
            func = cu(driver.cuModuleGetFunction, modules[cubin], kname.encode())
            regs = int(cu(driver.cuFuncGetAttribute, A_REGS, func))
            static = int(cu(driver.cuFuncGetAttribute, A_SMEM, func))
            max_threads = int(cu(driver.cuFuncGetAttribute, A_THREADS, func))
            kinfo = {"kernel": kname, "cubin": cubin, "registers": regs, "static_smem": static,
                     "max_threads_per_block": max_threads,
                     "ptxas_registers": entry.get("registers"),
                     "ptxas_static_smem": entry.get("static_smem")}
            for key, attr in (("default_max_dynamic_smem", A_MAXDYN),
                              ("default_carveout", A_CARVE), ("local_bytes", A_LOCAL)):
                try:
                    kinfo[key] = int(cu(driver.cuFuncGetAttribute, attr, func))
                except CudaError as e:
                    kinfo[key] = str(e)
        except (CudaError, OSError) as e:
            result["errors"].append(f"{label}: {e}")
            print(f"  ERROR {label}: {e}")
            continue
        result["kernels"].append(kinfo)
        n_kernels += 1

        optin_dyn = device.shared_memory_per_block_optin - static  # largest allowed dynamic size
        dyn_sizes = sorted(set(DYNAMIC_SMEM) | {max(optin_dyn, 0), optin_dyn + 128})
        for carveout in CARVEOUTS:
            carve_err = None
            if carveout is not None:
                try:
                    cu(driver.cuFuncSetAttribute, func, A_CARVE, carveout)
                except CudaError as e:
                    carve_err = str(e)
            for block in BLOCK_SIZES:
                if block > max_threads:
                    continue
                for dyn in dyn_sizes:
                    case = {"kernel": label, "registers": regs, "static_smem": static,
                            "block": block, "dynamic_smem": dyn, "carveout": carveout}
                    # Opt in to the dynamic size (the driver's default allows 48 KB - static);
                    # a size beyond the opt-in maximum is refused here and then gives 0 blocks.
                    want = max(dyn, DEFAULT_SMEM_PER_BLOCK - static, 0)
                    try:
                        cu(driver.cuFuncSetAttribute, func, A_MAXDYN, want)
                    except CudaError as e:
                        case["max_dynamic_refused"] = True
                        if static + want <= device.shared_memory_per_block_optin:
                            case["set_error"] = f"max dynamic {want}: {e}"
                    if carve_err:
                        case["set_error"] = f"carveout {carveout}: {carve_err}"
                    try:
                        case["cuda_blocks"] = int(cu(
                            driver.cuOccupancyMaxActiveBlocksPerMultiprocessor, func, block, dyn))
                    except CudaError as e:
                        case["cuda_blocks"] = None
                        case["cuda_error"] = str(e)
                    try:
                        occ = theoretical(device, Launch(block, regs, static, dyn, carveout))
                        case["ours_blocks"] = occ.blocks_per_sm
                        case["ours_limiter"] = occ.limiter
                    except Exception as e:  # our bug: record it, keep going
                        case["ours_blocks"] = None
                        case["ours_limiter"] = None
                        case["ours_error"] = f"{type(e).__name__}: {e}"
                    cases.append(case)
    try:  # tidy up; the process exits next anyway
        for mod in modules.values():
            driver.cuModuleUnload(mod)
        driver.cuDevicePrimaryCtxRelease(dev)
    except Exception as e:
        print(f"  (cleanup: {type(e).__name__}: {e})")

    return report(result, n_kernels, time.monotonic() - t0)


def report(result: dict, n_kernels: int, seconds: float) -> int:
    cases = result["cases"]
    def mismatch(c: dict) -> bool:
        return c.get("cuda_blocks") is not None and c["cuda_blocks"] != c["ours_blocks"]

    def error(c: dict) -> bool:
        # A driver error for a size beyond the opt-in maximum (which the driver refused to
        # set) is the driver saying "cannot launch" another way; only other errors count.
        refused = c.get("cuda_error") and c.get("max_dynamic_refused") \
            and c.get("ours_limiter") == "cannot_launch"
        return bool(c.get("set_error") or c.get("ours_error") or (c.get("cuda_error") and not refused))

    bad = [c for c in cases if mismatch(c)]
    errors = [c for c in cases if error(c)]
    per_kernel: dict[str, list] = collections.defaultdict(list)
    for c in cases:
        per_kernel[c["kernel"]].append(c)
    print(f"{'kernel':34} {'regs':>4} {'smem':>6} {'cases':>5} {'bad':>4}  limiters (ours)")
    for k, cs in per_kernel.items():
        lim = collections.Counter(c["ours_limiter"] for c in cs)
        nbad = sum(1 for c in cs if mismatch(c))
        print(f"{k:34} {cs[0]['registers']:>4} {cs[0]['static_smem']:>6} {len(cs):>5} {nbad:>4}  "
              + ", ".join(f"{n} {v}" for n, v in lim.most_common()))
    limiters = collections.Counter(c["ours_limiter"] for c in cases)
    print("limiters over all cases: " + ", ".join(f"{n} {v}" for n, v in limiters.most_common()))
    by_carve = collections.Counter(("default" if c["carveout"] is None else c["carveout"])
                                   for c in bad)
    result["summary"] = {"cases": len(cases), "mismatches": len(bad), "errors": len(errors),
                         "kernels": n_kernels, "seconds": round(seconds, 2),
                         "limiters": dict(limiters),
                         "mismatches_by_carveout": {str(k): v for k, v in by_carve.items()}}
    if not bad and not errors and not result["errors"] and cases:
        print(f"OK occupancy: {len(cases)} cases, 0 mismatches over {n_kernels} kernels "
              f"({seconds:.1f} s)")
        return 0
    print(f"BAD occupancy: {len(cases)} cases, {len(bad)} mismatches, {len(errors)} case errors, "
          f"{len(result['errors'])} kernel errors over {n_kernels} kernels ({seconds:.1f} s)")
    if by_carve:
        print("  mismatches by carveout: " + ", ".join(f"{k}: {v}" for k, v in by_carve.items()))
    for c in bad[:25]:
        print(f"  MISMATCH {c['kernel']} regs {c['registers']} static {c['static_smem']} block "
              f"{c['block']} dyn {c['dynamic_smem']} carveout {c['carveout']}: cuda "
              f"{c['cuda_blocks']}, ours {c['ours_blocks']} ({c['ours_limiter']})")
    for c in errors[:10]:
        print(f"  ERROR {c['kernel']} block {c['block']} dyn {c['dynamic_smem']} carveout "
              f"{c['carveout']}: "
              + "; ".join(c[k] for k in ("set_error", "cuda_error", "ours_error") if c.get(k)))
    for e in result["errors"][:10]:
        print(f"  ERROR {e}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
