"""One live frame of `gpuwatch trace`: its live allocations from the same call counts as its
allocations and frees (LiveAllocations), and drawn whole in place (LiveScreen.frame).
tests/ebpf/test_trace_tty.py checks both in a real terminal under load."""
import io
import re

from rich.console import Console

from gpuwatch.agent.trace.render import LiveScreen, render_live
from gpuwatch.agent.trace.summary import LiveAllocations


def _snap(live: int, allocations: int, frees: int) -> dict:
    return {"apis": {}, "memory": {"live_bytes": 0, "live_allocations": live, "allocations": allocations,
                                   "frees": frees}}


def _live(shown: dict) -> int:
    return shown["memory"]["live_allocations"]


def test_a_busy_process_shows_allocations_less_frees_whatever_the_table_read_later_says():
    la = LiveAllocations(0)  # the trace's own probe: nothing live when it attached
    for live, a, f in [(0, 0, 0), (130, 200, 80), (2290, 4580, 2296), (5000, 9000, 4100)]:
        shown = la.frame(_snap(live, a, f))
        assert _live(shown) == a - f
        assert shown["memory"]["allocations"] == a and shown["memory"]["frees"] == f


def test_the_offset_is_taken_again_from_a_table_read_while_nothing_happened():
    la = LiveAllocations(0)
    # 50 allocations freed that were made before the trace: the table knows them, the counts not
    assert _live(la.frame(_snap(150, 300, 200))) == 100
    assert _live(la.frame(_snap(150, 300, 200))) == 150  # same counts: the frame before read one instant
    assert _live(la.frame(_snap(160, 320, 210))) == 160  # from then on counted with its offset
    assert la.offset == 50


def test_the_agents_offset_is_what_was_live_at_the_start_and_never_negative():
    la = LiveAllocations(1000)  # the agent: 1000 live at the start, allocations and frees counted from it
    assert _live(la.frame(_snap(1010, 20, 10))) == 1010
    la = LiveAllocations(0)
    assert _live(la.frame(_snap(40, 10, 30))) == 40  # would be -20: the table's count instead
    assert _live(la.frame(_snap(41, 12, 31))) == 41
    assert la.frame({"apis": {}}) == {"apis": {}}  # no memory line: nothing to do


SNAP = {"apis": {"cuLaunchKernel": {"calls": 5, "errors": 0, "bytes": 0, "seconds": 0.0}},
        "kernels": [{"handle": "0x1", "name": "k" * 200, "launches": 5, "grid": [1, 1, 1], "block": [1, 1, 1]}],
        "memory": {"live_bytes": 1, "live_allocations": 1, "allocations": 1, "frees": 0}}


def test_a_frame_is_drawn_whole_from_the_top_left_corner_each_line_at_its_row():
    screen = LiveScreen(Console(file=io.StringIO(), color_system=None), fd=-1)
    for width, height in [(80, 24), (40, 5), (20, 3)]:
        frame = screen.frame(render_live(SNAP, None, 1.0, 1.0, pid=1, process="p", uprobes=3, duration=None,
                                         height=height, width=width), width, height)
        assert "\n" not in frame and "\r" not in frame  # rows by position: nothing scrolls
        parts = re.split(r"\x1b\[(\d+);1H", frame)[1:]
        rows = [(int(parts[i]), parts[i + 1]) for i in range(0, len(parts), 2)]
        lines = [(r, text) for r, text in rows if text.startswith("\x1b[2K")]
        assert [r for r, _ in lines] == list(range(1, len(lines) + 1)) and len(lines) <= height, frame
        assert all(len(text.removeprefix("\x1b[2K")) <= width for _, text in lines), frame
        assert lines[0][1].startswith("\x1b[2Ktrace PID 1 (p)")
        if len(lines) < height:  # below the last line: cleared
            assert rows[-1] == (len(lines) + 1, "\x1b[J"), frame
