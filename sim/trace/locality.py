"""Locality of a trace's routing, measured the way published expert-cache studies measured theirs, so a
generated or imported trace can be put next to their figures (docs/trace-generator.md, "Against real routing").

    lru_hit_rates(trace, capacities, LruProtocol(...))  per-layer LRU hit rate at each capacity (slots)
    reuse_within(trace, distances)                      share of selections reused within d tokens
    hot_pair_coverage(trace, fractions)                 routed mass of the hottest (layer, expert) pairs

Definitions:
  per-layer LRU  every layer has its own cache of `capacity` slots; a selection hits when its expert is
                 resident. The hit rate pools all layers' selections. Exact for every capacity at once from
                 one pass of Mattson stack distances (sim/trace/mrc.py).
  protocol       what a study recorded and replayed: which rows (decode only, or all), whether the cache
                 starts cold once (requests replayed one after another into the same cache) or is cleared at
                 every request, and how many cache keys one expert takes (an engine that caches an expert's
                 gate, up and down projections as three keys in one slot budget needs 3 slots per expert:
                 kekzl/imp tools/analysis/expert_cache_sim.py). Keys of one expert are always touched together,
                 so a cache of s slots holds exactly the floor(s / keys) most recent experts.
  reuse within d the share of all recorded selections (a request's first token included) whose expert the
                 same layer also selected in one of the previous d tokens of the same request
                 (DeepSeek-V2-Lite figures of routing-traces.md §6; d = 1 is the adjacent reuse counted over
                 all selections rather than over token pairs).
  hot pairs      the share of all routed selections held by the hottest fraction f of the n_layers x n_experts
                 (layer, expert) pairs, ranked by the trace's own counts (mbolt heat, Strata's profile).

Per-token work runs in numba (the stack-distance kernel, the reuse-gap kernel); nothing loops over rows in
Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba as nb
import numpy as np

from sim.errors import InputError
from sim.trace.format import MISSING, PHASE_DECODE, PHASE_PREFILL, Trace
from sim.trace.mrc import stack_distance_histograms

_MISS = int(MISSING)
PHASES = {"all": None, "decode": PHASE_DECODE, "prefill": PHASE_PREFILL}
COLD = ("trace", "request")
POOLS = ("layer", "shared")


@dataclass(frozen=True)
class LruProtocol:
    """How a study's LRU was measured (module docstring): rows replayed ('all', 'decode' or 'prefill'), cold
    start ('trace': once, requests one after another; 'request': cleared per request), cache keys per expert,
    and the pool ('layer': a cache per layer, capacities per layer; 'shared': one cache over all layers)."""
    rows: str = "all"
    cold: str = "trace"
    keys_per_expert: int = 1
    pool: str = "layer"

    def __post_init__(self):
        if self.rows not in PHASES:
            raise InputError("LruProtocol", "rows", self.rows, f"one of {', '.join(PHASES)}")
        if self.cold not in COLD:
            raise InputError("LruProtocol", "cold", self.cold, f"one of {', '.join(COLD)}")
        if self.pool not in POOLS:
            raise InputError("LruProtocol", "pool", self.pool, f"one of {', '.join(POOLS)}")
        if isinstance(self.keys_per_expert, bool) or not isinstance(self.keys_per_expert, int) \
                or self.keys_per_expert < 1:
            raise InputError("LruProtocol", "keys_per_expert", self.keys_per_expert, "an integer >= 1")


def _rows_in_order(trace: Trace, rows: str) -> np.ndarray:
    """Row indices of the protocol's phase, grouped by request (first appearance order), execution order within."""
    phase = PHASES[rows]
    keep = np.ones(trace.n_rows, bool) if phase is None else trace.phase == phase
    idx = np.flatnonzero(keep)
    _, first = np.unique(trace.request[idx], return_index=True)
    rank = np.empty(first.size, np.int64)
    rank[np.argsort(first)] = np.arange(first.size)
    _, inverse = np.unique(trace.request[idx], return_inverse=True)
    return idx[np.argsort(rank[inverse], kind="stable")]


def lru_distance_histogram(experts: np.ndarray, n_experts: int, pool: str = "layer") -> tuple[np.ndarray, np.ndarray]:
    """(hist [groups, keys + 1], cold [groups]): LRU stack distances (in experts) of the rows given, in order,
    from empty caches: per layer (groups = layers, keys = n_experts) or one shared pool (one group, keys =
    layers x n_experts)."""
    experts = np.ascontiguousarray(experts, np.uint16)
    n_layers = experts.shape[1]
    if pool == "layer":
        pools = groups = np.arange(n_layers, dtype=np.int64)
        keys = np.full(n_layers, n_experts, np.int64)
    else:
        pools = groups = np.zeros(n_layers, np.int64)
        keys = np.array([n_layers * n_experts], np.int64)
    hist = np.zeros((keys.size, 1, int(keys.max()) + 1), np.int64)
    cold = np.zeros((keys.size, 1), np.int64)
    stack_distance_histograms(experts, np.zeros(experts.shape[0], np.uint8), pools, groups, keys, n_experts,
                              hist, cold)
    return hist[:, 0], cold[:, 0]


def lru_hit_rates(trace: Trace, capacities, protocol: LruProtocol = LruProtocol()) -> dict:
    """LRU hit rates at each capacity in slots (module docstring). Returns {capacities, hit_rate (pooled over
    layers), per_layer [layers or the one shared pool][capacities], selections}; None without selections."""
    caps = np.asarray(list(capacities), np.int64)
    if caps.size == 0 or (caps < 0).any():
        raise InputError("lru_hit_rates", "capacities", list(capacities), "one or more slot counts >= 0")
    h = trace.header
    order = _rows_in_order(trace, protocol.rows)
    n_groups, n_keys = (h.n_layers, h.n_experts) if protocol.pool == "layer" else (1, h.n_layers * h.n_experts)
    hist = np.zeros((n_groups, n_keys + 1), np.int64)
    cold = np.zeros(n_groups, np.int64)
    if protocol.cold == "trace":
        runs = [order]
    else:
        cut = np.flatnonzero(trace.request[order][1:] != trace.request[order][:-1]) + 1
        runs = np.split(order, cut)
    for run in runs:
        if run.size:
            hh, cc = lru_distance_histogram(trace.experts[run], h.n_experts, protocol.pool)
            hist += hh
            cold += cc
    experts_held = np.minimum(caps // protocol.keys_per_expert, n_keys)
    cum = np.cumsum(hist, axis=1)  # cum[:, c] = accesses at distance <= c
    hits = cum[:, experts_held]    # [layers, capacities]
    total = hist.sum(1) + cold
    with np.errstate(invalid="ignore", divide="ignore"):
        per_layer = hits / total[:, None]
    pooled = hits.sum(0) / total.sum() if total.sum() else np.full(caps.size, np.nan)
    return dict(capacities=caps.tolist(), keys_per_expert=protocol.keys_per_expert, rows=protocol.rows,
                cold=protocol.cold, pool=protocol.pool, selections=int(total.sum()),
                hit_rate=[None if np.isnan(x) else float(x) for x in pooled],
                per_layer=[[None if np.isnan(x) else float(x) for x in row] for row in per_layer])


@nb.njit(cache=True)
def _gap_kernel(experts, order, request, max_gap, n_experts):
    """hist[layer, g] = selections whose expert the layer last selected g tokens earlier in the same request
    (g <= max_gap; g = 0 collects first uses and gaps beyond max_gap); total[layer] = recorded selections."""
    n_layers = experts.shape[1]
    k = experts.shape[2]
    hist = np.zeros((n_layers, max_gap + 1), np.int64)
    total = np.zeros(n_layers, np.int64)
    last = np.full((n_layers, n_experts), -1, np.int64)
    t = 0
    for i in range(order.shape[0]):
        r = order[i]
        if i > 0 and request[r] != request[order[i - 1]]:
            for layer in range(n_layers):
                for e in range(n_experts):
                    last[layer, e] = -1
            t = 0
        for layer in range(n_layers):
            if experts[r, layer, 0] == _MISS:
                continue
            for a in range(k):
                x = experts[r, layer, a]
                total[layer] += 1
                g = t - last[layer, x] if last[layer, x] >= 0 else 0
                hist[layer, g if g <= max_gap else 0] += 1
                last[layer, x] = t
        t += 1
    return hist, total


def reuse_gap_histogram(trace: Trace, max_gap: int, rows: str = "all") -> tuple[np.ndarray, np.ndarray]:
    """(hist [layers, max_gap + 1], total [layers]): the reuse gap in tokens of every selection (see _gap_kernel)."""
    order = _rows_in_order(trace, rows)
    return _gap_kernel(np.ascontiguousarray(trace.experts, np.uint16), order.astype(np.int64),
                       np.ascontiguousarray(trace.request), int(max_gap), trace.header.n_experts)


def reuse_within(trace: Trace, distances=(1, 2, 4, 8, 16, 32, 64), rows: str = "all") -> dict:
    """Share of selections reused within d tokens (module docstring), pooled and per layer."""
    d = np.asarray(list(distances), np.int64)
    if d.size == 0 or (d < 1).any():
        raise InputError("reuse_within", "distances", list(distances), "token distances >= 1")
    hist, total = reuse_gap_histogram(trace, int(d.max()), rows)
    cum = np.cumsum(hist[:, 1:], axis=1)
    within = cum[:, d - 1]
    with np.errstate(invalid="ignore", divide="ignore"):
        per_layer = within / total[:, None]
    pooled = within.sum(0) / total.sum() if total.sum() else np.full(d.size, np.nan)
    return dict(distances=d.tolist(), selections=int(total.sum()),
                share=[None if np.isnan(x) else float(x) for x in pooled],
                per_layer=[[None if np.isnan(x) else float(x) for x in row] for row in per_layer])


def pair_counts(trace: Trace) -> np.ndarray:
    """int64 [layers, n_experts]: selections of each (layer, expert) pair."""
    h = trace.header
    ex = trace.experts
    ok = ex != MISSING
    keys = (np.arange(h.n_layers, dtype=np.int64)[None, :, None] * h.n_experts + ex.astype(np.int64))[ok]
    return np.bincount(keys, minlength=h.n_layers * h.n_experts).reshape(h.n_layers, h.n_experts)


def hot_pair_coverage(trace: Trace, fractions=(0.05, 0.10, 0.186, 0.236, 0.5)) -> dict:
    """Share of routed selections held by the hottest fraction f of all (layer, expert) pairs."""
    f = np.asarray(list(fractions), float)
    if f.size == 0 or (f <= 0).any() or (f > 1).any():
        raise InputError("hot_pair_coverage", "fractions", list(fractions), "shares 0 < f <= 1")
    counts = np.sort(pair_counts(trace).ravel())[::-1]
    total = counts.sum()
    cum = np.cumsum(counts)
    n = np.maximum(np.round(f * counts.size).astype(np.int64), 1)
    share = cum[n - 1] / total if total else np.full(f.size, np.nan)
    return dict(fractions=f.tolist(), pairs=n.tolist(), share=[float(x) for x in share])
