"""The child that runs bcc for the agent (see compiler.py): `compile` (the C text on stdin, the
object as JSON on stdout) and `symbolise PID` (addresses as JSON on stdin). Exit status 3: a
message for a person on stderr's last line. Never imported by the agent itself.
"""
from __future__ import annotations

import base64
import ctypes
import json
import resource
import struct
import sys
import time

from gpuwatch.probes.ebpf import bpfsys, symbols
from gpuwatch.probes.ebpf.compiler import FORMAT, LD_IMM64, MAP_NAMES, PSEUDO_MAP_FD
from gpuwatch.probes.ebpf.loader import BCC_REMEDY, kernel_headers


def _import_bcc():
    import warnings
    with warnings.catch_warnings():
        # bcc 0.26's own module has an invalid escape sequence; its warning is noise to our users.
        warnings.simplefilter("ignore", SyntaxWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        import bcc
    return bcc


def _compile(text: bytes) -> dict:
    bcc = _import_bcc()
    t0 = time.perf_counter()
    try:
        b = bcc.BPF(text=text, cflags=["-Wno-macro-redefined", "-Wno-unused-function"])
    except Exception as e:
        _fail(f"bcc could not compile the probe ({e}); the kernel headers used are {kernel_headers()}: "
              f"install linux-headers for the running kernel (`gpuwatch doctor` says what is missing)")
    seconds = time.perf_counter() - t0
    lib, mod = bcc.lib, b.module
    maps, by_fd = [], {}
    for name in MAP_NAMES:
        fd = lib.bpf_table_fd(mod, name.encode())
        if fd < 0:
            _fail(f"the compiled probe has no map {name}")
        info = bpfsys.map_info(fd)
        by_fd[fd] = len(maps)
        maps.append({"name": name, "type": info["type"], "key_size": info["key_size"],
                     "value_size": info["value_size"], "max_entries": info["max_entries"], "flags": info["flags"]})
    programs = {}
    for name in symbols.PROGRAMS:
        start = lib.bpf_function_start(mod, name.encode())
        size = lib.bpf_function_size(mod, name.encode())
        if not start or not size:
            _fail(f"the compiled probe has no program {name}")
        code = bytearray(ctypes.string_at(start, size))
        refs = []
        for i in range(0, len(code), 8):
            op, regs = code[i], code[i + 1]
            if op == LD_IMM64 and regs >> 4:
                if regs >> 4 != PSEUDO_MAP_FD:
                    _fail(f"program {name}: a 64-bit load of kind {regs >> 4} (only map fds are supported)")
                fd = struct.unpack_from("<i", code, i + 4)[0]
                if fd not in by_fd:
                    _fail(f"program {name}: instruction {i // 8} refers to an unknown map fd {fd}")
                refs.append([i // 8, by_fd[fd]])
                struct.pack_into("<i", code, i + 4, 0)
        programs[name] = {"insns": base64.b64encode(bytes(code)).decode(), "maps": refs}
    return {"format": FORMAT, "license": (lib.bpf_module_license(mod) or b"GPL").decode(),
            "kern_version": lib.bpf_module_kern_version(mod), "maps": maps, "programs": programs,
            "compile_seconds": round(seconds, 3),
            # what the agent no longer holds: bcc, LLVM and the module, gone with this process
            "child_peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def _symbolise(pid: int, addrs: list) -> dict:
    bcc = _import_bcc()
    names = []
    for a in addrs:
        if not isinstance(a, int) or not 0 <= a < 1 << 64:
            _fail("addresses must be integers")
        text = bcc.BPF.sym(a, pid, show_module=True, show_offset=True, demangle=True)
        text = text.decode(errors="replace") if isinstance(text, bytes) else str(text)
        names.append(f"{a:#x}" if text.startswith("[unknown]") else text)
    return {"names": names}


def _fail(message: str) -> None:
    print(message, file=sys.stderr)
    sys.exit(3)


def main(argv: list[str]) -> None:
    try:
        _import_bcc()
    except ImportError:
        _fail(BCC_REMEDY)
    data = sys.stdin.buffer.read()
    if argv[:1] == ["compile"]:
        out = _compile(data)
    elif argv[:1] == ["symbolise"] and len(argv) == 2:
        out = _symbolise(int(argv[1]), json.loads(data))
    else:
        _fail("usage: python -m gpuwatch.probes.ebpf.bcc_child compile|symbolise PID")
    sys.stdout.write(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
