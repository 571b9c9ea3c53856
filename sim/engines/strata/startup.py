"""Strata's startup after its memory plan (memory.py): where every (layer, expert) pair's bytes are.

  1-2  size the cache (auto or --expert-cache N; #765 books an owned prompt path first, also the owned fallback of
       a borrowing plan that finds no loan; #496 may lower a default reserve), then the post-write check (sizing.py)
  3    fill it in profile rank order: slot i holds pair i, so the tail slots are the coldest
  4    plan_lend with the build's pricing (lending.py, pricing.py)
  5    the fork's independent buffers, chosen after the fill with the free VRAM left
  6    the RAM side: the arena (pinned as far as the driver and STRATA_ARENA_PIN_GIB let it), the resident
       complement under available - headroom with the lend region covered from the tail, budget mode (with the
       live-memory build's loan coverage) or the mapped files (ram.py)
The placement is then the run's mutable state: loans, refills, adaptive swaps and donors move pairs through it.
"""

from __future__ import annotations

import numpy as np

from sim.cache.kernels import key_counts
from sim.engines.strata.geometry import KV_BYTES_PER_CELL_LAYER
from sim.engines.strata.lending import (AUTO_CHUNK_CEILING_TOKENS, AUTO_CHUNKS_V0135, AUTO_CHUNKS_V0139,
                                        INDEPENDENT_CHUNKS_FORK, independent_prefill_chunk, min_working_slots,
                                        plan_lend)
from sim.engines.strata.memory import kv_streamed
from sim.engines.strata.pricing import Pricing, kv_stage_bytes
from sim.engines.strata.ram import conversation_expert_headroom, resident_headroom_bytes, resident_ram_plan
from sim.engines.strata.settings import MIN_KEEP_SLOTS, NO_BORROW_CHUNK_TOKENS
from sim.engines.strata.sizing import (adapted_vram_reserve, auto_expert_cache, expert_cache_budget_bytes,
                                       post_write_shrink, sized_slot_walk)
from sim.engines.strata.conversations import conversation_budget_bytes
from sim.errors import InputError
from sim.trace.rowfile import row_blocks
from sim.units import GIB, MIB

GPU, RAM_PINNED, RAM_PAGEABLE, FILE = 0, 1, 2, 3  # where a pair's bytes come from (Placement.home)
SOURCE_NAMES = {RAM_PINNED: "ram:pinned", RAM_PAGEABLE: "ram:pageable", FILE: "file"}


def pair_counts(rows, n_layers: int, n_experts: int) -> np.ndarray:
    """Routed (token, k) cells per pair of [T, L, k] uint16 rows (missing cells skipped): an array, or a prompt
    kept in a file (FileRows), read a block at a time."""
    counts = np.zeros(n_layers * n_experts, np.int64)
    for _, block in row_blocks(rows):
        key_counts(block, n_experts, counts)
    return counts


class Placement:
    """The cache's slots (pair_of_slot, slot_of, on_gpu), where each pair's bytes are when the GPU lacks them
    (home), the loan (loan_first), and the startup decisions behind them (the module docstring)."""

    def __init__(self, run):
        self.run = run  # the StrataProcess: its figures, knobs, machine and notices
        mem = run.m.memory
        knobs, flags, build = run.knobs, run.flags, run.build
        self.rank_pairs, has_profile = self._rank_pairs()
        ranked_blobs = run.pair_blob[self.rank_pairs]
        reserve = knobs.reserve_bytes
        free = mem.vram_free()
        self.free_at_sizing = free
        borrow = not flags.no_prefill_borrow and has_profile
        explicit = knobs.explicit_chunk
        mode = flags.ram_mode
        # the pinned share is measured before the RAM complement is built: ~0 in the resident modes (§3.2)
        if mode == "arena":
            pinned = self._arena_pinned_bytes()
            self.pinned_share = pinned / run.total_expert_bytes
        else:
            pinned, self.pinned_share = 0, 0.0
        self.pricing = self._pricing(self.pinned_share)
        bind = run.memory.draft_head_bind_bytes
        # 1-2: size the cache (#765 books an owned prompt path first), then the post-write check
        owned_chunk = explicit or NO_BORROW_CHUNK_TOKENS
        if flags.expert_cache == "auto" and build.startup_plan and not knobs.reserve_given:
            # #496: a default reserve that leaves too small a working cache gives way, before the prompt path is
            # planned (the cache it leaves is counted as the sized walk would lay it out)
            first = auto_expert_cache(ranked_blobs, run.max_blob, free, reserve, mtp_bind_bytes=bind)
            needed = min_working_slots(self.pricing, borrow)
            adapted = adapted_vram_reserve(free, reserve, bind, first.slots, needed, run.max_blob)
            if adapted != reserve:
                run.notices.append(f"expert cache: the {knobs.reserve_mib} MiB reserve leaves {first.slots} "
                                   f"slots, a working cache needs {needed}: a {adapted / MIB:.0f} MiB reserve "
                                   "instead (#496)")
                reserve = adapted
        self.vram_reserve = reserve
        if flags.expert_cache == "auto":
            def owned_first(chunk: int):  # #765: the owned prompt path booked before the cache is sized
                booked = self.pricing.need_owned(chunk) + bind
                return sized_slot_walk(ranked_blobs, (max(0, free - reserve - booked) // run.max_blob)
                                       * run.max_blob, free, reserve, booked)

            if build.startup_plan and not borrow:
                cache = owned_first(owned_chunk)
            else:
                cache = auto_expert_cache(ranked_blobs, run.max_blob, free, reserve, borrowing=borrow,
                                          owned_chunk_tokens=owned_chunk, mtp_bind_bytes=bind)
                fallback = self._lend_plan(cache.slot_bytes, borrow, has_profile) if build.startup_plan else None
                if fallback is not None and fallback.owned:  # no loan fits: the plan books the owned fallback
                    cache = owned_first(fallback.chunk_tokens)
                    run.notices.append(f"expert cache: no loan fits a cache sized for borrowing; the startup plan "
                                       f"books owned {fallback.chunk_tokens}-token buffers first (#765)")
            how = "auto"
        else:
            cache = sized_slot_walk(ranked_blobs, expert_cache_budget_bytes(flags.expert_cache, run.max_blob),
                                    free, reserve, bind)
            how = f"budget {flags.expert_cache} x {run.max_blob / MIB:.2f} MiB"
        shrink = post_write_shrink(ranked_blobs, cache, reserve, lambda used: free - used, wddm=run.hw.wddm)
        cache = shrink.cache
        for free_read, give in shrink.rounds:
            run.notices.append(f"expert cache: {free_read / MIB:.0f} MiB free after the write, below the "
                               f"{reserve / MIB:.0f} MiB reserve: giving back {give / MIB:.0f} MiB")
        self.cache = cache
        self.slots = cache.slots
        mem.set("vram", "expert cache", cache.bytes)
        mem.set("vram", "MTP draft head", bind)  # bound after the cache, booked before it
        run.notices.append(f"expert cache: {cache.slots} slots, {cache.bytes / MIB:.0f} MiB ({how}; "
                           f"{free / MIB:.0f} MiB free at sizing, reserve {reserve / MIB:.0f} MiB)")
        # 3: profile fill in rank order
        self.pair_of_slot = self.rank_pairs[: self.slots].copy()
        self.slot_of = np.full(run.n_layers * run.n_experts, -1, dtype=np.int64)
        self.slot_of[self.pair_of_slot] = np.arange(self.slots)
        self.on_gpu = self.slot_of >= 0
        self._plan_prompt_path(borrow, has_profile)
        self.loan_first: int | None = None  # first lent slot of the current loan
        # 6: the RAM side
        self._plan_ram(mode, pinned)
        if run.scenario.workload.page_cache == "warm":
            # the model files were read before the run (startup copies the complement from them; the runs read
            # warm files): the page cache holds what fits of them, the end of the files most recent
            run.m.page_cache.warm(np.arange(run.n_layers * run.n_experts))

    def _rank_pairs(self) -> tuple[np.ndarray, bool]:
        run = self.run
        n_layers, n_experts = run.n_layers, run.n_experts
        pair = np.arange(n_layers * n_experts)
        interleaved = (pair % n_experts) * n_layers + pair // n_experts  # rank r -> layer r % L
        profile = run.flags.expert_profile
        if profile is None:
            run.notices.append("no --expert-profile: the cache is filled in the interleaved stand-in order; "
                               "prompt buffers are owned (no borrowing without a profile)")
            return np.argsort(interleaved, kind="stable"), False
        if profile != "@trace":
            raise InputError("strata", "engine.flags.expert-profile", profile,
                             'only "@trace" (rank pairs by the scenario trace\'s routing counts) is modelled')
        counts = np.zeros(n_layers * n_experts, dtype=np.int64)
        for req in run.routing.requests:
            for rows in (req.prompt, req.decode):
                if len(rows):
                    counts += pair_counts(rows, n_layers, n_experts)
        return np.lexsort((interleaved, -counts)), True

    def _pricing(self, pinned_share: float) -> Pricing:
        run = self.run
        kv_stage = kv_stage_bytes(run.max_context, KV_BYTES_PER_CELL_LAYER[run.flags.kv]) \
            if kv_streamed(run.max_context, run.kv_cells) else 0
        return Pricing(run.build, pinned_share, run.max_blob, kv_stage, run.knobs.ring_override,
                       fused=run.knobs.fused, max_cells=run.max_context)

    def _lend_plan(self, slot_bytes, borrow: bool, has_profile: bool):
        """plan_lend (§3.3) with the build's chunk list and pricing, for a cache of these slots."""
        run = self.run
        knobs, flags, build = run.knobs, run.flags, run.build
        auto_cap = knobs.auto_cap
        candidates = AUTO_CHUNKS_V0135
        if build.auto_n and auto_cap:  # #669: the longer list, its entries above 8192 only up to auto:N
            candidates = tuple(c for c in AUTO_CHUNKS_V0139 if c <= max(AUTO_CHUNK_CEILING_TOKENS, auto_cap))
        ceiling = None
        if build.grid_auto:
            ceiling = max(AUTO_CHUNK_CEILING_TOKENS, min(auto_cap or 0, run.max_context))
        return plan_lend(slot_bytes, pinned_share=self.pinned_share, max_context_tokens=run.max_context,
                         explicit_chunk_tokens=knobs.explicit_chunk, candidates=candidates,
                         max_blob_bytes=run.max_blob, kv_stage=self.pricing.kv_stage, borrow=borrow,
                         has_profile=has_profile, lend_pct_override=knobs.lend_pct, pricing=self.pricing,
                         grid_ceiling_tokens=ceiling,
                         pressure_min_keep=flags.live_prefill_min_retained
                         if build.live_memory and flags.live_prefill_min_retained < MIN_KEEP_SLOTS else None)

    def _plan_prompt_path(self, borrow: bool, has_profile: bool) -> None:
        """4: plan_lend with the build's pricing; 5: the fork's independent buffers."""
        run = self.run
        mem, knobs, flags, build = run.m.memory, run.knobs, run.flags, run.build
        explicit, auto_cap, reserve = knobs.explicit_chunk, knobs.auto_cap, self.vram_reserve
        plan = self._lend_plan(self.cache.slot_bytes, borrow, has_profile)
        self.lend_plan = plan
        self.owned = plan.owned
        self.chunk = plan.chunk_tokens
        self.buffer_bytes = plan.buffer_bytes
        self.independent_chunk = 0
        free_after_cache = mem.vram_free()
        if build.independent_buffers and knobs.own_auto and not plan.owned:
            max_chunk = run.max_context if auto_cap is None and explicit is None else (auto_cap or explicit)
            offers = tuple((c, self.pricing.need(c)) for c in INDEPENDENT_CHUNKS_FORK)
            chosen = independent_prefill_chunk(offers, free_after_cache, reserve, max_chunk, plan.chunk_tokens)
            self.independent_chunk = chosen
            if chosen:
                self.owned, self.chunk = True, chosen
                self.buffer_bytes = dict(offers)[chosen]
                run.notices.append(f"prefill: independent buffers for {chosen}-token chunks, "
                                   f"{self.buffer_bytes / MIB:.0f} MiB ({free_after_cache / MIB:.0f} MiB free after "
                                   f"the cache, reserve {reserve / MIB:.0f} MiB kept)")
            else:
                run.notices.append(f"prefill: no independent buffer fits {free_after_cache / MIB:.0f} MiB free - "
                                   f"{reserve / MIB:.0f} MiB reserve; borrowing")
        if not self.owned:
            run.notices.append(f"prefill: borrowing up to {plan.lent_slots} slots ({plan.lend_bytes / MIB:.0f} MiB) "
                               f"for {plan.chunk_tokens}-token chunks (ring {self.pricing.ring(plan.chunk_tokens)})")
        elif plan.owned:
            run.notices.append(f"prefill: owned buffers for {plan.chunk_tokens}-token chunks, "
                               f"{plan.buffer_bytes / MIB:.0f} MiB")
        if self.owned:
            if self.buffer_bytes > free_after_cache:  # the cache and the buffers cannot both be on the card
                raise InputError(str(run.scenario.path or "scenario"), "engine.flags.expert-cache",
                                 flags.expert_cache,
                                 f"this card cannot hold both: owned prompt buffers ({self.buffer_bytes / MIB:.0f} "
                                 f"MiB for {self.chunk}-token chunks) exceed the {free_after_cache / MIB:.0f} MiB left "
                                 f"after the cache's {self.cache.slot_bytes.sum() / MIB:.0f} MiB; a smaller expert "
                                 "cache or chunk, or an expert profile (borrowed buffers)"
                                 + (f", or a shorter max-context (their K/V stage is "
                                    f"{self.pricing.kv_stage / MIB:.0f} MiB)" if self.pricing.kv_stage else ""))
            mem.set("vram", "prompt buffers (owned)", self.buffer_bytes)
        self.lend_first_planned = None if self.owned else plan.first_lent_slot

    def _arena_pinned_bytes(self) -> int:
        """The arena's page-locked bytes (Strata src/core/pinned.cu): the whole arena in one registration, unless
        STRATA_ARENA_PIN_GIB = N > 0 caps it (0 or unset: no cap) or the driver refuses a region that large
        (host.gpu_pinnable_gib); then it is registered one layer's slice at a time from the first layer, each
        slice only if it still fits under the cap and the driver's limit."""
        run = self.run
        total = run.total_expert_bytes
        limits = [] if run.knobs.arena_pin_cap_bytes is None else [run.knobs.arena_pin_cap_bytes]
        pinnable = run.hw.host.gpu_pinnable_gib
        if pinnable is not None:
            limits.append(pinnable.value * GIB)
        limit = min(limits, default=total)
        if limit >= total:
            return total
        whole_layers = np.cumsum(run.layer_blob * run.n_experts)
        pinned = int(whole_layers[whole_layers <= limit][-1]) if whole_layers[0] <= limit else 0
        run.notices.append(f"expert arena: {total / GIB:.2f} GiB cannot be pinned whole (limit {limit / GIB:.2f} "
                           f"GiB): {pinned / GIB:.2f} GiB pinned in layer slices, the rest through the stager")
        return pinned

    def _plan_ram(self, mode: str, pinned: int) -> None:
        run = self.run
        flags, knobs, hw = run.flags, run.knobs, run.hw
        mem = run.m.memory
        self.available_ram = mem.ram_available()  # MemAvailable / ullAvailPhys at this point of startup
        self.conv_budget = conversation_budget_bytes(flags.conversation_cache_mib, flags.prompt_cache)
        self.conv_floor = flags.conversation_cache_min_free_mib * MIB
        n_pairs = run.n_layers * run.n_experts
        # RAM copies of the complement / kept lend copies are page-locked where the driver lets a 30+ GiB region
        # be locked; under WDDM we take them as pageable (stager path): the arena pin cap under WDDM multi-GPU
        # (STRATA_ARENA_PIN_GIB, §3.5) and §6's "effective streaming through the stager" on that box.
        ram_code = RAM_PAGEABLE if hw.wddm else RAM_PINNED
        self.home = np.full(n_pairs, FILE, dtype=np.int8)  # where a pair's bytes come from when not on the GPU
        self.ram_plan = None
        self.headroom = None
        if mode == "arena":
            order = np.arange(n_pairs)
            pinned_pairs = np.cumsum(run.pair_blob[order]) <= pinned
            self.home[:] = np.where(pinned_pairs, RAM_PINNED, RAM_PAGEABLE)
            self.resident_alloc = run.total_expert_bytes
            if run.total_expert_bytes > self.available_ram:
                run.notices.append(f"arena: {run.total_expert_bytes / GIB:.2f} GiB of experts exceed the "
                                   f"{self.available_ram / GIB:.2f} GiB of RAM available: the run holds them in RAM "
                                   "all the same, which this box cannot (its pages would go to disk), so its "
                                   "speeds are optimistic; --resident-experts holds only the experts the GPU cache "
                                   "lacks, or maps the files")
            mem.set("ram", "expert arena", run.total_expert_bytes)
            return
        if mode == "mmap":  # every pair the GPU lacks comes from the mapped files: no RAM copy, no headroom rule
            self.resident_alloc = 0
            mem.set("ram", "resident experts", 0)
            return
        headroom = resident_headroom_bytes(mode, knobs.headroom_text)
        if run.build.conversation_headroom:
            headroom = conversation_expert_headroom(
                headroom, flags.conversation_cache_mib * MIB, flags.conversation_cache_slots, self.conv_floor,
                resident_experts=True, prompt_cache_entries=flags.prompt_cache)
        self.headroom = headroom
        cached_blobs = run.pair_blob[self.pair_of_slot]
        plan = resident_ram_plan(run.total_expert_bytes, cached_blobs, self.lend_first_planned, self.available_ram,
                                 headroom, mode=mode,
                                 resident_budget_bytes=None if flags.resident_budget_gib is None
                                 else int(flags.resident_budget_gib * GIB))
        self.ram_plan = plan
        if plan.message:
            run.notices.append(plan.message)
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
            if run.build.live_memory and self.lend_first_planned is not None:
                # live memory: the loan's RAM coverage shares the resident budget, lend region first (the
                # loan log reports RAM coverage and file fallback, docs/LIVE_MEMORY.md)
                lend_pairs = self.pair_of_slot[self.lend_first_planned:][::-1]
                covered = np.cumsum(run.pair_blob[lend_pairs]) <= budget
                self.home[lend_pairs[covered]] = ram_code
                budget -= int(run.pair_blob[lend_pairs[covered]].sum())
            ranked_out = self.rank_pairs[self.slots:]  # the complement in rank order: hottest copied first
            copied = np.cumsum(run.pair_blob[ranked_out]) <= budget
            self.home[ranked_out[copied]] = ram_code
            self.resident_alloc = int(run.pair_blob[(self.home != FILE)].sum())
        else:  # mmap fallback: every non-resident blob comes from the mapped files
            self.resident_alloc = 0
        mem.set("ram", "resident experts", self.resident_alloc)
        if plan.outcome != "budget":
            run.notices.append(f"resident RAM: complement {plan.complement_bytes / GIB:.2f} GiB, budget "
                               f"{plan.ram_budget_bytes / GIB:.2f} GiB (available {self.available_ram / GIB:.2f} - "
                               f"headroom {headroom / GIB:.2f}), lend copies {plan.covered_lent_slots} of "
                               f"{plan.covered_lent_slots + plan.file_blob_reads_per_refill} slots")

    def ring(self, chunk_tokens: int) -> int:
        return self.pricing.ring(chunk_tokens)

    def file_blob_reads_per_refill(self) -> int:
        """The planned loan's slots whose pair has no RAM copy: each refill reads them from the files."""
        if self.lend_first_planned is None:
            return 0
        return int((self.home[self.pair_of_slot[self.lend_first_planned:]] == FILE).sum())
