"""Strata v0.1.35 (Niko1221/Strata d9ab8435) and the #658 fork (spideytznn/Strata) as a SimPy process.

Covers: the profile-filled sized-slot expert cache (never evicts; adaptive decode tier), prompt buffers
borrowed from the cold tail of the cache (lend, stream, refill) or owned (#658's independent buffers),
the RAM tiers (arena, resident complement with lend-region coverage, budget mode, mmap fallback), file-blob
reads, in-session checkpoints and the conversation cache (park, make_room, restore).

Scenario: one engine process serves a scenario's requests in order (reference/strata-engine.md §3, §6).

Startup (strata_plan.py holds every rule; docs/planning.md):
  1. rank the (layer, expert) pairs: --expert-profile "@trace" ranks them by the workload's own routing
     counts (ties in the interleaved stand-in order);
  2. size the cache: --expert-cache N is a byte budget of N x max_blob walked in rank order with sized slots,
     auto is the uniform count from free VRAM and then the same walk; post-write shrink;
  3. fill it in rank order (slot i holds pair i: the tail slots are the coldest);
  4. plan_lend picks the chunk and the lend region (pinned share measured before the RAM complement:
     0 in the resident modes, so ring 96 and LendPct 85);
  5. fork-658 with STRATA_PREFILL_OWN_AUTO != "0": after the fill, independent_prefill_chunk prices owned
     buffers against the free VRAM left; chosen -> nothing is lent and no lend copies are kept in RAM;
  6. the RAM side: the complement of the GPU cache must fit available - headroom (fork: the headroom also
     covers the conversation budget + floor + 256 MiB), then the lend region is covered from the tail.

Per request:
  resume   the live session if the request continues it, else the newest parked entry of its conversation
           (restore: K/V of the resumed tokens + the running state, host -> device); the outgoing live
           session is parked first (make_room, physical-RAM floor; capture = device -> host);
  parts    the fresh tokens split at turn_at (where this turn starts) and at n - 1; a part of <= short-read
           tokens runs through the decode windows (any loan is refilled first), a longer one is batched;
  batched  lend(min(chunk, roundup256(n))), then chunks. Per chunk and layer every non-resident expert
           (from STREAM_ALL_MIN tokens on; below it the routed non-resident ones) is streamed through the
           ring on the copy stream while the compute stream works: two busy-until links booked per layer.
           The copy stream may run one ring ahead of the compute stream (see _prefill_chunk);
  refill   after the last batched part every lent slot is copied back from its source (one sync for the
           batch); a lent expert without a RAM copy is a file-blob read;
  decode   one step per token at the profile's decode figure, which is an ALL-IN measured rate (MTP verify
           windows and the CPU/PCIe handling of misses included): misses are counted and their PCIe share's
           bytes recorded, never added to the time. Every adapt-every rounds the adaptive tier swaps hot
           non-resident pairs in (side stream, H2D; D2H of the evicted one in the resident modes).

Where the prompt time ends: prefill_end is after the refill and the window of the last prompt token, i.e.
when the first output token exists. The engine splits every prompt at n - 1 and refills any loan before
that last token's decode window (§3.3 steps 3-4), so the prompt is not read until the refill is done; the
fork also counts the refill's file-blob reads "during each long prefill". state()["requests"] gives, per
request, the batched-chunk ("PP") time and the refill time separately, for a reading that stops earlier.

Events are coarse: one SimPy timeout per prompt chunk (48 layers booked analytically), per refill, per
short part, per park/restore and per decode token.
"""

from __future__ import annotations

import numpy as np
import simpy

from sim.cache.kernels import key_counts
from sim.engine import strata_plan as sp
from sim.engine.timeline import Link, Recorder
from sim.engine.workload import WorkloadRouting
from sim.errors import InputError

# fmt: off
MIB = 1 << 20
GIB = 1 << 30
MISSING = 0xFFFF                          # a missing routing cell (trace format)

# -- box and model calibration (docs/planning.md "Strata validation", calibrated assumptions) -------------
# VRAM held before the expert cache is sized (weights, INT8 KV at 262,144 tokens, FP8 PLE, MTP bind, CUDA
# context): 32 GiB - 21,502 MiB. docs/planning.md calibrates free VRAM at sizing = 21,502 MiB on the fork's
# 5090 from the auto cache's 10,222 slots (any value in [21,500.65, 21,503.19) MiB gives 10,222).
NON_EXPERT_VRAM_BYTES = 32 * 1024 * MIB - 21_502 * MIB
# Host RAM the engine cannot use for experts (Windows, other processes, the engine's other host memory):
# 48 GiB - (33.78 GiB resident allocation of the fork's borrowing run + 4.75 GiB headroom) = 9.47 GiB
# (docs/planning.md; the free parameter of the file-blob-read figure, not fitted to 1,799).
OTHER_HOST_RAM_BYTES = 48 * GIB - round((33.78 + 4.75) * GIB)
DEFAULT_MAX_CONTEXT_TOKENS = 262_144      # the #658 runs' context limit (seed); scenarios have no ctx key yet

# -- prompt path --------------------------------------------------------------------------------------
# Effective rate of the prompt path's copy stream for blobs in pageable host memory (stager memcpy into
# pinned buffers + DMA): the hardware profile's pcie.stager_stream_gbps where the box has one (the #658
# box: 16 GB/s from strata-engine.md §6, which gives no derivation and may come from the #658 runs, so the
# owned arm is not an independent check of it); else min(h2d_pinned, stager threads x memcpy).
HOST_HW_THREADS = 16                      # [E] the #658 box's CPU is not reported; >= 16 threads -> 4 stagers
STAGER_THREADS_MIN, STAGER_THREADS_MAX = 2, 4   # max(2, min(4, hw / 4)), STRATA_STAGER_THREADS (§3.2)
SHORT_READ_S_PER_TOKEN = 0.016            # decode-window reading of a short part, "about 16 ms/token" (§3.3)

# -- decode ------------------------------------------------------------------------------------------
PCIE_FRAC_NATIVE = 0.55                   # share of decode misses the GPU reads over PCIe, native packs (§3.1)
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


class StrataEngine:
    """One Strata process serving a scenario's requests in order (see the module docstring)."""

    def __init__(self, scenario, routing: WorkloadRouting, recorder: Recorder):
        self.scenario, self.routing, self.rec = scenario, routing, recorder
        hw, layout, engine = scenario.hardware_profile, scenario.layout, scenario.engine
        self.hw, self.flags, self.env_vars, self.variant = hw, engine.flags, engine.env, engine.variant
        self.compute = scenario.compute
        self.notices: list[str] = []
        self.L, self.E, self.k = layout.n_routed_layers, layout.n_experts, layout.top_k
        self.layer_blob = np.asarray(layout.expert_bytes_per_layer()[: self.L], dtype=np.int64)
        self.max_blob = int(self.layer_blob.max())
        self.total_expert_bytes = int(self.layer_blob.sum()) * self.E
        self.pair_blob = np.repeat(self.layer_blob, self.E)  # pair = layer * E + expert
        self.offsets = (np.arange(self.L, dtype=np.int32) * self.E)[None, :, None]
        self.max_context = DEFAULT_MAX_CONTEXT_TOKENS

        lat = hw.latency
        self.copy_lat_s = hw.pcie.copy_fixed_latency_us.value * 1e-6
        self.sync_s = lat.device_sync_us.value * 1e-6
        self.memcpy_call_s = lat.memcpy_call_us.value * 1e-6
        self.h2d_pinned = hw.pcie.h2d_pinned_gbps.value * 1e9
        self.h2d_pageable = hw.pcie.h2d_pageable_gbps.value * 1e9
        self.d2h_pageable = hw.pcie.d2h_pageable_gbps.value * 1e9
        threads = _env_int("STRATA_STAGER_THREADS", self.env_vars.STRATA_STAGER_THREADS, 1)
        self.stager_threads = threads if threads is not None else \
            max(STAGER_THREADS_MIN, min(STAGER_THREADS_MAX, HOST_HW_THREADS // 4))
        stager_memcpy = self.stager_threads * hw.host.memcpy_gbps.value * 1e9
        measured = hw.pcie.stager_stream_gbps
        self.stream_pageable = min(measured.value * 1e9 if measured is not None else self.h2d_pinned, stager_memcpy)
        self.ssd_stager = hw.ssd_read_gbps(self.stager_threads) * 1e9  # page faults of the stager threads
        self.ssd_qd1 = hw.ssd_read_gbps(1) * 1e9
        self.links = {
            "h2d": Link("PCIe H2D (copy stream)", self.h2d_pinned, self.copy_lat_s),
            "d2h": Link("PCIe D2H", hw.pcie.d2h_pinned_gbps.value * 1e9, self.copy_lat_s),
            "compute": Link("GPU compute", 0.0),
        }
        self._startup()
        # conversation state
        self.live: dict | None = None  # {"conv", "tokens"}
        self.parked: tuple[sp.ParkedConversation, ...] = ()
        self.context: dict[str, int] = {}  # a conversation's tokens so far (prompt + output of its last turn)
        self.conv_stats = {"parks": 0, "park_skips": [], "evictions": 0, "restores": []}
        self.request_log: list[dict] = []
        self.usage = np.zeros(self.L * self.E, dtype=np.float64)
        self.rounds = 0
        self.swaps = 0
        self.max_loan = 0

    # ------------------------------------------------------------------------------------ startup

    def _pair_counts(self, rows: np.ndarray) -> np.ndarray:
        """Routed (token, k) cells per pair of a [T, L, k] uint16 block (missing cells skipped)."""
        counts = np.zeros(self.L * self.E, np.int64)
        key_counts(rows, self.E, counts)
        return counts

    def _rank_pairs(self) -> tuple[np.ndarray, bool]:
        n_pairs = self.L * self.E
        pair = np.arange(n_pairs)
        interleaved = (pair % self.E) * self.L + pair // self.E  # rank r -> layer r % L (strata_plan)
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

    def _startup(self) -> None:
        hw, flags, env = self.hw, self.flags, self.env_vars
        self.rank_pairs, has_profile = self._rank_pairs()
        ranked_blobs = self.pair_blob[self.rank_pairs]
        reserve = flags.vram_reserve_mib * MIB
        self.vram_total = hw.vram_bytes
        self.non_expert_vram = NON_EXPERT_VRAM_BYTES
        free = self.vram_total - self.non_expert_vram
        borrow = not flags.no_prefill_borrow and has_profile
        explicit = flags.prefill if isinstance(flags.prefill, int) else None
        auto_cap = None
        if isinstance(flags.prefill, str) and flags.prefill.startswith("auto:"):
            auto_cap = int(flags.prefill[5:])
            self.notices.append(f"--prefill {flags.prefill}: v0.1.35 has no auto:N (upstream #669); read as auto "
                                f"with chunks <= {auto_cap}")
        # 1-2: size the cache, then the post-write check
        if flags.expert_cache == "auto":
            owned_chunk = explicit or sp.NO_BORROW_CHUNK_TOKENS
            cache = sp.auto_expert_cache(ranked_blobs, self.max_blob, free, reserve, borrowing=borrow,
                                         owned_chunk_tokens=owned_chunk)
            how = "auto"
        else:
            cache = sp.sized_slot_walk(ranked_blobs, sp.expert_cache_budget_bytes(flags.expert_cache, self.max_blob),
                                       free, reserve)
            how = f"budget {flags.expert_cache} x {self.max_blob / MIB:.2f} MiB"
        shrink = sp.post_write_shrink(ranked_blobs, cache, reserve, lambda used: free - used, wddm=hw.wddm)
        cache = shrink.cache
        for free_read, give in shrink.rounds:
            self.notices.append(f"expert cache: {free_read / MIB:.0f} MiB free after the write, below the "
                                f"{flags.vram_reserve_mib} MiB reserve: giving back {give / MIB:.0f} MiB")
        self.cache = cache
        self.slots = cache.slots
        self.notices.append(f"expert cache: {cache.slots} slots, {cache.bytes / MIB:.0f} MiB ({how}; "
                            f"{free / MIB:.0f} MiB free at sizing, reserve {flags.vram_reserve_mib} MiB)")
        # 3: profile fill in rank order
        self.pair_of_slot = self.rank_pairs[: self.slots].copy()
        self.slot_of = np.full(self.L * self.E, -1, dtype=np.int64)
        self.slot_of[self.pair_of_slot] = np.arange(self.slots)
        self.on_gpu = self.slot_of >= 0
        # 4: pinned share (before the RAM complement is built) and plan_lend
        mode = flags.ram_mode
        if mode == "arena":
            pin_gib = env.STRATA_ARENA_PIN_GIB
            pinned = self.total_expert_bytes
            if pin_gib is not None:
                try:
                    pinned = min(pinned, max(0, int(float(pin_gib) * GIB)))
                except ValueError:
                    raise InputError("STRATA_ARENA_PIN_GIB", "value", pin_gib, "must be a number of GiB") from None
            self.pinned_share = pinned / self.total_expert_bytes
        else:
            pinned, self.pinned_share = 0, 0.0  # resident/mmap modes measure the share on the mmap source (§3.2)
        lend_pct = _env_int("STRATA_PREFILL_LEND_PCT", env.STRATA_PREFILL_LEND_PCT)
        self.ring_override = _env_int("STRATA_PREFILL_RING", env.STRATA_PREFILL_RING)
        if self.ring_override is not None:
            self.notices.append("STRATA_PREFILL_RING sets the streaming ring; loans are still priced with the "
                                "default ring (strata_plan.plan_lend takes no override)")
        candidates = sp.AUTO_CHUNKS_V0135 if auto_cap is None else \
            tuple(c for c in sp.AUTO_CHUNKS_V0135 if c <= auto_cap) or (min(sp.AUTO_CHUNKS_V0135),)
        plan = sp.plan_lend(cache.slot_bytes, pinned_share=self.pinned_share, max_context_tokens=self.max_context,
                            explicit_chunk_tokens=explicit, candidates=candidates, max_blob_bytes=self.max_blob,
                            borrow=borrow, has_profile=has_profile, lend_pct_override=lend_pct)
        self.lend_plan = plan
        self.owned = plan.owned
        self.chunk = plan.chunk_tokens
        self.buffer_bytes = plan.buffer_bytes
        self.independent_chunk = 0
        free_after_cache = free - cache.bytes
        # 5: the fork's independent buffers, chosen after the fill with the free VRAM left
        own_auto = env.STRATA_PREFILL_OWN_AUTO
        if self.variant == "fork-658" and own_auto != "0" and not plan.owned:
            max_chunk = self.max_context if auto_cap is None and explicit is None else (auto_cap or explicit)
            offers = sp.independent_candidates(sp.INDEPENDENT_CHUNKS_FORK, self.pinned_share,
                                               max_blob_bytes=self.max_blob)
            chosen = sp.independent_prefill_chunk(offers, free_after_cache, reserve, max_chunk, plan.chunk_tokens)
            self.independent_chunk = chosen
            if chosen:
                self.owned, self.chunk = True, chosen
                self.buffer_bytes = dict(offers)[chosen]
                self.notices.append(f"prefill: independent buffers for {chosen}-token chunks, "
                                    f"{self.buffer_bytes / MIB:.0f} MiB ({free_after_cache / MIB:.0f} MiB free after "
                                    f"the cache, reserve {flags.vram_reserve_mib} MiB kept)")
            else:
                self.notices.append(f"prefill: no independent buffer fits {free_after_cache / MIB:.0f} MiB free - "
                                    f"{flags.vram_reserve_mib} MiB reserve; borrowing")
        if not self.owned:
            self.notices.append(f"prefill: borrowing up to {plan.lent_slots} slots ({plan.lend_bytes / MIB:.0f} MiB) "
                                f"for {plan.chunk_tokens}-token chunks (ring {self._ring(plan.chunk_tokens)})")
        elif plan.owned:
            self.notices.append(f"prefill: owned buffers for {plan.chunk_tokens}-token chunks, "
                                f"{plan.buffer_bytes / MIB:.0f} MiB")
        if self.owned and self.buffer_bytes > free_after_cache:
            self.notices.append(f"prefill: owned buffers ({self.buffer_bytes / MIB:.0f} MiB) exceed the "
                                f"{free_after_cache / MIB:.0f} MiB left after the cache")
        self.lend_first_planned = None if self.owned else plan.first_lent_slot
        self.loan_first: int | None = None  # first lent slot of the current loan
        # 6: the RAM side
        self._plan_ram(mode, pinned)

    def _plan_ram(self, mode: str, pinned: int) -> None:
        flags, env, hw = self.flags, self.env_vars, self.hw
        self.available_ram = hw.ram_bytes - OTHER_HOST_RAM_BYTES
        self.conv_budget = sp.conversation_budget_bytes(flags.conversation_cache_mib, flags.prompt_cache)
        self.conv_floor = flags.conversation_cache_min_free_mib * MIB
        n_pairs = self.L * self.E
        # RAM copies of the complement / kept lend copies are page-locked where the driver lets a 30+ GiB
        # region be locked; under WDDM we take them as pageable (stager path): the arena pin cap under WDDM
        # multi-GPU (STRATA_ARENA_PIN_GIB, §3.5) and §6's "effective streaming through the stager" on this box.
        ram_code = RAM_PAGEABLE if hw.wddm else RAM_PINNED
        self.home = np.full(n_pairs, FILE, dtype=np.int8)  # where a pair's bytes come from when not on the GPU
        self.ram_plan = None
        if mode == "arena":
            order = np.arange(n_pairs)
            pinned_pairs = np.cumsum(self.pair_blob[order]) <= pinned
            self.home[:] = np.where(pinned_pairs, RAM_PINNED, RAM_PAGEABLE)
            self.resident_alloc = self.total_expert_bytes
            if self.total_expert_bytes > self.available_ram:
                self.notices.append(f"arena: {self.total_expert_bytes / GIB:.2f} GiB of experts exceed the "
                                    f"{self.available_ram / GIB:.2f} GiB of RAM available")
            self.headroom = None
            return
        headroom = sp.resident_headroom_bytes(mode, env.STRATA_RESIDENT_HEADROOM_GIB)
        if self.variant == "fork-658":
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
            ranked_out = self.rank_pairs[self.slots:]  # the complement in rank order: hottest copied first
            copied = np.cumsum(self.pair_blob[ranked_out]) <= plan.budget_copy_bytes
            self.home[ranked_out[copied]] = ram_code
            self.resident_alloc = int(self.pair_blob[ranked_out[copied]].sum())
        else:  # mmap fallback: every non-resident blob comes from the mapped files
            self.resident_alloc = 0
        if plan.outcome != "budget":
            self.notices.append(f"resident RAM: complement {plan.complement_bytes / GIB:.2f} GiB, budget "
                                f"{plan.ram_budget_bytes / GIB:.2f} GiB (available {self.available_ram / GIB:.2f} - "
                                f"headroom {headroom / GIB:.2f}), lend copies {plan.covered_lent_slots} of "
                                f"{plan.covered_lent_slots + plan.file_blob_reads_per_refill} slots")

    # ------------------------------------------------------------------------------------ helpers

    def _ring(self, chunk_tokens: int) -> int:
        return sp.ring_slots(chunk_tokens, self.pinned_share, ring_override_slots=self.ring_override)

    def _parked_bytes(self) -> int:
        return sum(e.bytes for e in self.parked)

    def _page_cache_hit(self) -> float:
        """Share of file-tier bytes found in the page cache: the runs read warm files, and the page cache can
        hold what the resident tier and the parked sessions leave of the available RAM."""
        file_pairs = (self.home == FILE) & ~self.on_gpu
        lendable = np.zeros_like(file_pairs)
        if self.lend_first_planned is not None:
            lendable[self.pair_of_slot[self.lend_first_planned:]] = True
        working = int(self.pair_blob[(file_pairs | (lendable & (self.home == FILE)))].sum())
        room = self.available_ram - self.resident_alloc - self._parked_bytes()
        return 1.0 if working <= 0 else float(min(1.0, max(0.0, room) / working))

    def _vram_used(self) -> int:
        return self.non_expert_vram + self.cache.bytes + (self.buffer_bytes if self.owned else 0)

    def _ram_used(self) -> int:
        return self.resident_alloc + self._parked_bytes()

    def _source_split(self, pairs_mask: np.ndarray) -> np.ndarray:
        """[L, 4] counts of the masked pairs by source code."""
        codes = np.where(self.on_gpu, GPU, self.home).reshape(self.L, self.E)
        mask = pairs_mask.reshape(self.L, self.E)
        return np.stack([(mask & (codes == c)).sum(axis=1) for c in range(4)], axis=1)

    def _stream_seconds(self, n_pinned: int, n_pageable: int, n_file: int, blob: int, hit: float) -> float:
        """Copy-stream time of one layer's streamed blobs: pinned blobs are DMA'd (per-copy latency + the
        pinned rate); pageable RAM blobs and page-cache file blobs go through the stager at the box's
        effective stream rate; file blobs missing from the page cache are first read from the SSD."""
        file_bytes = n_file * blob
        return (n_pinned * (self.copy_lat_s + blob / self.h2d_pinned)
                + (n_pageable * blob + file_bytes) / self.stream_pageable
                + (1.0 - hit) * file_bytes / self.ssd_stager)

    def session_seconds(self, tokens: int, restore: bool = True) -> float:
        """Restore (host -> device) or capture (device -> host) of a session of `tokens` tokens: one running
        state + the K/V, copied tensor by tensor from pageable host memory, then one sync."""
        rate = self.h2d_pageable if restore else self.d2h_pageable
        return session_bytes(tokens) / rate + SESSION_COPIES * self.copy_lat_s + self.sync_s

    # ------------------------------------------------------------------------------------ prompt path

    def _lend(self, tokens: int) -> int:
        loan = sp.lend(self.lend_plan, self.cache.slot_bytes, tokens, self.loan_first)
        if loan.first_lent_slot is not None and loan.changed:
            first = loan.first_lent_slot
            self.on_gpu[self.pair_of_slot[first:]] = False
            self.loan_first = first
        self.max_loan = max(self.max_loan, self.slots - self.loan_first if self.loan_first is not None else 0)
        return loan.want_tokens

    def _prefill_chunk(self, t: float, request: int, step_no: int, rows: np.ndarray, ring: int,
                       carry: list) -> float:
        """One batched chunk through all layers. Per layer l the copy stream first fills the ring (up to
        `ring` blobs) once the compute stream has consumed enough of layer l-1's, then streams the rest while
        layer l's compute consumes them; compute of layer l ends no earlier than its last blob."""
        T = len(rows)
        routed = self._pair_counts(rows) > 0
        stream_all = T >= sp.STREAM_ALL_MIN_TOKENS_V0135
        streamed = ~self.on_gpu if stream_all else (~self.on_gpu & routed)
        split = self._source_split(streamed)
        lookups = routed.reshape(self.L, self.E).sum(axis=1)
        hits = (routed & self.on_gpu).reshape(self.L, self.E).sum(axis=1)
        hit = self._page_cache_hit()
        per_token = self.compute.prefill_us_per_token_layer.value * 1e-6
        c_layer = T * per_token
        lent = self.slots - self.loan_first if self.loan_first is not None else 0
        vram, ram = self._vram_used(), self._ram_used()
        end = t
        for layer in range(self.L):
            blob = int(self.layer_blob[layer])
            _, n_pin, n_pag, n_file = (int(x) for x in split[layer])
            n = n_pin + n_pag + n_file
            seconds = self._stream_seconds(n_pin, n_pag, n_file, blob, hit)
            cs_prev, c_prev, n_prev = carry
            head = min(1.0, ring / n) if n else 1.0
            consumed = c_prev * max(0.0, 1.0 - ring / n_prev) if n_prev else 0.0
            copy_end = self.links["h2d"].hold(max(t, cs_prev + consumed), seconds * head, n * blob * head, n)
            cs = max(t, self.links["compute"].free_at)
            if head < 1.0:
                copy_end = self.links["h2d"].hold(cs, seconds * (1.0 - head), n * blob * (1.0 - head), 0)
            cs, end = self.links["compute"].book(cs, c_layer, copy_end)
            carry[:] = [cs, c_layer, n]
            nbytes = n * blob
            sid = self.rec.step(request=request, phase="prefill", step=step_no, layer=layer, start_s=cs, end_s=end,
                                tokens=T, lookups=int(lookups[layer]), hits=int(hits[layer]), direct_loads=n,
                                h2d_bytes=nbytes, file_read_bytes=n_file * blob, lent_slots=lent,
                                vram_used_bytes=vram, ram_used_bytes=ram)
            for code, count in ((RAM_PINNED, n_pin), (RAM_PAGEABLE, n_pag), (FILE, n_file)):
                self.rec.copy(sid, "H2D", count, blob, SOURCE_NAMES[code], "ring")
        return end

    def _checkpoint(self, t: float, request: int, step_no: int, tokens: int) -> float:
        """An in-session checkpoint: the running state copied device -> host; the compute stream waits."""
        c = self.links["compute"]
        ready = max(t, c.free_at)
        seconds = RUNNING_STATE_BYTES / self.d2h_pageable + self.sync_s
        end = self.links["d2h"].hold(ready, seconds, RUNNING_STATE_BYTES, 1)
        c.block_until(end)
        sid = self.rec.step(request=request, phase="prefill", step=step_no, layer=-1, start_s=ready, end_s=end,
                            tokens=tokens, d2h_bytes=RUNNING_STATE_BYTES, vram_used_bytes=self._vram_used(),
                            ram_used_bytes=self._ram_used())
        self.rec.copy(sid, "D2H", 1, RUNNING_STATE_BYTES, "running-state", "checkpoint")
        return end

    def _refill(self, t: float, request: int, step_no: int) -> tuple[float, float]:
        """Copy every lent slot back from its source (one sync for the batch); a lent expert with no RAM copy is
        read from the mapped files (a file-blob read). Returns (end, seconds)."""
        if self.loan_first is None:
            return t, 0.0
        first = self.loan_first
        pairs = self.pair_of_slot[first:]
        homes = self.home[pairs]
        blobs = self.pair_blob[pairs]
        hit = self._page_cache_hit()
        ready = max(t, self.links["compute"].free_at)
        b = {code: int(blobs[homes == code].sum()) for code in (RAM_PINNED, RAM_PAGEABLE, FILE)}
        n_file = int((homes == FILE).sum())
        seconds = (len(pairs) * self.copy_lat_s + b[RAM_PINNED] / self.h2d_pinned
                   + (b[RAM_PAGEABLE] + b[FILE]) / self.h2d_pageable
                   + (1.0 - hit) * b[FILE] / self.ssd_qd1 + self.sync_s + self.memcpy_call_s)
        end = self.links["h2d"].hold(ready, seconds, int(blobs.sum()), len(pairs))
        self.links["compute"].block_until(end)
        self.on_gpu[pairs] = True
        self.loan_first = None
        sid = self.rec.step(request=request, phase="prefill", step=step_no, layer=-1, start_s=ready, end_s=end,
                            tokens=0, lookups=len(pairs), inserts=len(pairs), h2d_bytes=int(blobs.sum()),
                            file_read_bytes=b[FILE], file_blob_reads=n_file, lent_slots=len(pairs),
                            vram_used_bytes=self._vram_used(), ram_used_bytes=self._ram_used())
        for code in (RAM_PINNED, RAM_PAGEABLE, FILE):
            sel = homes == code
            sizes, counts = np.unique(blobs[sel], return_counts=True)
            for size, count in zip(sizes, counts):
                self.rec.copy(sid, "H2D", int(count), int(size), SOURCE_NAMES[code], "cache-slot")
        return end, end - ready

    def _short_read(self, t: float, request: int, step_no: int, rows: np.ndarray) -> float:
        """A short part through the decode verify windows (every lent slot is back by now)."""
        counts = self._pair_counts(rows)
        routed = counts > 0
        start, end = self.links["compute"].book(t, len(rows) * SHORT_READ_S_PER_TOKEN)
        self.rec.step(request=request, phase="prefill", step=step_no, layer=-1, start_s=start, end_s=end,
                      tokens=len(rows), lookups=int(routed.sum()), hits=int((routed & self.on_gpu).sum()),
                      vram_used_bytes=self._vram_used(), ram_used_bytes=self._ram_used())
        return end

    # ------------------------------------------------------------------------------------ decode

    def _decode_token(self, t: float, request: int, step_no: int, row: np.ndarray) -> float:
        cells = row.astype(np.int64) + self.offsets[0]
        cells = cells[row != MISSING]
        hit = self.on_gpu[cells]
        misses = cells[~hit]
        miss_bytes = int(self.pair_blob[misses].sum())
        file_misses = int((self.home[misses] == FILE).sum())
        start, end = self.links["compute"].book(t, self.L * self.compute.decode_us_per_token_layer.value * 1e-6)
        np.add.at(self.usage, cells, 1.0)
        self.rounds += 1
        inserts = d2h = h2d = file_reads = 0
        if self.rounds % self.flags.adapt_every == 0 and self.flags.adapt_swaps:
            inserts, h2d, d2h, file_reads = self._adapt(end)
        self.rec.step(request=request, phase="decode", step=step_no, layer=-1, start_s=start, end_s=end, tokens=1,
                      lookups=len(cells), hits=int(hit.sum()), inserts=inserts, evictions=inserts,
                      h2d_bytes=int(PCIE_FRAC_NATIVE * miss_bytes) + h2d, d2h_bytes=d2h,
                      file_read_bytes=int(self.pair_blob[misses[self.home[misses] == FILE]].sum()),
                      file_blob_reads=file_misses + file_reads, vram_used_bytes=self._vram_used(),
                      ram_used_bytes=self._ram_used())
        return end

    def _adapt(self, t: float) -> tuple[int, int, int, int]:
        """Adaptive tier: per layer pair the hottest non-resident pairs (usage >= 2) with the coldest resident
        ones while candidate >= victim + 1.5; best gains first, at most adapt-swaps. The incoming blob is
        copied into the victim's slot on a side stream (the decode does not wait); in the resident modes the
        victim's bytes go device -> host and take the incoming pair's place in RAM (homes exchanged)."""
        usage = self.usage.reshape(self.L, self.E)
        on_gpu = self.on_gpu.reshape(self.L, self.E)
        gains, cands, victims = [], [], []
        for layer in range(self.L):
            u = usage[layer]
            cand = np.flatnonzero(~on_gpu[layer] & (u >= ADAPT_MIN_USAGE) & (self.slot_of[layer * self.E:
                                                                                            (layer + 1) * self.E] < 0))
            res = np.flatnonzero(on_gpu[layer])
            if not len(cand) or not len(res):
                continue
            cand = cand[np.argsort(-u[cand], kind="stable")]
            res = res[np.argsort(u[res], kind="stable")]
            m = min(len(cand), len(res))
            gain = u[cand[:m]] - u[res[:m]]
            ok = gain >= ADAPT_MARGIN
            gains.append(gain[ok])
            cands.append(cand[:m][ok] + layer * self.E)
            victims.append(res[:m][ok] + layer * self.E)
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
        self.home[cand], self.home[victim] = self.home[victim], homes_in
        h2d = int(blobs.sum())
        pinned = int(blobs[homes_in == RAM_PINNED].sum())
        seconds = len(cand) * self.copy_lat_s + pinned / self.h2d_pinned + (h2d - pinned) / self.h2d_pageable
        self.links["h2d"].hold(t, seconds, h2d, len(cand))
        d2h = 0
        to_ram = homes_in != FILE  # the victim takes the incoming pair's place in RAM (none in the file tier)
        if self.flags.ram_mode != "arena" and to_ram.any():
            d2h = int(self.pair_blob[victim[to_ram]].sum())
            self.links["d2h"].hold(t, int(to_ram.sum()) * self.copy_lat_s + d2h / self.d2h_pageable, d2h,
                       int(to_ram.sum()))
        self.swaps += len(cand)
        return len(cand), h2d, d2h, int((homes_in == FILE).sum())

    # ------------------------------------------------------------------------------------ sessions

    def _park_live(self, t: float, request: int, held: int) -> float:
        """Park the outgoing live session: make_room, the physical-RAM floor, capture (device -> host)."""
        live = self.live
        self.live = None
        if live is None or live["tokens"] <= 0:
            return t
        entry = sp.ParkedConversation(live["conv"], session_bytes(live["tokens"]), live["tokens"])
        free_ram = self.available_ram - self._ram_used() - held
        result = sp.park_conversation(self.parked, entry, slots=self.flags.conversation_cache_slots,
                                      budget_bytes=self.conv_budget, held_bytes=held,
                                      available_ram_bytes=free_ram, min_free_bytes=self.conv_floor)
        self.conv_stats["evictions"] += len(result.evicted)
        if not result.parked:
            self.parked = result.entries
            if result.reason != "conversation cache disabled":
                self.conv_stats["park_skips"].append({"request": request, "conversation": live["conv"],
                                                      "reason": result.reason})
            return t
        seconds = self.session_seconds(live["tokens"], restore=False)
        end = self.links["d2h"].hold(max(t, self.links["compute"].free_at), seconds, entry.bytes, SESSION_COPIES)
        self.links["compute"].block_until(end)
        self.parked = result.entries
        self.conv_stats["parks"] += 1
        sid = self.rec.step(request=request, phase="prefill", step=-2, layer=-1, start_s=t, end_s=end, tokens=0,
                            d2h_bytes=entry.bytes, vram_used_bytes=self._vram_used(), ram_used_bytes=self._ram_used())
        self.rec.copy(sid, "D2H", 1, entry.bytes, "session", "parked")
        return end

    def _restore(self, t: float, request: int, entry: sp.ParkedConversation, tokens: int) -> float:
        seconds = self.session_seconds(tokens, restore=True)
        start = max(t, self.links["compute"].free_at)
        nbytes = session_bytes(tokens)
        end = self.links["h2d"].hold(start, seconds, nbytes, SESSION_COPIES)
        self.links["compute"].block_until(end)
        self.conv_stats["restores"].append({"request": request, "conversation": entry.name, "tokens": tokens,
                                            "ms": (end - start) * 1e3})
        sid = self.rec.step(request=request, phase="prefill", step=-1, layer=-1, start_s=start, end_s=end,
                            tokens=0, h2d_bytes=nbytes, vram_used_bytes=self._vram_used(),
                            ram_used_bytes=self._ram_used())
        self.rec.copy(sid, "H2D", 1, nbytes, "parked", "session")
        return end

    def _begin(self, t: float, request: int, conv: str, n: int) -> tuple[float, int]:
        """Pick the resume point (live session or a parked entry of this conversation), park the outgoing
        session if needed, restore the incoming one. Returns (time, resumed tokens)."""
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
        if self.live is not None and (self.live["conv"] != conv or incoming is not None):
            t = self._park_live(t, request, incoming.bytes if incoming is not None else 0)
        if incoming is not None:
            t = self._restore(t, request, incoming, resume)
        return t, resume

    # ------------------------------------------------------------------------------------ serve

    def serve(self, env: simpy.Environment, timings: list):
        short = self.flags.short_read
        every = self.flags.prompt_cache_every
        for request, (spec, routing) in enumerate(zip(self.scenario.workload.requests, self.routing.requests)):
            if spec.think_time_s:
                yield env.timeout(spec.think_time_s)
            arrival = t = env.now
            prompt = routing.prompt
            n = len(prompt)
            conv = spec.conversation if spec.conversation is not None else f"#request-{request}"
            t, resume = self._begin(t, request, conv, n)
            yield env.timeout(max(0.0, t - env.now))
            turn_at = self.context.get(conv, 0)
            cuts = sorted({resume, n - 1, n} | ({turn_at} if resume < turn_at < n - 1 else set()))
            step_no, pp_s, refill_s, fresh_done = 0, 0.0, 0.0, 0
            log = {"request": request, "conversation": conv, "resumed_tokens": resume, "loan_slots": 0}
            for lo, hi in zip(cuts, cuts[1:]):
                rows = prompt[lo:hi]
                if lo == turn_at and turn_at > 0 and self.flags.prompt_cache:
                    t = self._checkpoint(t, request, step_no, 0)
                    step_no += 1
                if len(rows) > short:
                    chunk = self.chunk if self.owned else self._lend(len(rows))
                    if not self.owned:
                        log["loan_slots"] = max(log["loan_slots"], self.slots - self.loan_first)
                    ring = self._ring(chunk)  # the buffers are carved (relaid out) for `chunk` tokens
                    carry = [t, 0.0, 0]
                    part_start = t
                    for first in range(0, len(rows), chunk):
                        block = rows[first: first + chunk]
                        t = self._prefill_chunk(t, request, step_no, block, ring, carry)
                        step_no += 1
                        before = fresh_done
                        fresh_done += len(block)
                        if self.flags.prompt_cache and fresh_done // every > before // every:
                            t = self._checkpoint(t, request, step_no, 0)
                            step_no += 1
                        yield env.timeout(max(0.0, t - env.now))
                    pp_s += t - part_start
                else:
                    if self.loan_first is not None:
                        t, s = self._refill(t, request, step_no)
                        refill_s += s
                        step_no += 1
                    t = self._short_read(t, request, step_no, rows)
                    step_no += 1
                    fresh_done += len(rows)
                    yield env.timeout(max(0.0, t - env.now))
            if self.loan_first is not None:
                t, s = self._refill(t, request, step_no)
                refill_s += s
                yield env.timeout(max(0.0, t - env.now))
            prefill_end = t
            for i, row in enumerate(routing.decode):
                t = self._decode_token(t, request, i, row)
                yield env.timeout(max(0.0, t - env.now))
            self.live = {"conv": conv, "tokens": n + len(routing.decode)}
            self.context[conv] = n + len(routing.decode)
            log.update(pp_ms=pp_s * 1e3, refill_ms=refill_s * 1e3, prefill_ms=(prefill_end - arrival) * 1e3)
            self.request_log.append(log)
            # the window of the last prompt token samples the first output token
            timings.append({"request": request, "arrival_s": arrival, "prefill_end_s": prefill_end,
                            "first_token_s": prefill_end, "end_s": t, "prompt_tokens": n,
                            "decode_tokens": len(routing.decode)})

    # ------------------------------------------------------------------------------------ state

    def state(self) -> dict:
        plan, ram = self.lend_plan, self.ram_plan
        return {
            "cache_slots": int(self.slots),
            "cache_mib": self.cache.bytes / MIB,
            "lent_slots": int(self.max_loan),
            "prefill_buffer_mib": self.buffer_bytes / MIB,
            "notices": list(self.notices),
            "owned": bool(self.owned),
            "chunk": int(self.chunk),
            "independent_chunk": int(self.independent_chunk),
            "plan_lend": {"chunk": plan.chunk_tokens, "lent_slots": plan.lent_slots, "lend_mib": plan.lend_bytes / MIB,
                          "first_lent_slot": plan.first_lent_slot, "owned": plan.owned,
                          "buffer_mib": plan.buffer_bytes / MIB},
            "pinned_share": self.pinned_share,
            "ram_mode": self.flags.ram_mode,
            "ram_plan": None if ram is None else {
                "outcome": ram.outcome, "complement_gib": ram.complement_bytes / GIB,
                "budget_gib": ram.ram_budget_bytes / GIB, "kept_lend_gib": ram.kept_lend_bytes / GIB,
                "covered_lent_slots": ram.covered_lent_slots, "keep_from_slot": ram.keep_from_slot,
                "headroom_gib": self.headroom / GIB, "available_gib": self.available_ram / GIB,
                "resident_alloc_gib": self.resident_alloc / GIB},
            "file_blob_reads_per_refill": int(((self.home[self.pair_of_slot[self.lend_first_planned:]] == FILE).sum())
                                              if self.lend_first_planned is not None else 0),
            "stream_gbps": {"pageable_stager": self.stream_pageable / 1e9, "pinned_dma": self.h2d_pinned / 1e9,
                            "stager_threads": self.stager_threads},
            "adaptive_swaps": int(self.swaps),
            "conversation_cache": {
                "budget_mib": self.conv_budget / MIB, "parks": self.conv_stats["parks"],
                "evictions": self.conv_stats["evictions"], "park_skips": list(self.conv_stats["park_skips"]),
                "restores": list(self.conv_stats["restores"]),
                "parked": [{"conversation": e.name, "tokens": e.tokens, "mib": e.bytes / MIB} for e in self.parked],
                f"restore_ms_{RESTORE_CHECK_TOKENS}_tokens": self.session_seconds(RESTORE_CHECK_TOKENS) * 1e3,
            },
            "requests": list(self.request_log),
        }
