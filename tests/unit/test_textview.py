"""agent/textview.py: the columns line up, what the agent says cannot drive the terminal, and
colors appear only on a terminal that wants them."""
import io
import os
import re

from gpuwatch.agent import textview


def test_columns_line_up_right_aligned_where_asked_and_no_trailing_spaces():
    lines = textview.table(("GPU", "Name", "Util"), [["0", "NVIDIA H200", "7%"], ["10", "A", "100%"]],
                           right=("GPU", "Util"))
    assert lines == ["GPU  Name         Util",
                     "  0  NVIDIA H200    7%",
                     " 10  A            100%"]
    assert textview.table(("A", "Reason"), [["x", ""]]) == ["A  Reason", "x"]


def test_text_from_the_agent_cannot_drive_the_terminal():
    st = {"version": "0.1.0\x1b[2J", "pid": 1, "uptime_seconds": 3.0, "snapshot_age_seconds": 0.1,
          "probes": {"nvml\x1b]0;x\x07": {"state": "down", "last_duration": 0.001, "late_total": 0,
                                           "errors_total": 1, "reason": "bad\x9b31m\nnext"}},
          "gpus": [{"index": 0, "name": "H200\x1b[31m", "uuid": "GPU-1"}],
          "processes": [{"gpu": "GPU-1", "pid": 7, "user": "u\u202e", "name": "evil\x1b[2J", "black": 2**30}],
          "recent_events": [{"ts": 0, "kind": "probe.down", "resource": "r\x1b", "attrs": {"reason": "x\x1b[H"}}],
          "store": {"error": "disk\x1b[K"}}
    text = "\n".join(textview.status_lines(st, color=False))
    assert "\x1b" not in text and "\x9b" not in text and "\u202e" not in text and "\x07" not in text
    assert "evil?[2J" in text and "bad?31m?next" in text and "H200?[31m" in text
    colored = "\n".join(textview.status_lines(st, color=True))
    # the only escapes are ours: colors, each reset
    codes = re.findall(r"\x1b\[(\d+)m", colored)
    assert set(codes) <= {"0", "1", "2", "31", "32", "33"} and colored.count("\x1b[") == len(codes)
    assert codes.count("0") * 2 == len(codes)  # each color reset


def test_colors_only_on_a_terminal_that_wants_them(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    assert not textview.use_color(io.StringIO())
    rd, wr = os.openpty()
    try:
        with open(wr, "w", closefd=False) as tty:
            assert textview.use_color(tty)
            monkeypatch.setenv("NO_COLOR", "1")
            assert not textview.use_color(tty)
            monkeypatch.delenv("NO_COLOR")
            monkeypatch.setenv("TERM", "dumb")
            assert not textview.use_color(tty)
    finally:
        os.close(rd)
        os.close(wr)
    assert textview.paint("up", "green", True) == "\x1b[32mup\x1b[0m" and textview.paint("up", "green", False) == "up"
