"""The control socket of a real agent against bad clients: each gets an error reply or a closed
connection, the agent keeps serving, and the next good request is answered.

tests/unit/test_control.py covers the protocol on a bare ControlServer; this is the agent itself
(its real handlers, NVML replayed, no eBPF, no CUPTI sampling).
"""
from __future__ import annotations

import json
import socket
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwatch.agent.control import ControlError, call
from tests.conftest import FIXTURE

METHODS = ["ping", "status", "trace.snapshot", "cupti.report", "cupti.process", "findings", "baseline.run",
           "baseline.show", "top"]


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    from tests.conftest import Agent

    a = Agent(tmp_path_factory.mktemp("ctl"), "--nvml-replay", str(FIXTURE), "--no-ebpf", "--no-cupti-sampling",
              "--no-baseline", "--no-otlp")
    a.metrics()
    end = time.monotonic() + 30
    while time.monotonic() < end:  # until the first snapshot with the replayed GPU is out
        try:
            if call(str(a.socket), "status")["gpus"] and "hw_power_watts" in a.metrics(5):
                break
        except ControlError:
            pass
        time.sleep(0.1)
    yield a
    assert a.stop() == 0, a.output()
    assert "Traceback" not in a.output(), a.output()


def exchange(path, payload: bytes, timeout: float = 10.0, half_close: bool = True) -> list[dict]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    try:
        try:
            s.sendall(payload)
            if half_close:
                s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the agent answered "too large" and closed while we were still sending
        buf = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            buf += chunk
    finally:
        s.close()
    return [json.loads(line) for line in buf.splitlines() if line.strip()]


def still_serving(agent) -> None:
    assert agent.proc.poll() is None, agent.output()
    assert call(str(agent.socket), "ping") == "pong"
    assert call(str(agent.socket), "status")["gpus"]
    assert "hw_power_watts" in agent.metrics(5)


@pytest.mark.parametrize("payload, error", [
    (b"{not json\n", "malformed request: not JSON"),
    (b"\xff\xfe\x00garbage\n", "malformed request: not JSON"),
    (b"[1, 2]\n", "expected a JSON object"),
    (b'"status"\n', "expected a JSON object"),
    (b"null\n", "expected a JSON object"),
    (b'{"method": "rm -rf /"}\n', "unknown method 'rm -rf /'"),
    (b'{"method": ["status"]}\n', "unknown method ['status']"),
    (b'{"method": "__init__"}\n', "unknown method '__init__'"),
    (b'{"method": "status", "params": [1]}\n', "params must be a JSON object"),
    (b'{"method": "status", "params": "x"}\n', "params must be a JSON object"),
    (b'{"method": "status", "params": 7}\n', "params must be a JSON object"),
    (b'{"method": "ping", "params": {"x": NaN}}\n', "NaN is not a JSON number"),
        (b'{"method": "ping", "params": {"x": 1}}\n', "ping refused: x: is not a field"),
    (b"[" * 60000 + b"\n", "malformed request"),  # deep nesting must not be a RecursionError
    (b'{"a":' * 10000 + b"1" + b"}" * 10000 + b"\n", "malformed request"),
])
def test_malformed_requests_get_an_error_reply(agent, payload, error):
    (reply,) = exchange(str(agent.socket), payload)
    if error is None:
        assert reply["ok"] is True, reply
    else:
        assert reply["ok"] is False and error in reply["error"], reply
    still_serving(agent)


@pytest.mark.parametrize("size", [70_000, 1_000_000, 16_000_000])
def test_huge_payloads_are_refused(agent, size):
    payload = b'{"method": "status", "params": {"x": "' + b"a" * size + b'"}}\n'
    replies = exchange(str(agent.socket), payload)
    assert replies == [{"ok": False, "error": "request too large (over 65536 bytes)"}]
    payload = b"x" * size  # and no newline at all
    assert exchange(str(agent.socket), payload)[0]["error"].startswith("request too large")
    still_serving(agent)


def test_clients_that_disconnect_mid_request_or_mid_reply(agent):
    path = str(agent.socket)
    for cut in (b"", b"{", b'{"method": "sta', b'{"method": "status"'):
        for _ in range(5):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            if cut:
                s.sendall(cut)
            s.close()
    for _ in range(5):  # asks, then goes away before reading the answer
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        s.sendall(b'{"method": "status"}\n' * 50)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
        s.close()
    still_serving(agent)


def test_a_good_request_after_a_bad_one_on_the_same_connection(agent):
    replies = exchange(str(agent.socket), b'{bad\n{"method": "ping"}\n')
    assert [r["ok"] for r in replies] == [False, True] and replies[1]["result"] == "pong"


@pytest.mark.parametrize("method", METHODS[1:])
@pytest.mark.parametrize("params", [
    {"pid": "abc"}, {"pid": -1}, {"pid": 0}, {"pid": 2**70}, {"pid": None}, {"pid": [1]}, {"pid": 1.5},
    {"gpu": {"x": 1}}, {"gpu": 10**30}, {"limit": -5}, {"limit": "many"}, {"limit": 10**12},
    {"kind": 3}, {"force": "yes"}, {"process": "\udcff"}, {"x" * 1000: 1},
])
def test_real_handlers_with_wrong_params_answer(agent, method, params):
    (reply,) = exchange(str(agent.socket), json.dumps({"method": method, "params": params}).encode() + b"\n")
    assert isinstance(reply["ok"], bool)
    if not reply["ok"]:
        assert isinstance(reply["error"], str) and reply["error"]
        assert "Traceback" not in reply["error"]
    assert agent.proc.poll() is None, agent.output()


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
                     max_leaves=8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(METHODS), params=st.dictionaries(
    st.sampled_from(["pid", "gpu", "limit", "kind", "force", "since", "process", "uid", "report", "x"]), _JSON,
    max_size=4))
def test_any_params_to_any_method_get_an_answer(agent, method, params):
    (reply,) = exchange(str(agent.socket), json.dumps({"method": method, "params": params}).encode() + b"\n")
    assert isinstance(reply.get("ok"), bool), reply


def test_the_agent_survived_it_all(agent):
    still_serving(agent)
    out = agent.output()
    assert "Traceback" not in out, out
