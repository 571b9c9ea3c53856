"""The cache-only engine, `[engine] name = "replay"`: a scenario's routing replayed through one cache.

It answers "what hit rate would cache X give on this workload" offline. The routing is the one the engines of
the scenario see (sim/engine/workload.py: the same generator draws or trace cuts, the same per-process memo);
the cache is one that `expertsim cache` offers, replayed by the same functions (sim/cache/replay.py): policy
lru | lfu | opt | static | ds4-slab, scope layer | class | global, slots per pool, prefill mode evict | append,
a ranking profile for static. No engine and no timing: counts and bytes only.

The workload as one trace: each request's prompt rows (phase prefill), then its decode rows, requests in
order, the cache carried from one request to the next as the engines keep it. Every prompt token routes (there
is no prefix or conversation cache) and only the routed layers replay (no MTP draft step). The figures cover
the whole workload: the `measured` flag, which picks the request an engine reports, does not apply.

Summary: the headline keys of a run (docs/metrics.md), null where a cache-only run gives them no meaning
(tok/s, TTFT, lent slots, buffers, file reads, simulated time), then the hit rates per phase and overall,
lookups, hits, misses, direct loads, evictions, bytes loaded, and tables per phase and per size class.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd

from sim.cache.kernels import HIT
from sim.cache.replay import Geometry, capacity_pools, lru_mrc, mrc_exact, parse_slots, read_profile, replay
from sim.engine.run import RunResult, provenance
from sim.engine.timeline import Recorder
from sim.engine.workload import workload_routing
from sim.trace.format import PHASE_DECODE, PHASE_PREFILL, Trace, TraceHeader
from sim.units import MIB

# Headline keys of an engine run that a replay has no figure for: null, never 0.
NO_MEANING = ("lent_slots", "prefill_buffer_mib", "file_blob_reads", "prefill_tok_s", "decode_tok_s",
              "belady_decode_hit_rate", "belady_gap", "ttft_s", "simulated_s", "gpu_idle_s")
# What `figures` gives: the keys a run's summary and the sweep's one-pass rows share.
FIGURES = ("cache_slots", "cache_mib", "decode_hit_rate", "prefill_hit_rate", "hit_rate", "lookups", "hits",
           "misses", "load_bytes")


def workload_trace(scenario) -> Trace:
    """The scenario's workload routing as one trace (module docstring): per request its prompt rows, then its
    decode rows; the routed layers only."""
    routing = workload_routing(scenario)
    layout = scenario.layout
    routed = layout.n_routed_layers
    experts, request, position, phase = [], [], [], []
    for i, r in enumerate(routing.requests):
        rows = len(r.prompt) + len(r.decode)
        experts += [r.prompt[:, :routed], r.decode[:, :routed]]
        phase += [np.full(len(r.prompt), PHASE_PREFILL), np.full(len(r.decode), PHASE_DECODE)]
        request.append(np.full(rows, i))
        position.append(np.arange(rows))
    header = TraceHeader(layout.name, routed, layout.n_experts, layout.top_k, "scenario workload", routing.sha256)
    return Trace(header, np.concatenate(request), np.concatenate(position), np.concatenate(phase),
                 np.concatenate(experts))


def cache_size(geometry: Geometry, policy: str, scope: str, capacity: np.ndarray) -> tuple[int, float]:
    """Slots and MiB of the cache. A pool of one layer or size class holds that size per slot; a global pool of
    mixed sizes is priced at its largest expert, since any slot may take it; ds4's slab is rebuilt for each size
    class, so it is at most its largest build."""
    if policy == "ds4-slab":
        return int(capacity.max()), float((capacity * geometry.class_bytes).max()) / MIB
    per_slot = {"layer": geometry.expert_bytes, "class": geometry.class_bytes,
                "global": geometry.expert_bytes.max(initial=0)}[scope]
    return int(capacity.sum()), float((capacity * per_slot).sum()) / MIB


def _rate(hits, lookups) -> float | None:
    return int(hits) / int(lookups) if lookups else None  # a phase without lookups has no rate (not 0)


def figures(geometry: Geometry, policy: str, scope: str, capacity: np.ndarray, lookups: np.ndarray,
            hits: np.ndarray, load_bytes) -> dict:
    """The FIGURES of a cache from its lookups and hits per phase (int [2]) and its loaded bytes. A run and the
    sweep's one-pass path both report through here, so their figures agree to the bit."""
    slots, mib = cache_size(geometry, policy, scope, capacity)
    return {
        "cache_slots": slots,
        "cache_mib": mib,
        "decode_hit_rate": _rate(hits[PHASE_DECODE], lookups[PHASE_DECODE]),
        "prefill_hit_rate": _rate(hits[PHASE_PREFILL], lookups[PHASE_PREFILL]),
        "hit_rate": _rate(hits.sum(), lookups.sum()),
        "lookups": int(lookups.sum()),
        "hits": int(hits.sum()),
        "misses": int(lookups.sum() - hits.sum()),
        "load_bytes": int(load_bytes),
    }


def _cache(scenario) -> tuple[Trace, Geometry, str, int]:
    """The workload trace, its geometry, the scope the policy runs at and how many capacities it takes."""
    flags = scenario.engine.flags
    trace = workload_trace(scenario)
    geometry = Geometry.of(trace, scenario.layout, str(scenario.path))
    scope, pool_keys = capacity_pools(geometry, flags.policy, flags.scope)
    return trace, geometry, scope, len(pool_keys)


def _records(frame: pd.DataFrame) -> list[dict]:
    """Rows as plain Python values (numpy scalars would be written as strings; NaN -> None)."""
    return [{k: None if isinstance(v, float) and np.isnan(v) else v.item() if isinstance(v, np.generic) else v
             for k, v in row.items()} for row in frame.to_dict(orient="records")]


def run_replay(scenario) -> RunResult:
    """Replay the scenario's workload through its cache; a RunResult whose step, copy and request frames are
    empty (nothing is timed)."""
    flags = scenario.engine.flags
    trace, geometry, scope, n_pools = _cache(scenario)
    capacity = parse_slots(flags.slots, n_pools, "engine.flags.slots")
    profile_path = profile_sha = ranking = None
    if flags.profile is not None:  # relative to the scenario file, as load_scenario checked it
        profile_path = scenario.path.parent / flags.profile  # an absolute profile path replaces the folder
        ranking = read_profile(profile_path, geometry)
        profile_sha = hashlib.sha256(profile_path.read_bytes()).hexdigest()
    result = replay(trace, geometry, flags.policy, scope, capacity, flags.prefill_mode, ranking)
    total = result.summary()
    lookups = result.counts.sum(axis=(0, 2))
    hits = result.counts[:, :, HIT].sum(axis=0)
    hardware = scenario.hardware_profile
    summary = {
        "scenario": str(scenario.path) if scenario.path else None,
        "engine": "replay",
        "variant": None,
        "hardware": hardware.name,  # named by the scenario, not used: nothing is timed
        "model": scenario.layout.name,
        "measured_request": None,  # the figures cover every request
        "requests": len(scenario.workload.requests),
        **figures(geometry, flags.policy, scope, result.capacity, lookups, hits, total["load_bytes"]),
        "direct_loads": total["direct_loads"],
        "evictions": total["evictions"],
        **{k: None for k in NO_MEANING},
        "per_phase": _records(result.per_phase()),
        "per_class": _records(result.per_class()),
        "links": [],
        "engine_state": {"policy": flags.policy, "scope": scope, "prefill_mode": flags.prefill_mode,
                         "capacity_slots": result.capacity.tolist(),
                         **{k: total[k] for k in ("profile", "size_changes") if k in total}},
        "provenance": provenance(scenario, trace.header.source_sha256,
                                 profile=str(profile_path) if profile_path else None, profile_sha256=profile_sha),
    }
    recorder = Recorder()
    return RunResult(summary, recorder.step_frame(), recorder.copy_frame(), pd.DataFrame())


def mrc_figures(scenario, slot_counts: list[int]) -> list[dict]:
    """`figures` of the scenario's cache with each of these slot counts in every pool, from one one-pass
    miss-ratio curve (sim.cache.replay.lru_mrc) instead of a replay per count. Exact only for an evicting LRU,
    a stack algorithm (mrc_exact): the scenario must be one."""
    flags = scenario.engine.flags
    if not mrc_exact(flags.policy, flags.prefill_mode):
        raise ValueError(f"the one-pass curve is not exact for {flags.policy} with prefill-mode {flags.prefill_mode}")
    trace, geometry, scope, n_pools = _cache(scenario)
    curve = lru_mrc(trace, geometry, scope)
    lookups = curve.group_lookups()
    rows = []
    for slots in slot_counts:
        hits = curve.group_hits(slots)
        load_bytes = int(((lookups - hits).sum(axis=1) * curve.group_bytes()).sum())
        capacity = parse_slots(slots, n_pools, "engine.flags.slots")
        rows.append(figures(geometry, flags.policy, scope, capacity, lookups.sum(axis=0), hits.sum(axis=0),
                            load_bytes))
    return rows


__all__ = ["FIGURES", "NO_MEANING", "cache_size", "figures", "mrc_figures", "run_replay", "workload_trace"]
