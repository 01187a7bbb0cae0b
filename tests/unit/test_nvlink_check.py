"""tests/gpu/nvlink_check.py's parsing of `nvidia-smi nvlink -s` / `-e` and its comparison, on CPU.

The sample texts follow published outputs (see the format note in nvlink_check.py): an H100/H200
header line with its UUID, tab-indented link lines, `<inactive>` for a link that is down."""
import importlib.util

from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location("nvlink_check", ROOT / "tests" / "gpu" / "nvlink_check.py")
nvlink_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nvlink_check)

U0, U1 = "GPU-abcdefab-cdef-abdc-abcd-abababababab", "GPU-12345678-1234-1234-1234-123456789abc"
STATUS = (f"GPU 0: NVIDIA H200 (UUID: {U0})\n\t Link 0: 26.562 GB/s\n\t Link 1: <inactive>\n\t Link 2: 26.562 GB/s\n"
          f"GPU 1: NVIDIA H200 (UUID: {U1})\n\t Link 0: 26.562 GB/s\n")
ERRORS = (f"GPU 0: NVIDIA H200 (UUID: {U0})\n"
          "\t Link 0: Replay Errors: 0\n\t Link 0: Recovery Errors: 0\n\t Link 0: CRC Errors: 0\n\n"
          "\t Link 1: Replay Errors: 4\n\t Link 1: Recovery Errors: 1\n\t Link 1: CRC Errors: 12\n\n"
          "\t Link 2: Replay Errors: 0\n\t Link 2: Recovery Errors: 0\n\t Link 2: CRC Errors: 0\n"
          f"GPU 1: NVIDIA H200 (UUID: {U1})\n"
          "\t Link 0: Replay Errors: 7\n\t Link 0: Recovery Errors: 0\n\t Link 0: CRC Errors: 3\n")


def test_parse_status():
    got = nvlink_check.parse_status(STATUS)
    assert got == {0: {"uuid": U0, "links": {0: 26.562, 1: None, 2: 26.562}}, 1: {"uuid": U1, "links": {0: 26.562}}}


def test_parse_errors():
    got = nvlink_check.parse_errors(ERRORS)
    assert got[0]["uuid"] == U0 and set(got[0]["links"]) == {0, 1, 2}
    assert got[0]["links"][1] == {"dl_replay": 4, "dl_recovery": 1, "dl_crc": 12}
    assert got[1]["links"][0] == {"dl_replay": 7, "dl_recovery": 0, "dl_crc": 3}


def probe_view(errors_gpu1_link0_replay=7.0, up_link1=0.0):
    errors0 = {(link, kind): 0.0 for link in range(3) for kind in ("dl_replay", "dl_recovery", "dl_crc")}
    errors0.update({(1, "dl_replay"): 4.0, (1, "dl_recovery"): 1.0, (1, "dl_crc"): 12.0})
    return {U0: {"up": {0: 1.0, 1: up_link1, 2: 1.0}, "errors": errors0},
            U1: {"up": {0: 1.0}, "errors": {(0, "dl_replay"): errors_gpu1_link0_replay, (0, "dl_recovery"): 0.0,
                                            (0, "dl_crc"): 3.0}}}


def test_compare_matches_and_tolerates_a_counter_moving_between_reads():
    status, errors = nvlink_check.parse_status(STATUS), nvlink_check.parse_errors(ERRORS)
    rows, bad = nvlink_check.compare(status, errors, probe_view(), probe_view())
    assert bad == [] and len(rows) == 4 and all(r["ok"] for r in rows)
    rows, bad = nvlink_check.compare(status, errors, probe_view(errors_gpu1_link0_replay=6.0),
                                     probe_view(errors_gpu1_link0_replay=9.0))
    assert bad == []


def test_compare_names_each_mismatch():
    status, errors = nvlink_check.parse_status(STATUS), nvlink_check.parse_errors(ERRORS)
    after = probe_view(errors_gpu1_link0_replay=8.0, up_link1=1.0)
    del after[U1]["up"][0]
    rows, bad = nvlink_check.compare(status, errors, probe_view(errors_gpu1_link0_replay=8.0), after)
    assert len(bad) == 4, bad
    assert "GPU 1 link 0: nvidia-smi 26.562 GB/s, probe up=None" in bad
    assert "GPU 0 link 1: nvidia-smi inactive, probe up=1.0" in bad
    assert f"GPU 1 ({U1}): nvidia-smi lists 1 links, the probe 0" in bad
    assert "GPU 1 link 0 dl_replay: nvidia-smi 7, probe 8.0 .. 8.0" in bad
    assert [r["ok"] for r in rows] == [True, False, True, False]
