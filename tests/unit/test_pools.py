"""The pool allocators' table and the classifier of allocating stacks (probes/ebpf/pools.py), on
mappings written as /proc/PID/maps has them (the eBPF tests run the same on real uprobes)."""
from __future__ import annotations

import pytest

from gpuwatch.agent.allocators import POOLS, names, parse_pool_libraries, pool_table
from gpuwatch.probes.ebpf import pools
from gpuwatch.probes.ebpf.pools import Classifier

SITE = "/opt/conda/lib/python3.12/site-packages"


@pytest.mark.parametrize("path, allocator", [
    (f"{SITE}/torch/lib/libc10_cuda.so", "pytorch"),
    (f"{SITE}/cupy/cuda/memory.cpython-312-x86_64-linux-gnu.so", "cupy"),
    (f"{SITE}/jaxlib/xla_extension.so", "xla"),
    (f"{SITE}/jaxlib/_jax.cpython-312-x86_64-linux-gnu.so", "xla"),
    (f"{SITE}/jax_plugins/xla_cuda12/xla_cuda_plugin.so", "xla"),
    (f"{SITE}/librmm/lib64/librmm.so", "rmm"),
    (f"{SITE}/rmm/pylibrmm/memory_resource.cpython-312-x86_64-linux-gnu.so", "rmm"),
    (f"{SITE}/tensorflow/libtensorflow_framework.so.2", "tensorflow"),
    (f"{SITE}/tensorflow/python/_pywrap_tensorflow_internal.so", "tensorflow"),
    # not pools: the runtime and the driver, PyTorch's other libraries, CuPy's runtime wrappers and hooks
    ("/usr/local/cuda/lib64/libcudart.so.13", None),
    ("/usr/lib/x86_64-linux-gnu/libcuda.so.1", None),
    (f"{SITE}/torch/lib/libc10.so", None),
    (f"{SITE}/torch/lib/libtorch_cuda.so", None),
    (f"{SITE}/cupy_backends/cuda/api/runtime.cpython-312-x86_64-linux-gnu.so", None),
    (f"{SITE}/cupy/cuda/memory_hook.cpython-312-x86_64-linux-gnu.so", None),
    (f"{SITE}/mylib/memory.cpython-312-x86_64-linux-gnu.so", None),  # CuPy's module name, elsewhere
])
def test_the_known_pools_by_their_libraries(path, allocator):
    found = Classifier().file_pool(path)
    assert (found.allocator if found else None) == allocator
    assert [p.allocator for p in POOLS] == ["pytorch", "cupy", "xla", "rmm", "tensorflow"]


def test_the_setting_adds_pools_and_globs_to_known_ones():
    assert parse_pool_libraries("") == {}
    assert parse_pool_libraries(" libfakepool.so*=fakepool, libmore.so=fakepool ,libc10_custom.so=pytorch") == {
        "fakepool": ("libfakepool.so*", "libmore.so"), "pytorch": ("libc10_custom.so",)}
    table = pool_table("libfakepool.so*=fakepool,myco/arena/*.so=arena,libc10_custom.so=pytorch")
    assert [p.allocator for p in table] == ["pytorch", "cupy", "xla", "rmm", "tensorflow", "fakepool", "arena"]
    by = {p.allocator: p for p in table}
    assert by["pytorch"].name == "PyTorch caching allocator (libc10_cuda)"
    assert by["pytorch"].patterns == ("libc10_cuda.so*", "libc10_custom.so")
    assert by["fakepool"].name == "fakepool (libfakepool.so*)"
    c = Classifier(table)
    assert c.file_pool("/tmp/x/libfakepool.so").allocator == "fakepool"
    assert c.file_pool("/srv/myco/arena/big.so").allocator == "arena"  # a glob with a / ends the path
    assert c.file_pool("/srv/other/arena/big.so") is None
    assert c.file_pool("/srv/libc10_custom.so").allocator == "pytorch"
    assert names(table)["arena"] == "arena (myco/arena/*.so)"


def maps_file(tmp_path, pid: int, rows: list[tuple[int, int, str, str]]) -> None:
    d = tmp_path / str(pid)
    d.mkdir(exist_ok=True)
    (d / "maps").write_text("".join(f"{lo:x}-{hi:x} {perms} 00000000 08:01 1234 {path}\n"
                                    for lo, hi, perms, path in rows))


LIBCUDA = (0x7000_0000, 0x7100_0000, "r-xp", "/usr/lib/x86_64-linux-gnu/libcuda.so.1")
CUDART = (0x7200_0000, 0x7210_0000, "r-xp", "/usr/local/cuda/lib64/libcudart.so.13")
C10 = (0x7300_0000, 0x7310_0000, "r-xp", f"{SITE}/torch/lib/libc10_cuda.so")
C10_DATA = (0x7310_0000, 0x7320_0000, "rw-p", f"{SITE}/torch/lib/libc10_cuda.so")
APP = (0x40_0000, 0x50_0000, "r-xp", "/usr/bin/python3.12")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_innermost_pool_frame_decides_and_each_stack_is_classified_once(tmp_path):
    maps_file(tmp_path, 7, [LIBCUDA, CUDART, C10, C10_DATA, APP,
                            (0x7400_0000, 0x7410_0000, "r-xp", f"{SITE}/cupy/cuda/memory.cpython-312.so"),
                            (0x7500_0000, 0x7600_0000, "r--p", "[anon:x]"), (0x7600_0000, 0x7700_0000, "rw-p", "")])
    c = Classifier(proc=str(tmp_path))
    asked = []

    def stack(*addrs):
        return lambda: asked.append(addrs) or list(addrs)

    # cuMemAlloc_v2 <- cudart <- c10 <- python: PyTorch's pool, though its caller is the runtime
    assert c.pool_of(7, 1, 0x7200_0010, stack(0x7000_0000, 0x7200_0010, 0x7300_0100, 0x40_1000)).allocator == "pytorch"
    assert c.pool_of(7, 1, 0x7200_0010, stack()).allocator == "pytorch"  # cached: addresses not asked again
    assert len(asked) == 1
    # the innermost pool wins: CuPy's pool over PyTorch's further out
    assert c.pool_of(7, 2, 0, stack(0x7000_0000, 0x7200_0010, 0x7400_0100, 0x7300_0100)).allocator == "cupy"
    # cudart <- python: outside any allocator; a data mapping of c10 and unmapped addresses count for nothing
    assert c.pool_of(7, 3, 0, stack(0x7000_0000, 0x7200_0010, 0x7310_0100, 0x7550_0000, 0x40_1000)) is None
    # libcuda itself is never a pool, whatever a glob says
    assert Classifier(pool_table("libcuda.so.2=x"), proc=str(tmp_path)).file_pool("/usr/lib/libcuda.so.2") is None
    # per process: the same stack id and caller in another process has its own mappings
    maps_file(tmp_path, 8, [LIBCUDA, CUDART, APP])
    assert c.pool_of(8, 1, 0x7200_0010, stack(0x7000_0000, 0x7200_0010, 0x7300_0100)) is None


def test_a_library_loaded_since_is_found_by_reading_the_mappings_again(tmp_path):
    clock = Clock()
    maps_file(tmp_path, 7, [LIBCUDA, CUDART, APP])
    c = Classifier(proc=str(tmp_path), clock=clock)
    assert c.pool_of(7, 1, 0, lambda: [0x7000_0000, 0x40_1000]) is None
    assert c.maps_pool(7) is False
    maps_file(tmp_path, 7, [LIBCUDA, CUDART, C10, APP])  # import torch
    # read again only a second after the last read
    assert c.pool_of(7, 2, 0, lambda: [0x7000_0000, 0x7300_0100]) is None
    clock.now += 1.0
    assert c.pool_of(7, 3, 0, lambda: [0x7000_0000, 0x7300_0100]).allocator == "pytorch"
    assert c.pool_of(7, 2, 0, lambda: []) is None  # a stack keeps what it was found to be


def test_maps_pool_is_rechecked_every_10_s_and_forget_drops_a_process(tmp_path):
    clock = Clock()
    maps_file(tmp_path, 7, [LIBCUDA, APP])
    c = Classifier(proc=str(tmp_path), clock=clock)
    assert c.maps_pool(7) is False
    maps_file(tmp_path, 7, [LIBCUDA, C10, APP])
    clock.now += 9.9
    assert c.maps_pool(7) is False
    clock.now += 0.1
    assert c.maps_pool(7) is True
    assert c.pool_of(7, 1, 0, lambda: [0x7300_0000]).allocator == "pytorch"
    maps_file(tmp_path, 7, [LIBCUDA, APP])  # a new process with the same PID
    c.forget([7])
    assert c.maps_pool(7) is False and c.pool_of(7, 1, 0, lambda: [0x7300_0000]) is None
    assert c.maps_pool(99) is False  # no such process: nothing mapped


def test_mapping_bounds_and_a_path_with_spaces(tmp_path):
    spaced = (0x7400_0000, 0x7410_0000, "r-xp", "/opt/my envs/torch/lib/libc10_cuda.so")
    low = (0x1000, 0x2000, "r-xp", f"{SITE}/torch/lib/libc10_cuda.so")  # the lowest mapping of all
    maps_file(tmp_path, 7, [low, LIBCUDA, spaced, APP])
    c = Classifier(proc=str(tmp_path))
    assert c.pool_of(7, 1, 0, lambda: [0x7000_0000, 0x7400_0010]).allocator == "pytorch"
    assert c.pool_of(7, 2, 0, lambda: [0x7000_0000, 0x1000]).allocator == "pytorch"
    assert c.pool_of(7, 3, 0, lambda: [0x7000_0000, 0x2000]) is None  # a mapping's end is outside it


@pytest.mark.parametrize("text, error", [
    ("libx.so", "'libx.so' has no allocator name: expected GLOB=NAME pairs separated by commas, "
                "e.g. \"libmypool.so*=mypool\""),
    (" =mine", "'=mine' has no library glob before \"=\""),
    ("libx.so=my pool", "'libx.so=my pool': the allocator name 'my pool' may hold only letters, digits and . _ + - "
                        "(1 to 64 of them)"),
    ("libx.so=", "'libx.so=': the allocator name '' may hold only letters, digits and . _ + - (1 to 64 of them)"),
    ("libx.so=" + "a" * 65, f"'libx.so={'a' * 65}': the allocator name '{'a' * 65}' may hold only letters, digits "
                            "and . _ + - (1 to 64 of them)"),
    ("libx.so=none", "'libx.so=none': 'none' means outside any allocator; choose another name"),
    ("*=x", "'*=x': the glob '*' names no library (it would match every file)"),
    ("*/?*=x", "'*/?*=x': the glob '*/?*' names no library (it would match every file)"),
    ("libc.so*=x", "'libc.so*=x': the glob 'libc.so*' matches libc.so.6, which every allocation's call stack runs "
                   "through; name the allocator's own library"),
    ("lib/libpython3*=x", "'lib/libpython3*=x': the glob 'lib/libpython3*' matches libpython3.12.so.1.0, which every "
                          "allocation's call stack runs through; name the allocator's own library"),
    ("libfine.so=ok, libcudart.so.*=rt", "'libcudart.so.*=rt': the glob 'libcudart.so.*' matches libcudart.so.13, "
                                         "which every allocation's call stack runs through; name the allocator's own "
                                         "library"),
])
def test_a_bad_setting_says_what_is_wrong(text, error):
    with pytest.raises(ValueError) as e:
        parse_pool_libraries(text)
    assert str(e.value) == error
    with pytest.raises(ValueError):
        pool_table(text)


def test_allocator_names_and_globs_that_are_fine():
    name = "A-z_0.9+" + "x" * 56  # 64 characters, every kind allowed
    assert parse_pool_libraries(f",, lib/x.so = {name} ,libcuda_pool.so=p,python3-pool*.so=p") == {
        name: ("lib/x.so",), "p": ("libcuda_pool.so", "python3-pool*.so")}


def test_mappings_that_are_not_code_or_not_files_and_a_bad_line(tmp_path):
    d = tmp_path / "7"
    d.mkdir()
    (d / "maps").write_text(f"7300000000-7310000000 r-xp 00000000 08:01 1234 {SITE}/torch/lib/libc10_cuda.so\n"
                            "7400000000-7410000000 r-xp 00000000 00:00 0\n"  # anonymous code: no path
                            f"7500000000-7510000000 r--p 00000000 08:01 1234 {SITE}/cupy/cuda/memory.so\n"
                            "zz-7610000000 r-xp 00000000 08:01 1234 /lib/after_a_bad_line.so\n"
                            f"7700000000-7710000000 r-xp 00000000 08:01 1234 {SITE}/librmm/lib64/librmm.so\n")
    m = pools._Maps(7, str(tmp_path), 5.0)
    assert m.rows == [(0x73_0000_0000, 0x73_1000_0000, f"{SITE}/torch/lib/libc10_cuda.so")]  # what came before it
    assert m.paths == {f"{SITE}/torch/lib/libc10_cuda.so"} and m.read_at == 5.0
    assert m.path(0x73_0FFF_FFFF) == f"{SITE}/torch/lib/libc10_cuda.so" and m.path(0x72_FFFF_FFFF) is None


def test_defaults_bare_names_and_names_of_several_globs():
    assert pool_table() == POOLS and Classifier()._proc == "/proc" and Classifier().names == names()
    assert POOLS[0].matches("libc10_cuda.so.1") and not POOLS[1].matches("memory.so")  # a bare name, no folder
    assert names(pool_table("a.so=n,b*.so=n"))["n"] == "n (a.so, b*.so)"
    with pytest.raises(ValueError):
        parse_pool_libraries("libx.so=a=b")  # the name is all after the first "="
    Classifier().forget([123])  # a process never seen: nothing to forget, no error
