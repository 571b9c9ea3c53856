"""ds4's SSD-streaming expert cache as SimPy processes on the simulated machine (antirez/ds4 @80ebbc3, PR #504 and
its successors; the variants in settings.VARIANTS).

One ds4 process serves a scenario's requests in order. Its threads are host-thread servers of the machine (the
main thread, the selected-load worker, #1082's pread pool); the GPU's legacy default stream, the copy engines and
the drive are the machine's. Each thread issues its work and waits on the event it gets back, so what overlaps and
what queues comes from who waits on what (reference/ds4-engine.md §1.6-§1.8). The phases live beside this module:

    memory.py   startup before the cache (the memory plan, allocated here first)
    caches.py   the expert caches in VRAM and the compact staging
    loads.py    the bytes of a miss, the pread pool, the hand-over to the kernels
    decode.py   the decode path on CUDA/ROCm (prompts up to 18 tokens, 64 for Q4_K layer 0, too)
    prefill.py  the batched prefill of longer prompts, and the hotlist seeding after it
    metal.py    the decode path on Metal

Every layer step is one row of steps.parquet; the copies of a step are rows of copy_plan.parquet.
"""

from __future__ import annotations

import numpy as np
import simpy

from sim.engines.base import Bounds, EngineState
from sim.engines.ds4.caches import ExpertCaches
from sim.engines.ds4.decode import CudaDecode
from sim.engines.ds4.geometry import Layers, model_family
from sim.engines.ds4.loads import Loads
from sim.engines.ds4.memory import plan_memory
from sim.engines.ds4.metal import MetalDecode
from sim.engines.ds4.prefill import Prefill
from sim.engines.ds4.settings import Knobs
from sim.engines.ds4.weights import decode_bytes_by_layer
from sim.errors import InputError
from sim.trace.format import MISSING
from sim.units import GIB, MIB


class Ds4Process:
    """One ds4 process serving a scenario's requests in order (see the module docstring)."""

    def __init__(self, scenario, routing, recorder, machine, domain):
        self.scenario, self.routing, self.rec, self.m, self.domain = scenario, routing, recorder, machine, domain
        layout = scenario.layout
        where = str(scenario.path or "scenario")
        self.knobs = knobs = Knobs.of(scenario, where)
        self.variant = knobs.variant
        self.layers = Layers.of(layout, knobs.mtp)
        self.family = model_family(scenario)
        self.memory = plan = plan_memory(scenario, knobs, self.layers, domain, where)
        for allocation in plan.allocations:
            machine.memory.set(*allocation)
        self.notices: list[str] = list(plan.notices)
        self.budget_experts = plan.budget_experts
        self._timing_figures(scenario, domain)
        self.main = machine.threads("ds4 main thread")
        self.worker = machine.threads("ds4 selected-load worker")
        pool = [machine.threads(f"ds4 pread worker {i}") for i in range(knobs.pool_workers)] \
            if knobs.pool_workers else None
        self.caches = ExpertCaches(machine, self.layers, self.variant.per_class, plan.budget_experts,
                                   plan.reserve_bytes, plan.staging_bytes, self.notices)
        self.loads = Loads(machine, self.layers, knobs, pool, recorder)
        self.prefill = Prefill(self, where)
        if knobs.metal:
            self.decode = MetalDecode(self, self.work, where)
        else:
            self.decode = CudaDecode(self)
            if scenario.workload.page_cache == "warm":  # the file was read before: the page cache holds what fits
                machine.page_cache.warm(np.arange(self.layers.n_routed * self.layers.n_experts))

    def _timing_figures(self, scenario, domain) -> None:
        """Compute per layer: the profile's per-token figures split by the bytes each part reads."""
        compute, n_routed = scenario.compute, self.layers.n_routed
        if compute.decode_us_per_token_layer is None:
            hw = scenario.hardware_profile
            raise InputError(str(hw.path or hw.name), f"compute.{scenario.compute_key}.decode_us_per_token_layer", None,
                             "ds4's decode needs the GPU time per token and layer of this model class")
        work = decode_bytes_by_layer(scenario.layout, self.family, range(self.layers.count))
        self.work = work
        share = work / work[:n_routed].sum() * n_routed  # mean layer = 1
        self.decode_s = compute.decode_us_per_token_layer.value * 1e-6 * share  # [layer, (other, shared, routed)]
        # non-routed weights past VRAM: a layer's kernels read their share of them over PCIe at every pass (the
        # machine's host_read, before the layer's attention), and in decode, whose figures are a roofline of the
        # bytes read, those bytes no longer take VRAM time
        resident = self.memory.resident
        over = self.memory.weight_pcie_bytes / resident.non_routed if resident.non_routed else 0.0
        self.weight_host_bytes = over * work[:, :2].sum(axis=1)  # per layer, per pass
        self.decode_s[:, :2] *= 1.0 - over
        # the same figures as Python floats, read once per decode layer step: a numpy row unpacks into numpy
        # scalars, which made every server clock and sum they reached numpy arithmetic (a sweep point's layers that
        # miss: 0.28 -> 0.24 CPU s a point with floats, 2026-12-06)
        self.decode_s_rows = self.decode_s.tolist()
        self.weight_host_rows = self.weight_host_bytes.tolist()
        # The main thread encodes each decode layer's graph before the GPU can run it: CPU time per token,
        # measured on a GB10 (record ds4-graph-encode-773), serial with the layer's kernels.
        encode = domain.use("ds4-graph-encode-773", "ds4's graph encode per decode token")
        self.encode_layer_s = encode.value * 1e-3 / n_routed
        # [layer][(other, shared, routed)] as Python floats, as decode_s_rows
        self.prefill_s = (compute.prefill_us_per_token_layer.value * 1e-6 * share).tolist()
        fixed = compute.prefill_us_per_chunk_layer
        self.prefill_chunk_fixed_s = 0.0 if fixed is None else fixed.value * 1e-6

    # --- serve -----------------------------------------------------------------------------------

    def serve(self, env: simpy.Environment, timings: list):
        knobs = self.knobs
        room_notice = False
        for request, (spec, routing) in enumerate(zip(self.scenario.workload.requests, self.routing.requests)):
            if spec.think_time_s:
                yield env.timeout(spec.think_time_s)
            arrival = env.now
            prompt = routing.prompt
            if len(prompt) <= knobs.decode_path_max:
                if knobs.metal:
                    self.decode.start_prompt()
                for i, row in enumerate(prompt):
                    yield from self.decode.token(request, "prefill", i, row)
            else:
                chunk = knobs.chunk_for(len(prompt))
                step_no = 0
                for step_no, first in enumerate(range(0, len(prompt), chunk)):
                    yield from self.prefill.chunk(request, step_no, prompt[first: first + chunk])
                yield from self.prefill.seed_from_hotlist(request, step_no + 1)
            prefill_end = env.now
            first_token = None
            mtp = routing.mtp if knobs.mtp else None
            if knobs.mtp and (mtp is None or len(mtp) < len(routing.decode)):
                raise InputError("scenario", "trace", "no MTP routing", "--mtp needs the MTP layer's routing")
            # the CLI stops generating when the context is full (room - 1 tokens, ds4_cli.c)
            room = max(0, knobs.ctx - len(prompt) - 1)
            decode = routing.decode[:room]
            if len(decode) < len(routing.decode) and not room_notice:
                self.notices.append(f"context full: ds4 generates at most --ctx {knobs.ctx} - prompt - 1 = {room} "
                                    f"tokens; request {request} asked for {len(routing.decode)}")
                room_notice = True
            for i, row in enumerate(decode):
                yield from self.decode.token(request, "decode", i, row, None if mtp is None else mtp[i])
                if first_token is None:
                    first_token = env.now
            timings.append({"request": request, "arrival_s": arrival, "prefill_end_s": prefill_end,
                            "first_token_s": first_token if first_token is not None else prefill_end,
                            "end_s": env.now, "prompt_tokens": len(prompt), "decode_tokens": len(decode)})

    # --- results ---------------------------------------------------------------------------------

    def bounds(self, request: int) -> Bounds:
        """The Belady bound's decode hit rate with the same class pools and slot counts: the most decode hits
        any cache of those sizes can get on the request's routing, its prompt warming the cache first
        (sim.cache.replay.decode_bound_hits); None for the slab, whose capacity changes with every size change."""
        return Bounds(self._belady(request) if self.variant.per_class or self.knobs.metal else None)

    def _belady(self, request: int) -> float | None:
        from sim.cache.replay import Geometry, decode_bound_hits, last_access_rows
        from sim.trace.format import PHASE_DECODE, PHASE_PREFILL, Trace, TraceHeader

        r = self.routing.requests[request]
        if not len(r.decode):
            return None
        n_routed, n_experts = self.layers.n_routed, self.layers.n_experts
        # the prompt's last access of each key: the bound is the same (last_access_rows), its memory per key
        prompt = last_access_rows(r.prompt[:, :n_routed], n_experts)
        decode = r.decode[:, :n_routed]
        if self.knobs.mtp:  # the draft runs on decode tokens only: its prompt cells are missing
            pad = np.full((len(prompt), len(self.layers.mtp_layers), prompt.shape[2]), MISSING, np.uint16)
            prompt = np.concatenate([prompt, pad], axis=1)
            decode = np.concatenate([decode, r.mtp[: len(decode)]], axis=1)
        rows = np.concatenate([prompt, decode])
        phase = np.r_[np.full(len(prompt), PHASE_PREFILL), np.full(len(decode), PHASE_DECODE)].astype(np.uint8)
        header = TraceHeader(self.scenario.layout.name, rows.shape[1], n_experts, rows.shape[2], "run", "")
        trace = Trace(header, np.zeros(len(rows)), np.arange(len(rows)), phase, rows)
        capacity = np.array([self.budget_experts]) if self.knobs.metal else np.array(self.caches.cache.capacity)
        hits = decode_bound_hits(trace, Geometry.of(trace, self.scenario.layout), capacity)
        return float(hits.sum() / np.count_nonzero(decode != MISSING))

    def state(self) -> EngineState:
        knobs, plan, caches, metal = self.knobs, self.memory, self.caches, self.knobs.metal
        caps = [self.budget_experts] if metal else [int(c) for c in caches.cache.capacity]
        r = plan.resident
        pc = self.m.page_cache
        backend = {"metal": {"cache_experts_held": self.decode.cache.count,
                             "cache_evictions": self.decode.cache.evictions,
                             "cache_peak_gib": self.decode.cache_peak_bytes / GIB,
                             "weight_fault_gib": self.decode.weight_fault_bytes / GIB}} if metal else {}
        cache_mib = (self.decode.cache_peak_bytes if metal else caches.cache_bytes()) / MIB
        planned = plan.planned_experts if plan.planned_experts is not None else int(sum(caps))
        detail = {
            "cache_slots": int(sum(caps)), "cache_slots_per_class": caps, "cache_mib": cache_mib, "lent_slots": 0,
            **backend,
            "prefill_buffer_mib": caches.staging_bytes / MIB, "notices": list(self.notices),
            "variant": self.variant.name, "variant_source": self.variant.source,
            "reserve_gib": plan.reserve_bytes / GIB, "budget_experts": self.budget_experts, "ctx": knobs.ctx,
            "budget_mode": self.variant.budget, "planned_cache_slots": planned,
            "non_routed_over_pcie_gib": plan.weight_pcie_bytes / GIB,
            "miss_source": ("page cache (buffered pread)" if knobs.buffered or metal else "SSD (O_DIRECT)")
            + (f", {knobs.pool_workers} pread workers" if knobs.pool_workers else ", QD1"),
            "hits_first": knobs.hits_first, "selected_shared_overlap": knobs.overlap,
            "page_cache": {"capacity_gib": pc.capacity_bytes / GIB, "used_gib": pc.used_bytes / GIB,
                           "read_hits": self.loads.page_cache_reads["hits"],
                           "read_misses": self.loads.page_cache_reads["misses"],
                           "keep_model_pages": knobs.keep_pages or metal},
            "class_expert_bytes": [int(b) for b in self.layers.class_bytes],
            "mtp_layers": [int(x) for x in self.layers.mtp_layers],
            "flushes_per_pool": list(caches.flushes), "hotlist_seeding": dict(self.prefill.seeding),
            "hotlist_seed_experts": int(sum(len(e) for _, e in self.prefill.seed_steps)),
            "slab_size_changes": dict(caches.size_changes),
            "vram_before_cache_gib": r.vram / GIB,
            "vram_before_cache": {"non_routed_gib": r.non_routed / GIB, "host_pinned_gib": r.host_pinned / GIB,
                                  "kv_gib": r.kv / GIB, "context_buffers_gib": r.context_buffers / GIB,
                                  "compute_buffers_gib": r.compute_buffers / GIB,
                                  "compute_buffers_record": r.record,
                                  "runtime_reserved_gib": r.runtime_reserved / GIB},
            "memory": self.m.memory.allocations()}
        return EngineState(int(sum(caps)), planned, cache_mib, 0, caches.staging_bytes / MIB, tuple(self.notices),
                           detail)
