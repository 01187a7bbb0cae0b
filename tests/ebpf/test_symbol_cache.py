"""A library's symbol offsets (where the uprobes go) kept in the eBPF cache: read once per file with
pyelftools, then from the cache without importing it; a rewritten file is read again (its change
time moved, whatever its modification time says); a cached table is input, checked entry by entry,
and the cache holds at most MAX_SYMBOL_FILES tables however many copies users make."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from gpuwatch.probes.ebpf import loader

pytestmark = pytest.mark.root


@pytest.fixture
def cache(tmp_path, monkeypatch) -> str:
    where = tmp_path / "cache"
    where.mkdir(mode=0o700)
    monkeypatch.setenv("GPUWATCH_BPF_CACHE", str(where))
    return str(where)


@pytest.fixture
def lib(fake_cuda, tmp_path) -> str:
    copy = tmp_path / "libcuda.so.1"
    shutil.copyfile(fake_cuda["lib"], copy)
    return str(copy)


def _tables(cache: str) -> list[str]:
    return sorted(n for n in os.listdir(cache) if n.startswith("symbols-"))


def _plant(cache: str, edit) -> None:
    (name,) = _tables(cache)
    path = os.path.join(cache, name)
    with open(path) as f:
        data = json.load(f)
    edit(data)
    with open(path, "w") as f:
        json.dump(data, f)


def test_read_once_then_from_the_cache_without_pyelftools(cache, lib):
    first = loader.function_offsets(lib)
    assert "cuMemAlloc_v2" in first and len(_tables(cache)) == 1
    code = ("import sys; from gpuwatch.probes.ebpf import loader; "
            f"t = loader.function_offsets({lib!r}); print(len(t), 'elftools' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, GPUWATCH_BPF_CACHE=cache)).stdout.split()
    assert out == [str(len(first)), "False"]
    # what the cache says is what is used (which is why it is root's alone: test_ebpf_links.py)
    moved = first["cuMemFree_v2"] + 16
    _plant(cache, lambda d: d["offsets"].update(cuMemFree_v2=moved))
    assert loader.function_offsets(lib)["cuMemFree_v2"] == moved


def test_a_rewritten_library_is_read_again(cache, lib):
    first = loader.function_offsets(lib)
    _plant(cache, lambda d: d["offsets"].update(cuMemFree_v2=first["cuMemFree_v2"] + 16))
    st = os.stat(lib)
    with open(lib, "r+b") as f:  # the same bytes, the same size, the modification time set back
        data = f.read()
        f.seek(0)
        f.write(data)
    os.utime(lib, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(lib).st_mtime_ns == st.st_mtime_ns
    assert loader.function_offsets(lib) == first
    assert len(_tables(cache)) == 2


@pytest.mark.parametrize("edit", [
    lambda d: d["offsets"].update(cuMemFree_v2=1 << 40),        # past the end of the file
    lambda d: d["offsets"].update(cuMemFree_v2=-1),
    lambda d: d["offsets"].update(cuMemFree_v2="0x10"),
    lambda d: d["offsets"].update(malloc=16),                     # not a hooked name
    lambda d: d["offsets"].update({"cu" + "x" * 300: 16}),        # too long a name
    lambda d: d.update(offsets=[1, 2]),
    lambda d: d.update(ident="1|0|0|0|0|0"),                      # another file's table
    lambda d: d.clear(),
], ids=["past-end", "negative", "string", "other-name", "long-name", "list", "other-file", "empty"])
def test_a_cached_table_out_of_bounds_is_read_again(cache, lib, edit):
    first = loader.function_offsets(lib)
    _plant(cache, edit)
    assert loader.function_offsets(lib) == first


def test_a_cache_others_may_write_is_not_read(cache, lib):
    first = loader.function_offsets(lib)
    _plant(cache, lambda d: d["offsets"].update(cuMemFree_v2=first["cuMemFree_v2"] + 16))
    os.chmod(os.path.join(cache, _tables(cache)[0]), 0o666)
    assert loader.function_offsets(lib) == first


def test_copies_of_a_library_keep_a_bounded_number_of_tables(cache, lib, tmp_path):
    """A user can make any number of copies for the daemon to attach to: each is a table, and only
    the newest MAX_SYMBOL_FILES stay."""
    n = loader.MAX_SYMBOL_FILES + 6
    for i in range(n):
        copy = tmp_path / f"copy{i}.so"
        shutil.copyfile(lib, copy)
        loader.function_offsets(str(copy))
    tables = _tables(cache)
    assert len(tables) == loader.MAX_SYMBOL_FILES
    last = loader.function_offsets(str(tmp_path / f"copy{n - 1}.so"))
    assert _tables(cache) == tables and last  # the newest was kept: a hit, nothing written
