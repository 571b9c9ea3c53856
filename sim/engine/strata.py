"""Strata (Niko1221/Strata v0.1.35 and later builds, and the #658 fork) as SimPy processes on the simulated
machine. The rules are in strata_plan.py (BUILDS says what each build changes).

Covers: the profile-filled sized-slot expert cache (never evicts; adaptive decode tier), prompt buffers
borrowed from the cold tail of the cache (lend, stream, refill) or owned (#658's independent buffers, 0.1.40's
owned pricing and #765 startup plan), the RAM tiers (arena, resident complement with lend-region coverage,
budget mode, the live-memory build's loan coverage, mmap fallback), file-blob reads through a finite page
cache, KV streaming (--kv-resident), in-session checkpoints and the conversation cache.

Processes: the main thread serves a scenario's requests in order (reference/strata-engine.md §3, §6); a
prompt chunk's layer runs a stager process (SSD faults, page-cache copies into the pinned buffers) beside it.

Startup (strata_plan.py holds every rule; docs/planning.md):
  VRAM before the cache = the driver's context (hardware profile) + Strata's runtime buffers (a calibration
  record per platform) + the pack's dense weights + the MTP draft layer + the session at --max-context (K/V of
  every cell, or only the --kv-resident window) + a GPU vision encoder, each from Strata's own loading logs
  (strata_plan.vram_before_cache); the cache is then sized (auto or
  --expert-cache N), filled in rank order (slot i holds pair i: the tail slots are the coldest), the loan
  planned (plan_lend with the build's pricing), the fork's independent buffers chosen, and the RAM side laid
  out (the complement of the GPU cache under available - headroom, the lend region covered from the tail).

The prompt path of a chunk, per layer (§3.2): every non-resident expert (from STREAM_ALL_MIN tokens on; below
it the routed ones) streams host -> device through the device ring, in expert-id order, in groups of
STREAM_GROUP_BLOBS. Three processes pass each group on:
  stager   the stager threads copy a group's pageable blobs into pinned buffers (a Container of kRing = 16),
           page-faulting file blobs from the drive first when the page cache misses them; pinned-RAM blobs
           skip it (they are DMA'd directly)
  copy     the copy stream waits for the group's pinned buffers, for free ring slots (a Container of ring
           slots), then DMAs it (the H2D copy engine) and hands the pinned buffers back
  compute  the compute stream runs the layer's attention half (no expert is read in it), then its experts in id
           order; a group's share waits for the group, then frees its ring slots. Through the attention half
           the copy stream runs only as far ahead as the ring has slots (ATTENTION_HALF_SHARE)
so the ring, the pinned buffers, the copy engine, the drive and the stager threads each hold the others up
only when they are the bottleneck. Refill after the last batched part copies every lent slot back from its
source (one sync for the batch); a lent expert without a RAM copy is a file-blob read.
Decode: one step per token at the profile's decode figure, an ALL-IN measured rate (MTP verify windows and the
CPU/PCIe handling of misses included: misses are counted, not added), plus the K/V cells streamed from host RAM
beyond the --kv-resident window. Every adapt-every rounds the adaptive tier swaps hot pairs in on a side stream.

Where the prompt time ends: prefill_end is after the refill and the window of the last prompt token, i.e.
when the first output token exists (the engine splits every prompt at n - 1 and refills before that last
token's decode window, §3.3 steps 3-4).
"""

from __future__ import annotations

import numpy as np
import simpy

from sim.cache.kernels import key_counts
from sim.engine import strata_plan as sp
from sim.engine.timeline import Recorder
from sim.engine.workload import WorkloadRouting
from sim.errors import InputError
from sim.units import GIB, MIB

# fmt: off
MISSING = 0xFFFF                          # a missing routing cell (trace format)
STAGER_THREADS_MIN, STAGER_THREADS_MAX = 2, 4   # max(2, min(4, hw / 4)), STRATA_STAGER_THREADS (§3.2)
PINNED_STAGING_BUFFERS = 16               # the stager's kRing pinned host buffers (§3.2)
STREAM_GROUP_BLOBS = 16                   # blobs handed on together (our event granularity): a pinned ring's worth
# A prompt chunk's layer reads each routed expert's weights from VRAM once, however many of its tokens use it.
WEIGHT_READ_EFFICIENCY = 0.80             # of the spec DRAM rate: llama.cpp's decode reaches 80 % of the
                                          # roofline on a 5090 under Linux (ggml-org/llama.cpp#28196, hw §1.2)
QSA_ATTENDED_CELLS = 2048                 # QSA reads ~2048 selected cells per query (§2.1)
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

# -- decode ------------------------------------------------------------------------------------------
QSA_POOLED_KEY_BYTES_PER_CELL = 128       # the indexer scores one 512 B pooled key per 4 cells, per query (qsa.hpp)
MTP_DRAFT_DENSE_BYTES = 111 * MIB         # the draft layer's dense weights ("experts 675, dense 111" MiB, logs)
DECODE_COMMIT_S = 0.5e-3                  # commit + emit after a window: 0.4-0.6 ms on 4090 / V100 decode logs
ADAPT_MIN_USAGE = 2.0                     # adaptive tier: candidates need usage >= 2.0 (§3.1)
ADAPT_MARGIN = 1.5                        # swap while candidate >= victim + 1.5 (§3.1)
ADAPT_DECAY = 0.7                         # usage x 0.7 after each adapt (§3.1)

# -- sessions ----------------------------------------------------------------------------------------
RUNNING_STATE_BYTES = 118_000_000         # GDN recurrences + conv, QSA indexer tails, PLE history (§2.1, §3.7)
# Parked K/V per token: a 162,150-token snapshot is 3.85 GB (IQ3_S, INT8 KV; §3.7) less one running state.
PARKED_BYTES_PER_TOKEN = (3_850_000_000 - RUNNING_STATE_BYTES) // 162_150          # 23,016 B
# Copies per capture/restore: K and V of 12 QSA layers + the draft layer, recurrence and conv state of 36 GDN
# layers, 12 indexer tails, the PLE history (§2.1; our count of the tensors, each one cudaMemcpy).
SESSION_COPIES = 2 * (12 + 1) + 2 * 36 + 12 + 1
RESTORE_CHECK_TOKENS = 984                # the fork's A->B->A check restored a 984-token checkpoint in ~26 ms
# fmt: on

GPU, RAM_PINNED, RAM_PAGEABLE, FILE = 0, 1, 2, 3
SOURCE_NAMES = {RAM_PINNED: "ram:pinned", RAM_PAGEABLE: "ram:pageable", FILE: "file"}


def _env_int(where: str, text: str | None, minimum: int = 0) -> int | None:
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        raise InputError(where, "value", text, "must be an integer") from None
    if value < minimum:
        raise InputError(where, "value", text, f"must be >= {minimum}")
    return value


def session_bytes(tokens: int) -> int:
    """Bytes of a parked session or restore: K/V of `tokens` plus one running state."""
    return RUNNING_STATE_BYTES + tokens * PARKED_BYTES_PER_TOKEN


class _ChunkCompute:
    """The compute stream of one prompt chunk: the layers in order, each layer's attention half (nothing streamed
    is read, so the copy stream can run ahead only by the ring's free slots), then its experts in id order. A streamed
    group's share is issued when the group arrives (the callback of its copy), the groups that have arrived by
    then back to back (at most half the ring's), and a group's ring slots come back when its share is done; a
    stretch of resident experts needs nothing to arrive. Issuing from the arrivals' callbacks keeps the stream's
    order (copies arrive in order) with one event per share instead of a process resumed twice per group."""

    def __init__(self, engine: "Strata", plans: list, attention_s: float, moe_half_s: np.ndarray,
                 ring_slots: simpy.Container, request: int, step_no: int, tokens: int, routed: np.ndarray, lent: int):
        self.e, self.plans, self.ring = engine, plans, ring_slots
        self.attention_s, self.moe_half_s = attention_s, moe_half_s
        self.attention_issued = False
        self.request, self.step_no, self.tokens, self.routed, self.lent = request, step_no, tokens, routed, lent
        self.layer, self.g, self.done = 0, 0, -1  # the next group to issue, and the last expert id issued
        self.arrivals = [0] * len(plans)  # groups of each layer that have arrived
        self.layer_start = None
        self.last_share = None  # the event of the last share issued
        self.finished = engine.m.env.event()  # when the chunk's last share is done
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
        gpu = self.e.m.gpu
        start = max(self.e.m.env.now, gpu.idle_at())
        end = gpu.hold(seconds, 0, 0, "prompt layer (experts in id order)")
        self.last_share = end
        if slots:
            end.callbacks.append(lambda _e: self.ring.put(slots))
        if self.layer_start is None:
            self.layer_start = start
        return start + seconds

    def advance(self) -> None:
        """Issue every share whose group has arrived, layer by layer, and record each layer that is done."""
        E = self.e.n_experts
        while self.layer < len(self.plans):
            groups = self.plans[self.layer]
            if not self.attention_issued:
                self.attention_issued = True
                if self.attention_s > 0:
                    self._issue(self.attention_s, 0)
            if self.g < len(groups):
                if self.arrivals[self.layer] <= self.g:
                    return  # the next group is still on its way
                h = min(self.arrivals[self.layer], self.g + self.batch)
                last = groups[h - 1][1]
                slots = sum(len(groups[i][0]) for i in range(self.g, h))
                self._issue(self.moe_half_s[self.layer] * (last - self.done) / E, slots)
                self.done, self.g = last, h
                continue
            end = self._issue(self.moe_half_s[self.layer] * (E - 1 - self.done) / E, 0) if self.done < E - 1 else \
                self.e.m.gpu.idle_at()
            self.e._record_prefill_layer(self, self.layer, end)
            self.layer, self.g, self.done, self.layer_start = self.layer + 1, 0, -1, None
            self.attention_issued = False
        if self.last_share is None or self.last_share.processed:
            self.finished.succeed()
        else:
            self.last_share.callbacks.append(lambda _e: self.finished.succeed())


class Strata:
    """One Strata process serving a scenario's requests in order (see the module docstring)."""

    name = "strata"

    def __init__(self, scenario, routing: WorkloadRouting, recorder: Recorder, machine, domain):
        self.scenario, self.routing, self.rec, self.m, self.domain = scenario, routing, recorder, machine, domain
        hw, layout, engine = scenario.hardware_profile, scenario.layout, scenario.engine
        self.hw, self.flags, self.env_vars = hw, engine.flags, engine.env
        self.build = sp.BUILDS[engine.variant]
        self.notices: list[str] = []
        self.n_layers, self.n_experts, self.top_k = layout.n_routed_layers, layout.n_experts, layout.top_k
        self.layer_blob = np.asarray(layout.expert_bytes_per_layer()[: self.n_layers], dtype=np.int64)
        self.max_blob = int(self.layer_blob.max())
        self.total_expert_bytes = int(self.layer_blob.sum()) * self.n_experts
        self.pair_blob = np.repeat(self.layer_blob, self.n_experts)  # pair = layer * n_experts + expert
        self.layer_offsets = (np.arange(self.n_layers, dtype=np.int32) * self.n_experts)[None, :, None]
        self.max_context = self.flags.max_context
        rates = machine.rates
        self.copy_lat_s = rates["latency_s"]
        self.h2d_pinned, self.h2d_pageable = rates["h2d_pinned"], rates["h2d_pageable"]
        self.d2h_pageable = rates["d2h_pageable"]
        threads = _env_int("STRATA_STAGER_THREADS", self.env_vars.STRATA_STAGER_THREADS, 1)
        self.stager_threads = threads if threads is not None else \
            max(STAGER_THREADS_MIN, min(STAGER_THREADS_MAX, int(hw.host.hardware_threads.value) // 4))
        # compute: the profile's figures (calibration records where they were fitted)
        compute = scenario.compute
        self.weight_read_s_per_byte = 1.0 / (hw.gpu.dram_bandwidth_gbps.value * 1e9 * WEIGHT_READ_EFFICIENCY)
        self._decode_setup(scenario, hw, layout, machine, domain)
        fixed = compute.prefill_us_per_chunk_layer
        self.prefill_chunk_layer_s = 0.0 if fixed is None else fixed.value * 1e-6
        # Prompt compute per chunk and layer = tokens x a per-token cost + the routed experts' weights read
        # once at the GPU's DRAM rate + the profile's fixed cost per chunk. The profile's per-token figure is the
        # slope between one-chunk prompts of two lengths (record strata-prefill-5090): what each token adds,
        # the per-chunk costs (these reads, the stream of the experts the cache lacks) being simulated apart.
        self.prefill_token_layer_s = compute.prefill_us_per_token_layer.value * 1e-6
        # VRAM before the cache: derived term by term (strata_plan.vram_before_cache)
        mem = machine.memory
        self.kv_cells = self.flags.kv_resident_cells
        self.vram_before = sp.vram_before_cache(scenario, domain)
        for name, n_bytes in self.vram_before:
            mem.set("vram", name, n_bytes)
        self.draft_head_bind = sp.draft_head_bind_bytes(sp.pack_weights(layout.name))
        if layout.name not in sp.PACK_WEIGHTS:
            self.notices.append(f"dense weights: no Strata log of the {layout.name} pack's weights; taking "
                                f"{sp.PACK_WEIGHTS_UNLOGGED.dense_bytes / MIB:,.0f} MiB, the mean of the logged packs")
        mem.set("ram", "K/V streamed from host (--kv-resident)",
                sp.kv_host_bytes(self.max_context, self.flags.kv, self.kv_cells))
        mem.set("ram", "stager pinned buffers", PINNED_STAGING_BUFFERS * self.max_blob)
        self.vram_record = sp.runtime_record_id(hw)
        # threads and buffers of the prompt path
        self.main = machine.threads("strata main thread")
        self.stager = machine.threads(f"strata stager ({self.stager_threads} threads)")
        self.pinned = simpy.Container(machine.env, capacity=PINNED_STAGING_BUFFERS, init=PINNED_STAGING_BUFFERS)
        self._startup()
        # conversation state
        self.live: dict | None = None  # {"conv", "tokens"}
        self.parked: tuple[sp.ParkedConversation, ...] = ()
        self.context: dict[str, int] = {}  # a conversation's tokens so far (prompt + output of its last turn)
        self.conv_stats = {"parks": 0, "park_skips": [], "evictions": 0, "restores": []}
        self.request_log: list[dict] = []
        self.usage = np.zeros(self.n_layers * self.n_experts, dtype=np.float64)
        self.rounds = 0
        self.swaps = 0
        self.max_loan = 0
        self.donor_copies = 0
        self.checkpoints = 0

    # ------------------------------------------------------------------------------------ startup

    def _pair_counts(self, rows: np.ndarray) -> np.ndarray:
        """Routed (token, k) cells per pair of a [T, L, k] uint16 block (missing cells skipped)."""
        counts = np.zeros(self.n_layers * self.n_experts, np.int64)
        key_counts(rows, self.n_experts, counts)
        return counts

    def _rank_pairs(self) -> tuple[np.ndarray, bool]:
        n_pairs = self.n_layers * self.n_experts
        pair = np.arange(n_pairs)
        interleaved = (pair % self.n_experts) * self.n_layers + pair // self.n_experts  # rank r -> layer r % L
        profile = self.flags.expert_profile
        if profile is None:
            self.notices.append("no --expert-profile: the cache is filled in the interleaved stand-in order; "
                                "prompt buffers are owned (no borrowing without a profile)")
            return np.argsort(interleaved, kind="stable"), False
        if profile != "@trace":
            raise InputError("strata", "engine.flags.expert-profile", profile,
                             'only "@trace" (rank pairs by the scenario trace\'s routing counts) is modelled')
        counts = np.zeros(n_pairs, dtype=np.int64)
        for req in self.routing.requests:
            for rows in (req.prompt, req.decode):
                if len(rows):
                    counts += self._pair_counts(rows)
        return np.lexsort((interleaved, -counts)), True

    def _pricing(self, pinned_share: float) -> sp.Pricing:
        kv_stage = sp.kv_stage_bytes(self.max_context, sp.KV_BYTES_PER_CELL_LAYER[self.flags.kv]) \
            if sp.kv_streamed(self.max_context, self.kv_cells) else 0
        return sp.Pricing(self.build, pinned_share, self.max_blob, kv_stage, self.ring_override,
                          fused=self.env_vars.STRATA_PF_FUSED == "1" and self.hw.gpu.api == "cuda",
                          max_cells=self.max_context)

    def _startup(self) -> None:
        hw, flags, env, build = self.hw, self.flags, self.env_vars, self.build
        mem = self.m.memory
        self.rank_pairs, has_profile = self._rank_pairs()
        ranked_blobs = self.pair_blob[self.rank_pairs]
        reserve = flags.vram_reserve_mib * MIB
        free = mem.vram_free()
        if free < 0:  # the K/V allocation at --max-context fails before any expert slot is sized
            raise InputError(str(self.scenario.path or "scenario"), "engine.flags.max-context", self.max_context,
                             f"Strata cannot allocate it: the runtime, the weights, the draft layer and the session "
                             f"at this context need {mem.used('vram') / GIB:.2f} GiB of the "
                             f"{mem.vram_total / GIB:.2f} GiB the GPU has (lower max-context or set kv-resident)")
        self.free_at_sizing = free
        borrow = not flags.no_prefill_borrow and has_profile
        explicit = flags.prefill if isinstance(flags.prefill, int) else None
        auto_cap = int(flags.prefill[5:]) if isinstance(flags.prefill, str) and flags.prefill.startswith("auto:") \
            else None
        self.ring_override = _env_int("STRATA_PREFILL_RING", env.STRATA_PREFILL_RING)
        mode = flags.ram_mode
        # the pinned share is measured before the RAM complement is built: ~0 in the resident modes (§3.2)
        if mode == "arena":
            pinned = self._arena_pinned_bytes(env.STRATA_ARENA_PIN_GIB)
            self.pinned_share = pinned / self.total_expert_bytes
        else:
            pinned, self.pinned_share = 0, 0.0
        self.pricing = self._pricing(self.pinned_share)
        # 1-2: size the cache (#765 books an owned prompt path first), then the post-write check
        owned_chunk = explicit or sp.NO_BORROW_CHUNK_TOKENS
        if flags.expert_cache == "auto" and build.startup_plan and "vram_reserve_mib" not in flags.model_fields_set:
            # #496: a default reserve that leaves too small a working cache gives way, before the prompt path is
            # planned (the cache it leaves is counted as the sized walk would lay it out)
            first = sp.auto_expert_cache(ranked_blobs, self.max_blob, free, reserve,
                                         mtp_bind_bytes=self.draft_head_bind)
            needed = sp.min_working_slots(self.pricing, borrow)
            adapted = sp.adapted_vram_reserve(free, reserve, self.draft_head_bind, first.slots, needed, self.max_blob)
            if adapted != reserve:
                self.notices.append(f"expert cache: the {flags.vram_reserve_mib} MiB reserve leaves {first.slots} "
                                    f"slots, a working cache needs {needed}: a {adapted / MIB:.0f} MiB reserve "
                                    "instead (#496)")
                reserve = adapted
        self.vram_reserve = reserve
        if flags.expert_cache == "auto":
            if build.startup_plan and not borrow:
                owned_bytes = self.pricing.need_owned(owned_chunk)
                booked = owned_bytes + self.draft_head_bind
                cache = sp.sized_slot_walk(ranked_blobs, (max(0, free - reserve - booked) // self.max_blob)
                                           * self.max_blob, free, reserve, booked)
            else:
                cache = sp.auto_expert_cache(ranked_blobs, self.max_blob, free, reserve, borrowing=borrow,
                                             owned_chunk_tokens=owned_chunk, mtp_bind_bytes=self.draft_head_bind)
            how = "auto"
        else:
            cache = sp.sized_slot_walk(ranked_blobs, sp.expert_cache_budget_bytes(flags.expert_cache, self.max_blob),
                                       free, reserve, self.draft_head_bind)
            how = f"budget {flags.expert_cache} x {self.max_blob / MIB:.2f} MiB"
        shrink = sp.post_write_shrink(ranked_blobs, cache, reserve, lambda used: free - used, wddm=hw.wddm)
        cache = shrink.cache
        for free_read, give in shrink.rounds:
            self.notices.append(f"expert cache: {free_read / MIB:.0f} MiB free after the write, below the "
                                f"{reserve / MIB:.0f} MiB reserve: giving back {give / MIB:.0f} MiB")
        self.cache = cache
        self.slots = cache.slots
        mem.set("vram", "expert cache", cache.bytes)
        mem.set("vram", "MTP draft head", self.draft_head_bind)  # bound after the cache, booked before it
        self.notices.append(f"expert cache: {cache.slots} slots, {cache.bytes / MIB:.0f} MiB ({how}; "
                            f"{free / MIB:.0f} MiB free at sizing, reserve {reserve / MIB:.0f} MiB)")
        # 3: profile fill in rank order
        self.pair_of_slot = self.rank_pairs[: self.slots].copy()
        self.slot_of = np.full(self.n_layers * self.n_experts, -1, dtype=np.int64)
        self.slot_of[self.pair_of_slot] = np.arange(self.slots)
        self.on_gpu = self.slot_of >= 0
        # 4: plan_lend with the build's pricing
        lend_pct = _env_int("STRATA_PREFILL_LEND_PCT", env.STRATA_PREFILL_LEND_PCT)
        candidates = sp.AUTO_CHUNKS_V0135
        if build.auto_n and auto_cap:  # #669: the longer list, its entries above 8192 only up to auto:N
            candidates = tuple(c for c in sp.AUTO_CHUNKS_V0139 if c <= max(sp.AUTO_CHUNK_CEILING_TOKENS, auto_cap))
        ceiling = None
        if build.grid_auto:
            ceiling = max(sp.AUTO_CHUNK_CEILING_TOKENS, min(auto_cap or 0, self.max_context))
        plan = sp.plan_lend(cache.slot_bytes, pinned_share=self.pinned_share, max_context_tokens=self.max_context,
                            explicit_chunk_tokens=explicit, candidates=candidates, max_blob_bytes=self.max_blob,
                            kv_stage=self.pricing.kv_stage, borrow=borrow, has_profile=has_profile,
                            lend_pct_override=lend_pct, pricing=self.pricing, grid_ceiling_tokens=ceiling,
                            pressure_min_keep=flags.live_prefill_min_retained
                            if build.live_memory and flags.live_prefill_min_retained < sp.MIN_KEEP_SLOTS else None)
        self.lend_plan = plan
        self.owned = plan.owned
        self.chunk = plan.chunk_tokens
        self.buffer_bytes = plan.buffer_bytes
        self.independent_chunk = 0
        free_after_cache = mem.vram_free()
        # 5: the fork's independent buffers, chosen after the fill with the free VRAM left
        own_auto = env.STRATA_PREFILL_OWN_AUTO
        if build.independent_buffers and own_auto != "0" and not plan.owned:
            max_chunk = self.max_context if auto_cap is None and explicit is None else (auto_cap or explicit)
            offers = tuple((c, self.pricing.need(c)) for c in sp.INDEPENDENT_CHUNKS_FORK)
            chosen = sp.independent_prefill_chunk(offers, free_after_cache, reserve, max_chunk, plan.chunk_tokens)
            self.independent_chunk = chosen
            if chosen:
                self.owned, self.chunk = True, chosen
                self.buffer_bytes = dict(offers)[chosen]
                self.notices.append(f"prefill: independent buffers for {chosen}-token chunks, "
                                    f"{self.buffer_bytes / MIB:.0f} MiB ({free_after_cache / MIB:.0f} MiB free after "
                                    f"the cache, reserve {reserve / MIB:.0f} MiB kept)")
            else:
                self.notices.append(f"prefill: no independent buffer fits {free_after_cache / MIB:.0f} MiB free - "
                                    f"{reserve / MIB:.0f} MiB reserve; borrowing")
        if not self.owned:
            self.notices.append(f"prefill: borrowing up to {plan.lent_slots} slots ({plan.lend_bytes / MIB:.0f} MiB) "
                                f"for {plan.chunk_tokens}-token chunks (ring {self.pricing.ring(plan.chunk_tokens)})")
        elif plan.owned:
            self.notices.append(f"prefill: owned buffers for {plan.chunk_tokens}-token chunks, "
                                f"{plan.buffer_bytes / MIB:.0f} MiB")
        if self.owned:
            if self.buffer_bytes > free_after_cache:
                self.notices.append(f"prefill: owned buffers ({self.buffer_bytes / MIB:.0f} MiB) exceed the "
                                    f"{free_after_cache / MIB:.0f} MiB left after the cache")
            mem.set("vram", "prompt buffers (owned)", self.buffer_bytes)
        self.lend_first_planned = None if self.owned else plan.first_lent_slot
        self.loan_first: int | None = None  # first lent slot of the current loan
        # 6: the RAM side
        self._plan_ram(mode, pinned)
        self._warm_page_cache()

    def _arena_pinned_bytes(self, pin_gib: str | None) -> int:
        """The arena's page-locked bytes (Strata src/core/pinned.cu): the whole arena in one registration, unless
        STRATA_ARENA_PIN_GIB = N > 0 caps it (0 or unset: no cap) or the driver refuses a region that large
        (host.gpu_pinnable_gib); then it is registered one layer's slice at a time from the first layer, each
        slice only if it still fits under the cap and the driver's limit."""
        total = self.total_expert_bytes
        limits = []
        if pin_gib is not None:
            try:
                cap = float(pin_gib) * GIB
            except ValueError:
                raise InputError("STRATA_ARENA_PIN_GIB", "value", pin_gib, "must be a number of GiB") from None
            if cap > 0:
                limits.append(cap)
        pinnable = self.hw.host.gpu_pinnable_gib
        if pinnable is not None:
            limits.append(pinnable.value * GIB)
        limit = min(limits, default=total)
        if limit >= total:
            return total
        whole_layers = np.cumsum(self.layer_blob * self.n_experts)
        pinned = int(whole_layers[whole_layers <= limit][-1]) if whole_layers[0] <= limit else 0
        self.notices.append(f"expert arena: {total / GIB:.2f} GiB cannot be pinned whole (limit {limit / GIB:.2f} "
                            f"GiB): {pinned / GIB:.2f} GiB pinned in layer slices, the rest through the stager")
        return pinned

    def _plan_ram(self, mode: str, pinned: int) -> None:
        flags, env, hw = self.flags, self.env_vars, self.hw
        mem = self.m.memory
        self.available_ram = mem.ram_available()  # MemAvailable / ullAvailPhys at this point of startup
        self.conv_budget = sp.conversation_budget_bytes(flags.conversation_cache_mib, flags.prompt_cache)
        self.conv_floor = flags.conversation_cache_min_free_mib * MIB
        n_pairs = self.n_layers * self.n_experts
        # RAM copies of the complement / kept lend copies are page-locked where the driver lets a 30+ GiB region
        # be locked; under WDDM we take them as pageable (stager path): the arena pin cap under WDDM multi-GPU
        # (STRATA_ARENA_PIN_GIB, §3.5) and §6's "effective streaming through the stager" on that box.
        ram_code = RAM_PAGEABLE if hw.wddm else RAM_PINNED
        self.home = np.full(n_pairs, FILE, dtype=np.int8)  # where a pair's bytes come from when not on the GPU
        self.ram_plan = None
        self.headroom = None
        if mode == "arena":
            order = np.arange(n_pairs)
            pinned_pairs = np.cumsum(self.pair_blob[order]) <= pinned
            self.home[:] = np.where(pinned_pairs, RAM_PINNED, RAM_PAGEABLE)
            self.resident_alloc = self.total_expert_bytes
            if self.total_expert_bytes > self.available_ram:
                self.notices.append(f"arena: {self.total_expert_bytes / GIB:.2f} GiB of experts exceed the "
                                    f"{self.available_ram / GIB:.2f} GiB of RAM available")
            mem.set("ram", "expert arena", self.total_expert_bytes)
            return
        if mode == "mmap":  # every pair the GPU lacks comes from the mapped files: no RAM copy, no headroom rule
            self.resident_alloc = 0
            mem.set("ram", "resident experts", 0)
            return
        headroom = sp.resident_headroom_bytes(mode, env.STRATA_RESIDENT_HEADROOM_GIB)
        if self.build.conversation_headroom:
            headroom = sp.conversation_expert_headroom(
                headroom, flags.conversation_cache_mib * MIB, flags.conversation_cache_slots, self.conv_floor,
                resident_experts=True, prompt_cache_entries=flags.prompt_cache)
        self.headroom = headroom
        cached_blobs = self.pair_blob[self.pair_of_slot]
        plan = sp.resident_ram_plan(self.total_expert_bytes, cached_blobs, self.lend_first_planned, self.available_ram,
                                    headroom, mode=mode,
                                    resident_budget_bytes=None if flags.resident_budget_gib is None
                                    else int(flags.resident_budget_gib * GIB))
        self.ram_plan = plan
        if plan.message:
            self.notices.append(plan.message)
        if plan.outcome == "startup-failure":
            raise InputError("strata startup", "resident RAM", f"{plan.complement_bytes / GIB:.2f} GiB", plan.message)
        not_cached = ~(self.slot_of >= 0)
        if plan.outcome == "resident":
            self.home[not_cached] = ram_code
            if plan.keep_from_slot is not None:
                self.home[self.pair_of_slot[plan.keep_from_slot:]] = ram_code
            self.resident_alloc = plan.complement_bytes + plan.kept_lend_bytes
        elif plan.outcome == "budget":
            budget = plan.budget_copy_bytes
            if self.build.live_memory and self.lend_first_planned is not None:
                # live memory: the loan's RAM coverage shares the resident budget, lend region first (the
                # loan log reports RAM coverage and file fallback, docs/LIVE_MEMORY.md)
                lend_pairs = self.pair_of_slot[self.lend_first_planned:][::-1]
                covered = np.cumsum(self.pair_blob[lend_pairs]) <= budget
                self.home[lend_pairs[covered]] = ram_code
                budget -= int(self.pair_blob[lend_pairs[covered]].sum())
            ranked_out = self.rank_pairs[self.slots:]  # the complement in rank order: hottest copied first
            copied = np.cumsum(self.pair_blob[ranked_out]) <= budget
            self.home[ranked_out[copied]] = ram_code
            self.resident_alloc = int(self.pair_blob[(self.home != FILE)].sum())
        else:  # mmap fallback: every non-resident blob comes from the mapped files
            self.resident_alloc = 0
        mem.set("ram", "resident experts", self.resident_alloc)
        if plan.outcome != "budget":
            self.notices.append(f"resident RAM: complement {plan.complement_bytes / GIB:.2f} GiB, budget "
                                f"{plan.ram_budget_bytes / GIB:.2f} GiB (available {self.available_ram / GIB:.2f} - "
                                f"headroom {headroom / GIB:.2f}), lend copies {plan.covered_lent_slots} of "
                                f"{plan.covered_lent_slots + plan.file_blob_reads_per_refill} slots")

    def _warm_page_cache(self) -> None:
        """The model files were read before the run (startup copies the complement from them; the runs read
        warm files): the page cache holds what fits of them, the end of the files most recent."""
        if self.scenario.workload.page_cache == "warm":
            self.m.page_cache.warm(np.arange(self.n_layers * self.n_experts))

    # ------------------------------------------------------------------------------------ helpers

    def _parked_bytes(self) -> int:
        return sum(e.bytes for e in self.parked)

    def _vram_used(self) -> int:
        return self.m.memory.used("vram")

    def _ram_used(self) -> int:
        return self.m.memory.used("ram")

    def _ring(self, chunk_tokens: int) -> int:
        return self.pricing.ring(chunk_tokens)

    def session_seconds(self, tokens: int, restore: bool = True) -> float:
        """Restore (host -> device) or capture (device -> host) of a session of `tokens` tokens: one running
        state + the K/V, copied tensor by tensor from pageable host memory, then one sync."""
        rate = self.h2d_pageable if restore else self.d2h_pageable
        return session_bytes(tokens) / rate + SESSION_COPIES * self.copy_lat_s + self.m.sync_s

    # ------------------------------------------------------------------------------------ prompt path

    def _lend(self, tokens: int):
        """lend(tokens): the loan for this part; in the live-memory build a lent expert without a RAM copy
        first takes a same-layer RAM-only expert's place (its GPU bytes copied device -> host)."""
        loan = sp.lend(self.lend_plan, self.cache.slot_bytes, tokens, self.loan_first, pricing=self.pricing)
        if loan.first_lent_slot is not None and loan.changed:
            first = loan.first_lent_slot
            lent_pairs = self.pair_of_slot[first:]
            if self.build.loan_donors:
                yield from self._donate(lent_pairs)
            self.on_gpu[lent_pairs] = False
            self.loan_first = first
        self.max_loan = max(self.max_loan, self.slots - self.loan_first if self.loan_first is not None else 0)
        return loan.want_tokens

    def _donate(self, lent_pairs: np.ndarray):
        """Live memory's donors ("Refreshing current loan coverage", docs/LIVE_MEMORY.md): for each lent pair whose
        bytes are only on the GPU, a same-layer pair that is not lent gives up its RAM slot, "GPU-backed duplicates
        ... preferred, followed by the coldest measured RAM occupant" (coldest by profile rank here); the lent
        pair's bytes go device -> host there."""
        uncovered = lent_pairs[self.home[lent_pairs] == FILE]
        if not len(uncovered):
            return
        lent_mask = np.zeros(len(self.home), np.bool_)
        lent_mask[lent_pairs] = True
        rank = np.empty(len(self.rank_pairs), np.int64)
        rank[self.rank_pairs] = np.arange(len(self.rank_pairs))
        moved = 0
        for layer in np.unique(uncovered // self.n_experts):
            want = uncovered[uncovered // self.n_experts == layer]
            lo, hi = layer * self.n_experts, (layer + 1) * self.n_experts
            pairs = np.arange(lo, hi)
            donors = pairs[(self.home[lo:hi] != FILE) & ~lent_mask[lo:hi]]
            # GPU-backed duplicates (their bytes stay in a GPU slot) first, then RAM-only pairs, coldest first
            donors = donors[np.lexsort((-rank[donors], ~self.on_gpu[donors]))]
            n = min(len(want), len(donors))
            self.home[want[:n]] = self.home[donors[:n]]
            self.home[donors[:n]] = FILE
            moved += int(self.pair_blob[want[:n]].sum())
            self.donor_copies += n
        if moved:
            yield self.m.d2h.copy(moved, int(self.donor_copies))

    def _split_groups(self, streamed: np.ndarray, codes: np.ndarray, group: int) -> list:
        """A layer's streamed pairs (ascending ids) as groups: (ids, last expert id, counts by source)."""
        if not len(streamed):
            return []
        starts = np.arange(0, len(streamed), group)
        c = codes[streamed]
        counts = [np.add.reduceat((c == code).astype(np.int64), starts) for code in (RAM_PINNED, RAM_PAGEABLE, FILE)]
        last = streamed[np.minimum(starts + group, len(streamed)) - 1] % self.n_experts
        return [(streamed[i: i + group], int(last[n]), int(counts[0][n]), int(counts[1][n]), int(counts[2][n]))
                for n, i in enumerate(starts)]

    def _prefill_chunk(self, request: int, step_no: int, rows: np.ndarray, ring: int):
        """One batched chunk through all layers (see the module docstring: stager, copy and compute)."""
        env = self.m.env
        T = len(rows)
        routed = self._pair_counts(rows) > 0
        stream_all = T >= self.build.stream_all_min_tokens
        streamed_mask = ~self.on_gpu if stream_all else (~self.on_gpu & routed)
        codes = np.where(self.on_gpu, GPU, self.home)
        group = max(1, min(STREAM_GROUP_BLOBS, ring, PINNED_STAGING_BUFFERS))
        ring_slots = simpy.Container(env, capacity=ring, init=ring)
        routed_bytes = (self.pair_blob * routed).reshape(self.n_layers, self.n_experts).sum(axis=1)
        attention_s = T * self.prefill_token_layer_s * ATTENTION_HALF_SHARE
        moe_half_s = (T * self.prefill_token_layer_s * (1 - ATTENTION_HALF_SHARE) + self.prefill_chunk_layer_s
                      + routed_bytes * self.weight_read_s_per_byte)
        lent = self.slots - self.loan_first if self.loan_first is not None else 0
        plans = []
        for layer in range(self.n_layers):
            lo = layer * self.n_experts
            ids = lo + np.flatnonzero(streamed_mask[lo: lo + self.n_experts])
            plans.append(self._split_groups(ids, codes, group))
        compute = _ChunkCompute(self, plans, attention_s, moe_half_s, ring_slots, request, step_no, T, routed, lent)
        env.process(self._stream(plans, ring_slots, compute))
        compute.advance()  # the layers before the first streamed group need nothing to arrive
        yield compute.finished

    def _record_prefill_layer(self, chunk: _ChunkCompute, layer: int, end_s: float) -> None:
        groups = chunk.plans[layer]
        blob = int(self.layer_blob[layer])
        n = sum(len(gr[0]) for gr in groups)
        n_file = sum(gr[4] for gr in groups)
        lo, hi = layer * self.n_experts, (layer + 1) * self.n_experts
        lookups = int(chunk.routed[lo:hi].sum())
        hits = int((chunk.routed & self.on_gpu)[lo:hi].sum())
        sid = self.rec.step(request=chunk.request, phase="prefill", step=chunk.step_no, layer=layer,
                            start_s=chunk.layer_start, end_s=end_s, tokens=chunk.tokens, lookups=lookups, hits=hits,
                            direct_loads=n, h2d_bytes=n * blob, file_read_bytes=n_file * blob, lent_slots=chunk.lent,
                            vram_used_bytes=self._vram_used(), ram_used_bytes=self._ram_used())
        for code, count in ((RAM_PINNED, sum(gr[2] for gr in groups)), (RAM_PAGEABLE, sum(gr[3] for gr in groups)),
                            (FILE, n_file)):
            self.rec.copy(sid, "H2D", count, blob, SOURCE_NAMES[code], "ring")

    def _stream(self, plans: list, ring_slots: simpy.Container, compute: "_ChunkCompute"):
        """The stager threads and the copy stream, group by group in order. A group is the pinned ring's worth of
        blobs. The stagers copy its pageable and file blobs into the pinned buffers (file blobs the page cache
        misses are page-faulted from the drive first, the threads' reads in flight together); once the ring has
        room the copy stream DMAs the group. The copy is booked on the copy engine without waiting for it, and
        hands its buffers back blob by blob as it runs: the stagers fill them with the next group meanwhile, and
        can finish that group no earlier than this copy ends (its last buffer). The copy's end is the group's
        arrival."""
        m = self.m
        previous = None  # the copy of the group before: its buffers free up as it runs
        for layer, groups in enumerate(plans):
            blob = int(self.layer_blob[layer])
            for g, (ids, _, n_pin, n_pag, n_file) in enumerate(groups):
                n_stage = n_pag + n_file
                if n_stage:
                    buffers = self.pinned.get(n_stage)
                    if not buffers.triggered:
                        yield buffers
                    if n_file:
                        file_ids = ids[self.home[ids] == FILE] if n_file < len(ids) else ids
                        missed = int((~m.page_cache.access(file_ids)).sum())
                        if missed:  # page faults of the stager threads, read-ahead sized
                            yield m.ssd.read(missed * blob, missed * m.ssd.fault_reads(blob),
                                             min(self.stager_threads, missed))
                    yield from m.memcpy(self.stager, n_stage * blob, self.stager_threads, "stager memcpy")
                    if previous is not None and not previous.processed:
                        yield previous  # the group's last buffer is free only once the copy before it is done
                room = ring_slots.get(len(ids))
                if not room.triggered:  # wait only when the ring is full (a triggered get needs no resume)
                    yield room
                # the group's copies are queued back to back on the copy stream: one fixed cost per group
                n_bytes = len(ids) * blob
                done = m.h2d.hold(m.h2d.cost_s(n_bytes, 1), n_bytes, len(ids), "prompt stream")
                if n_stage:  # the buffers pass to the copy, which frees them blob by blob for the next group
                    self.pinned.put(n_stage)
                done.callbacks.append(compute.arrived)
                previous = done

    def _checkpoint(self, request: int, step_no: int):
        """An in-session checkpoint: the running state copied device -> host; the compute stream waits."""
        m = self.m
        yield m.gpu.drained()
        start = m.env.now
        yield m.d2h.hold(RUNNING_STATE_BYTES / self.d2h_pageable + m.sync_s, RUNNING_STATE_BYTES, 1, "checkpoint")
        self.checkpoints += 1
        sid = self.rec.step(request=request, phase="prefill", step=step_no, layer=-1, start_s=start, end_s=m.env.now,
                            d2h_bytes=RUNNING_STATE_BYTES, vram_used_bytes=self._vram_used(),
                            ram_used_bytes=self._ram_used())
        self.rec.copy(sid, "D2H", 1, RUNNING_STATE_BYTES, "running-state", "checkpoint")

    def _refill(self, request: int, step_no: int):
        """Copy every lent slot back from its source on the main thread (one sync for the batch): pinned RAM is
        DMA'd, pageable RAM goes through the driver's pageable copy, and a lent expert with no RAM copy is read
        from the mapped files (a file-blob read: a page-cache hit, or page faults to the drive)."""
        if self.loan_first is None:
            return 0.0
        m = self.m
        yield m.gpu.drained()
        start = m.env.now
        pairs = self.pair_of_slot[self.loan_first:]
        homes = self.home[pairs]
        blobs = self.pair_blob[pairs]
        b = {code: int(blobs[homes == code].sum()) for code in (RAM_PINNED, RAM_PAGEABLE, FILE)}
        file_pairs = pairs[homes == FILE]
        n_file = len(file_pairs)
        if n_file:
            missed = ~m.page_cache.access(file_pairs)
            drive = int(self.pair_blob[file_pairs[missed]].sum())
            if drive:  # the refill thread's page faults, one after another
                yield m.ssd.read(drive, m.ssd.fault_reads(drive), 1)
        pageable = b[RAM_PAGEABLE] + b[FILE]
        seconds = (len(pairs) * self.copy_lat_s + b[RAM_PINNED] / self.h2d_pinned + pageable / self.h2d_pageable)
        yield m.h2d.hold(seconds, int(blobs.sum()), len(pairs), "refill")
        yield self.main.hold(m.sync_s + m.memcpy_call_s, 0, 1, "refill sync")
        self.on_gpu[pairs] = True
        self.loan_first = None
        sid = self.rec.step(request=request, phase="prefill", step=step_no, layer=-1, start_s=start, end_s=m.env.now,
                            tokens=0, lookups=len(pairs), inserts=len(pairs), h2d_bytes=int(blobs.sum()),
                            file_read_bytes=b[FILE], file_blob_reads=n_file, lent_slots=len(pairs),
                            vram_used_bytes=self._vram_used(), ram_used_bytes=self._ram_used())
        for code in (RAM_PINNED, RAM_PAGEABLE, FILE):
            sel = homes == code
            sizes, counts = np.unique(blobs[sel], return_counts=True)
            for size, count in zip(sizes, counts):
                self.rec.copy(sid, "H2D", int(count), int(size), SOURCE_NAMES[code], "cache-slot")
        return m.env.now - start

    def _short_read(self, request: int, step_no: int, rows: np.ndarray):
        """A short part through the decode verify windows (every lent slot is back by now)."""
        counts = self._pair_counts(rows)
        routed = counts > 0
        start = self.m.env.now
        per_token_s = self.domain.use("strata-short-read", "a short part's decode-window time per token").value * 1e-3
        yield self.m.gpu.hold(len(rows) * per_token_s, 0, 0, "short read (verify windows)")
        self.rec.step(request=request, phase="prefill", step=step_no, layer=-1, start_s=start, end_s=self.m.env.now,
                      tokens=len(rows), lookups=int(routed.sum()), hits=int((routed & self.on_gpu).sum()),
                      vram_used_bytes=self._vram_used(), ram_used_bytes=self._ram_used())

    # ------------------------------------------------------------------------------------ decode

    def _decode_setup(self, scenario, hw, layout, machine, domain) -> None:
        """The figures a verify window is built from (see _decode_window)."""
        weights = sp.pack_weights(layout.name)
        self.head_bytes = weights.head_bytes
        self.dense_layer_bytes = (weights.dense_bytes - weights.head_bytes) / self.n_layers
        self.layer_latency_s = domain.use("strata-decode-layer-latency",
                                          "Strata's GPU time per decode layer beyond its weights").value * 1e-6
        host = hw.host
        # the pool: a worker per physical core but the host's, and the host thread joining each drain
        self.pool_threads = int(host.physical_cores.value)
        self.pool_bytes_per_s = min(self.pool_threads * host.expert_kernel_gbps.value,
                                    host.dram_bandwidth_gbps.value) * 1e9
        self.pool = machine.threads(f"strata expert pool ({self.pool_threads} threads)")
        canonical_q2_0 = all((x.gate_type, x.up_type, x.down_type) == ("Q2_0",) * 3 for x in layout.layers)
        self.pcie_frac = sp.pcie_frac(self.h2d_pinned / 1e9, canonical_q2_0) if self.flags.pcie_frac is None \
            else self.flags.pcie_frac
        self.qsa_layer = (np.arange(self.n_layers) + 1) % sp.QSA_EVERY == 0
        drafts = scenario.engine.drafts
        widest = min(self.flags.spec + 2, sp.MAX_VERIFY_TOKENS) if self.flags.spec else 1
        self.window_tokens = min(drafts.window_tokens, widest)
        self.tokens_per_window = min(drafts.tokens_per_window, self.window_tokens)
        # one draft step: the draft layer's dense weights and its top-k Q2_0 experts (all in VRAM), one layer's latency
        self.draft_step_s = ((MTP_DRAFT_DENSE_BYTES + self.top_k * sp.Q2_0_BLOB_BYTES) * self.weight_read_s_per_byte
                             + self.layer_latency_s)

    def _decode_window(self, request: int, step_no: int, rows: np.ndarray, emitted: int, context_tokens: int):
        """One verify window of len(rows) tokens emitting `emitted` of them, layer by layer: the GPU's dense chain
        (the layer's weights at 80 % of the DRAM rate + its fixed latency; on QSA layers the indexer's scan of every
        cell's pooled key and the K/V blocks streamed from host RAM), then the layer's distinct routed experts: VRAM
        hits and the PCIe share on the GPU while the CPU pool computes the other misses; the next layer waits for
        both. Then the head, the draft steps and the commit. Booked without events: each layer's work waits only
        on the layer before it, so the chain's end is known when it is issued."""
        m = self.m
        E = self.n_experts
        pairs = (rows.astype(np.int64) + self.layer_offsets)[rows != MISSING]
        routed = np.unique(pairs)
        layer_of = routed // E
        hit = self.on_gpu[routed]
        L = self.n_layers
        n_hit = np.bincount(layer_of[hit], minlength=L)
        miss = routed[~hit]
        miss_layer = layer_of[~hit]
        n_miss = np.bincount(miss_layer, minlength=L)
        n_pinned_miss = np.bincount(miss_layer[self.home[miss] == RAM_PINNED], minlength=L)
        n_pcie = sp.pcie_share(n_miss, n_pinned_miss, self.pcie_frac)
        blob = self.layer_blob.astype(np.float64)
        cpu_bytes = (n_miss - n_pcie) * blob
        start = m.env.now
        # the pool's misses whose blob is in no RAM tier are read from the mapped files first (page faults)
        file_miss = miss[self.home[miss] == FILE]
        if len(file_miss):
            missed = file_miss[~m.page_cache.access(file_miss)]
            drive = int(self.pair_blob[missed].sum())
            if drive:
                yield m.ssd.read(drive, m.ssd.fault_reads(drive), min(self.pool_threads, len(missed)))
        T = len(rows)
        pre = np.full(L, self.layer_latency_s + self.dense_layer_bytes * self.weight_read_s_per_byte)
        pre[self.qsa_layer] += T * context_tokens * QSA_POOLED_KEY_BYTES_PER_CELL * self.weight_read_s_per_byte
        if self.kv_cells is not None and context_tokens > self.kv_cells:  # selected blocks outside the VRAM window
            outside = QSA_ATTENDED_CELLS * (context_tokens - self.kv_cells) / context_tokens
            pre[self.qsa_layer] += outside * sp.KV_BYTES_PER_CELL_LAYER[self.flags.kv] / self.h2d_pinned
        gpu_exp = (n_hit + n_pcie) * blob * self.weight_read_s_per_byte + n_pcie * blob / self.h2d_pinned
        cpu = cpu_bytes / self.pool_bytes_per_s
        ready = m.env.now
        for layer in range(L):
            ready = m.gpu.book(pre[layer], self.dense_layer_bytes, 1, "decode dense chain", ready)
            gpu_end = m.gpu.book(gpu_exp[layer], (n_hit[layer] + n_pcie[layer]) * blob[layer], 1,
                                 "decode experts (VRAM hits, PCIe share)", ready)
            if cpu[layer] > 0:
                gpu_end = max(gpu_end, self.pool.book(cpu[layer], cpu_bytes[layer], 1, "decode misses (CPU pool)",
                                                      ready))
            ready = gpu_end
        extras = (self.head_bytes * self.weight_read_s_per_byte + (T - 1) * self.draft_step_s + DECODE_COMMIT_S)
        end = m.gpu.book(extras, self.head_bytes, 1, "head, draft, commit", ready)
        yield m.env.timeout(end - m.env.now)
        np.add.at(self.usage, pairs, 1.0)
        self.rounds += 1
        inserts = d2h = h2d = file_reads = 0
        if self.flags.adapt_every and self.rounds % self.flags.adapt_every == 0 and self.flags.adapt_swaps:
            inserts, h2d, d2h, file_reads = self._adapt()
        pair_hits = self.on_gpu[pairs]
        self.rec.step(request=request, phase="decode", step=step_no, layer=-1, start_s=start, end_s=m.env.now,
                      tokens=emitted, lookups=len(pairs), hits=int(pair_hits.sum()), inserts=inserts,
                      evictions=inserts, h2d_bytes=int((n_pcie * blob).sum()) + h2d, d2h_bytes=d2h,
                      file_read_bytes=int(self.pair_blob[file_miss].sum()), file_blob_reads=len(file_miss) + file_reads,
                      vram_used_bytes=self._vram_used(), ram_used_bytes=self._ram_used())

    def _decode(self, request: int, rows: np.ndarray, context_tokens: int):
        """The decode loop: windows of window_tokens routed tokens (the next rows of the trace) that emit
        tokens_per_window of them on average, until every output token is out."""
        n = len(rows)
        if not n:
            return
        count = int(np.ceil(n / self.tokens_per_window)) + 1
        widths, emits = sp.spread(self.window_tokens, count), sp.spread(self.tokens_per_window, count)
        done = step = 0
        while done < n:
            width = max(1, int(widths[step % count]))
            emit = max(1, min(int(emits[step % count]), width, n - done))
            yield from self._decode_window(request, step, rows[done: done + width], emit, context_tokens + done)
            done += emit
            step += 1

    def _adapt(self) -> tuple[int, int, int, int]:
        """Adaptive tier: per layer pair the hottest non-resident pairs (usage >= 2) with the coldest resident
        ones while candidate >= victim + 1.5; best gains first, at most adapt-swaps. The incoming blob is copied
        into the victim's slot on a side stream (the decode does not wait). RAM copies follow
        exchange_cache_complement (src/core/expert_source.cpp, indexed copy 70874746903) and resident_stage_swaps
        (generate.cpp @ 0083bb7a, which skips the exchange when the victim's lend-region copy is in RAM already or
        the incoming pair has none): only when the incoming pair has a RAM copy and the victim has none do the
        victim's bytes go device -> host into the incoming pair's RAM place (homes exchanged); otherwise each keeps
        what it had, so an incoming pair from the file tier lands in the victim's slot without a RAM copy and a
        covered victim keeps its lend copy ("Adaptive swaps left later borrowers outside RAM", LIVE_MEMORY.md)."""
        E = self.n_experts
        usage = self.usage.reshape(self.n_layers, E)
        on_gpu = self.on_gpu.reshape(self.n_layers, E)
        gains, cands, victims = [], [], []
        for layer in range(self.n_layers):
            u = usage[layer]
            free_pair = self.slot_of[layer * E: (layer + 1) * E] < 0
            cand = np.flatnonzero(~on_gpu[layer] & (u >= ADAPT_MIN_USAGE) & free_pair)
            res = np.flatnonzero(on_gpu[layer])
            if not len(cand) or not len(res):
                continue
            cand = cand[np.argsort(-u[cand], kind="stable")]
            res = res[np.argsort(u[res], kind="stable")]
            n = min(len(cand), len(res))
            gain = u[cand[:n]] - u[res[:n]]
            ok = gain >= ADAPT_MARGIN
            gains.append(gain[ok])
            cands.append(cand[:n][ok] + layer * E)
            victims.append(res[:n][ok] + layer * E)
        self.usage *= ADAPT_DECAY
        if not gains:
            return 0, 0, 0, 0
        gain, cand, victim = np.concatenate(gains), np.concatenate(cands), np.concatenate(victims)
        keep = np.argsort(-gain, kind="stable")[: self.flags.adapt_swaps]
        cand, victim = cand[keep], victim[keep]
        if not len(cand):
            return 0, 0, 0, 0
        slots = self.slot_of[victim]
        homes_in = self.home[cand].copy()
        blobs = self.pair_blob[cand]
        self.slot_of[cand], self.slot_of[victim] = slots, -1
        self.pair_of_slot[slots] = cand
        self.on_gpu[cand], self.on_gpu[victim] = True, False
        # the arena holds every pair, so no victim lacks a RAM copy there and nothing is exchanged
        exchange = (homes_in != FILE) & (self.home[victim] == FILE)
        self.home[victim[exchange]] = homes_in[exchange]
        self.home[cand[exchange]] = FILE
        h2d = int(blobs.sum())
        pinned = int(blobs[homes_in == RAM_PINNED].sum())
        seconds = len(cand) * self.copy_lat_s + pinned / self.h2d_pinned + (h2d - pinned) / self.h2d_pageable
        self.m.h2d.book(seconds, h2d, len(cand), "adaptive swap")  # a side stream: nobody waits for it
        d2h = 0
        if exchange.any():
            d2h = int(self.pair_blob[victim[exchange]].sum())
            self.m.d2h.book(int(exchange.sum()) * self.copy_lat_s + d2h / self.d2h_pageable, d2h, int(exchange.sum()),
                            "adaptive swap")
        self.swaps += len(cand)
        return len(cand), h2d, d2h, int((homes_in == FILE).sum())

    # ------------------------------------------------------------------------------------ sessions

    def _park_live(self, request: int, held: int):
        """Park the outgoing live session: make_room, the physical-RAM floor, capture (device -> host)."""
        live = self.live
        self.live = None
        if live is None or live["tokens"] <= 0:
            return
        entry = sp.ParkedConversation(live["conv"], session_bytes(live["tokens"]), live["tokens"])
        free_ram = self.m.memory.ram_available() - held
        result = sp.park_conversation(self.parked, entry, slots=self.flags.conversation_cache_slots,
                                      budget_bytes=self.conv_budget, held_bytes=held,
                                      available_ram_bytes=free_ram, min_free_bytes=self.conv_floor)
        self.conv_stats["evictions"] += len(result.evicted)
        if not result.parked:
            self.parked = result.entries
            self.m.memory.set("ram", "parked conversations", self._parked_bytes())
            if result.reason != "conversation cache disabled":
                self.conv_stats["park_skips"].append({"request": request, "conversation": live["conv"],
                                                      "reason": result.reason})
            return
        m = self.m
        yield m.gpu.drained()
        start = m.env.now
        yield m.d2h.hold(self.session_seconds(live["tokens"], restore=False), entry.bytes, SESSION_COPIES, "park")
        self.parked = result.entries
        m.memory.set("ram", "parked conversations", self._parked_bytes())
        self.conv_stats["parks"] += 1
        sid = self.rec.step(request=request, phase="prefill", step=-2, layer=-1, start_s=start, end_s=m.env.now,
                            tokens=0, d2h_bytes=entry.bytes, vram_used_bytes=self._vram_used(),
                            ram_used_bytes=self._ram_used())
        self.rec.copy(sid, "D2H", 1, entry.bytes, "session", "parked")

    def _restore(self, request: int, entry: sp.ParkedConversation, tokens: int):
        m = self.m
        yield m.gpu.drained()
        start = m.env.now
        nbytes = session_bytes(tokens)
        yield m.h2d.hold(self.session_seconds(tokens, restore=True), nbytes, SESSION_COPIES, "restore")
        self.conv_stats["restores"].append({"request": request, "conversation": entry.name, "tokens": tokens,
                                            "ms": (m.env.now - start) * 1e3})
        sid = self.rec.step(request=request, phase="prefill", step=-1, layer=-1, start_s=start, end_s=m.env.now,
                            tokens=0, h2d_bytes=nbytes, vram_used_bytes=self._vram_used(),
                            ram_used_bytes=self._ram_used())
        self.rec.copy(sid, "H2D", 1, nbytes, "parked", "session")

    def _begin(self, request: int, conv: str, n: int):
        """Pick the resume point (live session or a parked entry of this conversation), park the outgoing
        session if needed, restore the incoming one. Returns the resumed tokens."""
        resume = 0
        if self.live is not None and self.live["conv"] == conv:
            resume = min(self.live["tokens"], n - 1)
        incoming = None
        for entry in reversed(self.parked):  # newest first
            if entry.name == conv and min(entry.tokens, n - 1) > resume:
                incoming, resume = entry, min(entry.tokens, n - 1)
                break
        if incoming is not None:
            self.parked = tuple(e for e in self.parked if e is not incoming)
            self.m.memory.set("ram", "parked conversations", self._parked_bytes())
        if self.live is not None and (self.live["conv"] != conv or incoming is not None):
            yield from self._park_live(request, incoming.bytes if incoming is not None else 0)
        if incoming is not None:
            yield from self._restore(request, incoming, resume)
        return resume

    # ------------------------------------------------------------------------------------ serve

    def serve(self, env: simpy.Environment, timings: list):
        short = self.flags.short_read
        every = self.flags.prompt_cache_every
        for request, (spec, routing) in enumerate(zip(self.scenario.workload.requests, self.routing.requests)):
            if spec.think_time_s:
                yield env.timeout(spec.think_time_s)
            arrival = env.now
            prompt = routing.prompt
            n = len(prompt)
            conv = spec.conversation if spec.conversation is not None else f"#request-{request}"
            resume = yield from self._begin(request, conv, n)
            turn_at = self.context.get(conv, 0)
            cuts = sorted({resume, n - 1, n} | ({turn_at} if resume < turn_at < n - 1 else set()))
            step_no, pp_s, refill_s, fresh_done = 0, 0.0, 0.0, 0
            log = {"request": request, "conversation": conv, "resumed_tokens": resume, "loan_slots": 0}
            for lo, hi in zip(cuts, cuts[1:]):
                rows = prompt[lo:hi]
                if lo == turn_at and turn_at > 0 and self.flags.prompt_cache:
                    yield from self._checkpoint(request, step_no)
                    step_no += 1
                if len(rows) > short:
                    chunk = self.chunk if self.owned else (yield from self._lend(len(rows)))
                    if not self.owned:
                        log["loan_slots"] = max(log["loan_slots"], self.slots - self.loan_first)
                    ring = self._ring(chunk)  # the buffers are carved (relaid out) for `chunk` tokens
                    part_start = env.now
                    for first in range(0, len(rows), chunk):
                        block = rows[first: first + chunk]
                        yield from self._prefill_chunk(request, step_no, block, ring)
                        step_no += 1
                        before = fresh_done
                        fresh_done += len(block)
                        if self.flags.prompt_cache and fresh_done // every > before // every:
                            yield from self._checkpoint(request, step_no)
                            step_no += 1
                    yield self.m.gpu.drained()
                    pp_s += env.now - part_start
                else:
                    if self.loan_first is not None:
                        refill_s += yield from self._refill(request, step_no)
                        step_no += 1
                    yield from self._short_read(request, step_no, rows)
                    step_no += 1
                    fresh_done += len(rows)
            if self.loan_first is not None:
                refill_s += yield from self._refill(request, step_no)
            yield self.m.gpu.drained()
            prefill_end = env.now
            yield from self._decode(request, routing.decode, n)
            self.live = {"conv": conv, "tokens": n + len(routing.decode)}
            self.context[conv] = n + len(routing.decode)
            log.update(pp_ms=pp_s * 1e3, refill_ms=refill_s * 1e3, prefill_ms=(prefill_end - arrival) * 1e3)
            self.request_log.append(log)
            # the window of the last prompt token samples the first output token
            timings.append({"request": request, "arrival_s": arrival, "prefill_end_s": prefill_end,
                            "first_token_s": prefill_end, "end_s": env.now, "prompt_tokens": n,
                            "decode_tokens": len(routing.decode)})

    # ------------------------------------------------------------------------------------ state

    def bounds(self, request: int) -> dict:
        """Strata's cache is static (profile fill + adaptive swaps): no replacement bound is reported."""
        return {"belady_decode_hit_rate": None}

    def state(self) -> dict:
        plan, ram = self.lend_plan, self.ram_plan
        pc = self.m.page_cache
        return {
            "cache_slots": int(self.slots),
            "cache_mib": self.cache.bytes / MIB,
            "lent_slots": int(self.max_loan),
            "prefill_buffer_mib": self.buffer_bytes / MIB,
            "notices": list(self.notices),
            "variant": self.build.name, "variant_source": self.build.source,
            "owned": bool(self.owned),
            "chunk": int(self.chunk),
            "ring_slots": int(self._ring(self.chunk)),
            "independent_chunk": int(self.independent_chunk),
            "plan_lend": {"chunk": plan.chunk_tokens, "lent_slots": plan.lent_slots, "lend_mib": plan.lend_bytes / MIB,
                          "first_lent_slot": plan.first_lent_slot, "owned": plan.owned,
                          "buffer_mib": plan.buffer_bytes / MIB},
            "pinned_share": self.pinned_share,
            "ram_mode": self.flags.ram_mode,
            "vram_before_cache_mib": sum(n for _, n in self.vram_before) / MIB,
            "vram_before_cache": {name: n / MIB for name, n in self.vram_before},
            "draft_head_bind_mib": self.draft_head_bind / MIB,
            "vram_free_at_sizing_mib": self.free_at_sizing / MIB,
            "vram_reserve_mib": self.vram_reserve / MIB,  # the reserve the cache was sized with (#496 may lower it)
            "vram_record": self.vram_record,
            "kv_resident_cells": self.kv_cells,
            "ram_plan": None if ram is None else {
                "outcome": ram.outcome, "complement_gib": ram.complement_bytes / GIB,
                "budget_gib": ram.ram_budget_bytes / GIB, "kept_lend_gib": ram.kept_lend_bytes / GIB,
                "covered_lent_slots": ram.covered_lent_slots, "keep_from_slot": ram.keep_from_slot,
                "headroom_gib": self.headroom / GIB, "available_gib": self.available_ram / GIB,
                "resident_alloc_gib": self.resident_alloc / GIB},
            "file_blob_reads_per_refill": int(((self.home[self.pair_of_slot[self.lend_first_planned:]] == FILE).sum())
                                              if self.lend_first_planned is not None else 0),
            "live_memory_donor_copies": int(self.donor_copies),
            "stager_threads": self.stager_threads,
            "page_cache": {"capacity_gib": pc.capacity_bytes / GIB, "used_gib": pc.used_bytes / GIB,
                           "hits": pc.hits, "misses": pc.misses},
            "adaptive_swaps": int(self.swaps),
            "conversation_cache": {
                "budget_mib": self.conv_budget / MIB, "parks": self.conv_stats["parks"],
                "evictions": self.conv_stats["evictions"], "park_skips": list(self.conv_stats["park_skips"]),
                "restores": list(self.conv_stats["restores"]),
                "parked": [{"conversation": e.name, "tokens": e.tokens, "mib": e.bytes / MIB} for e in self.parked],
                f"restore_ms_{RESTORE_CHECK_TOKENS}_tokens": self.session_seconds(RESTORE_CHECK_TOKENS) * 1e3,
            },
            "requests": list(self.request_log),
            "memory": self.m.memory.allocations(),
        }
