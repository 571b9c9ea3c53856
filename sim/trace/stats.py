"""Routing statistics of a trace: the figures docs/trace-generator.md calibrates against.

`trace_stats(trace)` returns a JSON-able dict:

  summary        flat name -> number (means and min/median/max over layers of the per-layer figures)
  per_layer      one dict per layer: reuse, reuse_prefill, reuse_decode, entropy_norm, top_k_share,
                 hottest_over_uniform, gini, distinct
  prefill_union  one dict per chunk length B: mean distinct experts per layer in B consecutive prefill
                 tokens of one request, and the independent-draw prediction sum_i (1 - (1 - q_i)^B)
                 from the trace's own per-layer heat (q_i = share of tokens that select expert i)
  coactivation   within-layer pair lift (lift = P(ij) / (P(i) P(j)) over a layer's recorded tokens) and
                 cross-layer dependence (adjacent-layer Jaccard and mutual information vs a shuffle)

Definitions (routing-traces.md §1 #1, §1 #2, §3):
  reuse          share of a cell's k experts that the previous token of the same request (previous row of
                 that request in execution order) also used in the same layer; pairs with a missing cell
                 are skipped. Reported per phase of the later token.
  window8_coverage  (summary) share of a cell's experts used by any of the 8 previous tokens of the
                 request in that layer (cells with 8 recorded predecessors)
  entropy_norm   entropy of the layer's selection distribution / ln(n_experts) (uniform layer = 1)
  top_k_share    share of the layer's selections taken by its top_k hottest experts
  hottest_over_uniform  hottest expert's share × n_experts
  gini           Gini coefficient of the per-expert selection counts (0 = uniform)

All per-token work runs in numba kernels: no Python loop over rows.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

from sim.trace.format import MISSING, PHASE_DECODE, PHASE_PREFILL, Trace

_MISS = int(MISSING)
# Mutual information is estimated on at most this many rows (evenly spaced): enough for a stable figure.
MI_MAX_ROWS = 20_000
# Pairs need this many co-occurrences before their lift counts (the mbolt threshold, §1 #2).
LIFT_MIN_COUNT = 5
LIFT_HIGH = 1.5
# Coverage window: share of a token's experts used by any of the previous WINDOW tokens of its request
# (OLMoE, WikiText: 75.5 % for 8 tokens, routing-traces.md §3.1).
WINDOW = 8


# ------------------------------------------------------------------------------------------ kernels


@nb.njit(cache=True)
def _reuse_kernel(experts, prev_row, phase):
    rows, n_layers, k = experts.shape
    hits = np.zeros((2, n_layers), np.int64)
    pairs = np.zeros((2, n_layers), np.int64)
    for r in range(rows):
        p = prev_row[r]
        if p < 0:
            continue
        ph = 1 if phase[r] == PHASE_DECODE else 0
        for layer in range(n_layers):
            if experts[r, layer, 0] == _MISS or experts[p, layer, 0] == _MISS:
                continue
            c = 0
            for a in range(k):
                x = experts[r, layer, a]
                for b in range(k):
                    if experts[p, layer, b] == x:
                        c += 1
                        break
            hits[ph, layer] += c
            pairs[ph, layer] += 1
    return hits, pairs


@nb.njit(cache=True)
def _window_kernel(experts, prev_row, window):
    """Per layer: (experts of a cell also used by any of the previous `window` tokens of its request,
    cells with `window` recorded predecessors)."""
    rows, n_layers, k = experts.shape
    hits = np.zeros(n_layers, np.int64)
    cells = np.zeros(n_layers, np.int64)
    back = np.empty(window, np.int64)
    for r in range(rows):
        n = 0
        p = prev_row[r]
        while p >= 0 and n < window:
            back[n] = p
            n += 1
            p = prev_row[p]
        if n < window:
            continue
        for layer in range(n_layers):
            if experts[r, layer, 0] == _MISS:
                continue
            ok = True
            for i in range(window):
                if experts[back[i], layer, 0] == _MISS:
                    ok = False
                    break
            if not ok:
                continue
            c = 0
            for a in range(k):
                x = experts[r, layer, a]
                found = False
                for i in range(window):
                    for b in range(k):
                        if experts[back[i], layer, b] == x:
                            found = True
                            break
                    if found:
                        break
                if found:
                    c += 1
            hits[layer] += c
            cells[layer] += 1
    return hits, cells


@nb.njit(cache=True)
def _heat_kernel(experts, n_experts):
    rows, n_layers, k = experts.shape
    heat = np.zeros((n_layers, n_experts), np.int64)
    cells = np.zeros(n_layers, np.int64)
    for r in range(rows):
        for layer in range(n_layers):
            if experts[r, layer, 0] == _MISS:
                continue
            cells[layer] += 1
            for a in range(k):
                heat[layer, experts[r, layer, a]] += 1
    return heat, cells


@nb.njit(cache=True)
def _union_kernel(experts, rows_in_order, starts, ends, chunk, n_experts):
    """Distinct experts per layer in each full chunk of `chunk` consecutive rows of every run
    rows_in_order[starts[i]:ends[i]]; returns (sum over chunks of distinct per layer, number of chunks)."""
    n_layers = experts.shape[1]
    k = experts.shape[2]
    stamp = np.full((n_layers, n_experts), -1, np.int64)
    total = np.zeros(n_layers, np.int64)
    n_chunks = 0
    for run in range(starts.shape[0]):
        s = starts[run]
        e = ends[run]
        for c0 in range(s, e - chunk + 1, chunk):
            for i in range(c0, c0 + chunk):
                r = rows_in_order[i]
                for layer in range(n_layers):
                    if experts[r, layer, 0] == _MISS:
                        continue
                    for a in range(k):
                        x = experts[r, layer, a]
                        if stamp[layer, x] != n_chunks:
                            stamp[layer, x] = n_chunks
                            total[layer] += 1
            n_chunks += 1
    return total, n_chunks


@nb.njit(cache=True)
def _pair_kernel(experts, layer, n_experts):
    """Upper-triangle co-occurrence counts of one layer (pairs within a cell)."""
    rows, _, k = experts.shape
    counts = np.zeros((n_experts, n_experts), np.int32)
    for r in range(rows):
        if experts[r, layer, 0] == _MISS:
            continue
        for a in range(k):
            x = experts[r, layer, a]
            for b in range(a + 1, k):
                y = experts[r, layer, b]
                if x < y:
                    counts[x, y] += 1
                elif y < x:
                    counts[y, x] += 1
    return counts


@nb.njit(cache=True)
def _cross_kernel(experts, rows, partner_rows, layer, n_experts):
    """Joint counts of (expert at `layer` in row r, expert at layer+1 in row partner_rows[i]) over all
    k x k pairs, and the summed Jaccard of the two cells' expert sets."""
    k = experts.shape[2]
    joint = np.zeros((n_experts, n_experts), np.int64)
    jac = 0.0
    n = 0
    for i in range(rows.shape[0]):
        r = rows[i]
        q = partner_rows[i]
        if experts[r, layer, 0] == _MISS or experts[q, layer + 1, 0] == _MISS:
            continue
        common = 0
        for a in range(k):
            x = experts[r, layer, a]
            for b in range(k):
                y = experts[q, layer + 1, b]
                joint[x, y] += 1
                if x == y:
                    common += 1
        jac += common / (2 * k - common)
        n += 1
    return joint, jac, n


# ------------------------------------------------------------------------------------------ helpers


def previous_rows(request: np.ndarray) -> np.ndarray:
    """int64 [rows]: index of the previous row of the same request in execution order, or -1."""
    request = np.asarray(request)
    order = np.argsort(request, kind="stable")
    prev = np.full(request.shape[0], -1, np.int64)
    if request.shape[0] > 1:
        same = request[order[1:]] == request[order[:-1]]
        prev[order[1:][same]] = order[:-1][same]
    return prev


def reuse_by_layer(experts: np.ndarray, request: np.ndarray, phase: np.ndarray):
    """(hits [2, layers], pairs [2, layers]): row 0 prefill, row 1 decode (phase of the later token)."""
    return _reuse_kernel(np.ascontiguousarray(experts, np.uint16), previous_rows(request),
                         np.ascontiguousarray(phase, np.uint8))


def prefill_union_by_layer(experts: np.ndarray, request: np.ndarray, phase: np.ndarray, chunk: int,
                           n_experts: int) -> tuple[np.ndarray, int]:
    """(mean distinct experts per layer over full chunks of `chunk` prefill tokens, number of chunks)."""
    rows = np.flatnonzero(np.asarray(phase) == PHASE_PREFILL)
    req = np.asarray(request)[rows]
    order = np.argsort(req, kind="stable")
    rows, req = rows[order], req[order]
    if rows.size:
        cut = np.flatnonzero(req[1:] != req[:-1]) + 1
        starts = np.r_[0, cut].astype(np.int64)
        ends = np.r_[cut, rows.size].astype(np.int64)
    else:
        starts = ends = np.zeros(0, np.int64)
    total, n_chunks = _union_kernel(np.ascontiguousarray(experts, np.uint16), rows.astype(np.int64), starts, ends,
                                    int(chunk), int(n_experts))
    mean = total / n_chunks if n_chunks else np.full(total.shape, np.nan)
    return mean, int(n_chunks)


def _f(x) -> float | None:
    """A JSON number: Python float, NaN/inf as None."""
    x = float(x)
    return x if math.isfinite(x) else None


def _spread(prefix: str, values: np.ndarray, out: dict) -> None:
    v = np.asarray(values, float)
    v = v[np.isfinite(v)]
    for name, fn in (("min", np.min), ("median", np.median), ("max", np.max)):
        out[f"{prefix}_{name}"] = _f(fn(v)) if v.size else None


def _entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def popularity_stats(heat: np.ndarray, top_k: int) -> dict:
    """Skew figures of one layer's selection counts (heat[e] = selections of expert e)."""
    heat = np.asarray(heat, float)
    n = heat.size
    total = heat.sum()
    if total <= 0:
        return dict(entropy_norm=None, top_k_share=None, hottest_over_uniform=None, gini=None, distinct=0)
    p = heat / total
    s = np.sort(heat)
    gini = float(((2 * np.arange(1, n + 1) - n - 1) * s).sum() / (n * total)) if n > 1 else 0.0
    return dict(entropy_norm=_entropy(p) / math.log(n) if n > 1 else 1.0,
                top_k_share=float(s[::-1][:top_k].sum() / total),
                hottest_over_uniform=float(p.max() * n),
                gini=gini,
                distinct=int((heat > 0).sum()))


def independent_union(q: np.ndarray, chunk: int) -> np.ndarray:
    """Expected distinct experts in `chunk` independent tokens, per row of q (inclusion probabilities)."""
    q = np.clip(np.asarray(q, float), 0.0, 1.0)
    return (1.0 - (1.0 - q) ** chunk).sum(axis=-1)


def _mutual_information(joint: np.ndarray) -> tuple[float, float]:
    """(MI in bits of the joint count table, entropy in bits of its row marginal)."""
    total = joint.sum()
    if total == 0:
        return math.nan, math.nan
    p = joint / total
    pa = p.sum(axis=1)
    pb = p.sum(axis=0)
    nz = p > 0
    mi = float((p[nz] * np.log2(p[nz] / np.outer(pa, pb)[nz])).sum())
    h = float(-(pa[pa > 0] * np.log2(pa[pa > 0])).sum())
    return mi, h


# ------------------------------------------------------------------------------------------ entry


def trace_stats(trace: Trace, chunk_lengths=(32, 128, 512, 2048)) -> dict:
    """Routing statistics of `trace` (see the module docstring); JSON-able."""
    h = trace.header
    n_layers, n_experts, k = h.n_layers, h.n_experts, h.top_k
    experts = np.ascontiguousarray(trace.experts, np.uint16)
    rows = trace.n_rows

    hits, pairs = reuse_by_layer(experts, trace.request, trace.phase)
    with np.errstate(invalid="ignore", divide="ignore"):
        reuse_pre = hits[0] / (k * pairs[0])
        reuse_dec = hits[1] / (k * pairs[1])
        reuse_all = hits.sum(0) / (k * pairs.sum(0))
    heat, cells = _heat_kernel(experts, n_experts)

    per_layer = []
    for layer in range(n_layers):
        pop = popularity_stats(heat[layer], k)
        per_layer.append(dict(layer=layer, reuse=_f(reuse_all[layer]), reuse_prefill=_f(reuse_pre[layer]),
                              reuse_decode=_f(reuse_dec[layer]),
                              **{key: (_f(v) if key != "distinct" and v is not None else v)
                                 for key, v in pop.items()}))

    summary: dict = dict(rows=rows, requests=int(np.unique(trace.request).size) if rows else 0,
                         prefill_rows=int((trace.phase == PHASE_PREFILL).sum()),
                         decode_rows=int((trace.phase == PHASE_DECODE).sum()),
                         n_layers=n_layers, n_experts=n_experts, top_k=k,
                         missing_cell_share=_f(1 - cells.sum() / (rows * n_layers)) if rows else None)
    with np.errstate(invalid="ignore", divide="ignore"):
        summary["reuse_mean"] = _f(hits.sum() / (k * pairs.sum())) if pairs.sum() else None
        summary["reuse_prefill_mean"] = _f(hits[0].sum() / (k * pairs[0].sum())) if pairs[0].sum() else None
        summary["reuse_decode_mean"] = _f(hits[1].sum() / (k * pairs[1].sum())) if pairs[1].sum() else None
    summary["reuse_random"] = k / n_experts
    w_hits, w_cells = _window_kernel(experts, previous_rows(trace.request), WINDOW)
    summary[f"window{WINDOW}_coverage_mean"] = _f(w_hits.sum() / (k * w_cells.sum())) if w_cells.sum() else None
    _spread("reuse", reuse_all, summary)
    for key in ("entropy_norm", "top_k_share", "hottest_over_uniform", "gini", "distinct"):
        _spread(key, np.array([np.nan if d[key] is None else d[key] for d in per_layer], float), summary)

    # ---- prefill union vs chunk length
    with np.errstate(invalid="ignore", divide="ignore"):
        q = heat / np.maximum(cells, 1)[:, None]
    union = []
    for chunk in chunk_lengths:
        chunk = int(chunk)
        mean, n_chunks = prefill_union_by_layer(experts, trace.request, trace.phase, chunk, n_experts)
        pred = independent_union(q, chunk)
        measured = mean[np.isfinite(mean)]
        entry = dict(chunk_tokens=chunk, chunks=n_chunks,
                     mean_distinct_per_layer=_f(measured.mean()) if measured.size else None,
                     min=_f(measured.min()) if measured.size else None,
                     max=_f(measured.max()) if measured.size else None,
                     independent_draw_prediction=_f(pred.mean()) if rows else None,
                     independent_min=_f(pred.min()) if rows else None,
                     independent_max=_f(pred.max()) if rows else None)
        union.append(entry)
        summary[f"union_{chunk}_mean"] = entry["mean_distinct_per_layer"]
        summary[f"union_{chunk}_independent"] = entry["independent_draw_prediction"]

    coact = coactivation_stats(experts, heat, cells, n_experts, k)
    for key, value in coact["within_layer"].items():
        if not isinstance(value, list):
            summary[f"coact_{key}"] = value
    for key, value in coact["cross_layer"].items():
        if not isinstance(value, list):
            summary[f"cross_layer_{key}"] = value
    return dict(summary=summary, per_layer=per_layer, prefill_union=union, coactivation=coact)


def coactivation_stats(experts: np.ndarray, heat: np.ndarray, cells: np.ndarray, n_experts: int, k: int) -> dict:
    """Within-layer pair lift and cross-layer dependence (see the module docstring)."""
    n_layers = experts.shape[1]
    pooled = []
    layer_p99, layer_max, layer_share, layer_top_cofire, kept_p99 = [], [], [], [], []
    iu = np.triu_indices(n_experts, 1)
    for layer in range(n_layers if k > 1 else 0):
        if cells[layer] == 0:
            continue
        counts = _pair_kernel(experts, layer, n_experts)[iu].astype(float)
        expect = heat[layer][iu[0]].astype(float) * heat[layer][iu[1]] / cells[layer]
        ok = counts >= LIFT_MIN_COUNT
        lift = counts[ok] / expect[ok]
        layer_top_cofire.append(counts.max() / cells[layer] if counts.size else 0.0)
        if lift.size == 0:
            continue
        pooled.append(lift)
        layer_p99.append(np.percentile(lift, 99))
        layer_max.append(lift.max())
        layer_share.append((lift >= LIFT_HIGH).mean())
        high = lift[lift >= LIFT_HIGH]
        if high.size:
            kept_p99.append(np.percentile(high, 99))
    within: dict = dict(min_count=LIFT_MIN_COUNT)
    if pooled:
        allv = np.concatenate(pooled)
        within.update(pairs=int(allv.size), share_lift_ge_1_5=_f((allv >= LIFT_HIGH).mean()),
                      lift_p99=_f(np.percentile(allv, 99)), lift_max=_f(allv.max()),
                      lift_median=_f(np.median(allv)),
                      layer_p99_median=_f(np.median(layer_p99)), layer_max_median=_f(np.median(layer_max)),
                      layer_share_lift_ge_1_5_median=_f(np.median(layer_share)),
                      kept_pairs_p99_median=_f(np.median(kept_p99)) if kept_p99 else None,
                      top_pair_cofire_share_max=_f(max(layer_top_cofire)))
    else:
        within.update(pairs=0, share_lift_ge_1_5=None, lift_p99=None, lift_max=None, lift_median=None,
                      layer_p99_median=None, layer_max_median=None, layer_share_lift_ge_1_5_median=None,
                      kept_pairs_p99_median=None, top_pair_cofire_share_max=None)

    # ---- cross-layer: adjacent layers of the same token vs a fixed shuffle of the rows
    rows = experts.shape[0]
    sel = np.linspace(0, rows - 1, min(rows, MI_MAX_ROWS)).astype(np.int64) if rows else np.zeros(0, np.int64)
    sel = np.unique(sel)
    shuffled = np.random.default_rng(12345).permutation(sel)
    mi_frac, jac, jac_shuf = [], [], []
    for layer in range(n_layers - 1):
        joint, j_sum, n = _cross_kernel(experts, sel, sel, layer, n_experts)
        joint_s, js_sum, ns = _cross_kernel(experts, sel, shuffled, layer, n_experts)
        if n == 0 or ns == 0:
            mi_frac.append(math.nan)
            continue
        mi, ent = _mutual_information(joint)
        mi_s, _ = _mutual_information(joint_s)
        mi_frac.append((mi - mi_s) / ent if ent > 0 else math.nan)
        jac.append(j_sum / n)
        jac_shuf.append(js_sum / ns)
    mf = np.array(mi_frac, float)
    finite = mf[np.isfinite(mf)]
    cross = dict(rows_used=int(sel.size),
                 adjacent_jaccard=_f(np.mean(jac)) if jac else None,
                 adjacent_jaccard_shuffled=_f(np.mean(jac_shuf)) if jac_shuf else None,
                 mi_fraction_mean=_f(finite.mean()) if finite.size else None,
                 mi_fraction_median=_f(np.median(finite)) if finite.size else None,
                 mi_fraction_per_pair=[_f(x) for x in mf])
    return dict(within_layer=within, cross_layer=cross)
