"""ds4's batched prefill and the hotlist seeding after it (ds4-engine.md §1.7, §1.9).

Prompts longer than the decode-path limit run layer-major in chunks: per layer the chunk's expert union is staged
(grow-only; cudaMalloc on growth), looked up in append mode (pr504+: hits copied, misses fill free slots, the rest
loaded directly, never an eviction) or, before #504, loaded whole after release_all frees every cache. The
neutronstar GLM stack reads each layer's whole expert tensors instead (Variant.prefill_whole_layers). After a
batched prompt ds4 seeds its caches from the popularity list (the hotlist), IQ2 layers only.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from sim.cache.kernels import DIRECT, EVICT, HIT, INSERT, MODE_APPEND, MODE_EVICT
from sim.cache.replay import Geometry, read_profile, trace_profile
from sim.engines.ds4.decode import SELECTED_IDS_BYTES
from sim.engines.ds4.sizing import hotlist_seed_plan
from sim.errors import InputError
from sim.trace.format import distinct_experts
from sim.trace.generate import HOTLIST_PROFILE_SEED, generate_trace, hotlist_profile_tokens


@functools.lru_cache(maxsize=8)
def builtin_hotlist(preset: str) -> np.ndarray | None:
    """Stand-in for ds4's built-in popularity list on a generator preset's expert ids (None: the preset's
    model has none): the preset's own profile run, as long as the run behind ds4's list, ranked by hits
    (sim.trace.generate.hotlist_profile_tokens says why). Read-only: the memo hands out one array."""
    tokens = hotlist_profile_tokens(preset)
    if tokens is None:
        return None
    keys = trace_profile(generate_trace(preset, tokens, 0, HOTLIST_PROFILE_SEED))
    keys.flags.writeable = False
    return keys


class Prefill:
    """A batched prompt chunk by chunk, and the seeding pass after it."""

    def __init__(self, run, where: str):
        self.run = run  # the Ds4Process: its machine, threads, caches, loads and per-layer figures
        self.seed_steps = self._hotlist_seed_plan(where)
        self.seeding = {"passes": 0, "loaded": 0, "layers_skipped_full": 0}

    def chunk(self, request: int, step_no: int, rows: np.ndarray):
        run = self.run
        run.caches.phase = "prefill"
        for layer in range(run.layers.n_routed):
            row = dict(request=request, phase="prefill", step=step_no, layer=layer, start_s=run.m.env.now,
                       tokens=len(rows))
            yield from self._layer(layer, rows, row)
        yield run.m.gpu.drained()

    def _layer(self, layer: int, rows: np.ndarray, row: dict):
        run = self.run
        m, caches, loads, main = run.m, run.caches, run.loads, run.main
        T = len(rows)
        other_s, shared_s, routed_s = (each * T for each in run.prefill_s[layer])
        if run.weight_host_rows[layer]:  # the chunk's kernels read the layer's weights past VRAM once
            yield from m.host_read(run.weight_host_rows[layer], "non-routed weights over PCIe")
        yield m.gpu.hold(other_s + run.prefill_chunk_fixed_s, 0, 0, "attention + router (chunk)")
        yield main.hold(m.sync_s + m.memcpy_call_s, T * SELECTED_IDS_BYTES, 1, "ids readback")
        union = distinct_experts(rows[:, layer], run.layers.n_experts)
        n_bytes = int(len(union) * run.layers.expert_bytes[layer])
        if run.variant.prefill_whole_layers:
            drive = yield from loads.stream_whole_layer(main, layer)
            hits, inserts, direct, handed = 0, 0, run.layers.n_experts, 0
            row.update(lookups=len(union), hits=0, inserts=0)
        elif caches.per_class:
            yield from caches.grow_staging(main, n_bytes)
            pool = yield from caches.prepare(main, int(run.layers.class_of_layer[layer]))
            outcome, _, _ = caches.cache.access(layer, union, pool, MODE_APPEND)
            n = np.bincount(outcome.astype(np.int64), minlength=4)
            hits, inserts, direct = int(n[HIT]), int(n[INSERT]), int(n[DIRECT])
            fetch = union[outcome != HIT]
            drive = yield from (loads.pool_load(layer, fetch) if run.knobs.rocm_readers else
                                loads.load(main, layer, fetch))
            yield from loads.to_staging(main, layer, hits + inserts)
            row.update(lookups=len(union), hits=hits, inserts=inserts)
            handed = hits + inserts
        else:
            yield from caches.release_all(main)  # pre-504: every batch call frees the resident cache first
            yield from caches.grow_staging(main, n_bytes)
            drive = yield from loads.load(main, layer, union)
            hits, inserts, direct, handed = 0, 0, len(union), 0
            row.update(lookups=len(union))
        yield main.hold(m.memcpy_call_s, 0, 1, "slot map upload")
        m.gpu.book(shared_s + routed_s, 0, 0, "shared + routed experts (chunk)")
        loads.record(row, layer, hits, inserts, direct, handed, drive)

    # --- hotlist ---------------------------------------------------------------------------------

    def _hotlist_seed_plan(self, where: str) -> list[tuple[int, np.ndarray]]:
        """The (layer, experts) steps of one seeding pass; empty when the engine would not seed (§1.9)."""
        run = self.run
        scenario, knobs = run.scenario, run.knobs
        if knobs.hotlist_off:
            return []
        seeded_layers = [i for i, x in enumerate(scenario.layout.layers[: run.layers.n_routed])
                         if x.gate_type.startswith("IQ2")]
        if not knobs.hotlist_visible or not seeded_layers:  # on CUDA only a "visible" budget seeds (L1482-1492)
            return []
        path = knobs.hotlist_path
        if path:
            file = Path(path) if scenario.path is None else Path(scenario.path).parent / path
            ranking = read_profile(file, Geometry.of_layout(scenario.layout, run.layers.n_routed))
        elif scenario.trace.generator is not None:
            ranking = builtin_hotlist(scenario.trace.generator)
            if ranking is None:  # ds4 ships lists for DeepSeek V4 Flash and Pro only
                return []
        elif run.family == "deepseek-v4":
            # ds4 reads this Metal-named variable on CUDA too (the seeding pass is one function, ds4.c L20814)
            raise InputError(where, "engine.env.DS4_METAL_STREAMING_EXPERT_HOTLIST", "(unset)",
                             "after each prompt ds4 seeds its cache from its built-in hotlist, whose (layer, expert) "
                             "ids match the real model's routing, not a trace of your own: give a list ranked from "
                             "a profiling run (`expertsim trace hotlist PROFILE.parquet -o hot.csv`, then this "
                             "variable = \"hot.csv\"), or set engine.flags.ssd-streaming-cold = true to seed nothing")
        else:
            return []
        return hotlist_seed_plan(ranking, run.layers.n_experts, seeded_layers, knobs.preload(run.budget_experts))

    def seed_from_hotlist(self, request: int, step_no: int):
        """metal_graph_seed_streaming_expert_cache_from_hotlist after a batch prefill (ds4.c L20814, §1.9): per
        layer, if its cache holds fewer than `preload` experts, prepare it for the layer's seed count and load
        each listed expert it lacks into its LRU slot (3 parts each, as a miss; no copy to staging)."""
        if not self.seed_steps:
            return
        run = self.run
        caches, loads = run.caches, run.loads
        self.seeding["passes"] += 1
        preload = sum(len(e) for _, e in self.seed_steps)
        for layer, experts in self.seed_steps:
            pool = caches.pool_of(layer)
            if caches.allocated[pool] and caches.cache.count(pool) >= preload:
                self.seeding["layers_skipped_full"] += 1
                continue
            start = run.m.env.now
            pool = yield from caches.prepare(run.main, int(run.layers.class_of_layer[layer]), len(experts))
            outcome, _, _ = caches.cache.access(layer, experts, pool, MODE_EVICT)
            missing = experts[(outcome == INSERT) | (outcome == EVICT)]
            yield from loads.load(run.main, layer, missing)
            self.seeding["loaded"] += len(missing)
            loads.record(dict(request=request, phase="seed", step=step_no, layer=layer, start_s=start,
                              lookups=len(experts), inserts=int((outcome == INSERT).sum()),
                              evictions=int((outcome == EVICT).sum())), layer, loaded=len(missing))
