"""llama.cpp and ik_llama.cpp with the routed experts of some MoE layers in host RAM (--cpu-moe, --n-cpu-moe N,
-ot exps=CPU): decode's expert matmuls on the CPU, large prompt ubatches copying the experts they use to the GPU (op
offload). ../shared/reference/llamacpp-engine.md (llama.cpp @ 34af94cd9, ik_llama.cpp @ 8337e4cd).

    settings.py  the [engine] table, the variants, placement by override regexes, every knob parsed once (Knobs)
    weights.py   the non-expert weights and attention of each supported file
    vram.py      what the load puts on the GPU, and mainline's --fit        memory.py  the load's memory plan
    search.py    plan's knobs                                               process.py the SimPy process
    kernels.py   ggml's CPU kernels per core, by type and instruction set (measured: sim/calibrate/ggml_kernels.py)
    graph.py     a decode layer's fixed costs: its GPU graph nodes' floor, a CPU MoE layer's split (measured:
                 sim/calibrate/llamacpp_layers.py)
"""

from __future__ import annotations

from sim.engines.base import Engine, MemoryPlan, SearchAxis, refused_tensor
from sim.engines.llamacpp import search
from sim.engines.llamacpp.settings import KEY_NCMOE, ONLY_IN, VARIANTS, Knobs, Settings
from sim.errors import InputError


MAINLINE_TYPE_COUNT = 43  # GGML_TYPE_COUNT, ggml/include/ggml.h at 0c1e57098 (Q2_0 = 42 the last)


class LlamaCpp(Engine):
    name = "llama.cpp"
    label = "llama.cpp"
    description = "llama.cpp with experts in host RAM (--n-cpu-moe, op offload)"
    Settings = Settings
    variants = VARIANTS
    default_objective = "decode_tok_s"
    knobs = search.KNOBS
    context_key = "engine.flags.ctx-size"
    only_in = ONLY_IN
    notes = {"engine.flags.n-cpu-moe": "mainline: the experts of blocks 0..N-1 in host RAM; ik_llama.cpp: the last N "
                                       "MoE layers",
             "engine.flags.override-tensor": 'list of "REGEX=BUFFER" (exps=CPU, blk\\.1[0-9]\\.ffn_.*=CUDA0): the '
                                             "first match wins, before --cpu-moe and --n-cpu-moe",
             "engine.flags.fit": "mainline: with none of -ot, --cpu-moe, --n-cpu-moe, -ngl, the last layers' "
                                 "experts stay in host RAM until the rest fits the GPU with 1 GiB spare",
             "engine.flags.n-gpu-layers": "-ngl N: the last N blocks on the GPU (mainline: the output layer counts as "
                                          "one), the blocks before them whole on the CPU; default every layer"}

    def validate(self, scenario, where: str) -> None:
        """llama.cpp's refusals at load (an unknown buffer type, a pinned buffer RAM cannot hold) and what the model
        does not run; a placement the GPU cannot hold is the plan's `why_no_cache`, refused when the run starts."""
        from sim.engines.llamacpp.memory import plan_memory

        engine = scenario.engine
        flags = engine.flags.model_dump(by_alias=True, exclude_defaults=True)
        env = engine.env.model_dump(exclude_none=True)
        for name in list(flags) + list(env):
            builds = ONLY_IN.get(name)
            if builds and engine.variant not in builds:
                table = "flags" if name in flags else "env"
                raise InputError(where, f"engine.{table}.{name}", flags.get(name, env.get(name)),
                                 f"read only by {', '.join(builds)}; this scenario runs {engine.variant}")
        knobs = Knobs.of(scenario, where)
        plan_memory(scenario, knobs, where)  # refusals of the load itself (pinning)
        for i, request in enumerate(scenario.workload.requests):
            if request.prompt_tokens + request.decode_tokens > knobs.ctx:
                raise InputError(where, f"workload.requests[{i}].prompt_tokens", request.prompt_tokens,
                                 f"llama-server refuses a request beyond --ctx-size {knobs.ctx} (\"the request exceeds "
                                 f"the available context size\"): {request.prompt_tokens} prompt + "
                                 f"{request.decode_tokens} output tokens")

    def plan_memory(self, scenario, domain=None) -> MemoryPlan:
        from sim.engines.llamacpp.memory import plan_memory

        where = str(scenario.path or "scenario")
        return plan_memory(scenario, Knobs.of(scenario, where), where)

    def room_for_a_cache(self, scenario, plan: MemoryPlan) -> tuple[tuple[str, object, str], ...]:
        """Where the default placement does not fit the card (every expert on the GPU: ik_llama.cpp has no --fit),
        the fewest MoE layers whose experts --n-cpu-moe keeps in host RAM for the rest to fit with mainline --fit's
        1 GiB spare: ik's --n-cpu-moe takes the last N, the layers --fit gives up first (vram.fit_placement). ik
        reads the tensors it overrides into pinned CUDA_Host buffers while pinning is on, dropping the file mapping
        (§7); where those exceed the RAM the load fails (memory.plan_memory), and GGML_CUDA_NO_PINNED=1 keeps the
        mapping, the page cache holding what fits. Nothing where the placement fits, mainline places its own
        (--fit), or even every expert on the CPU does not fit."""
        from sim.engines.llamacpp.memory import KEEP_THE_MAPPING, plan_memory
        from sim.engines.llamacpp.vram import FIT_MARGIN_BYTES, fit_placement, vram_allocations
        from sim.engines.llamacpp.weights import file_weights
        from sim.units import GIB

        where = str(scenario.path or "scenario")
        knobs = Knobs.of(scenario, where)
        layout, profile = scenario.layout, scenario.hardware_profile
        if plan.why_no_cache is None or not knobs.variant.ik or knobs.on_cpu.any() or knobs.places_layers:
            return ()
        on_cpu = fit_placement(layout, profile, knobs.ctx, knobs.ubatch, knobs.op_offload, where)
        used = sum(a.bytes for a in vram_allocations(layout, profile, file_weights(layout, where), on_cpu, knobs.ctx,
                                                     knobs.ubatch, knobs.op_offload))
        if used + FIT_MARGIN_BYTES > profile.vram_bytes:
            return ()
        n_cpu = int(on_cpu.any(axis=1).sum())
        every = sum(a.bytes for a in plan.allocations if a.pool == "vram")
        placed = (KEY_NCMOE, n_cpu,
                  f"set here: every expert on the GPU needs {every / GIB:.1f} GiB of its "
                  f"{profile.vram_bytes / GIB:.1f}; the last {n_cpu} of {len(on_cpu)} MoE layers' experts in host "
                  f"RAM leave {(profile.vram_bytes - used) / GIB:.1f} GiB spare (>= {FIT_MARGIN_BYTES // GIB} GiB, "
                  "mainline --fit's margin)")
        flags = scenario.engine.flags
        engine = scenario.engine.model_copy(update={"flags": flags.model_copy(update={"n_cpu_moe": n_cpu})})
        proposed = scenario.model_copy(update={"engine": engine})
        placed_knobs = Knobs.of(proposed, where)
        if not placed_knobs.pinned or flags.no_mmap or flags.run_time_repack:
            return (placed,)
        try:
            plan_memory(proposed, placed_knobs, where)
        except InputError as refusal:  # the pinned buffers exceed the RAM
            return (placed, ("engine.env.GGML_CUDA_NO_PINNED", "1",
                             f"set here: {refusal.why.removesuffix(': ' + KEEP_THE_MAPPING)}; without pinned "
                             "buffers ik keeps the file mapping, the page cache holding what RAM allows"))
        return (placed,)

    def search_space(self, data: dict) -> list[SearchAxis]:
        from sim.model.presets import PRESETS

        layout = PRESETS.get(data.get("model")) if isinstance(data.get("model"), str) else None
        return search.search_space(data, layout.n_routed_layers if layout is not None else 48)

    def records_read(self, scenario) -> tuple[str, ...]:
        """The records a run reads (process.py): its decode graph nodes' floor, a CPU MoE layer's split where a layer
        has experts on the CPU, and the CPU kernels of the slices the CPU computes (kernels.kernel_records)."""
        from sim.engines.llamacpp.kernels import kernel_records
        from sim.engines.llamacpp.vram import part_types

        knobs = Knobs.of(scenario, str(scenario.path or "scenario"))
        layout, host = scenario.layout, scenario.hardware_profile.host
        n = layout.n_routed_layers
        types = part_types(layout)[:n]
        computed = [t for slices in knobs.cpu_computed(n).values() for i, mask in slices for t in types[i][mask]]
        own = host.own_ggml_kernel_types  # which slices run at the host's own rate, whatever that rate is

        def measured_here(type_name: str) -> float | None:
            return 1.0 if type_name in own else None

        kernels = kernel_records(computed, None if host.simd is None else host.simd.value,
                                 "ik" if knobs.variant.ik else "ggml", measured_here)
        split = ("llamacpp-cpu-moe-split",) if knobs.on_cpu[:n].any() else ()
        nodes = "llamacpp-gpu-node-graphs" if knobs.cuda_graphs else "llamacpp-gpu-node-launch"
        return (nodes, *split, *sorted(kernels))

    def context_tokens(self, settings) -> int | None:
        return settings.flags.ctx_size

    def default_variant(self, layout, compute_key: str | None) -> str | None:
        """mainline, or ik_llama.cpp for a file with ik's own types (only ik loads it)."""
        return "ik" if refused_tensor(self, layout, "mainline") is not None else "mainline"

    def unloadable_type(self, variant: str | None, tensor: str, qt) -> str | None:
        """ik_llama.cpp loads its own types; mainline's gguf reader refuses a type id past its GGML_TYPE_COUNT
        (ggml/src/gguf.cpp gguf_init_from_file_impl, 43 at 0c1e57098), and the model load fails."""
        if qt.fork is None or (qt.fork == "ik_llama.cpp" and VARIANTS[variant or "mainline"].ik):
            return None
        return (f"llama.cpp fails to load the file (\"gguf_init_from_file_impl: tensor '{tensor}' has invalid ggml "
                f"type {qt.ggml_id}. should be in [0, {MAINLINE_TYPE_COUNT})\"): {qt.name} is {qt.fork}'s own type; "
                "run it with variant ik")

    def derived_compute(self, layout, profile):
        from sim.engines.llamacpp.weights import derived_compute

        return derived_compute(layout, profile)

    def refuses_hardware(self, profile) -> str | None:
        if profile.is_unified or profile.gpu.api == "metal":
            return "llama.cpp is modelled with a discrete CUDA or ROCm GPU (experts in host RAM behind PCIe)"
        return None

    def runs(self, layout, compute_key: str | None) -> str | None:
        from sim.engines.llamacpp.weights import file_weights

        if compute_key is None:  # the profile has no GPU figures for the model class: nothing timed can run
            return None
        try:
            file_weights(layout, "model")
        except InputError:
            return None
        return "llama.cpp runs it with the experts that do not fit the GPU in host RAM (--n-cpu-moe)"

    def process(self, scenario, routing, recorder, machine, domain):
        from sim.engines.llamacpp.process import LlamaCppProcess

        return LlamaCppProcess(scenario, routing, recorder, machine, domain)


__all__ = ["LlamaCpp", "Settings"]
