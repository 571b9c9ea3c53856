"""One-pass Mattson miss-ratio curves equal a replay at every capacity."""

import numpy as np
from hypothesis import given, settings

from sim.cache.replay import Geometry, lru_mrc, replay
from tests.test_cache import make_trace, routing


def naive_stack_distances(seq):
    """Mattson's definition, walked down an explicit LRU stack (the independent reference)."""
    stack, out = [], []
    for key in seq:
        if key in stack:
            d = stack.index(key) + 1
            stack.remove(key)
        else:
            d = None
        stack.insert(0, key)
        out.append(d)
    return out


def test_known_answer_abacb():
    trace = make_trace(np.array([0, 1, 0, 2, 1]).reshape(-1, 1, 1))
    mrc = lru_mrc(trace, Geometry.of(trace), "global")
    assert [mrc.hits(c) for c in range(4)] == [0, 0, 1, 2]
    assert naive_stack_distances([0, 1, 0, 2, 1]) == [None, None, 2, None, 3]
    curve = mrc.curve()
    assert curve["misses"].tolist()[:4] == [5, 5, 4, 3]


@settings(max_examples=200, deadline=None)
@given(routing)
def test_mrc_equals_replay_at_every_capacity(data):
    experts, n_experts = data
    trace = make_trace(experts, n_experts=n_experts)
    g = Geometry.of(trace)
    for scope in ("layer", "global"):
        mrc = lru_mrc(trace, g, scope)
        n_pools = experts.shape[1] if scope == "layer" else 1
        for capacity in range(0, n_experts * experts.shape[1] + 2):
            hits = replay(trace, g, "lru", scope, np.full(n_pools, capacity)).summary()["hits"]
            assert mrc.hits(capacity) == hits, (scope, capacity)


def test_mrc_matches_naive_stack_on_a_long_trace_with_renumbering():
    # 50k accesses over 64 keys: time is renumbered hundreds of times
    rng = np.random.default_rng(7)
    experts = rng.integers(0, 64, (50_000, 1, 1))
    trace = make_trace(experts, n_experts=64)
    mrc = lru_mrc(trace, Geometry.of(trace), "global")
    distances = [d for d in naive_stack_distances(experts.ravel().tolist()) if d is not None]
    expected = np.bincount(distances, minlength=65)
    assert mrc.hist.sum(axis=(0, 1)).tolist() == expected.tolist()


def test_curve_per_class_in_slots_and_bytes():
    from tests.test_cache import _TwoClassLayout

    rng = np.random.default_rng(1)
    trace = make_trace(rng.integers(0, 4, (50, 3, 1)), n_experts=4)
    g = Geometry.of(trace, _TwoClassLayout())
    curve = lru_mrc(trace, g, "class").curve()
    assert sorted(curve["class"].unique().tolist()) == [0, 1]
    q4 = curve[curve["class"] == 1]
    assert q4["bytes"].tolist() == [s * 14_155_776 for s in q4["slots"]]
    for capacity in (1, 2, 3):
        hits = replay(trace, g, "lru", "class", np.array([capacity, capacity])).per_class()["hits"].tolist()
        assert curve.query("slots == @capacity")["hits"].tolist() == hits
