"""api.frozen against dataclass(frozen=True): the same behaviour, from shared methods.

Each case is played on a pair of classes declared alike, one by each, and the two must agree:
construction (positional, keyword, defaults, factories, __post_init__), the TypeError of a bad
call, equality, hashing, repr, the guard against assignment, and the dataclasses functions."""
from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
from dataclasses import dataclass, field

import pytest
from hypothesis import given, strategies as st

from gpuwatch.agent import api, config, wire


def _declare(make, base):
    @make
    class Point(base):
        x: int
        y: int = 2
        tags: dict = field(default_factory=dict)

    @make
    class Point3(Point):
        z: tuple = ()

    @make
    class Checked(base):
        n: int

        def __post_init__(self) -> None:
            if self.n < 0:
                raise ValueError("n must not be negative")

    @make
    class Pair(base):
        a: int
        b: tuple = ()

    return Point, Point3, Checked, Pair


OURS = _declare(api.frozen, api.Frozen)
THEIRS = _declare(dataclass(frozen=True), object)
PAIRS = list(zip(OURS, THEIRS))


def _outcome(make):
    try:
        v = make()
    except Exception as e:  # noqa: BLE001 - the kind of error is what is compared
        return ("raises", type(e))
    return ("ok", dataclasses.asdict(v))


CALLS = [
    ((1,), {}), ((1, 5), {}), ((1, 5, {"a": 1}), {}), ((), {"x": 1}), ((), {"y": 1, "x": 3}),
    ((), {}), ((1, 2, {}, 4), {}), ((1,), {"x": 2}), ((1,), {"w": 2}), ((), {"y": 1}),
]


@pytest.mark.parametrize("args,kwargs", CALLS)
def test_a_call_builds_the_same_fields_or_fails_the_same_way(args, kwargs):
    ours, theirs = OURS[0], THEIRS[0]
    assert _outcome(lambda: ours(*args, **kwargs)) == _outcome(lambda: theirs(*args, **kwargs))


def test_inherited_fields_come_first_and_post_init_runs():
    (ours, theirs) = PAIRS[1]
    assert [f.name for f in dataclasses.fields(ours)] == [f.name for f in dataclasses.fields(theirs)] == \
        ["x", "y", "tags", "z"]
    assert dataclasses.astuple(ours(1, 2, {}, (3,))) == dataclasses.astuple(theirs(1, 2, {}, (3,)))
    for cls in PAIRS[2]:
        assert cls(3).n == 3
        with pytest.raises(ValueError, match="negative"):
            cls(-1)


def test_each_instance_gets_its_own_factory_default():
    a, b = OURS[0](1), OURS[0](1)
    assert a.tags == {} and a.tags is not b.tags


@given(st.integers(), st.integers(), st.integers(), st.integers())
def test_equality_hash_and_repr_agree(x1, y1, x2, y2):
    P, Q = PAIRS[3]
    a, b = P(x1, (y1,)), P(x2, (y2,))
    c, d = Q(x1, (y1,)), Q(x2, (y2,))
    assert (a == b) == (c == d) and (a != b) == (c != d)
    assert (hash(a) == hash(b)) == (hash(c) == hash(d))
    assert hash(a) == hash(c)  # the same tuple of values
    assert repr(a) == repr(c)  # both say Pair(a=..., b=...): the classes have the same qualname
    for cls in PAIRS[0]:  # a dict field: neither hashes
        with pytest.raises(TypeError):
            hash(cls(x1))


def test_instances_of_other_classes_are_never_equal():
    P, P3 = OURS[0], OURS[1]
    assert P(1, 2) != P3(1, 2)
    assert P(1, 2) != THEIRS[0](1, 2)
    assert P(1, 2).__eq__((1, 2, {})) is NotImplemented


def test_fields_cannot_be_assigned_or_deleted():
    for cls in PAIRS[0]:
        p = cls(1)
        with pytest.raises(dataclasses.FrozenInstanceError):
            p.x = 5
        with pytest.raises(dataclasses.FrozenInstanceError):
            p.other = 5
        with pytest.raises(dataclasses.FrozenInstanceError):
            del p.x
        assert p.x == 1


def test_replace_copy_and_pickle():
    P = OURS[1]
    p = P(1, 2, {"k": 1}, (4,))
    q = dataclasses.replace(p, y=7)
    assert (q.x, q.y, q.tags, q.z) == (1, 7, {"k": 1}, (4,)) and p.y == 2
    with pytest.raises(TypeError):
        dataclasses.replace(p, w=1)
    assert copy.copy(p) == p and copy.deepcopy(p) == p
    m = wire.TraceGraphsResult(truncated=True)
    assert pickle.loads(pickle.dumps(m)) == m


@pytest.mark.parametrize("module,least", [(wire, 40), (config, 10)])
def test_every_frozen_class_shares_the_methods(module, least):
    """The point of `frozen`: no wire type or configuration section has generated methods of its own
    (each compiled at import cost 0.4 ms before Python 3.13), and each is still a dataclass."""
    classes = [c for c in vars(module).values()
               if inspect.isclass(c) and issubclass(c, api.Frozen) and c not in (api.Frozen, wire.Spec, wire.Message,
                                                                               wire.Result)]
    assert len(classes) >= least
    for c in classes:
        assert dataclasses.is_dataclass(c), c
        own = {"__init__", "__eq__", "__hash__", "__repr__", "__setattr__", "__delattr__"} & set(vars(c))
        assert not own, f"{c.__name__} has generated {sorted(own)}"
        assert c._fields == tuple(f.name for f in dataclasses.fields(c))


def test_a_message_not_made_with_frozen_is_refused_not_parsed_empty():
    """A Message subclass declared with dataclass(frozen=True), or with no decorator, would have
    no field list of its own: parsing it must fail loudly rather than return a message of nothing."""
    @dataclass(frozen=True)
    class Plain(wire.Result):
        up: bool = wire.wire(wire.Bool())

    class Bare(wire.Result):
        pass

    for cls in (Plain, Bare):
        with pytest.raises(TypeError, match="not made with api.frozen"):
            cls.parse({"up": True})
    with pytest.raises(TypeError, match="not made with api.frozen"):
        Bare()
