"""Strata's prompt path, a batched chunk through every layer (strata-engine.md §3.2).

Per layer every non-resident expert (from STREAM_ALL_MIN tokens on; below it the routed ones) streams host ->
device through the device ring, in expert-id order, in groups of STREAM_GROUP_BLOBS. Three processes pass each
group on:
  stager   the stager threads copy a group's pageable blobs into pinned buffers (a Container of kRing = 16),
           page-faulting file blobs from the drive first when the page cache misses them; pinned-RAM blobs
           skip it (they are DMA'd directly)
  copy     the copy stream waits for the group's pinned buffers, for free ring slots (a Container of ring
           slots), then DMAs it (the H2D copy engine) and hands the pinned buffers back
  compute  the compute stream runs the layer's attention half (no expert is read in it), then its experts in id
           order; a group's share waits for the group, then frees its ring slots. Through the attention half
           the copy stream runs only as far ahead as the ring has slots (ATTENTION_HALF_SHARE). The waits and
           records the stream makes on the copy stream's events (stream_events) each idle it under WDDM
so the ring, the pinned buffers, the copy engine, the drive and the stager threads each hold the others up only
when they are the bottleneck. A layer's attention half costs more the later its chunk's positions (the QSA indexer,
attention.position_share); with --kv-resident below the context (K/V streamed), a QSA layer first stages the K/V of
the cells before the chunk from the host copy on the compute stream (the KV stage buffer, strata-engine.md §4.1),
bytes that queue on the copy engine with the expert stream.
"""

from __future__ import annotations

import numpy as np
import simpy

from sim.engines.strata.attention import position_share
from sim.engines.strata.geometry import KV_BYTES_PER_CELL_LAYER, qsa_layers
from sim.engines.strata.memory import PINNED_STAGING_BUFFERS, kv_streamed
from sim.engines.strata.pricing import kv_stage_bytes
from sim.engines.strata.startup import FILE, GPU, RAM_PAGEABLE, RAM_PINNED, SOURCE_NAMES, pair_counts

STREAM_GROUP_BLOBS = 16  # blobs handed on together (our event granularity): a pinned ring's worth
MMQ_GROUP_EXPERTS = 16  # routed experts per MMQ launch (prefill.cpp @ 2249c244, MMQ_GROUP)
# A prompt layer runs its attention half (GDN or QSA) before its MoE half, and only the MoE half consumes streamed
# experts (prefill.cpp, Prefill::run): the share of a token's compute in the attention half, from the kernels'
# multiply-adds per token and layer (the geometry of §2.1; an assumption: the dense projections and the routed
# experts' int8 products run at one rate per multiply-add). Attention half: the hyper-connection read
# 10240 -> 320 -> 10240 (+ inject) 6.59 M, then GDN (36 layers: qkv 2560 -> 10240, gate 2560 -> 6144, alpha/beta
# 2 x 2560 -> 48, out 6144 -> 2560, the recurrence's 4 passes over a 48 x 128 x 128 state) 61.07 M or QSA (12
# layers: q 2560 -> 12288, k/v 2 x 2560 -> 512, indexer 2560 -> 128 and -> 512, out 6144 -> 2560, 2048 cells x 24
# heads x 256 x 2, the indexer's pooled keys at a 16K context, c x 128) 78.71 M: 72.07 M on average. MoE half: its
# hyper-connection read 6.59 M, router 2560 -> 512 1.31 M, shared expert 3 x 2560 x 640 4.92 M, 10 routed experts x
# 4,915,200 = 49.15 M: 61.97 M. 72.07 / (72.07 + 61.97) = 0.538.
ATTENTION_HALF_SHARE = 0.538


def stream_events(streamed: np.ndarray, routed: np.ndarray, *, fused: bool, grouped: bool, ring: int) -> np.ndarray:
    """The cross-stream events the compute stream waits on or records for each of a layer's streamed experts, in
    id order (streamed, routed: masks over the layer's experts), charged where the stream issues them
    (Niko1221/Strata src/prefill/prefill.cpp @ 0165063d and @ 2249c244):
      unfused   a wait for the expert's copy and a record freeing its ring entry; a ring entry no token routes to
                is released with a record alone
      grouped   0.1.38's grouped gather (#372; a native pack streaming every expert): the routed experts in id
                order, resident or not, are gathered in MMQ groups of 16, one wait and one record for each group
                with a streamed expert, at its last streamed one
      fused     STRATA_PF_FUSED: one wait per batch of at most ring / 3 streamed experts (at the batch's last) and
                a record per streamed expert (a batch also holds at most fused::kMaxBatch experts, a figure we
                have not read: its waits are a lower bound, a few a layer)
    Each event counts whole, back-to-back records too: the comment gives one figure per wait or record."""
    routed_streamed = routed[streamed]
    if fused:
        per = max(1, ring // 3)
        index = np.arange(len(routed_streamed))
        return 1 + ((index % per == per - 1) | (index == len(index) - 1)).astype(np.int64)
    if not grouped:
        return np.where(routed_streamed, 2, 1).astype(np.int64)
    group = ((np.cumsum(routed) - 1) // MMQ_GROUP_EXPERTS)[streamed & routed]  # of each routed streamed expert
    events = np.ones(len(routed_streamed), dtype=np.int64)  # a skipped ring entry's record
    events[routed_streamed] = 2 * np.append(group[1:] != group[:-1], True)  # at a group's last streamed expert
    return events


class _ChunkCompute:
    """The compute stream of one prompt chunk: the layers in order, each layer's attention half (nothing streamed
    is read, so the copy stream can run ahead only by the ring's free slots), then its experts in id order. A streamed
    group's share is issued when the group arrives (the callback of its copy), the groups that have arrived by
    then back to back (at most half the ring's), and a group's ring slots come back when its share is done; a
    stretch of resident experts needs nothing to arrive. Issuing from the arrivals' callbacks keeps the stream's
    order (copies arrive in order) with one event per share instead of a process resumed twice per group."""

    def __init__(self, stream: "PromptStream", plans: list, attention_s: float, moe_half_s: np.ndarray,
                 ring_slots: simpy.Container, request: int, step_no: int, tokens: int, routed: np.ndarray, lent: int,
                 kv_stage: np.ndarray):
        self.stream, self.m, self.plans, self.ring = stream, stream.run.m, plans, ring_slots
        # per layer as Python values: a numpy scalar reaching the servers' clocks makes every sum after it numpy's
        self.attention_s, self.moe_half_s, self.kv_stage = attention_s, moe_half_s.tolist(), kv_stage.tolist()
        self.attention_issued = False
        self.staging = False  # a QSA layer's K/V stage is on its way: nothing after it may be issued
        self.request, self.step_no, self.tokens, self.routed, self.lent = request, step_no, tokens, routed, lent
        self.layer, self.g, self.done = 0, 0, -1  # the next group to issue, and the last expert id issued
        self.arrivals = [0] * len(plans)  # groups of each layer that have arrived
        self.layer_start = None
        self.last_share = None  # the event of the last share issued
        self.finished = self.m.env.event()  # when the chunk's last share is done
        group = max((len(groups[0][0]) for groups in plans if groups), default=1)
        self.batch = max(1, ring_slots.capacity // (2 * group))
        self.cursor = [(layer, g) for layer, groups in enumerate(plans) for g in range(len(groups))]
        self.next_arrival = 0

    def arrived(self, _event) -> None:
        layer, g = self.cursor[self.next_arrival]
        self.next_arrival += 1
        self.arrivals[layer] = g + 1
        self.advance()

    def _issue(self, seconds: float, slots: int) -> float:
        gpu = self.m.gpu
        start = max(self.m.env.now, gpu.idle_at())
        end = gpu.hold(seconds, 0, 0, "prompt layer (experts in id order)", later=True)  # callbacks hang on it
        self.last_share = end
        if slots:
            end.callbacks.append(lambda _e: self.ring.put(slots))
        if self.layer_start is None:
            self.layer_start = start
        return start + seconds

    def _staged_attention(self, n_bytes: int):
        """The K/V stage (a copy on the compute stream: it starts when the stream reaches it), then the attention."""
        yield from self.m.host_read(n_bytes, "prompt K/V stage from host")
        self.staging = False
        if self.attention_s > 0:
            self._issue(self.attention_s, 0)
        self.advance()

    def advance(self) -> None:
        """Issue every share whose group has arrived, layer by layer, and record each layer that is done."""
        E = self.stream.run.n_experts
        if self.staging:
            return
        while self.layer < len(self.plans):
            groups = self.plans[self.layer]
            if not self.attention_issued:
                self.attention_issued = True
                if self.kv_stage[self.layer]:
                    self.staging = True
                    if self.layer_start is None:  # the stage starts the layer, once the stream reaches it
                        self.layer_start = max(self.m.env.now, self.m.gpu.idle_at())
                    self.m.env.process(self._staged_attention(int(self.kv_stage[self.layer])))
                    return
                if self.attention_s > 0:
                    self._issue(self.attention_s, 0)
            if self.g < len(groups):
                if self.arrivals[self.layer] <= self.g:
                    return  # the next group is still on its way
                h = min(self.arrivals[self.layer], self.g + self.batch)
                last = groups[h - 1][1]
                slots = sum(len(groups[i][0]) for i in range(self.g, h))
                events = sum(groups[i][5] for i in range(self.g, h))
                self._issue(self.moe_half_s[self.layer] * (last - self.done) / E + self.m.stream_events_s(events),
                            slots)
                self.done, self.g = last, h
                continue
            end = self._issue(self.moe_half_s[self.layer] * (E - 1 - self.done) / E, 0) if self.done < E - 1 else \
                self.m.gpu.idle_at()
            self.stream.record_layer(self, self.layer, end)
            self.layer, self.g, self.done, self.layer_start = self.layer + 1, 0, -1, None
            self.attention_issued = False
        if self.last_share is None or self.last_share.processed:
            self.finished.succeed()
        else:
            self.last_share.callbacks.append(lambda _e: self.finished.succeed())


class PromptStream:
    """One run's prompt path: its stager threads, pinned buffers and the chunks it streams."""

    def __init__(self, run):
        self.run = run  # the StrataProcess: its figures, machine, placement and recorder
        self.stager = run.m.threads(f"strata stager ({run.knobs.stager_threads} threads)")
        self.pinned = simpy.Container(run.m.env, capacity=PINNED_STAGING_BUFFERS, init=PINNED_STAGING_BUFFERS)
        self.events = 0  # the compute stream's cross-stream waits and records so far (stream_events)

    def _split_groups(self, streamed: np.ndarray, codes: np.ndarray, group: int, events: np.ndarray) -> list:
        """A layer's streamed pairs (ascending ids) as groups: (ids, last expert id, counts by source, the compute
        stream's events)."""
        if not len(streamed):
            return []
        starts = np.arange(0, len(streamed), group)
        c = codes[streamed]
        counts = [np.add.reduceat((c == code).astype(np.int64), starts) for code in (RAM_PINNED, RAM_PAGEABLE, FILE)]
        group_events = np.add.reduceat(events, starts)
        last = streamed[np.minimum(starts + group, len(streamed)) - 1] % self.run.n_experts
        return [(streamed[i: i + group], int(last[n]), int(counts[0][n]), int(counts[1][n]), int(counts[2][n]),
                 int(group_events[n])) for n, i in enumerate(starts)]

    def chunk(self, request: int, step_no: int, rows: np.ndarray, ring: int, first_position: int):
        """One batched chunk through all layers (see the module docstring: stager, copy and compute), its first
        token at first_position of the conversation."""
        run, place = self.run, self.run.place
        env = run.m.env
        T = len(rows)
        routed = pair_counts(rows, run.n_layers, run.n_experts) > 0
        stream_all = T >= run.build.stream_all_min_tokens
        streamed_mask = ~place.on_gpu if stream_all else (~place.on_gpu & routed)
        codes = np.where(place.on_gpu, GPU, place.home)
        group = max(1, min(STREAM_GROUP_BLOBS, ring, PINNED_STAGING_BUFFERS))
        ring_slots = simpy.Container(env, capacity=ring, init=ring)
        routed_bytes = (run.pair_blob * routed).reshape(run.n_layers, run.n_experts).sum(axis=1)
        attention_s = T * run.prefill_token_layer_s * (ATTENTION_HALF_SHARE + position_share(first_position, T))
        staged = kv_stage_bytes(first_position, KV_BYTES_PER_CELL_LAYER[run.flags.kv]) \
            if kv_streamed(run.max_context, run.kv_cells) else 0
        kv_stage = np.where(qsa_layers(run.n_layers), staged, 0)
        moe_half_s = (T * run.prefill_token_layer_s * (1 - ATTENTION_HALF_SHARE) + run.prefill_chunk_layer_s
                      + run.m.vram_read_s(routed_bytes))
        lent = place.slots - place.loan_first if place.loan_first is not None else 0
        grouped = run.build.grouped_gather and not run.canonical_q2_0 and stream_all
        plans = []
        for layer in range(run.n_layers):
            lo = layer * run.n_experts
            layer_streamed = streamed_mask[lo: lo + run.n_experts]
            ids = lo + np.flatnonzero(layer_streamed)
            events = stream_events(layer_streamed, routed[lo: lo + run.n_experts], fused=run.knobs.fused, ring=ring,
                                   grouped=grouped)
            self.events += int(events.sum())
            plans.append(self._split_groups(ids, codes, group, events))
        compute = _ChunkCompute(self, plans, attention_s, moe_half_s, ring_slots, request, step_no, T, routed, lent,
                                kv_stage)
        env.process(self._stream(plans, ring_slots, compute))
        compute.advance()  # the layers before the first streamed group need nothing to arrive
        yield compute.finished

    def record_layer(self, chunk: _ChunkCompute, layer: int, end_s: float) -> None:
        run = self.run
        groups = chunk.plans[layer]
        blob = int(run.layer_blob[layer])
        n = sum(len(gr[0]) for gr in groups)
        n_file = sum(gr[4] for gr in groups)
        lo, hi = layer * run.n_experts, (layer + 1) * run.n_experts
        lookups = int(chunk.routed[lo:hi].sum())
        hits = int((chunk.routed & run.place.on_gpu)[lo:hi].sum())
        memory = run.m.memory
        sid = run.rec.step(request=chunk.request, phase="prefill", step=chunk.step_no, layer=layer,
                           start_s=chunk.layer_start, end_s=end_s, tokens=chunk.tokens, lookups=lookups, hits=hits,
                           direct_loads=n, h2d_bytes=n * blob, file_read_bytes=n_file * blob, lent_slots=chunk.lent,
                           vram_used_bytes=memory.used("vram"), ram_used_bytes=memory.used("ram"))
        for code, count in ((RAM_PINNED, sum(gr[2] for gr in groups)), (RAM_PAGEABLE, sum(gr[3] for gr in groups)),
                            (FILE, n_file)):
            run.rec.copy(sid, "H2D", count, blob, SOURCE_NAMES[code], "ring")

    def _stream(self, plans: list, ring_slots: simpy.Container, compute: _ChunkCompute):
        """The stager threads and the copy stream, group by group in order. A group is the pinned ring's worth of
        blobs. The stagers copy its pageable and file blobs into the pinned buffers (file blobs the page cache
        misses are page-faulted from the drive first, the threads' reads in flight together); once the ring has
        room the copy stream DMAs the group. The copy is booked on the copy engine without waiting for it, and
        hands its buffers back blob by blob as it runs: the stagers fill them with the next group meanwhile, and
        can finish that group no earlier than this copy ends (its last buffer). The copy's end is the group's
        arrival."""
        run = self.run
        m, home, threads = run.m, run.place.home, run.knobs.stager_threads
        previous = None  # the copy of the group before: its buffers free up as it runs
        for layer, groups in enumerate(plans):
            blob = int(run.layer_blob[layer])
            for g, (ids, _, n_pin, n_pag, n_file, _) in enumerate(groups):
                n_stage = n_pag + n_file
                if n_stage:
                    buffers = self.pinned.get(n_stage)
                    if not buffers.triggered:
                        yield buffers
                    if n_file:
                        file_ids = ids[home[ids] == FILE] if n_file < len(ids) else ids
                        missed = int((~m.page_cache.access(file_ids)).sum())
                        if missed:  # page faults of the stager threads, read-ahead sized
                            yield m.ssd.read(missed * blob, missed * m.ssd.fault_reads(blob), min(threads, missed),
                                             at_once=True)
                    yield m.memcpy(self.stager, n_stage * blob, threads, "stager memcpy")
                    if previous is not None and not previous.processed:
                        yield previous  # the group's last buffer is free only once the copy before it is done
                room = ring_slots.get(len(ids))
                if not room.triggered:  # wait only when the ring is full (a triggered get needs no resume)
                    yield room
                # the group's copies are queued back to back on the copy stream: one fixed cost per group
                n_bytes = len(ids) * blob
                done = m.h2d.copy(n_bytes, len(ids), "prompt stream", fixed_costs=1, later=True)
                if n_stage:  # the buffers pass to the copy, which frees them blob by blob for the next group
                    self.pinned.put(n_stage)
                done.callbacks.append(compute.arrived)
                previous = done
