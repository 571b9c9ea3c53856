"""ds4's Metal backend (a Metal profile, variant main-0814: ds4_metal.m and ds4.c read at upstream b0309611 for the
build of @84cc882): the decode path only.

The same decode layer as CUDA's (the async load worker beside the shared expert), but one cache table for the
whole model evicting by route hotness (sim.cache.hotness), its slots wired as they fill (the pool of unified
memory the page cache lives in shrinks with them); a miss is 3 buffered preads into the slot on a pool of 9
threads, a hit is read in place; the non-routed weights are the mapped file's pages, faulted from the drive when
the page cache lacks them; a warm page cache is what the same command's previous run left. The split hits-first
path runs once the cache is warm. The GPU runs what the host has committed: a layer's routed experts wait for the
next layer's encode, and every layer whose router picks its experts costs a host round trip (record
ds4-metal-round-trip-437); the hash layers (0-2) get their ids on the host. Not modelled there: its batch prefill
(prompts over 18 tokens, 64 for Q4_K/MXFP4 files) and mixed-quant files.
"""

from __future__ import annotations

import numpy as np

from sim.cache.hotness import SPLIT_MIN_MISSES, RouteHotnessCache
from sim.engines.ds4.decode import SELECTED_IDS_BYTES, Decode
from sim.engines.ds4.loads import PARTS_PER_EXPERT
from sim.errors import InputError
from sim.trace.format import MISSING

# fmt: off
METAL_HASH_LAYERS = 3                      # DS4_N_HASH_LAYER, Flash (ds4.c @b0309611 L560): routed by the token's table
APPLE_PAGE_BYTES = 16 * 1024               # getpagesize() on Apple silicon macOS: the cache's slots are page-rounded
METAL_CACHE_MEMORY = "expert cache (wired slots)"  # the Metal cache's share of the pool (an allocation's name)
# fmt: on


class MetalDecode(Decode):
    """The Metal path's state and its decode layer. The expert cache is one table for the whole model
    (sim.cache.hotness), its slots wired one by one as they fill: an expert's slot is a page-rounded share of a
    4 GiB shared slab, mlocked when the slot is first used (ds4_metal.m L11412-L11720), so the pool the page cache
    lives in shrinks as the cache fills and grows back when the process exits. The non-routed weights are not
    copied: Metal wraps the mapped file's pages (newBufferWithBytesNoCopy, L10399) and in streaming mode asks for
    no residency or warm-up (L1648, L3586), so they are page-cache extents the GPU reads in place, faulted from
    the drive when they are not resident: one extent per layer, the bytes a token reads there."""

    def __init__(self, run, work: np.ndarray, where: str):
        super().__init__(run)
        requests, limit = run.scenario.workload.requests, run.knobs.decode_path_max
        too_long = [i for i, r in enumerate(requests) if r.prompt_tokens > limit]
        if too_long:
            first = too_long[0]
            raise InputError(where, f"workload.requests[{first}].prompt_tokens", requests[first].prompt_tokens,
                             f"not modelled: ds4's Metal batch prefill (prompts over {limit} tokens); shorter prompts "
                             "run the decode path, which is")
        n_layers, n_experts = run.layers.n_routed, run.layers.n_experts
        self.slot_bytes = -(-int(run.layers.expert_bytes[0]) // APPLE_PAGE_BYTES) * APPLE_PAGE_BYTES
        self.cache = RouteHotnessCache(n_layers, n_experts, run.budget_experts)
        self.weight_bytes = work[:n_layers, :2].sum(axis=1).astype(np.int64)  # attention, router, shared
        self.weight_keys = run.m.page_cache.add_extents(self.weight_bytes)
        self.weight_fault_bytes = 0
        self.cache_peak_bytes = 0
        # the host round trip after each router signal, fitted on another box (record ds4-metal-round-trip-437)
        trip = run.domain.use("ds4-metal-round-trip-437", "ds4's Metal host round trip per router readback")
        self.round_trip_s = trip.value * 1e-6
        self.gpu_unsent: list[tuple[float, str]] = []  # kernels encoded into the open command buffer, not committed
        if run.scenario.workload.page_cache == "warm":
            self._previous_run()

    def start_prompt(self) -> None:
        """A decode-style prompt from its first token clears the route hotness."""
        self.cache.reset_hotness()

    def _set_cache_memory(self, count: int) -> None:
        n_bytes = count * self.slot_bytes
        self.run.m.memory.set("vram", METAL_CACHE_MEMORY, n_bytes)
        self.cache_peak_bytes = max(self.cache_peak_bytes, n_bytes)

    def _previous_run(self) -> None:
        """A warm page cache: the same command ran once before in a process of its own (#810 ran each setting in
        a new process, its "warm" row after the "cold" one). That run's reads are replayed through the page cache
        in their order, timing aside: per token and layer the layer's non-routed pages, then the extents of the
        experts its cache missed, while its wired slots take their share of the pool; at its exit the slots are
        freed and the pages stay. The routing is this run's (the same prompt, greedy)."""
        run = self.run
        n_layers, n_experts = run.layers.n_routed, run.layers.n_experts
        cache = RouteHotnessCache(n_layers, n_experts, run.budget_experts)
        pc, memory = run.m.page_cache, run.m.memory
        for routing in run.routing.requests:
            cache.reset_hotness()  # each prompt runs the decode path from its first token
            for row in np.concatenate([routing.prompt, routing.decode])[:, :n_layers]:
                cache.note_token()
                for layer in range(n_layers):
                    pc.access(self.weight_keys[layer: layer + 1], insert=True)
                    experts = row[layer][row[layer] != MISSING]
                    loads = cache.access(layer, experts).loads
                    memory.set("vram", METAL_CACHE_MEMORY, cache.count * self.slot_bytes)
                    pc.access(layer * n_experts + loads.astype(np.int64), insert=True)
        memory.set("vram", METAL_CACHE_MEMORY, 0)

    def _fault_weights(self, layer: int):
        """The layer's non-routed pages before its kernels run: resident, or read back from the drive by page
        faults (read-ahead sized requests, one after another)."""
        m = self.run.m
        if m.page_cache.access(self.weight_keys[layer: layer + 1], insert=True)[0]:
            return
        n_bytes = int(self.weight_bytes[layer])
        self.weight_fault_bytes += n_bytes
        yield m.ssd.read(n_bytes, m.ssd.fault_reads(n_bytes), 1, at_once=True)

    def _read(self, layer: int, experts: np.ndarray):
        """The misses' preads (begin_selected_load, ds4_metal.m L14057): 3 tasks per expert (gate, up, down) on
        min(tasks, pool threads) workers taking the next task as they free up (the pool's shared counter, L11003);
        each task a buffered pread into the expert's slot: a copy out of the page cache, after a drive read when
        the pages are not resident (the pages stay: no DONTNEED unless asked, L11730). Returns the drive's bytes."""
        if not len(experts):
            return 0
        run = self.run
        m, env = run.m, run.m.env
        in_ram, drive = run.loads.page_cache_lookup(layer, experts)
        tasks = iter([(int(part), bool(cached)) for cached in in_ram for part in run.layers.part_bytes[layer]])

        def worker(thread):
            for part, cached in tasks:  # the shared iterator: the next task to whichever worker is free
                if not cached:
                    yield m.ssd.read(part, 1, 1, at_once=True)
                yield m.memcpy(thread, part, 1, "pread copy")

        n_workers = min(run.knobs.pool_workers, PARTS_PER_EXPERT * len(experts))
        yield env.all_of([env.process(worker(thread)) for thread in run.loads.pool[:n_workers]])
        return drive

    def _commit(self) -> None:
        """[cb commit] of the open command buffer (ds4_gpu_flush_commands, ds4_metal.m L8221): the GPU gets the
        kernels encoded since the last commit, in order (the host has encoded them by now)."""
        for seconds, label in self.gpu_unsent:
            self.run.m.gpu.book(seconds, 0, 0, label)
        self.gpu_unsent.clear()

    def end_of_token(self) -> None:
        """The last layer's routed experts go with the output head, committed at the token's end."""
        self._commit()

    def layer(self, layer: int, experts: np.ndarray, row: dict, lookup: tuple | None = None):
        """One decode-path layer on Metal (ds4.c @b0309611 L23873-L23990). The GPU runs only what the host has
        committed, and the main thread commits at the router signal (the early commit) and after the shared expert,
        so a layer's routed experts go in the command buffer that the next layer's router signal closes: they wait
        for the host to encode that layer's attention. A layer whose router picks its experts signals the ids;
        the async load worker wakes on the event (a host round trip, record ds4-metal-round-trip-437, that also
        holds the main thread's wake and the GPU's start on the next commit), reads the ids back, looks them up,
        picks the victims and starts the pread pool (begin_selected_load); meanwhile the GPU runs the shared expert;
        the main thread joins the worker, commits the hits' experts first once the split is ready and worthwhile
        (sim.cache.hotness), then waits for the preads before it encodes the rest (the routed encode finishes the
        pending load, ds4_metal.m L14399). The hash layers (0-2) take their ids from the token on the host: the
        main thread starts their loads itself and commits nothing (metal_graph_decode_set_hash_selected_override,
        ds4.c L23221: no selected-id overlap for a layer with a token table), so their kernels wait for the first
        router signal. Hits are read in place from their slots, no copy."""
        run = self.run
        m = run.m
        other_s, shared_s, routed_s = run.decode_s_rows[layer]
        if layer == 0:
            self.cache.note_token()
        encoded = run.main.hold(run.encode_layer_s, 0, 1, "graph encode", later=True)
        yield from self._fault_weights(layer)  # while the main thread encodes
        yield encoded  # what is committed from here on has been encoded
        self.gpu_unsent.append((other_s, "attention + router"))
        hashed = layer < METAL_HASH_LAYERS
        if hashed:  # the ids are the token's: looked up on the main thread once it has encoded the router
            self.gpu_unsent.append((shared_s, "shared expert"))
        else:
            self._commit()  # the early commit after the router's signal
            signalled = m.gpu.drained(later=True)  # the router's signal: the end of what the stream holds now
            self.gpu_unsent.append((shared_s, "shared expert"))
            self._commit()  # flushed before the join
            yield signalled
            # the worker's wake-up and the ids; the main thread joins it once it has started the preads
            yield run.worker.hold(self.round_trip_s, SELECTED_IDS_BYTES, 1, "selected-id round trip")
        split_ready = self.cache.split_ready()
        lookup = self.cache.access(layer, experts)
        self._set_cache_memory(self.cache.count)
        reads = m.env.process(self._read(layer, lookup.loads))
        k, hits = len(experts), lookup.hits
        split = split_ready and hits >= 1 and lookup.misses >= SPLIT_MIN_MISSES
        if split:  # the hits' experts committed before the preads are waited for
            self.gpu_unsent.append((routed_s * hits / k, "routed experts (hits)"))
            self._commit()
        drive = yield reads
        self.gpu_unsent.append((routed_s * (k - hits) / k if split else routed_s,
                                "routed experts (misses)" if split else "routed experts"))
        evictions = int(np.count_nonzero(lookup.victims >= 0))
        row.update(lookups=k, hits=hits, inserts=len(lookup.loads) - evictions, evictions=evictions)
        run.loads.record(row, layer, hits, len(lookup.loads), 0, 0, drive)
