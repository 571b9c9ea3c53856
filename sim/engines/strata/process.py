"""Strata (Niko1221/Strata v0.1.35 and later builds, and the #658 fork) as SimPy processes on the simulated machine.

Covers: the profile-filled sized-slot expert cache (never evicts; adaptive decode tier), prompt buffers borrowed
from the cold tail of the cache (lend, stream, refill) or owned (#658's independent buffers, 0.1.40's owned pricing
and #765 startup plan), the RAM tiers (arena, resident complement with lend-region coverage, budget mode, the
live-memory build's loan coverage, mmap fallback), file-blob reads through a finite page cache, KV streaming
(--kv-resident), in-session checkpoints and the conversation cache. The phases live beside this module:

    memory.py, startup.py   VRAM before the cache (allocated here first), then the cache, loans and RAM tiers
    prompt_stream.py        a batched chunk: stager threads, copy stream, compute stream
    loans.py                lend, refill, short parts
    decode.py               verify windows and the adaptive tier
    sessions.py             checkpoints, parking and restoring conversations

The main thread serves a scenario's requests in order (reference/strata-engine.md §3, §6). Where the prompt time
ends: prefill_end is after the refill and the window of the last prompt token, i.e. when the first output token
exists (the engine splits every prompt at n - 1 and refills before that last token's decode window, §3.3 steps
3-4).
"""

from __future__ import annotations

import numpy as np
import simpy

from sim.engines.base import Bounds, EngineState
from sim.engines.strata.decode import Decode
from sim.engines.strata.loans import Loans
from sim.engines.strata.memory import plan_memory
from sim.engines.strata.prompt_stream import PromptStream
from sim.engines.strata.sessions import RESTORE_CHECK_TOKENS, Sessions
from sim.engines.strata.settings import Knobs
from sim.engines.strata.startup import Placement
from sim.units import GIB, MIB


class StrataProcess:
    """One Strata process serving a scenario's requests in order (see the module docstring)."""

    def __init__(self, scenario, routing, recorder, machine, domain):
        self.scenario, self.routing, self.rec, self.m, self.domain = scenario, routing, recorder, machine, domain
        hw, layout, engine = scenario.hardware_profile, scenario.layout, scenario.engine
        self.hw, self.flags = hw, engine.flags
        self.knobs = Knobs.of(scenario)
        self.build = self.knobs.build
        self.n_layers, self.n_experts, self.top_k = layout.n_routed_layers, layout.n_experts, layout.top_k
        self.layer_blob = np.asarray(layout.expert_bytes_per_layer()[: self.n_layers], dtype=np.int64)
        self.max_blob = int(self.layer_blob.max())
        self.total_expert_bytes = int(self.layer_blob.sum()) * self.n_experts
        self.pair_blob = np.repeat(self.layer_blob, self.n_experts)  # pair = layer * n_experts + expert
        # Strata's canonical Q2_0 pack (its own gather kernel and a fixed PCIe share) or a pack of native GGUF
        # quant types (MMQ's grouped gather, the probed PCIe share)
        self.canonical_q2_0 = all((x.gate_type, x.up_type, x.down_type) == ("Q2_0",) * 3 for x in layout.layers)
        self.layer_offsets = (np.arange(self.n_layers, dtype=np.int32) * self.n_experts)[None, :, None]
        self.max_context = self.flags.max_context
        self.kv_cells = self.flags.kv_resident_cells
        # compute: the profile's figures (calibration records where they were fitted); weights read from VRAM are
        # priced by the machine (vram_read_s)
        compute = scenario.compute
        self.decode = Decode(self, domain)
        fixed = compute.prefill_us_per_chunk_layer
        self.prefill_chunk_layer_s = 0.0 if fixed is None else fixed.value * 1e-6
        # Prompt compute per chunk and layer = tokens x a per-token cost + the routed experts' weights read
        # once at the GPU's DRAM rate + the profile's fixed cost per chunk. The profile's per-token figure is the
        # slope between one-chunk prompts of two lengths (record strata-prefill-5090): what each token adds,
        # the per-chunk costs (these reads, the stream of the experts the cache lacks) being simulated apart.
        self.prefill_token_layer_s = compute.prefill_us_per_token_layer.value * 1e-6
        # VRAM before the cache: derived term by term (memory.plan_memory)
        self.memory = plan_memory(scenario, self.knobs, domain, str(scenario.path or "scenario"))
        for allocation in self.memory.allocations:
            machine.memory.set(*allocation)
        self.notices: list[str] = list(self.memory.notices)
        self.main = machine.threads("strata main thread")
        self.prompt = PromptStream(self)
        self.place = Placement(self)
        self.loans = Loans(self)
        self.sessions = Sessions(self)
        self.request_log: list[dict] = []

    # ------------------------------------------------------------------------------------ serve

    def serve(self, env: simpy.Environment, timings: list):
        flags, place, sessions, loans = self.flags, self.place, self.sessions, self.loans
        short = flags.short_read
        every = flags.prompt_cache_every
        for request, (spec, routing) in enumerate(zip(self.scenario.workload.requests, self.routing.requests)):
            if spec.think_time_s:
                yield env.timeout(spec.think_time_s)
            arrival = env.now
            prompt = routing.prompt
            n = len(prompt)
            conv = spec.conversation if spec.conversation is not None else f"#request-{request}"
            resume = yield from sessions.begin(request, conv, n)
            turn_at = sessions.context.get(conv, 0)
            cuts = sorted({resume, n - 1, n} | ({turn_at} if resume < turn_at < n - 1 else set()))
            step_no, pp_s, refill_s, fresh_done = 0, 0.0, 0.0, 0
            log = {"request": request, "conversation": conv, "resumed_tokens": resume, "loan_slots": 0}
            for lo, hi in zip(cuts, cuts[1:]):
                rows = prompt[lo:hi]
                if lo == turn_at and turn_at > 0 and flags.prompt_cache:
                    yield from sessions.checkpoint(request, step_no)
                    step_no += 1
                if len(rows) > short:
                    chunk = place.chunk if place.owned else (yield from loans.lend(len(rows)))
                    if not place.owned:
                        log["loan_slots"] = max(log["loan_slots"], place.slots - place.loan_first)
                    ring = place.ring(chunk)  # the buffers are carved (relaid out) for `chunk` tokens
                    part_start = env.now
                    for first in range(0, len(rows), chunk):
                        block = rows[first: first + chunk]
                        yield from self.prompt.chunk(request, step_no, block, ring, lo + first)
                        step_no += 1
                        before = fresh_done
                        fresh_done += len(block)
                        if flags.prompt_cache and fresh_done // every > before // every:
                            yield from sessions.checkpoint(request, step_no)
                            step_no += 1
                    yield self.m.gpu.drained()
                    pp_s += env.now - part_start
                else:
                    if place.loan_first is not None:
                        refill_s += yield from loans.refill(request, step_no)
                        step_no += 1
                    yield from loans.short_read(request, step_no, rows)
                    step_no += 1
                    fresh_done += len(rows)
            if place.loan_first is not None:
                refill_s += yield from loans.refill(request, step_no)
            yield self.m.gpu.drained()
            prefill_end = env.now
            yield from self.decode.decode(request, routing.decode, n)
            sessions.live = {"conv": conv, "tokens": n + len(routing.decode)}
            sessions.context[conv] = n + len(routing.decode)
            log.update(pp_ms=pp_s * 1e3, refill_ms=refill_s * 1e3, prefill_ms=(prefill_end - arrival) * 1e3)
            self.request_log.append(log)
            # the window of the last prompt token samples the first output token
            timings.append({"request": request, "arrival_s": arrival, "prefill_end_s": prefill_end,
                            "first_token_s": prefill_end, "end_s": env.now, "prompt_tokens": n,
                            "decode_tokens": len(routing.decode)})

    # ------------------------------------------------------------------------------------ state

    def bounds(self, request: int) -> Bounds:
        """Strata's cache is static (profile fill + adaptive swaps): no replacement bound is reported."""
        return Bounds(None)

    def state(self) -> EngineState:
        place, sessions, memory = self.place, self.sessions, self.memory
        plan, ram = place.lend_plan, place.ram_plan
        pc = self.m.page_cache
        stats = sessions.stats
        detail = {
            "cache_slots": int(place.slots),
            "cache_mib": place.cache.bytes / MIB,
            "lent_slots": int(self.loans.max_loan),
            "prefill_buffer_mib": place.buffer_bytes / MIB,
            "notices": list(self.notices),
            "variant": self.build.name, "variant_source": self.build.source,
            "owned": bool(place.owned),
            "chunk": int(place.chunk),
            "ring_slots": int(place.ring(place.chunk)),
            "independent_chunk": int(place.independent_chunk),
            "plan_lend": {"chunk": plan.chunk_tokens, "lent_slots": plan.lent_slots, "lend_mib": plan.lend_bytes / MIB,
                          "first_lent_slot": plan.first_lent_slot, "owned": plan.owned,
                          "buffer_mib": plan.buffer_bytes / MIB},
            "pinned_share": place.pinned_share,
            "ram_mode": self.flags.ram_mode,
            "vram_before_cache_mib": sum(n for _, n in memory.vram_before) / MIB,
            "vram_before_cache": {name: n / MIB for name, n in memory.vram_before},
            "draft_head_bind_mib": memory.draft_head_bind_bytes / MIB,
            "vram_free_at_sizing_mib": place.free_at_sizing / MIB,
            "vram_reserve_mib": place.vram_reserve / MIB,  # the reserve the cache was sized with (#496 may lower it)
            "vram_record": memory.runtime_record,
            "kv_resident_cells": self.kv_cells,
            "ram_plan": None if ram is None else {
                "outcome": ram.outcome, "complement_gib": ram.complement_bytes / GIB,
                "budget_gib": ram.ram_budget_bytes / GIB, "kept_lend_gib": ram.kept_lend_bytes / GIB,
                "covered_lent_slots": ram.covered_lent_slots, "keep_from_slot": ram.keep_from_slot,
                "headroom_gib": place.headroom / GIB, "available_gib": place.available_ram / GIB,
                "resident_alloc_gib": place.resident_alloc / GIB},
            "file_blob_reads_per_refill": place.file_blob_reads_per_refill(),
            "live_memory_donor_copies": int(self.loans.donor_copies),
            "stager_threads": self.knobs.stager_threads,
            "prompt_stream_events": int(self.prompt.events),  # waits and records on the compute stream
            "prompt_event_stall_s": self.m.stream_events_s(self.prompt.events),  # their idle time under WDDM
            "page_cache": {"capacity_gib": pc.capacity_bytes / GIB, "used_gib": pc.used_bytes / GIB,
                           "hits": pc.hits, "misses": pc.misses},
            "adaptive_swaps": int(self.decode.swaps),
            "conversation_cache": {
                "budget_mib": place.conv_budget / MIB, "parks": stats["parks"],
                "evictions": stats["evictions"], "park_skips": list(stats["park_skips"]),
                "restores": list(stats["restores"]),
                "parked": [{"conversation": e.name, "tokens": e.tokens, "mib": e.bytes / MIB} for e in sessions.parked],
                f"restore_ms_{RESTORE_CHECK_TOKENS}_tokens": sessions.restore_seconds(RESTORE_CHECK_TOKENS) * 1e3,
            },
            "requests": list(self.request_log),
            "memory": self.m.memory.allocations(),
        }
        return EngineState(int(place.slots), int(place.slots), place.cache.bytes / MIB, int(self.loans.max_loan),
                           place.buffer_bytes / MIB, tuple(self.notices), detail)
