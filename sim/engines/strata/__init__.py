"""Strata (Niko1221/Strata v0.1.35 .. 0.1.40, the live-memory builds, and the #658 fork spideytznn/Strata):
Qwen3.8-Flash-Next with a profile-filled sized-slot expert cache, prompt buffers borrowed from its cold tail, RAM
tiers and a conversation cache (reference/strata-engine.md).

    settings.py  the [engine] table, the builds and the knobs parsed once      geometry.py  the one geometry it runs
    memory.py    the memory plan before the cache    sizing.py  the cache      pricing.py   the prompt path's bytes
    lending.py   loans and independent buffers       ram.py     RAM tiers      conversations.py  parking rules
    search.py    plan's knobs
    process.py   the SimPy process (startup, prompt_stream, loans, decode, sessions beside it)
"""

from __future__ import annotations

from sim.engines.base import Engine, MemoryPlan, SearchAxis
from sim.engines.strata import search
from sim.engines.strata.geometry import GEOMETRY, geometry_mismatch
from sim.engines.strata.ram import MMAP_CPU_HEADROOM_GIB, RESIDENT_HEADROOM_GIB
from sim.engines.strata.settings import BUILDS, KEY_HEADROOM, KEY_OWN, ONLY_IN, Knobs, Settings, check_settings
from sim.units import GIB

NEWEST_RELEASE = "v0.1.40"  # v0.1.40-live needs a resident budget and an expert profile (docs/LIVE_MEMORY.md)
# the flags that choose the RAM mode (settings.Flags): a user who sets one keeps it at scenario init
RAM_MODE_KEYS = frozenset(f"engine.flags.{flag}"
                          for flag in ("resident-experts", "resident-budget-gib", "mmap-experts"))


def _geometry_text() -> str:
    return ", ".join(f"{field} {' or '.join(map(str, allowed))}" for field, allowed in GEOMETRY.items())


class Strata(Engine):
    name = "strata"
    label = "Strata"
    reads_prompt_in_chunks = True  # startup's profile counts, the prompt's parts and chunks (startup.pair_counts)
    description = "Strata's sized-slot expert cache"
    Settings = Settings
    variants = BUILDS
    default_objective = "prefill_tok_s"
    knobs = search.KNOBS
    context_key = "engine.flags.max-context"
    only_in = ONLY_IN
    notes = {KEY_HEADROOM: f"unset = {RESIDENT_HEADROOM_GIB} GiB with resident-experts or resident-budget-gib, "
                           f"{MMAP_CPU_HEADROOM_GIB} GiB otherwise",
             KEY_OWN: 'fork-658 only; unset = on, "0" always borrows'}

    def validate(self, scenario, where: str) -> None:
        """Strata's refusals: what the engine would refuse, and what the model does not simulate."""
        check_settings(scenario, where)

    def starting_settings(self, layout, profile, typed: frozenset[str] = frozenset()) -> dict:
        """Where the arena (the default RAM mode: every expert read into RAM) exceeds the box's RAM and the user
        chose no RAM mode, start from --resident-experts: only the experts the GPU cache lacks in RAM, or the
        mapped files when even they do not fit (strata-engine.md §3.5)."""
        available = profile.ram_bytes - profile.os_reserved_bytes
        if layout.total_expert_bytes <= available or typed & RAM_MODE_KEYS:
            return {}
        return {"resident-experts": (True, f"the arena, Strata's default RAM mode, reads every expert into RAM: "
                                           f"{layout.total_expert_bytes / GIB:.1f} GiB of experts, "
                                           f"{available / GIB:.1f} GiB of RAM beside the OS; resident mode holds "
                                           "only those the GPU cache lacks, or maps the files when even they do "
                                           "not fit")}

    def plan_memory(self, scenario, domain=None) -> MemoryPlan:
        """The startup's memory plan (memory.plan_memory); its refusal comes when the engine starts."""
        from sim.engines.records import Domain
        from sim.engines.strata.memory import plan_memory

        if domain is None:
            domain = Domain(self.name, scenario.layout.name, scenario.hardware_profile.name,
                            self.context_tokens(scenario.engine))
        return plan_memory(scenario, Knobs.of(scenario), domain, str(scenario.path or "scenario"))

    def search_space(self, data: dict) -> list[SearchAxis]:
        return search.search_space(data)

    def owned_buffers(self, settings: dict) -> bool:
        return search.owned_buffers(settings)

    def context_tokens(self, settings) -> int:
        return settings.flags.max_context

    def records_read(self, scenario) -> tuple[str, ...]:
        """The runtime buffers of its platform, the decode window's layer latency and a short part's window time."""
        from sim.engines.strata.memory import runtime_record_id

        return (runtime_record_id(scenario.hardware_profile), "strata-decode-layer-latency", "strata-short-read")

    def refuses_hardware(self, profile) -> str | None:
        if profile.gpu.api == "metal":
            return "Strata is a C++/CUDA engine with HIP and SYCL ports (strata-engine.md §0): it has no Metal backend"
        return None

    def runs(self, layout, compute_key: str | None) -> str | None:
        if geometry_mismatch(layout) is not None:
            return None
        return f"Strata's kernels are built for one geometry ({_geometry_text()}), which {layout.name} has"

    def scope(self) -> str:
        return f"Strata: {_geometry_text()} only"

    def default_variant(self, layout, compute_key: str | None) -> str:
        return NEWEST_RELEASE

    def process(self, scenario, routing, recorder, machine, domain):
        from sim.engines.strata.process import StrataProcess

        return StrataProcess(scenario, routing, recorder, machine, domain)


__all__ = ["BUILDS", "Settings", "Strata"]
