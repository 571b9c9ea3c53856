"""ds4's decode path on CUDA and ROCm (the "selected/shared overlap" path, ds4-engine.md §1.6), per token and layer:

  main     attention + router on the default stream, then a device sync (the selected readback)
  worker   device sync, the 6 ids read back (a small synchronous cudaMemcpy), the cache lookup (numba), then
           for each miss 3 x (read -> H2D -> stream sync) strictly in turn (QD1: the worker waits each time),
           then the hits and the loaded experts copied into compact staging (3 synchronous D2D cudaMemcpy each,
           on the default stream, so they queue behind the kernels), then the slot map uploaded
  main     meanwhile enqueues the shared expert on the default stream; joins the worker; enqueues the routed
           experts' kernel, which the next layer's work queues behind.
Variants change who waits on what, not the arithmetic: pr605-cache gathers the hits with one kernel instead of the
per-expert copies, and pr605 also copies a miss's parts straight from the mapped file without O_DIRECT (one sync
per expert with it); pr1031 has no copy at all (kernels read the slots); pr1082 enqueues the hits' experts first and
reads the misses with 8 pread workers, each with its own staging and stream, so reads overlap each other (the
drive's queue depth) and the hits' compute. DS4_CUDA_DISABLE_STREAMING_SELECTED_SHARED_OVERLAP runs the fetch before
the shared expert on the main thread. Prompts of up to 18 tokens (64 when layer 0 is Q4_K) run this path too.
"""

from __future__ import annotations

import numpy as np

from sim.cache.kernels import DIRECT, EVICT, HIT, INSERT, MODE_EVICT
from sim.engines.ds4.decode_chain import SELECTED_IDS_BYTES, Prepared, TokenChain
from sim.engines.ds4.loads import PARTS_PER_EXPERT
from sim.machine.chains import BOOK, SYNC, WAIT, Job, JobChain
from sim.trace.format import MISSING

# A chain call costs ~21 us before its steps (JobChain.run with whole logs: 21 us for one step, 43 us for twenty,
# measured 2026-12-06 on the project's VM) and an all-hit layer issued through `layer` ~15-20 us: a run of fewer
# layers than this is done a layer at a time (the outputs are the same either way)
CHAIN_MIN_LAYERS = 3


class Decode:
    """A token through the decode path, layer by layer (the backend's `layer`), then the last kernels drained."""

    def __init__(self, run):
        self.run = run  # the Ds4Process: its machine, threads, caches, loads and per-layer figures

    def layer(self, layer: int, experts: np.ndarray, row: dict, lookup: tuple | None = None):
        """One layer step; `lookup` (counts of each outcome, the experts that missed): its cache lookup, done ahead
        by `lookups`, or None."""
        raise NotImplementedError

    def lookups(self, layers: np.ndarray, experts: np.ndarray) -> tuple | None:
        """The lookups of a run of the token's steps from the first, in one call, where they can be done ahead:
        each step's outcomes [step, k] and counts of each outcome [step, 4] for the run's steps (None: the first
        step looks up for itself)."""
        return None

    def prepared_lookups(self, layers: np.ndarray, experts: np.ndarray) -> tuple:
        """Where `lookups` cannot start at the first step (its prepare() frees or allocates) but a run from it can be
        done at once: the run's prepare() calls made now, each before its step's lookup: ((outcomes, counts),
        Prepared). (None, None): the first step goes through `layer`."""
        return None, None

    def hit_runs(self, layers: np.ndarray, lookups: tuple | None) -> list[tuple[int, int]]:
        """Runs [first, last) of the token's layer steps that `chain` can do (none unless the backend has chains)."""
        return []

    def chain(self, request: int, phase: str, step_no: int, layers: np.ndarray, k: int) -> None:
        """A run of `hit_runs` done at once, by a process that runs alone."""
        raise NotImplementedError

    def steps_at_once(self, row: dict, layers: np.ndarray, counts: np.ndarray, missed: np.ndarray,
                      missed_ends: np.ndarray, prepared: Prepared | None) -> bool:
        """A run of the token's layer steps done at once, where the backend can (row: the columns its step rows
        share; counts, missed and missed_ends: its lookups, as `looked_up_ahead` slices them; prepared: its steps'
        prepare() calls made ahead, by `prepared_lookups`). Whether it did."""
        return False

    def end_of_token(self) -> None:
        """What the host does once a token's layers are issued (nothing on CUDA)."""

    def token(self, request: int, phase: str, step_no: int, routing: np.ndarray, mtp_routing: np.ndarray | None = None):
        """One token through the decode path; mtp_routing [mtp layers, k]: the draft step's experts, run after
        the forward pass (decode tokens only, when the scenario runs MTP)."""
        run = self.run
        run.caches.phase = phase
        n_routed = run.layers.n_routed
        layers, experts = run.layers.routed_layers, routing[:n_routed]
        if mtp_routing is not None:
            layers = run.layers.all_layers
            experts = np.concatenate([experts, mtp_routing[: len(layers) - n_routed]])
        first, n = 0, len(layers)
        while first < n:
            lookups, prepared = self.lookups(layers[first:], experts[first:]), None
            if lookups is None:
                lookups, prepared = self.prepared_lookups(layers[first:], experts[first:])
            if lookups is None:  # this step looks up itself (its pool may be freed, allocated or grown)
                layer = int(layers[first])
                row = dict(request=request, phase=phase, step=step_no, layer=layer, start_s=run.m.env.now, tokens=1)
                yield from self.layer(layer, experts[first], row)
                first += 1
                continue
            last = first + len(lookups[0])
            yield from self.looked_up_ahead(request, phase, step_no, layers[first:last], experts[first:last], lookups,
                                            prepared)
            first = last
        self.end_of_token()
        # the token exists once the last layer's kernels (queued on the stream) are done
        yield run.m.gpu.drained()

    def looked_up_ahead(self, request: int, phase: str, step_no: int, layers: np.ndarray, experts: np.ndarray,
                        lookups: tuple, prepared: Prepared | None):
        """A run of the token's steps whose lookups were done ahead: all at once where the backend can (always,
        when its first step's prepare() was done ahead), else its runs of hits as chains and its other steps one at
        a time."""
        run = self.run
        outcome, counts = lookups
        # each step's misses as a slice of every step's misses in order
        missed = experts[outcome != HIT]
        missed_ends = np.cumsum(outcome.shape[1] - counts[:, HIT])
        if self.steps_at_once(dict(request=request, phase=phase, step=step_no, tokens=1), layers, counts, missed,
                              missed_ends, prepared):
            return
        if prepared is not None:
            raise RuntimeError("a step prepared ahead for a run that could not be done at once")
        counts_of_step, missed_ends = counts.tolist(), missed_ends.tolist()
        runs = iter(self.hit_runs(layers, lookups))
        next_run = next(runs, None)
        layer_ids = layers.tolist()
        i = 0
        while i < len(layer_ids):
            if next_run is not None and next_run[0] == i:
                first, last = next_run
                next_run = next(runs, None)
                if run.m.env.runs_alone():
                    self.chain(request, phase, step_no, layers[first:last], experts.shape[1])
                    i = last
                    continue
            row = dict(request=request, phase=phase, step=step_no, layer=layer_ids[i], start_s=run.m.env.now,
                       tokens=1)
            n, end = counts_of_step[i], missed_ends[i]
            yield from self.layer(layer_ids[i], experts[i], row, (n, missed[end - (experts.shape[1] - n[HIT]): end]))
            i += 1


class CudaDecode(Decode):
    """The module docstring's path, on the GPU's legacy default stream. Each thread waits for what its next call
    needs (its encode, a sync, a copy) before it issues it; kernels enqueued on the stream run in order behind
    what was enqueued before them."""

    def __init__(self, run):
        super().__init__(run)
        self._hit_chains: dict[int, tuple] = {}  # per expert count k: _hit_chain's chain, seconds and bytes
        self._token_chain: TokenChain | None = None  # made at the first token that can take it

    def lookups(self, layers: np.ndarray, experts: np.ndarray) -> tuple | None:
        """Issue 33: the lookups of the token's steps from the first in one kernel call, as far as no step can
        change a pool (`_steps_ahead`). The outcomes are those of the steps' own lookups one after another
        (tests/test_ds4_engine.py)."""
        n = self._steps_ahead(layers, experts)
        if n == 0:
            return None
        caches = self.run.caches
        return caches.cache.access_steps(layers[:n], experts[:n], caches.pool_of_layers, MODE_EVICT)

    def _steps_ahead(self, layers: np.ndarray, experts: np.ndarray) -> int:
        """How many steps from the first can look up ahead: each step's prepare() would find its pool as is
        (allocated, of its class, at the budget), its experts fit the compact staging (no growth that could release
        the caches) and no cell is missing. A slab's change of size class ends them (that step frees and
        reallocates the slab)."""
        run = self.run
        n = run.caches.steps_as_is(run.layers.class_of_layer[layers].tolist())
        return self._steps_fit(layers[:n], experts[:n]) if n else 0

    def _steps_fit(self, layers: np.ndarray, experts: np.ndarray) -> int:
        """How many steps from the first fit the compact staging as it is and have no missing cell."""
        run = self.run
        staged = experts.shape[1] * run.layers.expert_bytes[layers]
        n = len(layers)
        if staged.max() > run.caches.staging_bytes:
            n = int(np.argmax(staged > run.caches.staging_bytes))
        missing = experts[:n] == MISSING
        if missing.any():
            n = int(np.argmax(missing.any(axis=1)))
        return n

    def prepared_lookups(self, layers: np.ndarray, experts: np.ndarray) -> tuple:
        """Issue 33: a slab's changes of size class (or any other prepare() that frees or allocates) in a run that
        will be done at once: prepare() is plain arithmetic on the caches and the thread's waits, which the compiled
        call then pays after each step's ids readback, where `layer` pays them. Each prepare() is made after the
        lookups of the steps before it. The run stops before a step whose staging would grow or whose routing has
        a missing cell, and, on unified memory, at a second prepare() (the pool's VRAM is the page cache's RAM
        there, which the steps before it read)."""
        run = self.run
        caches, memory = run.caches, run.m.memory
        if not self._at_once(layers):
            return None, None
        outcomes, counts, waits, ends, vram_used = [], [], [], [], []
        first = 0
        while first < len(layers) and not (first and memory.unified):
            if not self._steps_fit(layers[first:first + 1], experts[first:first + 1]):
                break
            waits += caches.prepare_at_once(int(run.layers.class_of_layer[layers[first]]))
            last = first + 1 + self._steps_ahead(layers[first + 1:], experts[first + 1:])
            outcome, count = caches.cache.access_steps(layers[first:last], experts[first:last], caches.pool_of_layers,
                                                       MODE_EVICT)
            outcomes.append(outcome)
            counts.append(count)
            ends += [len(waits)] * (last - first)
            vram_used += [memory.used("vram")] * (last - first)
            first = last
        if not outcomes:
            return None, None
        return (np.concatenate(outcomes), np.concatenate(counts)), Prepared(waits, ends, vram_used)

    # Issue 33: a decode layer whose experts all hit, in a run alone on its machine (no other process, nothing
    # queued: Environment.runs_alone), has nothing to wait on but its own jobs, whose ends are known when issued:
    # `layer`'s jobs for that case (the selected/shared overlap path, no hits first, no non-routed weights over
    # PCIe) are a chain of the machine's (sim/machine/chains.py), and a run of such layers is one call. The same
    # jobs in the same order, the same floats (tests/test_ds4_engine.py runs scenarios with chains and without).
    # False: every layer through `layer`.
    chain_hits = True

    # Issue 33: the steps of a token whose lookups were done ahead, in a run alone on its machine, done in one
    # compiled call, misses included (sim/engines/ds4/decode_chain.py), where the run's settings are the ones that
    # call covers. False: hit runs as chains, every other layer through `layer`.
    chain_tokens = True

    def steps_at_once(self, row: dict, layers: np.ndarray, counts: np.ndarray, missed: np.ndarray,
                      missed_ends: np.ndarray, prepared: Prepared | None) -> bool:
        if not self._at_once(layers):
            return False
        self._token_chain.run_steps(row, layers, counts, missed, missed_ends, prepared)
        return True

    def _at_once(self, layers: np.ndarray) -> bool:
        """Whether these steps can be done in one compiled call now: the run's settings are the ones it covers
        and the machine has nothing else in flight (TokenChain.applies)."""
        run = self.run
        knobs = run.knobs
        if not (self.chain_tokens and knobs.overlap and not knobs.hits_first and run.loads.pool is None
                and run.variant.miss_copy != "pr605" and knobs.buffered and not run.weight_host_bytes[layers].any()):
            return False
        if self._token_chain is None:
            self._token_chain = TokenChain(run)
        return self._token_chain.applies()

    def hit_runs(self, layers: np.ndarray, lookups: tuple | None) -> list[tuple[int, int]]:
        run = self.run
        if lookups is None or not self.chain_hits or not run.knobs.overlap or run.knobs.hits_first:
            return []
        outcome, counts = lookups
        chainable = (counts[:, HIT] == outcome.shape[1]) & (run.weight_host_bytes[layers] == 0)
        edges = np.flatnonzero(np.diff(np.concatenate(([False], chainable, [False]))))
        return [(first, last) for first, last in zip(edges[0::2].tolist(), edges[1::2].tolist())
                if last - first >= CHAIN_MIN_LAYERS]

    def chain(self, request: int, phase: str, step_no: int, layers: np.ndarray, k: int) -> None:
        chain, seconds, n_bytes = self._hit_chain(k)
        starts, marks = chain.run(seconds[layers], n_bytes[layers])
        n = len(layers)
        self.run.loads.record_steps(dict(request=request, phase=phase, step=step_no, tokens=1), layers.tolist(), k,
                                    [k] * n, [0] * n, [0] * n, [0] * n, [0] * n, starts.tolist(), marks.tolist())

    def _hit_chain(self, k: int) -> tuple:
        """The jobs of `layer` when its k experts all hit, as a chain, with each layer's seconds and bytes per job
        (made once per k)."""
        if k in self._hit_chains:
            return self._hit_chains[k]
        run = self.run
        m = run.m
        gpu, main, worker = m.gpu, run.main, run.worker
        then_ops = 1 if m.memcpy_call_s else 0  # to_staging's slot-map upload
        jobs = [Job(main, WAIT, 1, "graph encode"), Job(gpu, BOOK, 0, "attention + router"),
                Job(main, SYNC, 1, "device sync", gpu), Job(gpu, BOOK, 0, "shared expert"),
                Job(worker, WAIT, 1, "ids readback")]
        n_layers = len(run.decode_s)
        columns = [np.full(n_layers, run.encode_layer_s), run.decode_s[:, 0], np.full(n_layers, m.sync_s),
                   run.decode_s[:, 1], np.full(n_layers, m.sync_s + m.memcpy_call_s)]
        sizes = [0, 0, 0, 0, SELECTED_IDS_BYTES]
        hit_copy = run.variant.hit_copy
        if hit_copy == "none":
            jobs.append(Job(worker, WAIT, then_ops, "slot map upload"))
        else:
            staged = k * run.layers.expert_bytes[:n_layers].astype(np.int64)
            gather = hit_copy != "memcpy"
            copies = 1 if gather else PARTS_PER_EXPERT * k
            jobs += [Job(gpu, BOOK, copies, "D2D gather kernel" if gather else "D2D memcpy"),
                     Job(worker, SYNC, then_ops, "slot map upload", gpu)]
            columns.append(np.array([m.stream_d2d_s(int(b), copies, gather) for b in staged.tolist()]))
            sizes.append(staged)
        columns.append(np.full(n_layers, m.memcpy_call_s))
        sizes.append(0)
        mark = len(jobs) - 1  # the step's row is recorded once the slot map is up
        jobs += [Job(main, SYNC, 1, "flush + join", gpu), Job(gpu, BOOK, 0, "routed experts")]
        columns += [np.full(n_layers, m.sync_s), run.decode_s[:, 2]]
        sizes += [0, 0]
        n_bytes = np.stack([np.broadcast_to(np.asarray(b, np.int64), n_layers) for b in sizes], axis=1)
        self._hit_chains[k] = (JobChain(m.env, jobs, mark), np.stack(columns, axis=1), n_bytes)
        return self._hit_chains[k]

    def _select_and_load(self, thread, layer: int, experts: np.ndarray, row: dict, routed_s: float,
                         lookup: tuple | None):
        """begin_compact_load for one decode layer: ids back, lookup, misses, hand-over (see the module doc)."""
        run = self.run
        m, caches, loads = run.m, run.caches, run.loads
        # the thread's device sync (the stream is idle: the main thread has just synced) and the ids readback
        yield thread.hold(m.sync_s + m.memcpy_call_s, SELECTED_IDS_BYTES, 1, "ids readback")
        if lookup is None:
            yield from caches.grow_staging(thread, int(len(experts) * run.layers.expert_bytes[layer]))
            pool = yield from caches.prepare(thread, int(run.layers.class_of_layer[layer]))
            outcome, _, _ = caches.cache.access(layer, experts, pool, MODE_EVICT)
            each = outcome.tolist()  # (k list counts: a third of a bincount's time)
            n = [each.count(HIT), each.count(INSERT), each.count(EVICT), each.count(DIRECT)]
            fetch = experts[outcome != HIT]
        else:  # looked up ahead (`lookups`): staging and pool as they are
            n, fetch = lookup
        hits, inserts, evictions, direct = n[HIT], n[INSERT], n[EVICT], n[DIRECT]
        loaded = inserts + evictions
        k = len(experts)
        if run.knobs.hits_first:  # #1082: the hits' experts run while the misses are read
            m.gpu.book(routed_s * hits / k, 0, 0, "routed experts (hits)")
            drive = (yield from self._load_misses(thread, layer, fetch)) if len(fetch) else 0
            m.gpu.book(routed_s * (k - hits) / k, 0, 0, "routed experts (misses)")
        else:
            drive = (yield from self._load_misses(thread, layer, fetch)) if len(fetch) else 0
        yield from loads.to_staging(thread, layer, hits + loaded, m.memcpy_call_s, "slot map upload")
        row.update(lookups=k, hits=hits, inserts=inserts, evictions=evictions)
        loads.record(row, layer, hits, loaded, direct, hits + loaded, drive)

    def _load_misses(self, thread, layer: int, fetch: np.ndarray):
        """The misses' reads and uploads: #1082's pread pool, or the thread's own QD1 chain (a process to yield
        from; a step whose experts all hit has none)."""
        loads = self.run.loads
        return loads.pool_load(layer, fetch) if loads.pool is not None else loads.load(thread, layer, fetch)

    def layer(self, layer: int, experts: np.ndarray, row: dict, lookup: tuple | None = None):
        run = self.run
        m = run.m
        other_s, shared_s, routed_s = run.decode_s_rows[layer]
        yield run.main.hold(run.encode_layer_s, 0, 1, "graph encode")  # the kernels exist once encoded
        if run.weight_host_rows[layer]:
            yield from m.host_read(run.weight_host_rows[layer], "non-routed weights over PCIe")
        m.gpu.book(other_s, 0, 0, "attention + router")
        # the selected readback's device sync: the main thread waits for the stream, then the sync's own cost
        yield m.gpu.synchronize(run.main, m.sync_s, 1, "device sync")
        hits_first = run.knobs.hits_first
        if run.knobs.overlap:
            # the main thread enqueues the shared expert and joins the worker, which does the fetch meanwhile.
            # The worker is this process: the main thread has nothing else to do until the join, and its enqueue
            # lands on the stream before any of the worker's copies (FIFO on the stream either way).
            m.gpu.book(shared_s, 0, 0, "shared expert")
            yield from self._select_and_load(run.worker, layer, experts, row, routed_s, lookup)
            # flush_commands and the join: with hits first the worker has queued the routed kernels, which the join
            # does not wait for (the next layer's kernels queue behind them), and its copies are done (it synced
            # each); otherwise the device sync waits for the stream
            if hits_first:
                yield run.main.hold(m.sync_s, 0, 1, "flush + join")
            else:
                yield m.gpu.synchronize(run.main, m.sync_s, 1, "flush + join")
        else:  # the synchronous path: the main thread fetches, then enqueues the shared expert
            yield from self._select_and_load(run.main, layer, experts, row, routed_s, lookup)
            m.gpu.book(shared_s, 0, 0, "shared expert")
        if not hits_first:
            m.gpu.book(routed_s, 0, 0, "routed experts")  # enqueued; the next layer's work queues behind it
