"""Strata's RAM tiers (strata-engine.md §3.5, §3.6), as pure functions:

  RAM        complement of the GPU cache must fit available - headroom; lend region covered from the
             last slot backwards (resident_ram_plan); uncovered lent slots are file-blob reads per refill
  #658       conversation_expert_headroom: the conversation budget inside the headroom
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.errors import InputError
from sim.schema import check_int
from sim.units import GIB, MIB

# fmt: off
U64_MAX = (1 << 64) - 1                            # size_t saturation in the fork's helpers (§3.5)
CONVERSATION_HEADROOM_MARGIN_MIB = 256             # fork: budget + min_free + 256 MiB (§3.5, seed)
RESIDENT_HEADROOM_GIB = 4                          # --resident-experts / --resident-budget-gib (§3.5)
MMAP_CPU_HEADROOM_GIB = 8                          # other resident modes (§3.5)
BUDGET_MODE_MARGIN_MIB = 256                       # --resident-budget-gib clamp: available - headroom - 256 MiB (§3.5)
# fmt: on


def conversation_expert_headroom(existing_headroom_bytes: int, conv_budget_bytes: int, conv_slots: int,
                                 conv_min_free_bytes: int, *, resident_experts: bool = True,
                                 prompt_cache_entries: int = 6) -> int:
    """The fork's conversation_expert_headroom (§3.5, seed): with resident experts and an enabled
    conversation cache (budget > 0, slots > 0, prompt cache > 0) the headroom is
    max(existing, budget + min_free + 256 MiB), saturating at 2^64 - 1; otherwise unchanged."""
    where = "conversation_expert_headroom"
    existing = check_int(where, "existing_headroom_bytes", existing_headroom_bytes)
    budget = check_int(where, "conv_budget_bytes", conv_budget_bytes)
    min_free = check_int(where, "conv_min_free_bytes", conv_min_free_bytes)
    if not (resident_experts and budget > 0 and check_int(where, "conv_slots", conv_slots) > 0
            and check_int(where, "prompt_cache_entries", prompt_cache_entries) > 0):
        return existing
    wanted = min(budget + min_free + CONVERSATION_HEADROOM_MARGIN_MIB * MIB, U64_MAX)
    return max(existing, wanted)


# --resident-experts; --resident-cpu-experts with --mmap-experts and a static profile; --resident-budget-gib G
# --resident-experts; --resident-cpu-experts with --mmap-experts and a static profile; --resident-budget-gib G
RESIDENT_MODES = ("resident-experts", "resident-cpu-experts", "resident-budget")


def resident_headroom_bytes(mode: str, env_headroom_gib: str | None = None) -> int:
    """Headroom under available RAM (§3.5): 4 GiB for --resident-experts and --resident-budget-gib, 8 GiB
    for the other resident mode; STRATA_RESIDENT_HEADROOM_GIB overrides (the fork set 4.75)."""
    if mode not in RESIDENT_MODES:
        raise InputError("resident RAM", "mode", mode, f"one of {', '.join(RESIDENT_MODES)}")
    if env_headroom_gib is not None:
        try:
            gib = float(env_headroom_gib)
        except ValueError:
            raise InputError("STRATA_RESIDENT_HEADROOM_GIB", "value", env_headroom_gib,
                             "must be a number of GiB") from None
        if not gib >= 0:
            raise InputError("STRATA_RESIDENT_HEADROOM_GIB", "value", env_headroom_gib, "must be >= 0")
        return int(gib * GIB)
    return (MMAP_CPU_HEADROOM_GIB if mode == "resident-cpu-experts" else RESIDENT_HEADROOM_GIB) * GIB


@dataclass(frozen=True)
class ResidentPlan:
    """The RAM side of resident mode. outcome: "resident" (complement in RAM), "mmap-fallback"
    (--resident-experts whose complement does not fit: plain mmap, warning), "startup-failure" (the other
    mode), "budget" (--resident-budget-gib: budget_copy_bytes of the complement by rank, no lend copies).
    covered_lent_slots are RAM copies of lend-region slots; file_blob_reads_per_refill = lent - covered.
    Messages are ours (the engine's wording is not in the notes)."""

    outcome: str
    complement_bytes: int
    ram_budget_bytes: int
    kept_lend_bytes: int
    covered_lent_slots: int
    file_blob_reads_per_refill: int
    keep_from_slot: int | None
    budget_copy_bytes: int
    message: str | None


def resident_ram_plan(total_expert_bytes: int, cache_blob_bytes: np.ndarray, lend_first_slot: int | None,
                      available_ram_bytes: int, headroom_bytes: int, *, mode: str = "resident-experts",
                      resident_budget_bytes: int | None = None) -> ResidentPlan:
    """Resident RAM mode and choose_resident_keep_from (expert_source.cpp, generate.cpp, §3.5, §3.6).

    complement = every expert not in the GPU cache = total expert bytes - blob bytes of the cached pairs;
    budget = available - headroom. The complement must fit, else startup fails ("resident-cpu-experts")
    or --resident-experts falls back to plain mmap. Then the lend region (slots from lend_first_slot to
    the end) gets RAM copies from the LAST slot backwards while complement + kept <= budget (stopping at
    the first that does not fit). cache_blob_bytes are the cached pairs' blob bytes in slot order.
    """
    where = "resident RAM"
    if mode not in RESIDENT_MODES:
        raise InputError(where, "mode", mode, f"one of {', '.join(RESIDENT_MODES)}")
    blobs = np.asarray(cache_blob_bytes, dtype=np.int64)
    slots = len(blobs)
    complement = check_int(where, "total_expert_bytes", total_expert_bytes) - int(blobs.sum())
    if complement < 0:
        raise InputError(where, "total_expert_bytes", total_expert_bytes, "is smaller than the cached blobs")
    budget = (check_int(where, "available_ram_bytes", available_ram_bytes)
              - check_int(where, "headroom_bytes", headroom_bytes))
    lent = 0 if lend_first_slot is None else slots - check_int(where, "lend_first_slot", lend_first_slot)
    if lent < 0:
        raise InputError(where, "lend_first_slot", lend_first_slot, f"beyond the cache's {slots} slots")
    if mode == "resident-budget":
        clamp = max(0, budget - BUDGET_MODE_MARGIN_MIB * MIB)
        asked = -1 if resident_budget_bytes is None else resident_budget_bytes
        asked = check_int(where, "resident_budget_bytes", asked)
        copy = min(asked, clamp, complement)
        return ResidentPlan("budget", complement, budget, 0, 0, lent, None, copy, None)
    if complement > budget:
        gib = f"{complement / GIB:.2f} GiB complement > {max(budget, 0) / GIB:.2f} GiB budget " \
              f"(available {available_ram_bytes / GIB:.2f} - headroom {headroom_bytes / GIB:.2f} GiB)"
        if mode == "resident-experts":
            return ResidentPlan("mmap-fallback", complement, budget, 0, 0, lent, None, 0,
                                f"warning: resident experts do not fit ({gib}); falling back to mmap")
        return ResidentPlan("startup-failure", complement, budget, 0, 0, lent, None, 0,
                            f"resident experts do not fit ({gib})")
    spare = budget - complement
    tail = np.cumsum(blobs[::-1][:lent])
    covered = int(np.searchsorted(tail, spare, side="right"))
    kept = int(tail[covered - 1]) if covered else 0
    return ResidentPlan("resident", complement, budget, kept, covered, lent - covered,
                        slots - covered if covered else None, complement, None)
