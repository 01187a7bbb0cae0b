"""The compiled-object checks (probes/ebpf/compiler.py): a cache file is input, whoever wrote it,
so every field is checked before anything reaches bpf(). No kernel needed: the objects are made
here, in the shape bcc_child prints."""
import base64
import copy

import pytest

from gpuwatch.probes.ebpf import compiler, symbols

LOAD_MAP = bytes.fromhex("1811000000000000" "0000000000000000")  # r1 = map fd (ld_imm64, src 1)
EXIT = bytes.fromhex("b700000000000000" "9500000000000000")


def valid() -> dict:
    maps = [{"name": n, "type": 1, "key_size": 8, "value_size": 8, "max_entries": 16, "flags": 1}
            for n in compiler.MAP_NAMES]
    prog = {"insns": base64.b64encode(LOAD_MAP + EXIT).decode(), "maps": [[0, 2]]}
    return {"key": "k", "license": "GPL", "kern_version": 0, "maps": maps,
            "programs": {name: dict(prog) for name in symbols.PROGRAMS}}


def test_a_valid_object_puts_the_map_fds_where_the_references_are():
    obj = compiler.CompiledObject(valid())
    code = obj.instructions("gw_entry", list(range(100, 100 + len(compiler.MAP_NAMES))))
    assert int.from_bytes(code[4:8], "little") == 102 and code[8:] == (LOAD_MAP + EXIT)[8:]


def _broken(change) -> dict:
    data = copy.deepcopy(valid())
    change(data)
    return data


@pytest.mark.parametrize("change", [
    lambda d: d.update(license="Proprietary"),
    lambda d: d["maps"].pop(),                                       # a map missing
    lambda d: d["maps"][0].update(name="extra"),                     # an unknown map
    lambda d: d["maps"][0].update(max_entries=-1),
    lambda d: d["maps"][0].update(key_size="8"),
    lambda d: d["maps"][0].update(flags=1 << 40),
    lambda d: d["programs"].pop("gw_return"),
    lambda d: d["programs"].update(gw_other=d["programs"]["gw_entry"]),
    lambda d: d["programs"]["gw_entry"].update(insns=base64.b64encode(b"1234567").decode()),  # not whole insns
    lambda d: d["programs"]["gw_entry"].update(insns="not base64!"),
    lambda d: d["programs"]["gw_entry"].update(maps=[[1, 2]]),       # not a 64-bit load
    lambda d: d["programs"]["gw_entry"].update(maps=[[0, 99]]),      # no such map
    lambda d: d["programs"]["gw_entry"].update(maps=[[99, 0]]),      # past the program
    lambda d: d.update(kern_version=True),
])
def test_a_malformed_object_is_refused(change):
    with pytest.raises((ValueError, KeyError, TypeError)):
        compiler.CompiledObject(_broken(change))
