"""The cache-only engine, `[engine] name = "replay"`: a scenario's routing replayed through one cache.

It answers "what hit rate would cache X give on this workload" offline. The routing is the one the engines of
the scenario see (sim/workload.py: the same generator draws or trace cuts, the same per-process memo);
the cache is one that `expertsim cache` offers, replayed by the same functions (sim/cache/replay.py): policy
lru | lfu | opt | static | ds4-slab, scope layer | class | global, slots per pool, prefill mode evict | append,
a ranking profile for static. No engine and no timing: counts and bytes only.

The workload as one trace (sim/workload.py workload_trace): each request's prompt rows (phase prefill), then its decode rows, requests in
order, the cache carried from one request to the next as the engines keep it. Every prompt token routes (there
is no prefix or conversation cache) and only the routed layers replay (no MTP draft step). The figures cover
the whole workload: the `measured` flag, which picks the request an engine reports, does not apply.

Summary: the headline keys of a run (docs/metrics.md), null where a cache-only run gives them no meaning
(tok/s, TTFT, lent slots, buffers, file reads, simulated time), then the hit rates per phase and overall,
lookups, hits, misses, direct loads, evictions, bytes loaded, and tables per phase and per size class.
"""

from __future__ import annotations

import hashlib


from sim.cache.kernels import HIT
from sim.cache.replay import Geometry, capacity_pools, lru_mrc, mrc_exact, parse_slots, read_profile, replay
from sim.engines.base import EngineState
from sim.engines.replay.summary import NO_MEANING, figures, records
from sim.trace.format import Trace
from sim.workload import WorkloadRouting, workload_trace


def _cache(scenario, routing: WorkloadRouting | None = None) -> tuple[Trace, Geometry, str, int]:
    """The workload trace, its geometry, the scope the policy runs at and how many capacities it takes."""
    flags = scenario.engine.flags
    trace = workload_trace(scenario, routing)
    geometry = Geometry.of(trace, scenario.layout, str(scenario.path))
    scope, pool_keys = capacity_pools(geometry, flags.policy, flags.scope)
    return trace, geometry, scope, len(pool_keys)


class ReplayProcess:
    """The replay of one run: the workload through the scenario's cache, once, when its state is asked for."""

    def __init__(self, scenario, routing: WorkloadRouting):
        self.scenario, self.routing = scenario, routing

    def state(self) -> EngineState:
        scenario = self.scenario
        flags = scenario.engine.flags
        trace, geometry, scope, n_pools = _cache(scenario, self.routing)
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
        found = figures(geometry, flags.policy, scope, result.capacity, lookups, hits, total["load_bytes"])
        return EngineState(
            found["cache_slots"], found["cache_slots"], found["cache_mib"], None, None,
            detail={"policy": flags.policy, "scope": scope, "prefill_mode": flags.prefill_mode,
                    "capacity_slots": result.capacity.tolist(),
                    **{k: total[k] for k in ("profile", "size_changes") if k in total}},
            figures={"requests": len(scenario.workload.requests), **found, "direct_loads": total["direct_loads"],
                     "evictions": total["evictions"], **{k: None for k in NO_MEANING},
                     "per_phase": records(result.per_phase()), "per_class": records(result.per_class())},
            provenance={"profile": str(profile_path) if profile_path else None, "profile_sha256": profile_sha})


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


__all__ = ["ReplayProcess", "mrc_figures"]
