"""Hypothesis strategies built from the wire specs (agent/wire.py): for each message, JSON that is
well formed but hostile — values at and just beyond every bound, the wrong JSON type, odd
printable and unprintable text, lists at their maximum length and one past it, unknown fields.

`params(method)` draws a JSON params object for a control method; `expect(method, raw)` says what
the agent must answer to it: None when it parses (the handler decides), else the refusal naming
the field, exactly as the server words it.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import strategies as st

from gpuwatch.agent import wire

# Text a person would not type: controls, escapes, bidi overrides, a lone surrogate, non-BMP.
ODD_TEXT = st.lists(st.sampled_from(["\x00", "\n", "\x1b[31m", "\u202e", "\udcff", "\U0001f600", "é", "a", " ",
                                     '"', "\\", "%s", "{"]), max_size=12).map("".join)
WRONG_TYPE = st.sampled_from([None, True, False, [], {}, "", "1", 1.5, -1, 2**64, 10**400 // 10**300])


def minimal(spec: wire.Spec) -> Any:
    """The smallest value the spec accepts (an element of a list filled to its maximum)."""
    if isinstance(spec, wire.Int):
        return spec.lo
    if isinstance(spec, wire.Float):
        return spec.lo
    if isinstance(spec, wire.Str):
        return spec.choices[0] if spec.choices else ""
    if isinstance(spec, wire.Bool):
        return False
    if isinstance(spec, wire.Opt):
        return None
    if isinstance(spec, (wire.ListOf, wire.MapOf)):
        return [] if isinstance(spec, wire.ListOf) else {}
    if isinstance(spec, wire.Fixed):
        return [minimal(spec.item)] * spec.n
    if isinstance(spec, wire.Obj):
        return {k: minimal(s) for k, (s, d) in spec.message.specs().items() if d is dataclasses.MISSING}
    if isinstance(spec, wire.Json):
        return None
    raise TypeError(spec)


def value(spec: wire.Spec) -> st.SearchStrategy:
    """JSON for one field: mostly in or at the edge of its bounds, sometimes beyond or the wrong type."""
    if isinstance(spec, wire.Int):
        edges = [spec.lo, spec.hi, spec.lo - 1, spec.hi + 1, 0, -(2**63), 2**63, 2**64]
        good = st.sampled_from(edges) | st.integers(spec.lo, spec.hi)
        return good | st.sampled_from([float(spec.hi), 1e308, True]) | WRONG_TYPE
    if isinstance(spec, wire.Float):
        edges = [spec.lo, spec.hi, spec.lo - 1e-9, spec.hi * 1.0000001 + 1, -0.0, 5e-324, 1e308, 10**400]
        good = st.sampled_from(edges) | st.floats(spec.lo, spec.hi, allow_nan=False) | st.integers(0, 10)
        return good | WRONG_TYPE
    if isinstance(spec, wire.Str):
        cases = [st.sampled_from(["", "a" * spec.max_len, "a" * (spec.max_len + 1)]), ODD_TEXT, st.text(max_size=20)]
        if spec.choices:
            cases.append(st.sampled_from(spec.choices))
        if spec.pattern:
            cases.append(st.from_regex(spec.pattern, fullmatch=True).filter(lambda s: len(s) <= spec.max_len))
        return st.one_of(*cases) | WRONG_TYPE
    if isinstance(spec, wire.Bool):
        return st.booleans() | WRONG_TYPE
    if isinstance(spec, wire.Opt):
        return st.none() | value(spec.inner)
    if isinstance(spec, wire.ListOf):
        small = minimal(spec.item)
        return (st.lists(value(spec.item), max_size=3)
                | st.just([small] * spec.max_len) | st.just([small] * (spec.max_len + 1)) | WRONG_TYPE)
    if isinstance(spec, wire.Fixed):
        return st.lists(value(spec.item), min_size=spec.n - 1, max_size=spec.n + 1) | WRONG_TYPE
    if isinstance(spec, wire.MapOf):
        return st.dictionaries(st.text(max_size=8), value(spec.value), max_size=3) | WRONG_TYPE
    if isinstance(spec, wire.Obj):
        return message(spec.message) | WRONG_TYPE
    if isinstance(spec, wire.Json):
        return st.recursive(st.none() | st.booleans() | st.integers() | ODD_TEXT,
                            lambda kids: st.lists(kids, max_size=3), max_leaves=6)
    raise TypeError(spec)


def message(cls: type[wire.Message]) -> st.SearchStrategy[dict]:
    """A JSON object for a message: its required fields (rarely left out), any of the optional
    ones, now and then a field it does not have."""
    specs = cls.specs()
    required = {k: value(s) for k, (s, d) in specs.items() if d is dataclasses.MISSING}
    optional = {k: value(s) for k, (s, d) in specs.items() if d is not dataclasses.MISSING}
    extra = st.dictionaries(st.sampled_from(["x", "pid ", "__class__", "a" * 300]), st.integers(), max_size=1)

    def build(req: dict, opt: dict, drop: bool, unknown: dict) -> dict:
        out = {**req, **opt}
        if drop and req:
            out.pop(sorted(req)[0])
        return {**out, **unknown}

    return st.builds(build, st.fixed_dictionaries(required), st.fixed_dictionaries({}, optional=optional),
                     st.integers(0, 9).map(lambda n: n == 0),
                     st.integers(0, 4).flatmap(lambda n: extra if n == 0 else st.just({})))


def params(method: str) -> st.SearchStrategy[dict]:
    return message(wire.METHODS[method])


def expect(method: str, raw: dict) -> str | None:
    """None when `raw` parses as the method's params; else the agent's refusal, word for word."""
    try:
        wire.METHODS[method].parse(raw)
    except wire.WireError as e:
        return f"{method} refused: {e}"
    return None
