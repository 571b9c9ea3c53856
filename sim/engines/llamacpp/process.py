"""llama.cpp with the experts of some MoE layers in host RAM, as SimPy processes on the simulated machine (the
reference's §3-§6; ggml-backend-sched @ 34af94cd9).

One process serves the requests in order; nothing overlaps between ubatches (llama_context::decode runs them one after
another, §3). Per MoE layer whose expert tensors live in host memory:

  decode, or a ubatch below the offload rule, or --no-op-offload
      the GPU runs attention and the router; the scheduler copies the hidden state and the ids to the host (a
      synchronous switch); the CPU's mul_mat_id reads each distinct selected expert once on -t (-tb) threads, out of
      the file mapping (page faults from the drive for pages not in the page cache) or its buffer, after the split's
      own cost (graph.py); the result is copied back (the second switch)
  a ubatch the GPU takes (op offload)
      the host reads the ids back (synchronous), and copies the experts the ubatch uses (#15346; every expert before
      it, and in ik_llama.cpp with -no-ooae) over PCIe, consecutive ids merged into one copy, pageable from the
      mapping or a plain RAM buffer, or pinned; the GPU multiplies. The copy and the GEMM share the backend's
      stream: they serialise.

GPU-resident layers run on the GPU only; in decode each of a layer's graph nodes there has a floor (graph.py). A
layer -ngl leaves on the CPU runs there whole: each token the CPU reads its other weights, its selected experts and
its K/V; a ubatch the GPU takes copies its weights whole (and its experts used) with the K/V its attention reads.
The output layer runs on its side of -ngl. Every layer of every
token or ubatch is a row of steps.parquet.
"""

from __future__ import annotations

import numpy as np

from sim.engines.base import Bounds, EngineState, setting
from sim.engines.llamacpp.graph import cpu_moe_split_s, decode_gpu_nodes, gpu_node_s
from sim.engines.llamacpp.kernels import expert_core_rate
from sim.engines.llamacpp.memory import HOST_WORDS, plan_memory
from sim.engines.llamacpp.vram import FP32_BYTES, layer_weight_bytes, part_bytes, part_types
from sim.engines.llamacpp.settings import RUN_PADDING_BYTES, Knobs
from sim.engines.llamacpp.weights import file_weights
from sim.errors import InputError
from sim.trace.format import MISSING, distinct_experts
from sim.units import GIB, MIB

IDS_BYTES = 4  # one int32 expert id per (token, slot), read back before an offloaded layer (§3)


def used_runs(experts: np.ndarray, n_experts: int) -> tuple[int, int]:
    """How the scheduler copies a ubatch's distinct experts of one layer (ascending, as distinct_experts gives
    them; ggml-backend.cpp:1676-1709): (runs of consecutive ids, runs that end before the tensor's last expert and
    so are padded)."""
    if experts.size == 0:
        return 0, 0
    runs = 1 + int(np.count_nonzero(np.diff(experts.astype(np.int64)) != 1))
    return runs, runs - int(experts[-1] == n_experts - 1)


class LlamaCppProcess:
    """One llama.cpp process (llama-server or llama-cli) serving a scenario's requests in order."""

    def __init__(self, scenario, routing, recorder, machine, domain):
        self.scenario, self.routing, self.rec, self.m = scenario, routing, recorder, machine
        layout = scenario.layout
        where = str(scenario.path or "scenario")
        self.knobs = knobs = Knobs.of(scenario, where)
        self.memory = plan = plan_memory(scenario, knobs, where)
        if plan.why_no_cache is not None:  # the load fails before anything runs
            raise InputError(where, plan.knob, setting({"engine": scenario.engine.model_dump(by_alias=True)}, plan.knob),
                             plan.why_no_cache)
        for allocation in plan.allocations:
            machine.memory.set(*allocation)
        self.notices = list(plan.notices)
        self.n_layers, self.n_experts, self.top_k = layout.n_routed_layers, layout.n_experts, layout.top_k
        parts = part_bytes(layout)[: self.n_layers]
        on_cpu = knobs.on_cpu[: self.n_layers]
        self.cpu_layer = on_cpu.any(axis=1).tolist()  # per-layer figures as Python values: see decode_gpu_s
        self.cpu_bytes = (parts * on_cpu).sum(axis=1)  # one expert's slices in host memory, per layer
        self.cpu_parts = on_cpu.sum(axis=1)
        gpu_bytes = (parts * ~on_cpu).sum(axis=1)
        expert_bytes = parts.sum(axis=1)
        weights = file_weights(layout, where)
        self.attention = weights.attention
        # -ngl: the layers before the first GPU block run whole on the CPU, the output layer on either side
        self.whole_cpu = knobs.whole_cpu[: self.n_layers].tolist()
        # one core's rate in ggml's kernels over a layer's host-resident slices (kernels.py), and over all its slices
        # for a layer -ngl leaves on the CPU, whose other weights go at its experts' rate [E: their types are not held]
        types = part_types(layout)[: self.n_layers]
        simd = scenario.hardware_profile.host.simd
        isa = None if simd is None else simd.value
        build = "ik" if knobs.variant.ik else "ggml"  # whose CPU kernels (kernels.py)

        def core_rate(layer: int, mask) -> float | None:
            return expert_core_rate(parts[layer][mask], types[layer][mask], isa, domain, self.notices, build,
                                    machine.own_ggml_kernel)

        rates = {why: {i: core_rate(i, mask) for i, mask in slices}
                 for why, slices in knobs.cpu_computed(self.n_layers).items()}
        self.cpu_core_rate = [rates["experts"].get(i) for i in range(self.n_layers)]
        self.whole_core_rate = [rates["whole"].get(i) for i in range(self.n_layers)]
        self.output_core_rate = rates["output"].get(self.n_layers - 1)
        self.layer_weight_bytes = layer_weight_bytes(weights, self.n_layers)
        self.output_bytes = weights.output_bytes
        # decode: a layer streams its share of the non-expert weights and its selected GPU-resident slices from VRAM,
        # and each of its graph nodes on the GPU has a floor (graph.py); the output layer reads its projection once a
        # token (Python floats: a numpy scalar reaching the servers' clocks makes every sum after it numpy arithmetic)
        self.decode_gpu_s = (machine.vram_read_s(self.layer_weight_bytes + self.top_k * gpu_bytes)
                             + decode_gpu_nodes(self.cpu_layer) * gpu_node_s(knobs.cuda_graphs, domain)).tolist()
        self.cpu_split_s = cpu_moe_split_s(domain) if any(self.cpu_layer) else 0.0
        self.output_gpu_s = machine.vram_read_s(weights.output_bytes)
        other = weights.gpu_bytes / self.n_layers  # the non-expert weights a prompt token passes, per layer
        # a prompt token: the profile's figure for the model class (experts resident), split by the bytes each part
        # of the layer reads per token, so the routed share moves with the experts wherever they are computed
        compute = scenario.compute
        per_token = compute.prefill_us_per_token_layer.value * 1e-6
        routed = self.top_k * expert_bytes / (self.top_k * expert_bytes + other)
        self.prefill_other_s = (per_token * (1.0 - routed)).tolist()
        self.prefill_routed_s = (per_token * routed).tolist()
        fixed = compute.prefill_us_per_chunk_layer
        self.prefill_fixed_s = 0.0 if fixed is None else fixed.value * 1e-6
        # the prompt's attention over its context: the GPU's measured attention rate, else the prompt figure's time
        # per FLOP of a token's matmul weights
        attention = self.attention
        self.attention_s_per_position = 0.0 if attention.flops_per_position is None else machine.attention_s(
            attention.flops_per_position, per_token / (2 * attention.active_params_per_layer))
        self.hidden_bytes = layout.hidden * FP32_BYTES
        self.main = machine.threads("llama.cpp main thread")
        self.cpu = machine.threads("llama.cpp CPU experts")
        self.mapped = knobs.host == "mapped" and any(self.cpu_layer)
        self.locked = False
        if self.mapped and knobs.mlock:
            cpu_total = plan.cpu_expert_bytes
            if cpu_total <= machine.memory.ram_available():
                machine.memory.set("ram", "CPU experts (mlocked mapping)", cpu_total)
                self.locked = True
            else:
                self.notices.append(f"mlock: {cpu_total / GIB:.2f} GiB of expert pages cannot be locked in "
                                    f"{machine.memory.ram_available() / GIB:.2f} GiB: left pageable")
        self.paged = self.mapped and not self.locked
        if self.paged and scenario.workload.page_cache == "warm":  # loaded before: the page cache holds what fits
            keys = (np.flatnonzero(self.cpu_layer)[:, None] * self.n_experts + np.arange(self.n_experts)).ravel()
            machine.page_cache.warm(keys)
        self.totals = dict(offloaded_layer_steps=0, cpu_layer_steps=0, h2d_expert_bytes=0, h2d_expert_copies=0,
                           cpu_expert_read_bytes=0, page_fault_read_bytes=0, reused_prompt_tokens=0)
        if knobs.places_layers:
            self.totals.update(whole_cpu_layer_steps=0, cpu_layer_weight_bytes=0, h2d_layer_weight_bytes=0)

    # --- the pieces -------------------------------------------------------------------------------

    def _faults(self, layer: int, experts: np.ndarray):
        """Page faults of the selected experts' host slices: pages not in the page cache come from the drive."""
        if not self.paged or not len(experts):
            return 0
        hit = self.m.page_cache.access(layer * self.n_experts + experts.astype(np.int64))
        missing = int((~hit).sum()) * int(self.cpu_bytes[layer])
        if missing:
            yield self.m.ssd.read(missing, self.m.ssd.fault_reads(missing), at_once=True)
            self.totals["page_fault_read_bytes"] += missing
        return missing

    def _switch(self, n_bytes: float, to_host: bool):
        """One GPU<->CPU switch of the scheduler: the stream drained, the tensor copied, the host synchronised."""
        m = self.m
        if to_host:
            yield m.gpu.drained()
        yield (m.d2h if to_host else m.h2d).copy(n_bytes, 1, "switch", pageable_bytes=n_bytes)
        yield self.main.hold(m.sync_s, 0, 1, "sync")

    def _cpu_layer(self, layer: int, rows: np.ndarray, threads: int):
        """The CPU's mul_mat_id of one layer for these rows (§3.1): each distinct selected expert read once, n x k
        rows of work."""
        n = len(rows)
        yield from self._switch(n * self.hidden_bytes + rows.size * IDS_BYTES, True)
        yield self.main.hold(self.cpu_split_s, 0, 1, "CPU split")
        selected = rows[rows != MISSING]
        used = distinct_experts(rows, self.n_experts)
        fault = yield from self._faults(layer, used)
        read = len(used) * int(self.cpu_bytes[layer])
        work = len(selected) * int(self.cpu_bytes[layer])
        yield self.m.cpu_expert_matmul(self.cpu, read, work, threads, core_bytes_per_s=self.cpu_core_rate[layer])
        yield from self._switch(n * self.hidden_bytes, False)
        self.totals["cpu_layer_steps"] += 1
        self.totals["cpu_expert_read_bytes"] += read
        return read, fault

    def _offloaded_layer(self, layer: int, rows: np.ndarray):
        """Op offload of one CPU layer (§5.2): ids back, the used experts' slices over PCIe, the GEMM on the GPU."""
        m, knobs = self.m, self.knobs
        yield m.gpu.drained()
        yield self.main.hold(m.sync_s + m.memcpy_call_s, rows.size * IDS_BYTES, 1, "ids readback")
        if knobs.copy_used_only:
            experts = distinct_experts(rows, self.n_experts)
            distinct, (runs, padded) = len(experts), used_runs(experts, self.n_experts)
        else:
            distinct, runs, padded = self.n_experts, 1, 0
            experts = np.arange(self.n_experts)
        fault = yield from self._faults(layer, experts)
        parts = int(self.cpu_parts[layer])
        n_bytes = distinct * int(self.cpu_bytes[layer]) + parts * padded * RUN_PADDING_BYTES
        yield m.h2d.copy(n_bytes, parts * runs, "op offload experts", pageable_bytes=0 if knobs.pinned else n_bytes)
        m.gpu.book(len(rows) * self.prefill_routed_s[layer], 0, 0, "expert GEMMs (offloaded)")
        self.totals["offloaded_layer_steps"] += 1
        self.totals["h2d_expert_bytes"] += n_bytes
        self.totals["h2d_expert_copies"] += parts * runs
        return n_bytes, fault, distinct

    def _kv_bytes(self, first: int, n: int) -> float:
        """One layer's share of the K/V that queries at positions first .. first+n-1 read."""
        return self.attention.kv_bytes_per_token_layer * self.attention.positions(first, n) / self.n_layers

    def _whole_cpu_layer(self, layer: int, rows: np.ndarray, first: int, threads: int):
        """A layer -ngl leaves on the CPU, for these rows [n, k] at positions first ..: the CPU reads its other
        weights, each distinct selected expert and the K/V of the range once, and passes over them for every row
        (every token's matmuls, its k experts, its attention's reads) [E: CPU attention priced as its K/V reads]."""
        n = len(rows)
        selected = rows[rows != MISSING]
        used = distinct_experts(rows, self.n_experts)
        fault = yield from self._faults(layer, used)
        expert = int(self.cpu_bytes[layer])
        read = self.layer_weight_bytes + len(used) * expert + self._kv_bytes(first + n - 1, 1)
        work = n * self.layer_weight_bytes + len(selected) * expert + self._kv_bytes(first, n)
        yield self.m.cpu_expert_matmul(self.cpu, read, work, threads, "layer (CPU)", self.whole_core_rate[layer])
        self.totals["whole_cpu_layer_steps"] += 1
        self.totals["cpu_expert_read_bytes"] += len(used) * expert
        self.totals["cpu_layer_weight_bytes"] += self.layer_weight_bytes
        return fault

    def _offloaded_whole_layer(self, layer: int, rows: np.ndarray, first: int):
        """Op offload of a layer -ngl leaves on the CPU: its other weights cross the link whole, as any host weight
        of a MUL_MAT does (§3), with the K/V range its attention reads [E from C: the attention taken by the GPU
        beside the matmuls around it]; then its experts as a CPU MoE layer's (used only)."""
        m, n = self.m, len(rows)
        yield m.gpu.drained()
        n_bytes = self.layer_weight_bytes + self._kv_bytes(first + n - 1, 1)
        yield m.h2d.copy(n_bytes, 1, "op offload layer weights", pageable_bytes=0 if self.knobs.pinned else n_bytes)
        self.totals["h2d_layer_weight_bytes"] += n_bytes
        self.totals["whole_cpu_layer_steps"] += 1
        expert_bytes, fault, _ = yield from self._offloaded_layer(layer, rows)
        return n_bytes + expert_bytes, fault

    def _output(self, on_host: bool):
        """The output layer of a decode token, on its side of -ngl (the hidden state crossing once if it must)."""
        m = self.m
        if self.knobs.output_on_gpu:
            if on_host:
                yield from self._switch(self.hidden_bytes, False)
            m.gpu.book(self.output_gpu_s, 0, 0, "output layer (GPU)")
        else:
            if not on_host:
                yield from self._switch(self.hidden_bytes, True)
            yield m.cpu_expert_matmul(self.cpu, self.output_bytes, self.output_bytes, self.knobs.threads,
                                      "output layer (CPU)", self.output_core_rate)
            self.totals["cpu_layer_weight_bytes"] += self.output_bytes

    # --- a token and a ubatch ---------------------------------------------------------------------

    def _step(self, request: int, phase: str, step: int, layer: int, start: float, tokens: int, **row) -> None:
        self.rec.step(request=request, phase=phase, step=step, layer=layer, start_s=start, end_s=self.m.env.now,
                      tokens=tokens, vram_used_bytes=self.m.memory.used("vram"),
                      ram_used_bytes=self.m.memory.used("ram"), **row)

    def decode_token(self, request: int, step: int, rows: np.ndarray, position: int):
        """One generated token at a context position, rows [layers, k]: each attention layer also reads the K/V of
        the positions it attends to."""
        m = self.m
        kv_s = m.vram_read_s(self.attention.kv_bytes_per_token_layer * self.attention.positions(position, 1)) \
            / self.n_layers
        on_host = False  # the token's hidden state after a layer -ngl left on the CPU
        for layer in range(self.n_layers):
            start = m.env.now
            if self.whole_cpu[layer]:
                fault = yield from self._whole_cpu_layer(layer, rows[layer][None, :], position, self.knobs.threads)
                on_host = True
                self._step(request, "decode", step, layer, start, 1, file_read_bytes=fault)
                continue
            if on_host:  # the first GPU layer: the hidden state crosses once
                yield from self._switch(self.hidden_bytes, False)
                on_host = False
            m.gpu.book(self.decode_gpu_s[layer] + kv_s, 0, 0, "layer (GPU)")
            if self.cpu_layer[layer]:
                read, fault = yield from self._cpu_layer(layer, rows[layer][None, :], self.knobs.threads)
                self._step(request, "decode", step, layer, start, 1, file_read_bytes=fault,
                           d2h_bytes=self.hidden_bytes)
        yield from self._output(on_host)
        yield m.gpu.drained()

    def ubatch(self, request: int, step: int, rows: np.ndarray, first: int):
        """One prompt ubatch, rows [n, layers, k], its first token at context position `first`."""
        m, knobs = self.m, self.knobs
        n = len(rows)
        offload = knobs.offloads(n, self.top_k, self.n_experts)
        attention_s = self.attention_s_per_position * self.attention.positions(first, n) / self.n_layers
        on_host = False
        for layer in range(self.n_layers):
            start = m.env.now
            if self.whole_cpu[layer]:
                if offload:
                    h2d, fault = yield from self._offloaded_whole_layer(layer, rows[:, layer], first)
                    m.gpu.book(n * self.prefill_other_s[layer] + self.prefill_fixed_s + attention_s, 0, 0,
                               "layer (GPU, offloaded)")
                    # the layer's share of the weights and K/V is an even spread (fractional bytes): the step
                    # row counts whole bytes
                    self._step(request, "prefill", step, layer, start, n, h2d_bytes=round(h2d),
                               file_read_bytes=fault)
                else:
                    fault = yield from self._whole_cpu_layer(layer, rows[:, layer], first, knobs.threads_batch)
                    on_host = True
                    self._step(request, "prefill", step, layer, start, n, file_read_bytes=fault)
                continue
            if on_host:
                yield from self._switch(n * self.hidden_bytes, False)
                on_host = False
            m.gpu.book(n * self.prefill_other_s[layer] + self.prefill_fixed_s + attention_s, 0, 0, "layer (GPU)")
            if not self.cpu_layer[layer]:
                m.gpu.book(n * self.prefill_routed_s[layer], 0, 0, "expert GEMMs")
                continue
            if offload:
                n_bytes, fault, distinct = yield from self._offloaded_layer(layer, rows[:, layer])
                self._step(request, "prefill", step, layer, start, n, h2d_bytes=n_bytes, file_read_bytes=fault)
            else:
                read, fault = yield from self._cpu_layer(layer, rows[:, layer], knobs.threads_batch)
                self._step(request, "prefill", step, layer, start, n, file_read_bytes=fault)
        yield m.gpu.drained()

    def ubatches(self, n_tokens: int) -> list[tuple[int, int]]:
        """(first, size) of each ubatch of a prompt: logical batches of -b tokens, each cut into -ub (§5.1)."""
        out = []
        for first_batch in range(0, n_tokens, self.knobs.batch):
            end = min(n_tokens, first_batch + self.knobs.batch)
            out += [(f, min(self.knobs.ubatch, end - f)) for f in range(first_batch, end, self.knobs.ubatch)]
        return out

    def serve(self, env, timings: list):
        """The requests in order on one slot. A request that continues the conversation the slot holds reuses its
        K/V: only the prompt's new tokens are computed, from the position the slot reached (llama-server's prompt
        cache of a slot; llama-bench -d and llama-sweep-bench measure at such a depth). Any other request starts the
        slot afresh. The request's prompt_tokens in the timings are the tokens computed, as llama.cpp reports them."""
        held = (None, 0)  # (conversation, tokens of K/V) the slot holds
        for request, (spec, routing) in enumerate(zip(self.scenario.workload.requests, self.routing.requests)):
            if spec.think_time_s:
                yield env.timeout(spec.think_time_s)
            arrival = env.now
            # the whole prompt held: its last token is computed again for the logits (at least one token is)
            continues = held[0] is not None and spec.conversation == held[0]
            reused = min(held[1], len(routing.prompt) - 1) if continues else 0
            self.totals["reused_prompt_tokens"] += reused
            prompt = routing.prompt[reused:]
            for step, (first, size) in enumerate(self.ubatches(len(prompt))):
                yield from self.ubatch(request, step, prompt[first: first + size, : self.n_layers], reused + first)
            prefill_end = env.now
            first_token = None
            for i, rows in enumerate(routing.decode):
                yield from self.decode_token(request, i, rows[: self.n_layers], len(routing.prompt) + i)
                if first_token is None:
                    first_token = env.now
            held = (spec.conversation, len(routing.prompt) + len(routing.decode))
            timings.append({"request": request, "arrival_s": arrival, "prefill_end_s": prefill_end,
                            "first_token_s": first_token if first_token is not None else prefill_end,
                            "end_s": env.now, "prompt_tokens": len(prompt), "decode_tokens": len(routing.decode)})

    # --- results ----------------------------------------------------------------------------------

    def bounds(self, request: int) -> Bounds:
        return Bounds(None)  # no expert cache

    def state(self) -> EngineState:
        knobs = self.knobs
        cpu_layers = [int(b) for b, cpu in zip((x.block for x in self.scenario.layout.layers), self.cpu_layer) if cpu]
        detail = {
            "variant_source": knobs.variant.source,
            "cpu_moe_layers": len(cpu_layers),
            "cpu_moe_blocks": cpu_layers,
            "host_buffer": "mlocked mapping" if self.locked else HOST_WORDS[knobs.host],
            "cpu_expert_gib": round(self.memory.cpu_expert_bytes / GIB, 3),
            "ubatch": knobs.ubatch,
            "threads": knobs.threads,
            "threads_batch": knobs.threads_batch,
            "op_offload_from_tokens": knobs.offload_threshold(self.top_k, self.n_experts),
            "compute_buffer_mib": round(next(a.bytes for a in self.memory.allocations if a.name == "compute buffer")
                                        / MIB, 1),
            **({"cpu_blocks": knobs.cpu_blocks, "output_layer": "GPU" if knobs.output_on_gpu else "CPU"}
               if knobs.places_layers else {}),
            **self.totals,
        }
        return EngineState(None, None, None, None, None, tuple(self.notices), detail)
