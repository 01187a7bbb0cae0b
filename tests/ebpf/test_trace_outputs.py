"""Issue 35 item 2 (and issue 31 break 7): exit codes scripts can trust. Any output asked for
(--summary-json, --output and its PATH.events records) that is not written makes `gpuwatch trace`
exit non-zero with one line naming it; nothing is written anywhere else. Real uprobes on the fake
libcuda, a real full filesystem (a 64 KiB tmpfs) and /dev/full."""
from __future__ import annotations

import os
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from .test_trace_cli import _run

pytestmark = pytest.mark.root


def _errors(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if line.startswith("Error: ")]


def test_a_summary_sent_to_dev_full_exits_1_and_dev_full_stays_a_device(fake_cuda, drivers):
    d = drivers()
    r = _run("--pid", str(d.pid), "--library", fake_cuda["lib"], "--summary-json", "/dev/full", "--duration", "0.5")
    assert r.returncode == 1, r.stderr
    # Was: "summary written to /dev/full", exit 0 (the device replaced by a file, as root).
    assert _errors(r.stderr) == ["Error: --summary-json: could not write /dev/full: No space left on device"]
    assert "summary written" not in r.stderr
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_outputs_on_a_full_disk_exit_1_one_line_each_and_leave_nothing(fake_cuda, drivers):
    top = Path(tempfile.mkdtemp(prefix="gw-full-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(top)], check=True)
    try:
        fd = os.open(top / "filler", os.O_WRONLY | os.O_CREAT)  # fill it: not a page left
        try:
            while os.write(fd, b"x" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        d = drivers()
        r = _run("--pid", str(d.pid), "--library", fake_cuda["lib"], "--summary-json", str(top / "s.json"),
                 "--output", str(top / "t.json"), "--duration", "1")
        if r.returncode == 1 and _errors(r.stderr)[0].startswith("Error: --output"):
            pytest.fail(f"the trace did not start: {r.stderr}")  # the records file is made before tracing
        assert r.returncode == 1, r.stderr
        errors = _errors(r.stderr)
        assert errors[0] == f"Error: --summary-json: could not write {top}/s.json: No space left on device", errors
        assert len(errors) <= 2 and all("No space left on device" in e for e in errors), errors
        assert "summary written" not in r.stderr and "trace written" not in r.stderr
        assert sorted(os.listdir(top)) in (["filler"], ["filler", "t.json.events"])  # records kept for a retry
    finally:
        subprocess.run(["umount", str(top)], check=False)
        os.rmdir(top)
