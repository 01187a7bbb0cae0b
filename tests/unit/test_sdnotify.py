"""sd_notify over a real datagram socket, the watchdog's pacing, and logging's journald detection."""
import io
import json
import logging
import os
import socket
import uuid

import pytest

from gpuwatch.agent import logs, sdnotify


def receiver(address):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(address)
    s.settimeout(2.0)
    return s


def drain(s):
    s.settimeout(0.05)
    out = []
    try:
        while True:
            out.append(s.recv(4096).decode())
    except socket.timeout:
        pass
    return out


def test_no_notify_socket_is_a_quiet_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False
    assert sdnotify.ready() is False
    monkeypatch.setenv("NOTIFY_SOCKET", "relative/path")
    assert sdnotify.notify("READY=1") is False


def test_ready_and_status_to_a_path_socket(tmp_path, monkeypatch):
    path = str(tmp_path / "notify")
    r = receiver(path)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert sdnotify.ready("watching 8 GPUs") is True
    assert r.recv(4096) == b"READY=1\nSTATUS=watching 8 GPUs"
    assert sdnotify.notify("STOPPING=1")
    assert r.recv(4096) == b"STOPPING=1"
    r.close()


def test_abstract_namespace_socket(monkeypatch):
    name = f"gpuwatch-test-{uuid.uuid4().hex}"
    r = receiver("\0" + name)
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    assert sdnotify.ready() is True
    assert r.recv(4096) == b"READY=1"
    r.close()


def test_send_failure_is_not_raised(tmp_path, monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    assert sdnotify.notify("READY=1") is False


@pytest.mark.parametrize("usec, pid, expected", [
    ("30000000", None, 30.0),
    ("30000000", "self", 30.0),
    ("30000000", "1", None),  # meant for another process
    ("0", None, None),
    ("junk", None, None),
    (None, None, None),
])
def test_watchdog_interval(monkeypatch, usec, pid, expected):
    for var, value in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", pid)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, str(os.getpid()) if value == "self" else value)
    assert sdnotify.watchdog_interval() == expected


def test_watchdog_pings_at_most_every_half_interval(tmp_path, monkeypatch):
    path = str(tmp_path / "notify")
    r = receiver(path)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "10000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    now = [100.0]
    wd = sdnotify.Watchdog(clock=lambda: now[0])
    assert wd.interval == 10.0
    for t in (100.0, 101.0, 104.9, 105.0, 105.1, 109.0, 110.0, 116.0):
        now[0] = t
        wd.ping()
    # Sent at 100, 105, 110, 116 (each at least 5 s after the previous one).
    assert drain(r) == ["WATCHDOG=1"] * 4
    r.close()


def test_watchdog_disabled_without_systemd(monkeypatch):
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    wd = sdnotify.Watchdog()
    assert wd.interval is None
    wd.ping()  # no-op


# -- logs: the text format adapts to journald ------------------------------------------------

@pytest.fixture
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_text_log_has_a_timestamp_outside_journald(tmp_path, monkeypatch, restore_root_logger):
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    with open(tmp_path / "err", "w+") as f:
        logs.setup_logging("info", "text", stream=f)
        logging.getLogger("gpuwatch.test").info("hello %s", "there")
        logging.getLogger("gpuwatch.test").debug("hidden")
        f.seek(0)
        line = f.read()
    assert line.endswith("INFO gpuwatch.test: hello there\n") and line[:4].isdigit()
    assert "hidden" not in line


def test_text_log_under_journald_has_priority_and_no_timestamp(tmp_path, monkeypatch, restore_root_logger):
    with open(tmp_path / "err", "w+") as f:
        st = os.fstat(f.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        logs.setup_logging("debug", "text", stream=f)
        log = logging.getLogger("gpuwatch.test")
        log.warning("hot GPU")
        try:
            raise ValueError("x")
        except ValueError:
            log.exception("failed")
        f.seek(0)
        lines = f.read().splitlines()
    assert lines[0] == "<4>WARNING gpuwatch.test: hot GPU"
    assert lines[1] == "<3>ERROR gpuwatch.test: failed"
    assert all(line.startswith("<3>") for line in lines[1:])  # traceback lines keep the priority


def test_journal_stream_of_another_file_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("JOURNAL_STREAM", "1:2")
    with open(tmp_path / "err", "w") as f:
        assert not logs.stream_is_journal(f)


def test_json_log_lines(restore_root_logger):
    buf = io.StringIO()
    logs.setup_logging("warning", "json", stream=buf)
    logging.getLogger("gpuwatch.x").warning("probe %s late", "nvml")
    logging.getLogger("gpuwatch.x").info("not shown")
    (line,) = buf.getvalue().splitlines()
    rec = json.loads(line)
    assert rec["level"] == "warning" and rec["logger"] == "gpuwatch.x" and rec["msg"] == "probe nvml late"
    assert rec["ts"].endswith("Z")


def test_bad_log_settings():
    with pytest.raises(ValueError, match="log level"):
        logs.setup_logging("loud", "text")
    with pytest.raises(ValueError, match="log format"):
        logs.setup_logging("info", "xml")
