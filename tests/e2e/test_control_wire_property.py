"""Every control method of a real agent, driven with params drawn from its wire type
(tests/wire_strategies.py): values at and beyond the bounds, odd text, lists at and past their
maximum length. The agent answers each request — the result, or a refusal that names the field
(word for word what the wire type says) or the handler's reason — never "failed in the agent";
its results parse as their wire types; it stays up and /metrics stays readable.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwatch.agent import wire
from gpuwatch.agent.control import MAX_REQUEST, call
from tests.conftest import wait_for
from tests.e2e.test_control_bad_input import agent, exchange  # noqa: F401 - the same module-scoped real agent
from tests.wire_strategies import expect, params


@pytest.mark.parametrize("method", sorted(wire.METHODS))
@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(data=st.data())
def test_every_method_answers_hostile_but_well_formed_params(agent, method, data):
    raw = data.draw(params(method), label="params")
    request = json.dumps({"method": method, "params": raw}).encode() + b"\n"
    (reply,) = exchange(str(agent.socket), request)
    if len(request) - 1 > MAX_REQUEST:
        assert reply == {"ok": False, "error": f"request too large (over {MAX_REQUEST} bytes)"}
        return
    refusal = expect(method, raw)
    if refusal is not None:  # the wire type refuses it: the reply names the field
        assert reply == {"ok": False, "error": refusal}
    elif not reply["ok"]:  # the handler's reason, never a failure of the agent
        assert reply["error"] and "failed in the agent" not in reply["error"] and "not JSON" not in reply["error"]
    elif method in wire.RESULTS:
        wire.RESULTS[method].parse(reply["result"], "result")
    assert agent.proc.poll() is None, agent.output()


def test_the_agent_is_up_and_its_metrics_readable_after_it_all(agent):
    assert call(str(agent.socket), "ping") == "pong"
    # every method counted, once the next snapshot (1 s) has the last of them
    text = wait_for(lambda: (lambda t: t if 'method="trace.snapshot"' in t else "")(agent.metrics(5)), 5)
    assert "hw_power_watts" in text
    for method in wire.METHODS:
        assert f'gpuwatch_control_requests_total{{method="{method}",' in text, method
    assert 'result="refused"' in text and 'result="error"' not in text
