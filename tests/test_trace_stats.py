"""trace_stats: known answers on tiny hand-made traces, and the real Mixtral figures of routing-traces.md §1 #1."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from sim.trace.format import MISSING, PHASE_DECODE, PHASE_PREFILL, Trace, TraceHeader
from sim.trace.stats import independent_union, popularity_stats, previous_rows, trace_stats

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
MIXTRAL = DATA / "mixtral-routing"


def make(experts, n_experts, request=None, phase=None, position=None) -> Trace:
    experts = np.asarray(experts)
    if experts.ndim == 2:  # one layer
        experts = experts[:, None, :]
    rows, n_layers, k = experts.shape
    header = TraceHeader(model="toy", n_layers=n_layers, n_experts=n_experts, top_k=k, source="hand-made",
                         source_sha256="0" * 64)
    request = np.zeros(rows) if request is None else np.asarray(request)
    phase = np.full(rows, PHASE_DECODE) if phase is None else np.asarray(phase)
    position = np.arange(rows) if position is None else np.asarray(position)
    return Trace(header, request, position, phase, experts).validate()


def layer(stats, i=0):
    return stats["per_layer"][i]


# ------------------------------------------------------------------------------------------ reuse


def test_reuse_three_tokens_by_hand():
    # t1 shares {1} with t0, t2 shares {1, 2} with t1: (1 + 2) / (2 pairs x k=2) = 0.75
    s = trace_stats(make([[0, 1], [1, 2], [2, 1]], 4))
    assert layer(s)["reuse"] == pytest.approx(0.75)
    assert s["summary"]["reuse_mean"] == pytest.approx(0.75)
    assert s["summary"]["reuse_random"] == pytest.approx(0.5)


def test_reuse_follows_the_request_not_the_row_before():
    # rows interleave two requests: r0 = [0,1] [0,1] (reuse 1), r1 = [2,3] [4,5] (reuse 0)
    s = trace_stats(make([[0, 1], [2, 3], [1, 0], [4, 5]], 8, request=[0, 1, 0, 1]))
    assert layer(s)["reuse"] == pytest.approx(0.5)
    assert previous_rows(np.array([0, 1, 0, 1])).tolist() == [-1, -1, 0, 1]


def test_reuse_split_by_phase_of_the_later_token():
    # prefill: t1 vs t0 share 1 of 2; decode: t2 vs t1 share 2 of 2, t3 vs t2 share 0
    s = trace_stats(make([[0, 1], [1, 2], [2, 1], [5, 6]], 8,
                         phase=[PHASE_PREFILL, PHASE_PREFILL, PHASE_DECODE, PHASE_DECODE]))
    assert layer(s)["reuse_prefill"] == pytest.approx(0.5)
    assert layer(s)["reuse_decode"] == pytest.approx(0.5)
    assert layer(s)["reuse"] == pytest.approx(0.5)
    s = trace_stats(make([[0, 1], [1, 2], [2, 1]], 8, phase=[PHASE_PREFILL, PHASE_PREFILL, PHASE_DECODE]))
    assert layer(s)["reuse_prefill"] == pytest.approx(0.5)
    assert layer(s)["reuse_decode"] == pytest.approx(1.0)
    assert s["summary"]["reuse_mean"] == pytest.approx(0.75)


def test_missing_cells_are_skipped():
    m = int(MISSING)
    # pairs (t0,t1) and (t1,t2) touch the missing cell: only (t2,t3) counts, sharing 1 of 2
    s = trace_stats(make([[0, 1], [m, m], [2, 3], [3, 4]], 8))
    assert layer(s)["reuse"] == pytest.approx(0.5)
    assert s["summary"]["missing_cell_share"] == pytest.approx(0.25)
    assert layer(s)["distinct"] == 5


def test_no_pairs_gives_none_not_nan():
    s = trace_stats(make([[0, 1]], 4))
    assert layer(s)["reuse"] is None and s["summary"]["reuse_mean"] is None
    json.dumps(s, allow_nan=False)


# ------------------------------------------------------------------------------------------ skew


def test_uniform_layer():
    # 4 experts, k=2, every expert selected twice
    s = trace_stats(make([[0, 1], [2, 3], [1, 2], [3, 0]], 4))
    d = layer(s)
    assert d["entropy_norm"] == pytest.approx(1.0)
    assert d["top_k_share"] == pytest.approx(0.5)
    assert d["hottest_over_uniform"] == pytest.approx(1.0)
    assert d["gini"] == pytest.approx(0.0)
    assert d["distinct"] == 4


def test_skewed_layer_by_hand():
    # counts: expert 0 x3, 1 x2, 2 x1, 3 x0 (6 selections, k=1)
    s = trace_stats(make([[0], [0], [0], [1], [1], [2]], 4))
    d = layer(s)
    p = np.array([3, 2, 1]) / 6
    assert d["entropy_norm"] == pytest.approx(float(-(p * np.log(p)).sum() / math.log(4)))
    assert d["top_k_share"] == pytest.approx(0.5)
    assert d["hottest_over_uniform"] == pytest.approx(2.0)
    # Gini of (0, 1, 2, 3) / 6: sum_i (2i - n - 1) x_i / (n sum x) = (-3*0 - 1*1 + 1*2 + 3*3) / (4*6)
    assert d["gini"] == pytest.approx(10 / 24)
    assert d["distinct"] == 3
    assert popularity_stats(np.zeros(4), 1)["entropy_norm"] is None


# ------------------------------------------------------------------------------------------ union


def test_prefill_union_by_hand():
    # request 0: 5 prefill tokens, then 1 decode; request 1: 2 prefill tokens
    experts = [[0, 1], [1, 2], [3, 4], [3, 5], [7, 6], [0, 7], [4, 5], [5, 6]]
    phase = [0, 0, 0, 0, 0, 1, 0, 0]
    request = [0, 0, 0, 0, 0, 0, 1, 1]
    s = trace_stats(make(experts, 8, request=request, phase=phase), chunk_lengths=(2, 4, 8))
    by = {u["chunk_tokens"]: u for u in s["prefill_union"]}
    # chunks of 2: r0 {0,1,2} (3), {3,4,5} (3); r0's 5th token is a partial chunk; r1 {4,5,6} (3)
    assert by[2]["chunks"] == 3 and by[2]["mean_distinct_per_layer"] == pytest.approx(3.0)
    # chunks of 4: r0 only: {0,1,2,3,4,5} = 6
    assert by[4]["chunks"] == 1 and by[4]["mean_distinct_per_layer"] == pytest.approx(6.0)
    assert by[8]["chunks"] == 0 and by[8]["mean_distinct_per_layer"] is None
    # independent-draw prediction from the trace's own heat: q_i = count_i / 8 tokens
    counts = np.bincount(np.ravel(experts), minlength=8)
    q = counts / 8
    assert by[2]["independent_draw_prediction"] == pytest.approx(float((1 - (1 - q) ** 2).sum()))
    assert independent_union(np.full(4, 0.5), 1) == pytest.approx(2.0)
    assert independent_union(np.full(4, 0.5), 3) == pytest.approx(4 * (1 - 0.125))


# ------------------------------------------------------------------------------------------ co-activation


def test_pair_lift_by_hand():
    # 10 tokens, k=2 of 8: experts 0 and 1 always together (5 tokens), the rest spread out
    experts = [[0, 1]] * 5 + [[2, 3], [4, 5], [6, 7], [2, 4], [3, 5]]
    s = trace_stats(make(experts, 8))
    w = s["coactivation"]["within_layer"]
    # lift(0,1) = P(01) / (P0 P1) = 0.5 / (0.5 * 0.5) = 2; it is the only pair with count >= 5
    assert w["pairs"] == 1
    assert w["lift_max"] == pytest.approx(2.0)
    assert w["share_lift_ge_1_5"] == pytest.approx(1.0)
    assert w["top_pair_cofire_share_max"] == pytest.approx(0.5)


def test_cross_layer_identical_vs_independent_layers():
    rng = np.random.default_rng(0)
    rows, e, k = 4000, 16, 2
    a = np.argsort(rng.random((rows, e)), axis=1)[:, :k]
    b = np.argsort(rng.random((rows, e)), axis=1)[:, :k]
    same = trace_stats(make(np.stack([a, a], axis=1), e))["coactivation"]["cross_layer"]
    assert same["adjacent_jaccard"] == pytest.approx(1.0)
    assert same["adjacent_jaccard_shuffled"] < 0.2
    # all k x k pairs of a token: half are (x, x), half (x, y != x). Exactly: MI = 1/2 log2(256/32) +
    # 1/2 log2(256/480) = 1.0466 bits of H = 4 bits
    exact = (0.5 * math.log2(256 / 32) + 0.5 * math.log2(256 / 480)) / 4
    assert same["mi_fraction_mean"] == pytest.approx(exact, abs=0.01)
    indep = trace_stats(make(np.stack([a, b], axis=1), e))["coactivation"]["cross_layer"]
    assert abs(indep["mi_fraction_mean"]) < 0.01
    assert indep["adjacent_jaccard"] == pytest.approx(indep["adjacent_jaccard_shuffled"], abs=0.01)


def test_output_is_json_and_complete():
    rng = np.random.default_rng(1)
    experts = np.argsort(rng.random((300, 3, 8)), axis=2)[:, :, :2]
    s = trace_stats(make(experts, 8, phase=np.r_[np.zeros(200), np.ones(100)]), chunk_lengths=(32, 128))
    json.dumps(s, allow_nan=False)
    assert set(s) == {"summary", "per_layer", "prefill_union", "coactivation"}
    assert [d["layer"] for d in s["per_layer"]] == [0, 1, 2]
    for d in s["per_layer"]:
        assert set(d) == {"layer", "reuse", "reuse_prefill", "reuse_decode", "entropy_norm", "top_k_share",
                          "hottest_over_uniform", "gini", "distinct"}
    assert [u["chunk_tokens"] for u in s["prefill_union"]] == [32, 128]
    for key in ("reuse_mean", "entropy_norm_median", "union_32_mean", "coact_share_lift_ge_1_5",
                "cross_layer_mi_fraction_mean"):
        assert key in s["summary"]


# ------------------------------------------------------------------------------------------ real Mixtral


def read_decode_jsonl(path: Path) -> Trace:
    """Decode-only Mario928 files: one record per (problem, token_idx, layer); absent records -> MISSING."""
    cells = defaultdict(dict)
    n_layers = 0
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            cells[(rec["problem_id"], rec["token_idx"])][rec["layer"]] = rec["experts"]
            n_layers = max(n_layers, rec["layer"] + 1)
    problems = sorted({p for p, _ in cells})
    keys = [(p, t) for p in problems for t in range(1 + max(t for q, t in cells if q == p))]
    experts = np.full((len(keys), n_layers, 2), MISSING, np.uint16)
    for i, key in enumerate(keys):
        for lay, ids in cells.get(key, {}).items():
            experts[i, lay] = ids
    request = np.array([problems.index(p) for p, _ in keys])
    position = np.array([t for _, t in keys])
    return make(experts, 8, request=request, position=position)


@pytest.mark.skipif(not MIXTRAL.is_dir(), reason="../shared/data/mixtral-routing not present")
@pytest.mark.parametrize("name, reuse, entropy, top_share", [
    # routing-traces.md §1 #1 (computed by the project): reuse; per-layer entropy min/mean/max of 3 bits;
    # top expert's share of a layer's selections
    ("humaneval_2_routing.jsonl", 0.399, (2.83, 2.94, 2.99), (0.14, 0.23)),
    ("gsm8k_2_routing.jsonl", 0.344, (2.75, 2.92, 2.98), (0.16, 0.24)),
])
def test_real_mixtral_decode_files(name, reuse, entropy, top_share):
    s = trace_stats(read_decode_jsonl(MIXTRAL / name))
    assert s["summary"]["reuse_decode_mean"] == pytest.approx(reuse, abs=0.0015)
    bits = np.array([d["entropy_norm"] for d in s["per_layer"]]) * 3
    assert bits.min() == pytest.approx(entropy[0], abs=0.006)
    assert bits.mean() == pytest.approx(entropy[1], abs=0.006)
    assert bits.max() == pytest.approx(entropy[2], abs=0.006)
    share = np.array([d["hottest_over_uniform"] for d in s["per_layer"]]) / 8
    assert share.min() == pytest.approx(top_share[0], abs=0.006)
    assert share.max() == pytest.approx(top_share[1], abs=0.006)


@pytest.mark.skipif(not MIXTRAL.is_dir(), reason="../shared/data/mixtral-routing not present")
def test_real_mixtral_raw_file_prefill_and_decode():
    importers = pytest.importorskip("sim.trace.importers")
    trace = importers.import_trace(MIXTRAL / "routing_raw.jsonl", n_experts=8)
    s = trace_stats(trace)["summary"]
    # routing-traces.md §3.1 / §3.6: HumanEval/0 raw, prefill 0.390 / decode 0.359 (~2.9 % cells missing)
    assert s["reuse_prefill_mean"] == pytest.approx(0.390, abs=0.004)
    assert s["reuse_decode_mean"] == pytest.approx(0.359, abs=0.004)
    assert s["prefill_rows"] == 135 and s["decode_rows"] == 83
