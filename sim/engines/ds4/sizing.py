"""ds4's CUDA streaming expert cache sizing, as pure functions (antirez/ds4 @80ebbc3, and PR #504).

Sources: reference/ds4-engine.md §1.2-§1.4, §1.7, §1.12, §1.13 and §6 (line numbers are those of
`ds4_cuda.cu` @80ebbc3 unless a "port" line of giannisanni/neutronstar @db82323 is named). The rules (the budget
and the reserve as ds4 parses them: sim/engines/ds4/settings.py):

  live cap   cap = min(requested, floor((free + reclaim - reserve) / expert_bytes)); disabled when
             free + reclaim <= reserve; a notice when cap != requested, printed only when it differs
             from the last one printed
  classes    after #504 up to 4 caches keyed by (gate bytes, down bytes), allocated in first-touch order
             from one free VRAM: the last class gets the leftover (allocate_class_caches)
  slab       before #504 one cache keyed on the last size seen: every size change releases it and
             resets the notice dedup, so mixed files print a notice at every transition
             (replay_cache_sizing(per_class=False))
  growth     a same-size cache smaller than its target is released and reallocated EMPTY when the
             live cap allows more (prepare_class_cache)
  OOM        cap -= ceil(cap / 10) per failed allocation until it fits or reaches 0 (oom_shrink)
  staging    batch prefill staging = |union| x expert bytes, grow-only (prefill_staging_bytes)
  hotlist    after each batch prefill, up to `preload` experts of the popularity list, IQ2 layers only,
             layer by layer (hotlist_seed_plan; how many: settings.hotlist_preload_experts)

Messages are the engine's text without its "ds4: " stderr prefix; numbers print with two decimals, as
in the #503 log ("available 81.57 GiB, reserve 16.00 GiB, 13.50 MiB/expert").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sim.engines.ds4.geometry import expert_bytes
from sim.engines.ds4.settings import VRAM_RESERVE_MAX_FRACTION_OF_TOTAL
from sim.errors import InputError
from sim.schema import check_int
from sim.units import GIB, MIB

# fmt: off
MAX_EXPERT_SIZE_CLASSES = 4                        # port L218-231: DS4_CUDA_STREAM_EXPERT_CLASSES (§1.2)
OOM_SHRINK_DIVISOR = 10                            # shrunken_cap L1605: cap -= ceil(cap / 10) (§1.3)
# fmt: on


def _gib(n_bytes: int) -> str:
    return f"{n_bytes / GIB:.2f}"


def capped_notice(requested_experts: int, capacity_experts: int, available_bytes: int, reserve_bytes: int,
                  expert_size_bytes: int) -> str:
    return (f"CUDA streaming expert cache capped from {requested_experts} to {capacity_experts} experts "
            f"(available {_gib(available_bytes)} GiB, reserve {_gib(reserve_bytes)} GiB, "
            f"{expert_size_bytes / MIB:.2f} MiB/expert)")


def disabled_notice(available_bytes: int, reserve_bytes: int) -> str:
    return (f"CUDA streaming expert cache disabled: available {_gib(available_bytes)} GiB "
            f"<= reserve {_gib(reserve_bytes)} GiB")


@dataclass(frozen=True)
class LiveBudget:
    """What live_budget decides for one allocation: capacity in experts (0 when disabled) and the notice
    the engine would print (None when cap == requested). Dedup is the caller's (NoticeDedup)."""

    capacity_experts: int
    notice: str | None
    disabled: bool


def live_budget(requested_experts: int, expert_size_bytes: int, free_vram_bytes: int, reserve_bytes: int,
                reclaim_bytes: int = 0) -> LiveBudget:
    """live_budget (L1510-1579, §1.3): available = free + reclaim; disabled if available <= reserve; else
    cap = min(requested, floor((available - reserve) / expert bytes)), noticed when cap != requested."""
    where = "ds4 live budget"
    check_int(where, "requested_experts", requested_experts, 0)
    check_int(where, "expert_size_bytes", expert_size_bytes, 1)
    check_int(where, "free_vram_bytes", free_vram_bytes)
    check_int(where, "reserve_bytes", reserve_bytes)
    check_int(where, "reclaim_bytes", reclaim_bytes)
    available_bytes = free_vram_bytes + reclaim_bytes
    if available_bytes <= reserve_bytes:
        return LiveBudget(0, disabled_notice(available_bytes, reserve_bytes), True)
    capacity = min(requested_experts, (available_bytes - reserve_bytes) // expert_size_bytes)
    notice = None
    if capacity != requested_experts:
        notice = capped_notice(requested_experts, capacity, available_bytes, reserve_bytes, expert_size_bytes)
    return LiveBudget(capacity, notice, False)


class NoticeDedup:
    """The engine's notice de-duplication: print only if the value differs from the last one printed.

    One instance per notice state: a single global one before #504, one per size class after it.
    `reset()` is note_size()'s reset on a size change before #504 (L1592-1603).
    """

    def __init__(self) -> None:
        self._last: str | None = None

    def reset(self) -> None:
        self._last = None

    def emit(self, notice: str | None) -> str | None:
        if notice is None or notice == self._last:
            return None
        self._last = notice
        return notice


# ------------------------------------------------------------------------------------------ classes (#504)


def allocate_class_caches(class_expert_bytes: Sequence[int], budget_experts: int, total_vram_bytes: int,
                          free_vram_bytes: int, reserve_bytes: int,
                          other_allocation_bytes: int | Sequence[int] = 0) -> tuple[LiveBudget, ...]:
    """Per-class capacities after PR #504 (§1.13, §6): classes in first-touch order, each sized by
    live_budget from what the earlier classes left of the same free VRAM.

    class_expert_bytes: expert bytes of each class, first touched first (q2 at layer 0, then q4).
    budget_experts: the configured budget, applied to EACH class (the budget is per class, not global).
    free_vram_bytes: free VRAM before any expert cache is allocated.
    reserve_bytes: the reserve (clamped here to total VRAM / 2, as vram_reserve_bytes does).
    other_allocation_bytes: VRAM held by other allocations (compact staging, say) when each class is
      allocated: one number for all, or one per class (staging is grow-only, so pass its size then).
    """
    where = "ds4 class caches"
    n = len(class_expert_bytes)
    if not 1 <= n <= MAX_EXPERT_SIZE_CLASSES:
        raise InputError(where, "classes", n, f"ds4 keeps 1..{MAX_EXPERT_SIZE_CLASSES} size classes")
    check_int(where, "total_vram_bytes", total_vram_bytes, 1)
    reserve_bytes = min(check_int(where, "reserve_bytes", reserve_bytes),
                        int(total_vram_bytes * VRAM_RESERVE_MAX_FRACTION_OF_TOTAL))
    others = ([other_allocation_bytes] * n if isinstance(other_allocation_bytes, (int, np.integer))
              else list(other_allocation_bytes))
    if len(others) != n:
        raise InputError(where, "other_allocation_bytes", len(others), f"needs one value per class ({n})")
    allocated_bytes, out = 0, []
    for size, other in zip(class_expert_bytes, others):
        size = check_int(where, "class expert bytes", size, 1)
        other = check_int(where, "other_allocation_bytes", other)
        free_now = max(0, free_vram_bytes - allocated_bytes - other)
        decision = live_budget(budget_experts, size, free_now, reserve_bytes)
        allocated_bytes += decision.capacity_experts * size
        out.append(decision)
    return tuple(out)


# ------------------------------------------------------------------------------------------ prepare / growth


@dataclass(frozen=True)
class CacheState:
    """One (class) cache: the (gate, down) size it was built for and its capacity in experts."""

    size_key: tuple[int, int]
    capacity_experts: int


@dataclass(frozen=True)
class PrepareOutcome:
    state: CacheState | None  # None: no cache (disabled)
    flushed: bool  # every cached expert was lost (size change or growth)
    allocated: bool  # a new allocation was made (count = 0, tick = 0)
    notice: str | None  # from live_budget, before dedup; growth checks print none


def prepare_class_cache(existing: CacheState | None, size_key: tuple[int, int], target_experts: int,
                        free_vram_bytes: int, reserve_bytes: int) -> PrepareOutcome:
    """prepare() (L1820-1933; port L1973, §1.4) for one class.

    free_vram_bytes is what cudaMemGetInfo would report with `existing` still allocated.
    - another size: release (flush) and allocate fresh with the live budget (and its notice);
    - capacity >= target: keep as is;
    - smaller than target: recompute the live cap with reclaim = capacity x bytes and no notice; if it
      exceeds the capacity, release and reallocate EMPTY at the new cap (growth flushes the cache).
    """
    size_bytes = expert_bytes(*size_key)
    if existing is not None and existing.size_key == size_key:
        if existing.capacity_experts >= target_experts:
            return PrepareOutcome(existing, False, False, None)
        reclaim = existing.capacity_experts * size_bytes
        grown = live_budget(target_experts, size_bytes, free_vram_bytes, reserve_bytes, reclaim)
        if grown.capacity_experts > existing.capacity_experts:
            return PrepareOutcome(CacheState(size_key, grown.capacity_experts), existing.capacity_experts > 0,
                                  True, None)
        return PrepareOutcome(existing, False, False, None)
    flushed = existing is not None and existing.capacity_experts > 0
    if existing is not None:  # released before the new size is sized: its bytes are free again
        free_vram_bytes += existing.capacity_experts * expert_bytes(*existing.size_key)
    fresh = live_budget(target_experts, size_bytes, free_vram_bytes, reserve_bytes)
    state = CacheState(size_key, fresh.capacity_experts) if fresh.capacity_experts > 0 else None
    return PrepareOutcome(state, flushed, state is not None, fresh.notice)


@dataclass(frozen=True)
class SizingReplay:
    """A sequence of layer visits replayed through prepare(): the capacity serving each visit (0 when the
    cache is disabled), the notices printed as (visit index, text), and how often a cache holding experts
    was thrown away (size changes and growth)."""

    capacities: tuple[int, ...]
    notices: tuple[tuple[int, str], ...]
    flushes: int
    allocations: int


def replay_cache_sizing(visit_size_keys: Sequence[tuple[int, int]], requested_experts: int,
                        free_vram_bytes: int, reserve_bytes: int, *, per_class: bool,
                        other_allocation_bytes: int = 0) -> SizingReplay:
    """Replay the cache sizing over layer visits in forward order (one key per layer visit).

    per_class=False is @80ebbc3: one slab keyed on the last size seen; a size change runs note_size()
    (reset of the runtime cap and the global notice dedup) and prepare() releases the whole slab, so a
    mixed q2/q4 file prints the cap notice at every transition (§1.12).
    per_class=True is PR #504: up to 4 class caches with per-class dedup; a 5th size recycles class 0
    (released, its cap and notice reset).
    free_vram_bytes: free VRAM with no expert cache allocated (less other_allocation_bytes).
    """
    check_int("ds4 replay", "free_vram_bytes", free_vram_bytes)
    base_free = max(0, free_vram_bytes - check_int("ds4 replay", "other_allocation_bytes", other_allocation_bytes))
    n_classes = MAX_EXPERT_SIZE_CLASSES if per_class else 1
    keys: list[tuple[int, int] | None] = [None] * n_classes
    states: list[CacheState | None] = [None] * n_classes
    dedups = [NoticeDedup() for _ in range(n_classes)]
    capacities, notices, flushes, allocations = [], [], 0, 0
    for visit, key in enumerate(visit_size_keys):
        if per_class:
            if key in keys:
                c = keys.index(key)
            elif None in keys:
                c = keys.index(None)
                keys[c] = key
                dedups[c].reset()
            else:  # class_index(): all 4 taken, release class 0 and reuse it
                c = 0
                flushes += states[0] is not None and states[0].capacity_experts > 0
                states[0], keys[0] = None, key
                dedups[0].reset()
        else:
            c = 0
            if keys[0] != key:  # note_size(): a new size resets the runtime cap and the notice
                keys[0] = key
                dedups[0].reset()
        held = sum(s.capacity_experts * expert_bytes(*s.size_key) for s in states if s is not None)
        outcome = prepare_class_cache(states[c], key, requested_experts, max(0, base_free - held), reserve_bytes)
        flushes += outcome.flushed
        allocations += outcome.allocated
        states[c] = outcome.state
        printed = dedups[c].emit(outcome.notice)
        if printed is not None:
            notices.append((visit, printed))
        capacities.append(0 if outcome.state is None else outcome.state.capacity_experts)
    return SizingReplay(tuple(capacities), tuple(notices), flushes, allocations)


# ------------------------------------------------------------------------------------------ OOM


def shrunken_cap(cap_experts: int) -> int:
    """shrunken_cap (L1605, §1.3): cap - ceil(cap / 10); 1 shrinks to 0."""
    check_int("ds4 OOM", "cap_experts", cap_experts)
    return cap_experts - math.ceil(cap_experts / OOM_SHRINK_DIVISOR) if cap_experts else 0


@dataclass(frozen=True)
class OomShrink:
    capacity_experts: int  # what was finally allocated (0: cache disabled, direct selected loads)
    attempts: tuple[int, ...]  # caps tried, in order
    messages: tuple[str, ...]


def oom_shrink(cap_experts: int, expert_size_bytes: int, allocatable_bytes: int,
               live_cap_experts: int | None = None) -> OomShrink:
    """try_alloc / note_oom_cap (L1611-1648, §1.3): allocate cap x expert bytes (3 slabs); on failure
    cap -= ceil(cap/10), the runtime cap is recorded, the live budget is re-applied (live_cap_experts,
    if given) and the allocation retried, until it fits or reaches 0.

    allocatable_bytes stands for the device: an allocation of n bytes succeeds iff n <= it. The
    "shrinking" message is shortened in the notes (an elided middle); we print its known parts.
    """
    check_int("ds4 OOM", "expert_size_bytes", expert_size_bytes, 1)
    check_int("ds4 OOM", "allocatable_bytes", allocatable_bytes)
    cap = check_int("ds4 OOM", "cap_experts", cap_experts)
    attempts, messages = [], []
    while cap > 0:
        attempts.append(cap)
        if cap * expert_size_bytes <= allocatable_bytes:
            return OomShrink(cap, tuple(attempts), tuple(messages))
        messages.append(f"allocation failed at {cap} experts / {_gib(cap * expert_size_bytes)} GiB")
        new_cap = shrunken_cap(cap)
        messages.append(f"shrinking resident cache margin by {cap - new_cap} experts; "
                        f"runtime cache cap now {new_cap}")
        cap = new_cap if live_cap_experts is None else min(new_cap, live_cap_experts)
    messages.append("disabling resident expert cache after OOM; using direct selected loads")
    return OomShrink(0, tuple(attempts), tuple(messages))


# ------------------------------------------------------------------------------------------ staging


def prefill_staging_bytes(union_expert_counts: Sequence[int], layer_expert_bytes: Sequence[int],
                          current_staging_bytes: int = 0) -> int:
    """Compact staging after a batch prefill (§1.2, §1.7): each layer's call needs |union| x expert bytes
    (gate, up and down buffers); the buffer is grow-only, so the result is the high-water mark.

    union_expert_counts[i] is the size of the chunk's expert union at layer i, layer_expert_bytes[i]
    that layer's expert bytes (2 x gate + down). The int32 (token, k) -> compact map is not counted.
    """
    if len(union_expert_counts) != len(layer_expert_bytes):
        raise InputError("ds4 staging", "layers", (len(union_expert_counts), len(layer_expert_bytes)),
                         "one union size per layer expert size")
    staging = check_int("ds4 staging", "current_staging_bytes", current_staging_bytes)
    for count, size in zip(union_expert_counts, layer_expert_bytes):
        staging = max(staging, check_int("ds4 staging", "union size", count) * size)
    return staging


# ------------------------------------------------------------------------------------------ hotlist


def hotlist_seed_plan(ranking_keys: np.ndarray, n_experts: int, seeded_layers: Sequence[int],
                      preload_experts: int) -> list[tuple[int, np.ndarray]]:
    """The seeding pass as (layer, experts) steps: the first `preload_experts` entries of the popularity
    list that fall on a seeded (IQ2) layer, grouped by layer in layer order, each layer's experts in list
    order (seed_experts prepares the class cache for one layer's seed count, then seeds them one by one)."""
    keys = np.asarray(ranking_keys, np.int64)
    keys = keys[np.isin(keys // n_experts, np.asarray(list(seeded_layers), np.int64))][:preload_experts]
    layers = keys // n_experts
    return [(int(layer), (keys[layers == layer] % n_experts).astype(np.uint16)) for layer in np.unique(layers)]

