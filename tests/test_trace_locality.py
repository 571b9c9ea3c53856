"""sim.trace.locality: LRU hit rates under a study's protocol, reuse within d tokens and hot-pair coverage, against
hand-worked answers, an OrderedDict LRU written here independently (keys per expert as kekzl/imp's
expert_cache_sim.py counts them), hypothesis properties, and the real figures routing-traces.md quotes."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.errors import InputError
from sim.trace.format import PHASE_DECODE, PHASE_PREFILL, Trace, TraceHeader
from sim.trace.locality import LruProtocol, hot_pair_coverage, lru_hit_rates, reuse_within

ROOT = Path(__file__).resolve().parents[1]
MIXTRAL = ROOT.parent / "shared" / "data" / "mixtral-routing"
V2_LITE = ROOT / "sim" / "trace" / "generator_deepseek_v2_lite.json"


def make(experts, n_experts, request=None, phase=None) -> Trace:
    experts = np.asarray(experts, np.uint16)
    if experts.ndim == 2:
        experts = experts[:, None, :]
    rows, n_layers, k = experts.shape
    header = TraceHeader(model="toy", n_layers=n_layers, n_experts=n_experts, top_k=k, source="hand-made",
                         source_sha256="0" * 64)
    request = np.zeros(rows, np.int32) if request is None else np.asarray(request, np.int32)
    phase = np.full(rows, PHASE_DECODE, np.uint8) if phase is None else np.asarray(phase, np.uint8)
    return Trace(header, request, np.arange(rows, dtype=np.int32), phase, experts).validate()


def reference_lru(trace: Trace, slots: int, keys: int = 1, rows="all", cold="trace", pool="layer") -> float:
    """An OrderedDict LRU: every selected expert touches `keys` keys (its projections) in order."""
    caches: dict = {}
    hits = total = 0
    last_request = None
    for r in range(trace.n_rows):
        if rows == "decode" and trace.phase[r] != PHASE_DECODE:
            continue
        if cold == "request" and trace.request[r] != last_request:
            caches = {}
        last_request = trace.request[r]
        for layer in range(trace.header.n_layers):
            cache = caches.setdefault(layer if pool == "layer" else 0, OrderedDict())
            for e in trace.experts[r, layer]:
                for proj in range(keys):
                    key = (layer, int(e), proj)
                    total += 1
                    if key in cache:
                        hits += 1
                        cache.move_to_end(key)
                    else:
                        cache[key] = True
                        while len(cache) > slots:
                            cache.popitem(last=False)
    return hits / (total // keys * keys) if total else float("nan")


# ------------------------------------------------------------------------------------------ LRU


def test_lru_by_hand():
    # one layer, k = 1: A B A C B. 2 slots: A B (miss miss) A hit, C evicts B, B miss -> 1 hit of 5
    t = make([[0], [1], [0], [2], [1]], 4)
    assert lru_hit_rates(t, [1, 2, 3])["hit_rate"] == pytest.approx([0.0, 0.2, 0.4])


def test_three_keys_per_expert_hold_a_third_as_many_experts():
    # kekzl/imp's cache keys are (projection, expert): 6 slots hold 2 experts, 5 slots hold 1 (and a part)
    t = make([[0], [1], [0], [2], [1]], 4)
    got = lru_hit_rates(t, [3, 5, 6, 8], LruProtocol(keys_per_expert=3))["hit_rate"]
    assert got == pytest.approx([0.0, 0.0, 0.2, 0.2])
    for slots, g in zip([3, 5, 6, 8], got):
        assert g == pytest.approx(reference_lru(t, slots, keys=3))


def test_decode_rows_only_and_cold_per_request():
    t = make([[0], [0], [1], [1], [0]], 2, request=[0, 0, 0, 1, 1],
             phase=[PHASE_PREFILL, PHASE_DECODE, PHASE_DECODE, PHASE_DECODE, PHASE_DECODE])
    # decode rows 0 1 | 1 0 with one cache: miss miss hit hit (2 slots)
    assert lru_hit_rates(t, [2], LruProtocol(rows="decode"))["hit_rate"] == pytest.approx([0.5])
    # cleared at the request: 0 1 | 1 0 -> miss miss | miss miss
    assert lru_hit_rates(t, [2], LruProtocol(rows="decode", cold="request"))["hit_rate"] == pytest.approx([0.0])
    # all rows: 0 0 1 | 1 0 -> miss hit miss hit hit
    assert lru_hit_rates(t, [2])["hit_rate"] == pytest.approx([0.6])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), layers=st.integers(1, 3), requests=st.integers(1, 3),
       keys=st.integers(1, 3), rows=st.sampled_from(["all", "decode"]), cold=st.sampled_from(["trace", "request"]),
       pool=st.sampled_from(["layer", "shared"]))
def test_property_lru_equals_an_ordered_dict_at_every_size(seed, layers, requests, keys, rows, cold, pool):
    rng = np.random.default_rng(seed)
    n = 12 * requests
    ex = np.stack([np.stack([rng.choice(6, 2, replace=False) for _ in range(layers)]) for _ in range(n)])
    prompt_rows = rng.integers(0, 13, requests)  # each request's prompt comes before its decode steps
    phase = np.concatenate([np.arange(12) >= p for p in prompt_rows])
    t = make(ex, 6, request=np.repeat(np.arange(requests), 12), phase=phase)
    slots = list(range(0, 6 * layers * keys + 2))
    got = lru_hit_rates(t, slots, LruProtocol(rows=rows, cold=cold, keys_per_expert=keys, pool=pool))["hit_rate"]
    want = [reference_lru(t, s, keys, rows, cold, pool) for s in slots]
    np.testing.assert_allclose(np.array(got, float), np.array(want, float), atol=1e-12)
    finite = [g for g in got if g is not None]
    assert finite == sorted(finite)  # LRU is a stack algorithm: more slots never fewer hits


@pytest.mark.parametrize("field, value", [("rows", "warm"), ("cold", "never"), ("keys_per_expert", 0),
                                          ("keys_per_expert", True), ("pool", "global")])
def test_bad_protocol_is_an_input_error(field, value):
    with pytest.raises(InputError) as info:
        LruProtocol(**{field: value})
    assert info.value.field == field


# ------------------------------------------------------------------------------------------ reuse within d


def test_reuse_within_by_hand():
    # one layer, k = 1: 0 1 0 0 2 1 -> gaps -, -, 2, 1, -, 4: within 1: 1/6, within 2: 2/6, within 4: 3/6
    t = make([[0], [1], [0], [0], [2], [1]], 4)
    assert reuse_within(t, [1, 2, 4])["share"] == pytest.approx([1 / 6, 2 / 6, 3 / 6])


def test_reuse_within_stops_at_the_request():
    t = make([[0], [0], [0], [0]], 2, request=[0, 0, 1, 1])
    assert reuse_within(t, [1])["share"] == pytest.approx([0.5])  # the first token of each request cannot reuse


def test_hot_pair_coverage_by_hand():
    # two layers x 2 experts; counts (layer 0: 3, 1; layer 1: 0, 4): the hottest half of the 4 pairs holds 7/8
    t = make(np.array([[[0], [1]], [[0], [1]], [[0], [1]], [[1], [1]]]), 2)
    assert hot_pair_coverage(t, [0.25, 0.5, 1.0])["share"] == pytest.approx([4 / 8, 7 / 8, 1.0])


# ------------------------------------------------------------------------------------------ real figures


@pytest.mark.skipif(not MIXTRAL.is_dir(), reason="../shared/data/mixtral-routing not present")
def test_real_mixtral_per_layer_lru():
    # routing-traces.md §1 #1 (computed by the project): HumanEval decode, per-layer LRU at 2-6 experts
    # 34 / 48 / 60 / 70 / 80 %
    from tests.test_trace_stats import read_decode_jsonl

    t = read_decode_jsonl(MIXTRAL / "humaneval_2_routing.jsonl")
    got = lru_hit_rates(t, [2, 3, 4, 5, 6])["hit_rate"]
    assert np.array(got) == pytest.approx([0.34, 0.48, 0.60, 0.70, 0.80], abs=0.01)


def test_derived_v2_lite_figures_are_the_published_ones():
    # traces/derive_deepseek_v2_lite.py ran these functions over the 1,999 prompts; routing-traces.md §6 quotes
    # reuse within 1/2/4/8/16/32/64 = 26.2/36.5/49.5/64.7/78.7/87.3/90.7 %, adjacent 0.265, and one shared LRU at
    # 10/18.6/25/50 % of the pairs 26.3/37.0/44.5/70.4 %
    doc = json.loads(V2_LITE.read_text())
    assert (doc["prompts"], doc["tokens"]) == (1999, 192_023)
    assert doc["reuse_within"]["share"] == pytest.approx([0.262, 0.365, 0.495, 0.647, 0.787, 0.873, 0.907], abs=6e-4)
    assert doc["adjacent_reuse"]["mean"] == pytest.approx(0.265, abs=6e-4)
    assert doc["lru"]["shared"]["hit"] == pytest.approx([0.263, 0.370, 0.445, 0.704], abs=6e-4)
