"""The cache-only replay, `[engine] name = "replay"`: a scenario's routing through one `expertsim cache` cache.

Untimed: no machine and no clock, so the hardware profile is named but not read (no compute figures needed) and
a run gives counts and bytes only (sim/engines/replay/process.py)."""

from __future__ import annotations

from pathlib import Path

from sim.engines.base import Allocation, Engine, Knob, MemoryPlan, SearchAxis, candidates
from sim.engines.replay.settings import ReplayFlags, Settings
from sim.engines.replay.summary import FIGURES
from sim.errors import InputError
from sim.schema import is_file, safe_path

KEY_SLOTS = "engine.flags.slots"
KEY_POLICY = "engine.flags.policy"


class Replay(Engine):
    name = "replay"
    label = "expertsim cache"
    description = "a cache-only replay"
    Settings = Settings
    variants = {}
    timed = False
    default_objective = "decode_hit_rate"
    knobs = (Knob(KEY_SLOTS, "cache", "slots"), Knob(KEY_POLICY, "cache policy"))
    flags_note = "the `expertsim cache` options, as that command takes them"
    notes = {KEY_POLICY: "lru, lfu, opt (Belady's bound), static (filled once from a ranking) or ds4-slab (one slab "
                         "released at every expert-size change)",
             "engine.flags.prefill-mode": "evict: every prefill miss evicts; append: hit, fill free slots, else load "
                                          "directly (ds4 after #504)"}
    # Its summary leads with the cache's figures and their tables; its sweep rows add these.
    headline = (*FIGURES, "direct_loads", "evictions")
    extra_metrics = ("hit_rate", "misses", "load_bytes")
    summary_tables = ("per_phase", "per_class")

    def validate(self, scenario, where: str) -> None:
        from sim.cache.replay import Geometry, capacity_pools

        layout, base = scenario.layout, scenario.path.parent
        flags: ReplayFlags = scenario.engine.flags
        if flags.policy == "opt" and flags.prefill_mode != "evict":
            raise InputError(where, "engine.flags.prefill-mode", flags.prefill_mode,
                             "opt is the bound of an evicting cache: use evict")
        if flags.profile is not None:
            if flags.policy != "static":
                raise InputError(where, "engine.flags.profile", flags.profile,
                                 f"read only by policy static; this scenario's policy is {flags.policy}")
            safe_path(where, "engine.flags.profile", flags.profile)
            path = Path(flags.profile) if Path(flags.profile).is_absolute() else base / flags.profile
            if not is_file(path):
                raise InputError(where, "engine.flags.profile", flags.profile, f"no such file ({path})")
        # A replay routes the model's routed layers (no MTP draft steps).
        geometry = Geometry.of_layout(layout, layout.n_routed_layers)
        scope, pool_keys = capacity_pools(geometry, flags.policy, flags.scope)
        slots = flags.slots if isinstance(flags.slots, list) else [flags.slots] * len(pool_keys)
        if len(slots) != len(pool_keys):
            pools = "size class" if flags.policy == "ds4-slab" or scope == "class" else scope
            raise InputError(where, "engine.flags.slots", flags.slots,
                             f"{len(slots)} counts; policy {flags.policy}, scope {scope} on {layout.name} takes one "
                             f"count, or one per {pools} ({len(pool_keys)})")
        for pool, (count, keys) in enumerate(zip(slots, pool_keys)):
            if count > keys:  # the kernels allocate every slot: a count beyond the pool's experts is no cache at all
                raise InputError(where, "engine.flags.slots", flags.slots,
                                 f"{count} slots in pool {pool}, which has only {keys} experts")

    def plan_memory(self, scenario, domain=None) -> MemoryPlan:
        """Nothing runs beside the cache: the GPU's memory less the runtime's reservation is all the cache's (an
        upper bound: the model's other weights are not counted)."""
        profile = scenario.hardware_profile
        reserved = profile.runtime_reserved_bytes
        return MemoryPlan((Allocation("vram", "runtime reserved (driver, context)", reserved),),
                          profile.vram_bytes - reserved)

    def search_space(self, data: dict) -> list[SearchAxis]:
        """The slot count (the scenario's, half and twice it) and the policy (the scenario's, LRU and LFU)."""
        flags = (data.get("engine") or {}).get("flags") or {}
        slots = flags.get("slots")
        counts = [slots] if isinstance(slots, list) else candidates(slots, max(1, slots // 2), slots * 2) \
            if isinstance(slots, int) else []
        policy = flags.get("policy", "lru")
        return [SearchAxis(self.knobs[0], counts, True),
                SearchAxis(self.knobs[1], candidates(policy, "lru", "lfu"), False)]

    def unloadable_type(self, variant: str | None, tensor: str, qt) -> str | None:
        return None  # a replay reads the routing and the experts' sizes only, whatever their type

    def runs(self, layout, compute_key: str | None) -> str | None:
        return "its routing is replayed through one cache: hit rates, no timing"

    def starting_settings(self, layout, profile, typed: frozenset[str] = frozenset()) -> dict:
        slots = replay_slots(layout, profile)
        return {"slots": (slots, f"slots per pool (per layer with scope layer): {slots} of {layout.n_experts} experts, "
                                 f"what {profile.name}'s GPU memory holds of every layer beside the runtime's "
                                 "reservation (the model's other weights not counted: an upper bound)")}

    def one_pass(self, table: dict) -> str | None:
        from sim.cache.replay import mrc_exact  # numba: imported only for a replay's points

        flags = ReplayFlags.model_validate(table.get("flags", {}))
        return KEY_SLOTS if mrc_exact(flags.policy, flags.prefill_mode) else None

    def one_pass_figures(self, scenario, values: list) -> list[dict]:
        from sim.engines.replay.process import mrc_figures

        return mrc_figures(scenario, values)

    def process(self, scenario, routing, recorder, machine, domain):
        from sim.engines.replay.process import ReplayProcess

        return ReplayProcess(scenario, routing)


def replay_slots(layout, profile) -> int:
    """Slots per layer for a replay: as many experts of every routed layer as the GPU's memory holds beside the
    runtime's reservation (the model's other weights not counted: an upper bound), at least one."""
    per_slot_bytes = layout.max_expert_bytes * layout.n_routed_layers
    fit = (profile.vram_bytes - profile.runtime_reserved_bytes) // per_slot_bytes
    return int(max(1, min(layout.n_experts, fit)))


__all__ = ["Replay", "ReplayFlags", "Settings", "replay_slots"]
