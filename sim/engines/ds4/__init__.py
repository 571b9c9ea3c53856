"""ds4 (antirez/ds4, DeepSeek V4 and the neutronstar GLM-5.2 stack): CUDA/ROCm and Metal SSD streaming with an
expert cache in VRAM, one slab before PR #504 and per size class after it (reference/ds4-engine.md).

    settings.py  the [engine] table, the variants and every knob parsed once (Knobs)
    geometry.py  the model families and the layers a run routes        weights.py  non-routed weights, work per layer
    sizing.py    the live budget, per-class caches, growth, OOM         planner.py  the later builds' budget planner
    memory.py    the memory plan before the cache                       search.py   plan's knobs
    process.py   the SimPy process (caches, loads, decode, prefill, metal beside it)
"""

from __future__ import annotations

from sim.engines.base import Engine, MemoryPlan, SearchAxis
from sim.engines.ds4 import search
from sim.engines.ds4.geometry import family_of, model_family
from sim.engines.ds4.settings import (DEFAULT_VRAM_RESERVE_GIB, KEY_RESERVE, METAL_VARIANTS, NOT_MODELLED, ONLY_IN,
                                      VRAM_RESERVE_MAX_FRACTION_OF_TOTAL, VARIANTS, Knobs, Settings, check_backend,
                                      check_budget, check_flags, check_reserve_read, context_tokens)
from sim.errors import InputError

# ds4's build per model family: for DeepSeek V4 upstream's newest (VARIANTS lists upstream's builds in merge order,
# PR #1082 last, then the neutronstar fork's); GLM-5.2's shape (DS4_SHAPE_GLM52) exists only in the neutronstar
# fork's ds4.c (ds4-engine.md §2.4), so its newest build there.
VARIANT_BY_FAMILY = {"deepseek-v4": "pr1082", "glm-5.2": "neutronstar-glm"}
RECORDS_BY_FAMILY = {"deepseek-v4.1": ("ds4-v41-graph-8k", "ds4-v41-graph-400k"),
                     "deepseek-v4": ("ds4-flash-buffers-503",), "glm-5.2": ("ds4-glm52-buffers-neutronstar",)}


class Ds4(Engine):
    name = "ds4"
    label = "ds4"
    description = "ds4's SSD-streaming expert cache"
    Settings = Settings
    variants = VARIANTS
    default_objective = "decode_tok_s"
    knobs = search.KNOBS
    context_key = "engine.flags.ctx"
    only_in = ONLY_IN
    not_modelled = NOT_MODELLED
    notes = {"engine.flags.ssd-streaming": "experts stream from the SSD: ds4 is modelled with --ssd-streaming only",
             KEY_RESERVE: f"whole GiB as a string; unset = {DEFAULT_VRAM_RESERVE_GIB} GiB; at most VRAM / "
                          f"{1 / VRAM_RESERVE_MAX_FRACTION_OF_TOTAL:g}"}

    def validate(self, scenario, where: str) -> None:
        """ds4's refusals: what the engine would refuse, and what the model does not simulate."""
        layout, engine = scenario.layout, scenario.engine
        check_flags(scenario, where)
        check_backend(scenario, where)
        check_reserve_read(scenario, where)
        mtp = engine.flags.mtp
        if mtp is not None and not VARIANTS[engine.variant].mtp_streaming:
            raise InputError(where, "engine.flags.mtp", mtp,
                             "ds4 rejects --mtp together with --ssd-streaming (ds4.c L25685 @80ebbc3)")
        if mtp is not None and layout.n_mtp_layers == 0:
            raise InputError(where, "engine.flags.mtp", mtp,
                             f"model {layout.name} has no MTP layer in its file; variant {engine.variant} runs the "
                             "draft layer bound from the main GGUF (a separate MTP GGUF is not modelled)")
        if model_family(scenario) is None:
            raise InputError(where, "model", layout.name,
                             "ds4 is modelled for DeepSeek V4 (Flash, Pro), V4.1 Flash and GLM-5.2 files (set "
                             "model_class to deepseek-v4-flash, deepseek-v4.1-flash or glm-5.2 for a GGUF)")
        check_budget(scenario, where)

    def plan_memory(self, scenario, domain=None) -> MemoryPlan:
        """The startup's memory plan (memory.plan_memory); its refusals come when the engine starts."""
        from sim.engines.ds4.geometry import Layers
        from sim.engines.ds4.memory import plan_memory
        from sim.engines.records import Domain

        where = str(scenario.path or "scenario")
        knobs = Knobs.of(scenario, where)
        if domain is None:
            domain = Domain(self.name, scenario.layout.name, scenario.hardware_profile.name, knobs.ctx)
        return plan_memory(scenario, knobs, Layers.of(scenario.layout, knobs.mtp), domain, where)

    def room_for_a_cache(self, scenario, plan: MemoryPlan) -> tuple[tuple[str, str, str], ...]:
        """The reserve as the whole GiB that holds one layer of the largest class's experts: the compact staging a
        prompt chunk grows to (nearly every expert of a layer, ds4-engine.md §1.7), which the reserve is there to
        leave room for (#780 and #732: prefill OOMs on 12 GB cards). None where that is no smaller than the
        reserve that left no cache (then none)."""
        import math

        from sim.engines.ds4.geometry import Layers
        from sim.units import GIB

        knobs = Knobs.of(scenario, str(scenario.path or "scenario"))
        layers = Layers.of(scenario.layout, knobs.mtp)
        staging_gib = math.ceil(layers.n_experts * max(layers.class_bytes) / GIB)
        if plan.why_no_cache is None or staging_gib * GIB >= knobs.reserve_bytes:
            return ()
        return ((KEY_RESERVE, str(staging_gib),
                 f"set here: ds4's default reserve ({DEFAULT_VRAM_RESERVE_GIB} GiB, at most VRAM / 2) leaves no expert "
                 f"cache on this card; {staging_gib} GiB holds the staging of one layer's {layers.n_experts} experts "
                 f"of its largest class, what a prompt chunk grows to (ds4-engine.md §1.7)"),)

    def search_space(self, data: dict) -> list[SearchAxis]:
        return search.search_space(data)

    def context_tokens(self, settings) -> int:
        return context_tokens(settings.flags)

    def records_read(self, scenario) -> tuple[str, ...]:
        """Its family's resident-set record(s) (memory.resident_set), the graph encode per decode token and, on the
        Metal backend, its host round trip per router readback."""
        metal = ("ds4-metal-round-trip-437",) if scenario.hardware_profile.gpu.api == "metal" else ()
        return (*RECORDS_BY_FAMILY[model_family(scenario)], "ds4-graph-encode-773", *metal)

    def runs(self, layout, compute_key: str | None) -> str | None:
        family = family_of(layout, compute_key)
        if family is None:
            return None
        return f"ds4 is modelled for DeepSeek V4 and GLM-5.2 files; {layout.name} is {family}"

    def scope(self) -> str:
        return "ds4: DeepSeek V4 and GLM-5.2 files only"

    def default_variant(self, layout, compute_key: str | None) -> str:
        return VARIANT_BY_FAMILY.get(family_of(layout, compute_key), VARIANT_BY_FAMILY["deepseek-v4"])

    def process(self, scenario, routing, recorder, machine, domain):
        from sim.engines.ds4.process import Ds4Process

        return Ds4Process(scenario, routing, recorder, machine, domain)


__all__ = ["Ds4", "METAL_VARIANTS", "Settings", "VARIANTS"]
