"""ds4's CUDA streaming expert cache sizing, as pure functions (antirez/ds4 @80ebbc3, and PR #504).

Sources: reference/ds4-engine.md §1.2-§1.4, §1.7, §1.12, §1.13 and §6 (line numbers are those of
`ds4_cuda.cu` @80ebbc3 unless a "port" line of giannisanni/neutronstar @db82323 is named). The rules:

  budget     --ssd-streaming-cache-experts N | NGB, DS4_CUDA_STREAMING_EXPERT_CACHE_N, default 512,
             clamped to 23424 (requested_budget_experts)
  reserve    DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB: integer GiB, default 16, <= total VRAM / 2
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
             layer by layer (hotlist_seed_plan, hotlist_preload_experts)

Messages are the engine's text without its "ds4: " stderr prefix; numbers print with two decimals, as
in the #503 log ("available 81.57 GiB, reserve 16.00 GiB, 13.50 MiB/expert").
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

import numpy as np
from pydantic import Field, PlainValidator

from sim.errors import InputError
from sim.schema import Strict, digits, env_table, written
from sim.units import GIB, MIB

# fmt: off
DS4_CUDA_STREAM_EXPERT_DEFAULT_EXPERTS = 512       # ds4_cuda.cu L38: budget when none is given (§1.2)
DS4_CUDA_STREAM_EXPERT_MAX_EXPERTS = 61 * 384      # ds4_cuda.cu L39: 23424, the Pro model's expert count (§1.2)
DEFAULT_VRAM_RESERVE_GIB = 16                      # live_budget L1510-1579: reserve default (§1.3)
VRAM_RESERVE_MAX_FRACTION_OF_TOTAL = 0.5           # live_budget: reserve clamped to total VRAM / 2 (§1.3)
MAX_EXPERT_SIZE_CLASSES = 4                        # port L218-231: DS4_CUDA_STREAM_EXPERT_CLASSES (§1.2)
OOM_SHRINK_DIVISOR = 10                            # shrunken_cap L1605: cap -= ceil(cap / 10) (§1.3)
AUTO_PRELOAD_CAP_EXPERTS = 4096                    # DS4_METAL_STREAMING_EXPERT_AUTO_PRELOAD_CAP default (§1.9)
# fmt: on

CLI_CACHE_EXPERTS = "--ssd-streaming-cache-experts"

_CACHE_ARG = re.compile(r"([0-9]+)(GB)?")


def _check_int(where: str, field: str, value: object, minimum: int = 0) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise InputError(where, field, value, f"must be an integer >= {minimum}")
    return int(value)


def expert_bytes(gate_bytes: int, down_bytes: int) -> int:
    """Bytes of one cached expert: gate and up slabs (gate_bytes each) plus the down slab (§1.2, §1.3)."""
    _check_int("ds4 expert size", "gate_bytes", gate_bytes, 1)
    _check_int("ds4 expert size", "down_bytes", down_bytes, 1)
    return 2 * gate_bytes + down_bytes


# ------------------------------------------------------------------------------------------ budget


def parse_cache_experts_arg(text: str, first_routed_layer_expert_bytes: int) -> int:
    """`--ssd-streaming-cache-experts N|NGB` as a number of experts (ds4_ssd.c, ds4.c L25638-25672, §1.3).

    N is a count; NGB is N GiB of experts of the FIRST routed layer: floor(N GiB / its expert bytes), so
    70GB of the mixed Flash file (6.75 MiB q2 experts at layer 0) is 10619. The clamp to 23424 is
    applied later, by requested_budget_experts. We accept only these two spellings (digits, optional
    "GB" suffix); the engine's own error wording for other text is not in the notes.
    """
    where = f"{CLI_CACHE_EXPERTS}"
    _check_int(where, "first routed layer expert bytes", first_routed_layer_expert_bytes, 1)
    match = _CACHE_ARG.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise InputError(where, "value", text, "must be N (experts) or NGB (GiB of experts), N a whole number")
    amount = int(match.group(1))
    experts = amount * GIB // first_routed_layer_expert_bytes if match.group(2) else amount
    if experts < 1:
        raise InputError(where, "value", text, "must give at least one expert")
    return experts


def cache_budget_bytes(text: str | None) -> int | None:
    """`--ssd-streaming-cache-experts NGB` as the byte budget the later builds plan with (N GiB); None for a count
    or no flag (validated by the Flags model)."""
    match = None if text is None else _CACHE_ARG.fullmatch(text)
    return int(match.group(1)) * GIB if match is not None and match.group(2) else None


def requested_budget_experts(cli_experts: int | None = None, env_cache_experts: str | None = None) -> int:
    """requested_budget (L1454-1472): env DS4_CUDA_STREAMING_EXPERT_CACHE_N, else the CLI value, else 512;
    clamped to 23424. A non-integer env value is ignored here (our choice; the notes give no message)."""
    requested = DS4_CUDA_STREAM_EXPERT_DEFAULT_EXPERTS
    if cli_experts is not None:
        requested = _check_int(CLI_CACHE_EXPERTS, "experts", cli_experts, 1)
    if env_cache_experts is not None and env_cache_experts.isascii() and env_cache_experts.isdigit():
        requested = int(env_cache_experts)
    return min(requested, DS4_CUDA_STREAM_EXPERT_MAX_EXPERTS)


def vram_reserve_bytes(env_reserve_gib: str | None, total_vram_bytes: int) -> int:
    """DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB (§1.3): integer GiB only; anything else (unset, "0.5",
    "12GB", "-1") keeps the 16 GiB default silently. The result is clamped to at most total VRAM / 2."""
    _check_int("ds4 VRAM", "total_vram_bytes", total_vram_bytes, 1)
    reserve_gib = DEFAULT_VRAM_RESERVE_GIB
    if env_reserve_gib is not None and env_reserve_gib.isascii() and env_reserve_gib.isdigit():
        reserve_gib = int(env_reserve_gib)
    return min(reserve_gib * GIB, int(total_vram_bytes * VRAM_RESERVE_MAX_FRACTION_OF_TOTAL))


# ------------------------------------------------------------------------------------------ live budget


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
    _check_int(where, "requested_experts", requested_experts, 0)
    _check_int(where, "expert_size_bytes", expert_size_bytes, 1)
    _check_int(where, "free_vram_bytes", free_vram_bytes)
    _check_int(where, "reserve_bytes", reserve_bytes)
    _check_int(where, "reclaim_bytes", reclaim_bytes)
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
    _check_int(where, "total_vram_bytes", total_vram_bytes, 1)
    reserve_bytes = min(_check_int(where, "reserve_bytes", reserve_bytes),
                        int(total_vram_bytes * VRAM_RESERVE_MAX_FRACTION_OF_TOTAL))
    others = ([other_allocation_bytes] * n if isinstance(other_allocation_bytes, (int, np.integer))
              else list(other_allocation_bytes))
    if len(others) != n:
        raise InputError(where, "other_allocation_bytes", len(others), f"needs one value per class ({n})")
    allocated_bytes, out = 0, []
    for size, other in zip(class_expert_bytes, others):
        size = _check_int(where, "class expert bytes", size, 1)
        other = _check_int(where, "other_allocation_bytes", other)
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
    _check_int("ds4 replay", "free_vram_bytes", free_vram_bytes)
    base_free = max(0, free_vram_bytes - _check_int("ds4 replay", "other_allocation_bytes", other_allocation_bytes))
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
    _check_int("ds4 OOM", "cap_experts", cap_experts)
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
    _check_int("ds4 OOM", "expert_size_bytes", expert_size_bytes, 1)
    _check_int("ds4 OOM", "allocatable_bytes", allocatable_bytes)
    cap = _check_int("ds4 OOM", "cap_experts", cap_experts)
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
    staging = _check_int("ds4 staging", "current_staging_bytes", current_staging_bytes)
    for count, size in zip(union_expert_counts, layer_expert_bytes):
        staging = max(staging, _check_int("ds4 staging", "union size", count) * size)
    return staging


# ------------------------------------------------------------------------------------------ hotlist


def hotlist_preload_experts(budget_experts: int, preload_flag: int | None = None,
                            auto_cap_env: str | None = None) -> int:
    """How many hotlist experts a seeding pass loads (§1.9): --ssd-streaming-preload-experts N when given,
    else min(budget, auto cap), the auto cap being DS4_METAL_STREAMING_EXPERT_AUTO_PRELOAD_CAP (4096)."""
    where = "ds4 hotlist"
    _check_int(where, "budget_experts", budget_experts)
    if preload_flag is not None:
        return _check_int(where, "--ssd-streaming-preload-experts", preload_flag)
    cap = AUTO_PRELOAD_CAP_EXPERTS
    if auto_cap_env is not None:
        if not auto_cap_env.strip().isdigit():
            raise InputError(where, "DS4_METAL_STREAMING_EXPERT_AUTO_PRELOAD_CAP", auto_cap_env,
                             "must be a whole number of experts")
        cap = int(auto_cap_env)
    return min(budget_experts, cap)


def hotlist_seed_plan(ranking_keys: np.ndarray, n_experts: int, seeded_layers: Sequence[int],
                      preload_experts: int) -> list[tuple[int, np.ndarray]]:
    """The seeding pass as (layer, experts) steps: the first `preload_experts` entries of the popularity
    list that fall on a seeded (IQ2) layer, grouped by layer in layer order, each layer's experts in list
    order (seed_experts prepares the class cache for one layer's seed count, then seeds them one by one)."""
    keys = np.asarray(ranking_keys, np.int64)
    keys = keys[np.isin(keys // n_experts, np.asarray(list(seeded_layers), np.int64))][:preload_experts]
    layers = keys // n_experts
    return [(int(layer), (keys[layers == layer] % n_experts).astype(np.uint16)) for layer in np.unique(layers)]


# ------------------------------------------------------------------------------------------ the budget planner
#
# Later upstream sizes one total expert budget before anything is allocated (ds4.c @54b36ed
# ds4_engine_configure_streaming_cache_budget, ds4_ssd.c ds4_ssd_auto_cache_plan): the working set R is Metal's
# recommendedMaxWorkingSetSize, or the device's total memory (hipMemGetInfo on ROCm, the GTT pool on an APU;
# cudaMemGetInfo with #488). A budget in GiB is capped to the graph working-set pressure budget; no budget on
# Metal/ROCm (and CUDA with #488) is the auto budget; then two layers of prefill headroom come off the top.

AUTO_CACHE_PCT = 80                                # DS4_SSD_AUTO_CACHE_PCT default (ds4_ssd.c @54b36ed)
GRAPH_PRESSURE_SHARE = (7, 8)                      # the manual cap: 7/8 of R less the context's memory
PREFILL_HEADROOM_LAYERS = 2                        # DS4_STREAMING_PREFILL_HEADROOM_LAYERS (ds4.c @54b36ed L4506)
V41_RUNTIME_ALLOWANCE_BYTES = 2 * GIB              # "2.00 GiB runtime/I/O allowance" (the #1036 log)


def graph_pressure_cap_bytes(working_set: int, context_bytes: int) -> int:
    """ds4_streaming_manual_cache_safe_bytes (ds4.c @54b36ed L4627-4661): floor_GiB(R x 7/8 - the context's
    memory), at least 1 GiB ("budget X GiB capped to Y GiB to stay below the graph working-set pressure budget")."""
    num, den = GRAPH_PRESSURE_SHARE
    return max(GIB, (working_set * num // den - context_bytes) // GIB * GIB)


@dataclass(frozen=True)
class BudgetPlan:
    cache_experts: int  # the count handed to the expert cache: the planner's dynamic experts, or the auto count
    headroom_bytes: int  # two layers of prefill staging held inside a byte budget (0: none)
    notices: tuple[str, ...]


def _one_expert_at_least(n_bytes: int, expert_size: int, cacheable: int) -> int:
    return max(1, min(n_bytes // expert_size, cacheable))


def budget_plan(mode: str, *, api: str, working_set: int, requested_bytes: int | None,
                requested_experts: int | None, expert_size: int, n_experts: int, cacheable_layers: int, non_routed: int,
                context_bytes: int, fixed_bytes: int = 0, where: str = "ds4 budget planner",
                field: str = "engine.flags.ssd-streaming-cache-experts") -> BudgetPlan:
    """The expert budget of the later builds (see the section above). mode: "auto-488" (#488: the auto count; only
    asked when no budget is given, a given one being the live path's), "planner" (@54b36ed) or "planner-v41"
    (#1036); requested_bytes:
    the CLI's NGB, requested_experts its N (a count gets no cap and no headroom split: ds4.c L53827); api: the
    profile's GPU interface (the auto budget is Metal's and ROCm's, and CUDA's with #488); fixed_bytes: for the
    V4.1 fit, the static weights and graph the working set also holds; expert_size and cacheable_layers: the
    dominant routed size (most layers) and the layers of that size (ds4_streaming_routed_expert_bytes,
    ds4_streaming_cacheable_expert_count @54b36ed). Raises the engine's startup refusals."""
    cacheable = cacheable_layers * n_experts
    notices: list[str] = []
    if requested_experts is not None:
        return BudgetPlan(min(requested_experts, cacheable), 0, ())
    if requested_bytes is not None:
        total = requested_bytes
        cap = graph_pressure_cap_bytes(working_set, context_bytes)
        if total > cap:
            notices.append(f"SSD streaming cache budget {total / GIB:.2f} GiB capped to {cap / GIB:.2f} GiB to "
                           "stay below the graph working-set pressure budget")
            total = cap
    elif api in ("metal", "hip") or mode == "auto-488":
        target = working_set * AUTO_CACHE_PCT // 100
        experts = _one_expert_at_least(max(0, target - non_routed), expert_size, cacheable)
        total = experts * expert_size
        notices.append(f"SSD streaming auto cache budget: {api} recommends {working_set / GIB:.2f} GiB working set; "
                       f"{AUTO_CACHE_PCT} % = {target / GIB:.2f} GiB for model + cached experts, non-routed weights "
                       f"{non_routed / GIB:.2f} GiB; expert budget {experts} ({total / GIB:.2f} GiB)"
                       + ("; non-routed weights already fill the target: a one-expert cache"
                          if target <= non_routed else ""))
        if mode == "auto-488":
            return BudgetPlan(experts, 0, tuple(notices))
    else:  # a CUDA build of @54b36ed has no auto budget (ds4.c L405-413): no cache is planned
        return BudgetPlan(0, 0, ("no expert budget given: this CUDA build plans no expert cache "
                                 "(its auto budget is Metal's and ROCm's)",))
    headroom = min(PREFILL_HEADROOM_LAYERS, cacheable_layers) * n_experts * expert_size
    if headroom >= total:
        raise InputError(where, field, f"{total / GIB:.2f} GiB",
                         f"ds4 refuses it: byte budget {total / GIB:.2f} GiB is too small: routed prefill headroom "
                         f"needs {headroom / GIB:.2f} GiB")
    dynamic = min((total - headroom) // expert_size, cacheable)
    if dynamic == 0:
        raise InputError(where, field, f"{total / GIB:.2f} GiB",
                         "ds4 refuses it: byte budget is too small or invalid for this model")
    notices.append(f"{api} SSD streaming total expert budget {total / GIB:.2f} GiB = {headroom / GIB:.2f} GiB prefill "
                   f"headroom + {dynamic * expert_size / GIB:.2f} GiB dynamic cache ({dynamic} experts, "
                   f"{expert_size / MIB:.2f} MiB each)")
    if mode == "planner-v41":
        room = working_set - fixed_bytes - headroom - V41_RUNTIME_ALLOWANCE_BYTES
        fitted = max(0, min(dynamic, room // expert_size))
        if fitted == 0:
            raise InputError(where, field, f"{total / GIB:.2f} GiB",
                             "ds4 refuses it: no dynamic cache fits beside the static weights, staging, graph and "
                             "the runtime/I/O allowance")
        if fitted < dynamic:
            notices.append(f"V4.1 SSD cache fitted from {dynamic} to {fitted} experts for context/runtime headroom")
        dynamic = fitted
    return BudgetPlan(int(dynamic), headroom, tuple(notices))


# ------------------------------------------------------------------------------------------ knobs
#
# The scenario's [engine] table for ds4: the engine's own flag and environment names (ds4-engine.md §4), its
# variants, and the refusals of settings the model does not simulate. Values the real engine accepts and
# then reads its own way are kept raw (a reserve of "0.5" keeps the 16 GiB default, as ds4 does).

@dataclass(frozen=True)
class Variant:
    """What a ds4 build does differently (ds4-engine.md §1.13-§1.14)."""

    name: str
    per_class: bool  # caches per (gate, down) size class (#504); else one slab keyed on the last size
    prefill_reads_cache: bool  # prefill hits copy from the cache and misses append (#504); else release_all
    hit_copy: str  # "memcpy": 3 synchronous D2D copies per expert into compact staging; "gather": one
    #               kernel per layer through a device table (#605); "none": kernels read the slots (#1031)
    pread_pool: bool  # #1082: hits first + 8 pread workers with their own staging and stream
    mtp_streaming: bool  # runs the in-file MTP draft layer together with --ssd-streaming
    source: str
    # how the expert budget is sized (see budget_plan): "live" the CLI/env count, capped per class by free VRAM
    # less the reserve (@80ebbc3 to #1082); "auto-488" the same, with #488's auto budget when none is given;
    # "planner" the total expert budget of later upstream (the 7/8 working-set cap, two layers of prefill
    # headroom, the auto budget); "planner-v41" that plan fitted once more to V4.1's runtime allowance (#1036)
    budget: str = "live"
    # non-routed weights VRAM cannot hold stay in mapped host memory, read over PCIe at every use (the weight
    # cache's fallback, cuda_model_range_ptr); else they must all fit in VRAM
    weight_overflow: bool = False
    # batched prefill reads every expert of each layer, not the chunk's union: the batch MoE kernels take the
    # layer's whole expert tensors through the weight cache, which streams them from the file in copy chunks
    # (the neutronstar GLM stack: glm_graph_routed_moe_batch_dispatch -> routed_moe_launch, which uses the
    # compact selected cache only when the layer's selected load prepared it, and no GLM batch path prepares
    # it; cuda_model_range_ptr -> cuda_model_range_ptr_from_fd, giannisanni/neutronstar @253cfb1 ds4.c
    # L29825, ds4_cuda.cu L13630-13660 and L1300-1390); the expert cache is neither read nor filled
    prefill_whole_layers: bool = False
    # how a miss's three parts reach the GPU: "per-part" each read into pinned staging, uploaded and synced in
    # turn (the ring restarts every call, ds4-engine.md §1.8); "pr605" #605's third and fourth commits: with no
    # O_DIRECT fd a plain cudaMemcpy from the mapped file (5930a3f, "default streamed expert uploads to plain
    # copy without O_DIRECT"), else the ring kept across the parts and one sync per expert (1c055bb, "pipeline
    # the streamed expert upload path"; both as described in nexus-cw/ds4 research/gb10/MEASUREMENTS.md)
    miss_copy: str = "per-part"


VARIANTS = {v.name: v for v in (
    Variant("pre-504", False, False, "memcpy", False, False, "antirez/ds4 @80ebbc3 (ds4-engine.md §1.2-§1.10)"),
    Variant("pr504", True, True, "memcpy", False, False, "PR #504 (seed; ds4-engine.md §1.13)"),
    Variant("pr605-cache", True, True, "gather", False, False,
            "PR #605's first commit (10ba298): the restored per-class cache, cache-reading prefill and its device "
            "gather-slots table (ds4-engine.md §1.14; the table sits with the restored cache in iCreil/ds4 "
            "@35f2513, whose streamed copy is still the per-part one the third commit replaced)"),
    Variant("pr605", True, True, "gather", False, False,
            "PR #605, all four commits: pr605-cache, then the per-load VRAM query skipped once the cache has "
            "settled (9167d12), the pipelined streamed upload (1c055bb) and plain pageable copies without "
            "O_DIRECT (5930a3f)", miss_copy="pr605"),
    Variant("pr1031", True, True, "none", False, False,
            "PR #1031: bounded LRU in contiguous slabs, kernels read remapped slots (no D2D copy), IQ2 prefill "
            "through the compact selected table (ds4-engine.md §1.14)"),
    Variant("pr1082", True, True, "none", True, False,
            "PR #1082 on #1031: hits first, an 8-worker pread pool, gate and up of every miss before the downs "
            "(ds4-engine.md §1.14)"),
    Variant("pr488", True, True, "memcpy", False, False,
            "PR #488 on #504's per-class caches: CUDA's auto budget, 80 % of the device's memory less the non-routed "
            "weights (at least one expert) when no budget is given (antirez/ds4#488)", "auto-488", True),
    Variant("main-0728", True, True, "none", False, False,
            "antirez/ds4 @54b36ed (2026-07-28): the total expert budget planner (ds4_engine_configure_streaming_"
            "cache_budget: the 7/8 working-set cap, two layers of prefill headroom, the Metal/ROCm auto budget), "
            "kernels reading the cache's slots, non-routed weights in a lazily filled weight cache with mapped "
            "host memory past it", "planner", True),
    Variant("main-v41", True, True, "none", False, False,
            "antirez/ds4 of #1036 (2026-09): main-0728's planner, its dynamic cache fitted once more so that static "
            "weights, staging, cache, graph and a 2 GiB runtime/I/O allowance fit the working set (V4.1)",
            "planner-v41", True),
    Variant("main-0814", False, False, "none", False, False,
            "antirez/ds4 @84cc882 (2026-08-14) on its Metal backend, the build of #810, read at upstream b0309611 "
            "(2026-08-05, the newest upstream in reach): main-0728's total expert budget planner (the same rules there, "
            "ds4.c L4567-L4720, L54440-L54625); one global "
            "(layer, expert) table evicting by route hotness, its slots wired as they fill; misses read by buffered "
            "preads of a 9-thread pool into the slot, hits read in place; the non-routed weights mapped file "
            "pages (sim/cache/hotness.py, sim/engine/ds4.py)", "planner"),
    Variant("neutronstar-glm-slab", False, False, "memcpy", False, True,
            "what-if: the neutronstar GLM stack's MTP draft steps with upstream's pre-504 slab",
            prefill_whole_layers=True),
    Variant("neutronstar-glm", True, True, "memcpy", False, True,
            "giannisanni/neutronstar @db823235: PR #504 ported onto the fork's GLM CUDA stack; its batched prefill "
            "(working from @1d8a26c's IQ2 LUT fix) reads whole layers", prefill_whole_layers=True),
)}
PREAD_POOL_WORKERS = 8  # #1082: "a pread pool of 8 workers, each with pinned staging and its own CUDA stream"
# The builds whose Metal backend is modelled, and the only ones that run on a Metal profile: the CUDA and ROCm
# variants are other builds' GPU paths, and the Metal path of the older builds was not read.
METAL_VARIANTS = ("main-0814",)
METAL_PREAD_THREADS_DEFAULT = 9      # ds4_gpu_stream_expert_pread_thread_limit (ds4_metal.m @b0309611 L10878)
METAL_PREAD_THREADS_RANGE = (1, 18)  # DS4_METAL_STREAMING_EXPERT_PREAD_THREADS, clamped there to 1..18
DEFAULT_CTX_TOKENS = 32768  # ds4_cli.c: "-c, --ctx N  Context size allocated for the session. Default: 32768"

# Knobs that exist only in some variants: setting one on another variant is a mistake, not a no-op.
ONLY_IN: dict[str, tuple[str, ...]] = {
    "expert-profile": ("pr1031", "pr1082"),  # CUDA --expert-profile came with #1031 (§1.14)
    "DS4_EXPERT_PROFILE": ("pr1031", "pr1082"),
    "DS4_EXPERT_HOTLIST": ("pr1031", "pr1082"),
    "DS4_CUDA_HITS_FIRST": ("pr1082",),
    "DS4_CUDA_STREAMING_EXPERT_PREAD_POOL": ("pr1082",),
    "DS4_METAL_STREAMING_EXPERT_PREAD_THREADS": METAL_VARIANTS,
}
ENV_NAMES = (
    # ds4-engine.md §4, CUDA streaming @80ebbc3
    "DS4_CUDA_STREAMING_EXPERT_CACHE_N", "DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB",
    "DS4_CUDA_STREAMING_EXPERT_CACHE_VERBOSE", "DS4_CUDA_STREAMING_EXPERT_CACHE_PROFILE",
    "DS4_CUDA_ENABLE_STREAMING_EXPERT_HOTLIST", "DS4_CUDA_STREAMING_EXPERT_HOTLIST",
    "DS4_CUDA_DISABLE_STREAMING_SELECTED_SHARED_OVERLAP", "DS4_CUDA_DISABLE_STREAMING_PREFILL_BATCH_SELECTED_LOAD",
    "DS4_CUDA_STREAMING_PREFILL_BATCH_SELECTED_PROFILE", "DS4_CUDA_NO_DIRECT_IO", "DS4_CUDA_KEEP_MODEL_PAGES",
    "DS4_CUDA_MODEL_COPY_CHUNK_MB", "DS4_CUDA_WEIGHT_CACHE_VERBOSE",
    # the shared graph layer (named METAL, also read on CUDA)
    "DS4_METAL_STREAMING_DECODE_PREFILL_MAX", "DS4_METAL_DISABLE_STREAMING_DECODE_PREFILL",
    "DS4_METAL_DISABLE_STREAMING_COLD_DECODE_PREFILL", "DS4_METAL_PREFILL_CHUNK", "DS4_METAL_RESUME_PREFILL_MIN",
    "DS4_METAL_DISABLE_STREAMING_EXPERT_HOTLIST", "DS4_METAL_STREAMING_EXPERT_HOTLIST",
    "DS4_METAL_STREAMING_EXPERT_AUTO_PRELOAD_CAP",
    # later variants
    "DS4_EXPERT_PROFILE", "DS4_EXPERT_HOTLIST", "DS4_CUDA_HITS_FIRST", "DS4_CUDA_STREAMING_EXPERT_PREAD_POOL",
    # the Metal backend (ds4_metal.m)
    "DS4_METAL_STREAMING_EXPERT_PREAD_THREADS",
)
Env = env_table("Ds4Env", "ds4 environment variable", ENV_NAMES)
# Knobs whose effect the model does not simulate: a scenario that sets one is refused rather than run as if
# it were absent. The VERBOSE/PROFILE variables and --expert-profile only print or write files: accepted.
NOT_MODELLED = {
    "DS4_CUDA_DISABLE_STREAMING_PREFILL_BATCH_SELECTED_LOAD": "prefill without batched selected loads",
    "DS4_METAL_DISABLE_STREAMING_COLD_DECODE_PREFILL": "the cold decode-style prefill switch",
    "DS4_METAL_RESUME_PREFILL_MIN": "server resumes from a KV checkpoint",
}
COPY_CHUNK_MIB_RANGE = (16, 4096)  # DS4_CUDA_MODEL_COPY_CHUNK_MB clamp (ds4-engine.md §1.2, L218-222)


def _check_cache_experts(value: object) -> str:
    """`--ssd-streaming-cache-experts N|NGB`, kept as the text ds4 parses (an integer is taken as N)."""
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    number = text[:-2] if isinstance(text, str) and text.endswith("GB") else text
    if not isinstance(number, str) or not digits(number):
        raise ValueError('must be N (experts) or "NGB" (GiB of experts), N a whole number')
    return text


class Flags(Strict):
    """ds4 CLI flags (ds4_help.c @80ebbc3, ds4-engine.md §4). None = the engine's default."""

    KEY_KIND: ClassVar[str] = "ds4 flag"
    ssd_streaming: bool = Field(True, alias="ssd-streaming")
    # N experts, or "NGB": N GiB of experts of the first routed layer. Default: 512 on CUDA.
    ssd_streaming_cache_experts: Annotated[str, PlainValidator(_check_cache_experts)] | None = \
        Field(None, alias="ssd-streaming-cache-experts")
    ssd_streaming_cold: bool = Field(False, alias="ssd-streaming-cold")
    ssd_streaming_preload_experts: Annotated[int, Field(ge=0)] | None = \
        Field(None, alias="ssd-streaming-preload-experts")  # default: auto, capped at 4096
    # Default: the whole prompt if <= 4096 tokens, else 4096 (8192 for PRO).
    prefill_chunk: Annotated[int, Field(ge=1)] | None = Field(None, alias="prefill-chunk")
    ctx: Annotated[int, Field(ge=2)] | None = None  # the session's context; default 32768
    # The MTP draft model. Upstream refuses it together with --ssd-streaming (ds4.c L25685 @80ebbc3); the
    # neutronstar GLM stack binds the draft layer (GLM-5.2's blk.78) from the main GGUF: pass its path.
    mtp: str | None = None
    expert_profile: str | None = Field(None, alias="expert-profile")


class Settings(Strict):
    KEY_KIND: ClassVar[str] = "ds4 engine key"
    name: Literal["ds4"]
    # pre-504 .. pr1082, pr488, main-0728, main-v41, main-0814 (Metal), neutronstar-*: see VARIANTS.
    variant: Literal["pre-504", "pr504", "pr605-cache", "pr605", "pr1031", "pr1082", "pr488", "main-0728", "main-v41",
                     "main-0814", "neutronstar-glm-slab", "neutronstar-glm"]
    flags: Flags = Field(default_factory=Flags)
    env: Env = Field(default_factory=Env)


def env_set(env, name: str) -> bool:
    return getattr(env, name, None) not in (None, "0", "")


def env_count(where: str, env, name: str, minimum: int = 0) -> int | None:
    text = getattr(env, name, None)
    if text is None:
        return None
    if not digits(text.strip()) or int(text) < minimum:
        raise InputError(where, f"engine.env.{name}", text, f"must be a whole number >= {minimum}")
    return int(text)


def _variant_gate(where: str, section: str, names: set[str], engine) -> None:
    for name in sorted(names):
        allowed = ONLY_IN.get(name)
        if allowed is not None and engine.variant not in allowed:
            raise InputError(where, f"engine.{section}.{name}", written(getattr(engine, section), name),
                             f"read only by variant {' or '.join(allowed)}; this scenario's variant is "
                             f"{engine.variant}")


def model_family(scenario) -> str | None:
    """Which of ds4's models a scenario's file is (family_of)."""
    return family_of(scenario.layout, scenario.compute_key)


def family_of(layout, compute_key: str | None) -> str | None:
    """Which of ds4's models a file is, by its model class (the hardware profile's compute key: the preset's
    name, or model_class for a GGUF), else the layout's name: "deepseek-v4", "deepseek-v4.1" or "glm-5.2"; None
    for any other."""
    key = compute_key or layout.name
    for family in ("deepseek-v4.1", "deepseek-v4", "glm-5.2"):  # V4.1 before V4: the longer name first
        if key.startswith(family):
            return family
    return None


def context_tokens(flags) -> int:
    return flags.ctx if flags.ctx is not None else DEFAULT_CTX_TOKENS


def validate(scenario, where: str) -> None:
    """ds4's refusals: what the engine would refuse, and what the model does not simulate."""
    profile, layout, engine = scenario.hardware_profile, scenario.layout, scenario.engine
    flags, env = engine.flags, engine.env
    _variant_gate(where, "flags", {Flags.model_fields[n].alias or n for n in flags.model_fields_set}, engine)
    _variant_gate(where, "env", set(env.model_fields_set), engine)
    for name in sorted(set(env.model_fields_set) & set(NOT_MODELLED)):
        raise InputError(where, f"engine.env.{name}", getattr(env, name),
                         f"not modelled: {NOT_MODELLED[name]}; remove it to simulate the default path")
    chunk_mib = env.DS4_CUDA_MODEL_COPY_CHUNK_MB
    if chunk_mib is not None:
        if not digits(chunk_mib):
            raise InputError(where, "engine.env.DS4_CUDA_MODEL_COPY_CHUNK_MB", chunk_mib, "must be a whole MiB count")
        low, high = COPY_CHUNK_MIB_RANGE
        largest_part = max(max(x.gate_bytes, x.up_bytes, x.down_bytes) for x in layout.layers)
        if min(max(int(chunk_mib), low), high) * MIB < largest_part:
            raise InputError(where, "engine.env.DS4_CUDA_MODEL_COPY_CHUNK_MB", chunk_mib,
                             f"not modelled: expert parts of up to {largest_part / MIB:.2f} MiB would span several "
                             "copy chunks; the model copies each part as one chunk")
    if not flags.ssd_streaming:
        raise InputError(where, "engine.flags.ssd-streaming", False,
                         "the simulator models ds4 with --ssd-streaming only (the expert cache exists only then)")
    variant = VARIANTS[engine.variant]
    _validate_backend(scenario, where)
    reserve_env = env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB
    if reserve_env is not None and variant.budget.startswith("planner"):
        raise InputError(where, "engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB", reserve_env,
                         f"not read by variant {variant.name}: its planner sizes the cache against the working set")
    if flags.mtp is not None and not variant.mtp_streaming:
        raise InputError(where, "engine.flags.mtp", flags.mtp,
                         "ds4 rejects --mtp together with --ssd-streaming (ds4.c L25685 @80ebbc3)")
    if flags.mtp is not None and layout.n_mtp_layers == 0:
        raise InputError(where, "engine.flags.mtp", flags.mtp,
                         f"model {layout.name} has no MTP layer in its file; variant {engine.variant} runs the "
                         "draft layer bound from the main GGUF (a separate MTP GGUF is not modelled)")
    if model_family(scenario) is None:
        raise InputError(where, "model", layout.name,
                         "ds4 is modelled for DeepSeek V4 (Flash, Pro), V4.1 Flash and GLM-5.2 files (set model_class "
                         "to deepseek-v4-flash, deepseek-v4.1-flash or glm-5.2 for a GGUF)")
    total = layout.n_routed_layers * layout.n_experts
    text = flags.ssd_streaming_cache_experts
    if text is not None:
        gib = text.endswith("GB")
        amount = int(text[:-2] if gib else text)
        # NGB counts experts of the first routed layer (ds4.c L25638-25672, ds4-engine.md §1.3)
        experts = amount * GIB // layout.layers[0].expert_bytes if gib else amount
        if experts < 1:
            raise InputError(where, "engine.flags.ssd-streaming-cache-experts", text, "must give at least one expert")
        if experts > total:
            raise InputError(where, "engine.flags.ssd-streaming-cache-experts", text,
                             f"{experts} experts is more than the model's {total} routed experts")
    cache_n = env.DS4_CUDA_STREAMING_EXPERT_CACHE_N
    if cache_n is not None and digits(cache_n) and int(cache_n) > total:
        raise InputError(where, "engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_N", cache_n,
                         f"more than the model's {total} routed experts")
    reserve = env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB
    # ds4 reads an integer GiB only (anything else keeps the 16 GiB default) and clamps it to VRAM / 2:
    # both are the engine's to reproduce. A reserve of the whole VRAM or more is no setting anyone runs.
    if reserve is not None and digits(reserve) and int(reserve) * GIB >= profile.vram_bytes:
        raise InputError(where, "engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB", reserve,
                         f"a reserve >= the GPU's VRAM ({profile.vram_bytes / GIB:g} GiB on {profile.name})")
    ctx = context_tokens(flags)
    for i, request in enumerate(scenario.workload.requests):
        # ds4_session_sync (ds4.c): "prompt exceeds context" when prompt->len >= ctx_size, one token of
        # generation room being required (read at giannisanni/neutronstar @db823235, carrying upstream @80ebbc3)
        if request.prompt_tokens >= ctx:
            raise InputError(where, f"workload.requests[{i}].prompt_tokens", request.prompt_tokens,
                             f"ds4 refuses it: prompt exceeds context (--ctx {ctx}; the prompt must be shorter)")


def _validate_backend(scenario, where: str) -> None:
    """The GPU backend a build runs on the profile's GPU: Metal for the Metal variants, and only there; what the
    modelled Metal path does not cover is refused."""
    profile, layout, engine = scenario.hardware_profile, scenario.layout, scenario.engine
    metal = profile.gpu.api == "metal"
    if metal and engine.variant not in METAL_VARIANTS:
        raise InputError(where, "engine.variant", engine.variant,
                         f"ds4 runs its Metal backend on {profile.name}; that backend is modelled for variant "
                         f"{' or '.join(METAL_VARIANTS)} only (the other variants are CUDA/ROCm paths)")
    if not metal:
        if engine.variant in METAL_VARIANTS:
            raise InputError(where, "engine.variant", engine.variant,
                             f"modelled on its Metal backend only; {profile.name} runs {profile.gpu.api}")
        return
    cuda_env = sorted(name for name in engine.env.model_fields_set if name.startswith("DS4_CUDA_"))
    if cuda_env:
        raise InputError(where, f"engine.env.{cuda_env[0]}", getattr(engine.env, cuda_env[0]),
                         "read by ds4's CUDA backend only; the Metal backend always reads misses with buffered "
                         "preads and keeps the pages")
    sizes = {(x.gate_bytes, x.down_bytes) for x in layout.layers[: layout.n_routed_layers]}
    if len(sizes) > 1:
        raise InputError(where, "model", layout.name,
                         "not modelled: on Metal the expert cache keeps one size class and the other layers read "
                         "their experts through the mapped file (a mixed-quant file)")
    threads = engine.env.DS4_METAL_STREAMING_EXPERT_PREAD_THREADS
    if threads is not None and not digits(threads):
        raise InputError(where, "engine.env.DS4_METAL_STREAMING_EXPERT_PREAD_THREADS", threads,
                         "must be a whole number of threads")


def metal_pread_threads(env) -> int:
    """The Metal backend's pread pool size: DS4_METAL_STREAMING_EXPERT_PREAD_THREADS or 9, clamped to 1..18 (0 counts
    as 1, as in ds4_gpu_stream_expert_pread_thread_limit)."""
    text = getattr(env, "DS4_METAL_STREAMING_EXPERT_PREAD_THREADS", None)
    threads = METAL_PREAD_THREADS_DEFAULT if text is None else int(text)
    low, high = METAL_PREAD_THREADS_RANGE
    return min(max(threads, low), high)


# ------------------------------------------------------------------------------------------ VRAM before the cache
#
# VRAM ds4 holds before its expert cache is sized = the non-routed weights it keeps on the GPU + the KV cache
# and the prefill context buffers at --ctx (their formula below, from the graph allocation) + its compute
# buffers (a calibration record: fitted, see sim/engine/records.py) + the driver/runtime reservation of the
# hardware profile.

FLASH_KV_LAYERS = 43          # DS4_N_LAYER
FLASH_HEAD_DIM = 512          # DS4_N_HEAD_DIM: one KV row (f32)
FLASH_INDEXER_HEAD_DIM = 128  # DS4_N_INDEXER_HEAD_DIM
FLASH_SWA_TOKENS = 128        # DS4_N_SWA: the sliding attention window
FLASH_RAW_ROW_ALIGN = 256     # the raw KV rows are padded to a 256-row multiple (ds4.c, raw cap)
FLASH_RAW_ROWS_MAX = 8192     # and capped at 8192 rows
FLASH_F32_BYTES = 4           # KV rows are stored as f32 on the GPU


def flash_compress_ratio(layer: int) -> int:
    """DeepSeek-V4 attention compression per layer (ds4.c ds4_layer_compress_ratio): the first two layers
    are dense (0), then the layers alternate: even ones ratio 4 with an indexer, odd ones ratio 128."""
    if layer < 2:
        return 0
    return 4 if layer % 2 == 0 else 128


def flash_raw_rows(ctx_tokens: int, prefill_cap_tokens: int) -> int:
    """Rows of each layer's raw (sliding-window) KV: during a batched prefill it holds the chunk plus the
    previous window, padded to a multiple of 256 rows and capped at 8192 (ds4.c
    metal_graph_raw_cap_for_context)."""
    window = max(1, min(FLASH_SWA_TOKENS, ctx_tokens))
    wanted = max(1, min(window + prefill_cap_tokens, ctx_tokens))
    wanted = min(-(-wanted // FLASH_RAW_ROW_ALIGN) * FLASH_RAW_ROW_ALIGN, FLASH_RAW_ROWS_MAX)
    return max(wanted, window)


def flash_kv_bytes(ctx_tokens: int, prefill_cap_tokens: int) -> int:
    """The KV cache ds4 allocates on the GPU for a session of ctx_tokens (DeepSeek-V4 Flash): per layer the
    raw rows (flash_raw_rows), and per compressed layer ctx / ratio + 2 compressed rows (plus the indexer's
    rows on ratio-4 layers), every row f32 (ds4.c metal_graph_kv_cache_bytes_for_context)."""
    total = FLASH_KV_LAYERS * flash_raw_rows(ctx_tokens, prefill_cap_tokens) * FLASH_HEAD_DIM * FLASH_F32_BYTES
    for layer in range(FLASH_KV_LAYERS):
        ratio = flash_compress_ratio(layer)
        if ratio:
            rows = ctx_tokens // ratio + 2
            total += rows * FLASH_HEAD_DIM * FLASH_F32_BYTES
            if ratio == 4:
                total += rows * FLASH_INDEXER_HEAD_DIM * FLASH_F32_BYTES
    return total


def flash_context_buffer_bytes(ctx_tokens: int, prefill_cap_tokens: int) -> int:
    """The prefill's attention context buffers beside the KV cache: 2 x (ctx / 4 + 2) x prefill chunk f32
    (ds4.c metal_graph_context_bytes_for_kv_policy)."""
    return 2 * (ctx_tokens // 4 + 2) * prefill_cap_tokens * FLASH_F32_BYTES


# GLM-5.2's MLA cache: per layer and token the compressed KV (kv-lora 512) and the rope key (64), f32 on the
# neutronstar stack ("78 x ctx x (512 + 64) x 4 B", the cross-check of the GLM-5.2 resident set).
GLM52_MLA_ROW_FLOATS = 512 + 64
GLM52_KV_LAYERS = 78

# DeepSeek-V4-Flash's non-routed weights: "non-routed weights: 8.20 GiB" (antirez/ds4#488, ds4-engine.md §2.3).
FLASH_NON_ROUTED_GIB = 8.20
# DeepSeek-V4.1-Flash's: "V4.1 SSD prepared 9.37 GiB static weights" (the ROCm planner's line, antirez/ds4 PR #1036).
V41_NON_ROUTED_GIB = 9.37
# GLM-5.2 on the neutronstar rig keeps "~8 GiB pinned host RAM" of its resident weights in host memory
# (giannisanni/neutronstar README): those bytes are not in VRAM.
GLM52_HOST_PINNED_GIB = 8


@dataclass(frozen=True)
class ResidentSet:
    """What ds4 holds before its expert cache (bytes): in VRAM and in pinned host RAM."""

    non_routed: int  # the file's non-routed weights
    host_pinned: int  # the part of them kept in pinned host RAM instead of VRAM
    kv: int  # KV cache at --ctx
    context_buffers: int  # the prefill's attention context buffers at --ctx
    compute_buffers: int  # compute buffers and scratch (a calibration record)
    runtime_reserved: int  # the driver's and runtime's own reservation (hardware profile)
    record: str  # the calibration record of compute_buffers (V4.1: of its graph, held as context_buffers)

    @property
    def context_memory(self) -> int:
        """The context's memory the later builds' budget cap leaves room for: KV and context buffers."""
        return self.kv + self.context_buffers

    @property
    def vram(self) -> int:
        return (self.non_routed - self.host_pinned + self.kv + self.context_buffers + self.compute_buffers
                + self.runtime_reserved)


# GLM-5.2's non-routed weights, [derived] from public geometry at the ds4 file's quants (no published
# figure of the GGUF's non-routed bytes is in our notes).
# Geometry: hardware-and-gguf.md §4 (hidden 6144, 64 heads MLA, dense FFN 12288, vocab 154,880, 3 dense +
# 75 MoE layers + 1 MTP, 256 experts, 1 shared expert of width 2048); MLA ranks from slime/miles
# scripts/models/glm5-744B-A40B.sh (q-lora 2048, kv-lora 512, qk head 192 + rope 64, v head 256); the DSA
# indexer from the GLM-5.2 config (index_n_heads 32, index_head_dim 128, index_topk_freq 4,
# index_skip_topk_offset 3; quoted in miles' GLM-5.2 launcher), whose weights exist only in the layers that
# compute the index: blocks 1-3 and every 4th after (1-based), 21 of 78, plus the MTP block.
# Check: these counts give 753.33 B parameters; at BF16 (router bias F32) that is 1,506,659,919,872 B,
# exactly the GLM-5.2 checkpoint's safetensors total_size (quoted in the same launcher and in GLM-5.2
# manifest tests); the 744 B headline is the same count without the MTP block.
# Quants: "everything that makes decisions stays at Q8_0/F32" (neutronstar README, the ds4 GLM-5.2 file):
# every 2-D non-routed matrix Q8_0, every 1-D tensor (norms, biases) F32, the MTP eh_proj Q8_0
# (neutronstar docs/glm-mtp-port.md); the MTP block shares the embedding and output head. Result: 18.70
# GiB. The README's "196.6 GiB file" less the routed bytes (176.98 GiB, block table) implies 19.62 GiB:
# the recipe keeps ~0.9 GiB more above Q8_0 than this derivation.
GLM52_MLA = dict(q_lora=2048, kv_lora=512, heads=64, qk_nope=192, qk_rope=64, v_head=256)
GLM52_DENSE_FFN = 12288
GLM52_VOCAB = 154_880
GLM52_INDEXER = dict(heads=32, head_dim=128, every=4, first=3)
FLASH_VOCAB = 129_280  # DS4_N_VOCAB
FLASH_EMBEDDING_BYTES = FLASH_VOCAB * 4096 * 2  # the F16 token embedding: only one row is read per token


def _q(type_name: str, n_weights: int) -> int:
    from sim.model.quant import QUANT_TYPES

    t = QUANT_TYPES[type_name]
    return n_weights // t.block_weights * t.block_bytes


def _glm52_layer_bytes(hidden: int, n_experts: int, width: int, moe: bool, indexer: bool) -> int:
    m = GLM52_MLA
    mats = [hidden * m["q_lora"], m["q_lora"] * m["heads"] * (m["qk_nope"] + m["qk_rope"]),
            hidden * (m["kv_lora"] + m["qk_rope"]), m["kv_lora"] * m["heads"] * (m["qk_nope"] + m["v_head"]),
            m["heads"] * m["v_head"] * hidden]
    vecs = [m["q_lora"], m["kv_lora"], hidden, hidden]  # q_a_norm, kv_a_norm, attention and FFN norms
    if indexer:
        ix = GLM52_INDEXER
        mats += [m["q_lora"] * ix["heads"] * ix["head_dim"], hidden * ix["head_dim"], hidden * ix["heads"]]
        vecs += [ix["head_dim"], ix["head_dim"]]  # k norm weight and bias
    if moe:
        mats += [3 * hidden * width, hidden * n_experts]  # one shared expert, the router
        vecs += [n_experts]  # router bias (e_score_correction)
    else:
        mats += [3 * hidden * GLM52_DENSE_FFN]
    return sum(_q("Q8_0", n) for n in mats) + sum(_q("F32", n) for n in vecs)


def glm52_non_routed_bytes(layout) -> int:
    """Non-routed bytes of the ds4 GLM-5.2 file (main blocks, MTP glue, embedding, head): see above."""
    ix = GLM52_INDEXER
    n_main = layout.n_blocks - layout.n_mtp_layers
    total = 0
    for block in range(n_main):
        one_based = block + 1
        indexer = one_based <= ix["first"] or (one_based - ix["first"]) % ix["every"] == 0
        total += _glm52_layer_bytes(layout.hidden, layout.n_experts, layout.expert_width,
                                    block not in layout.dense_blocks, indexer)
    for _ in range(layout.n_mtp_layers):  # a full MoE block with its indexer, plus eh_proj and 3 norms
        total += _glm52_layer_bytes(layout.hidden, layout.n_experts, layout.expert_width, True, True)
        total += _q("Q8_0", 2 * layout.hidden * layout.hidden) + _q("F32", 3 * layout.hidden)
    return total + 2 * _q("Q8_0", GLM52_VOCAB * layout.hidden) + _q("F32", layout.hidden)  # embd, head, norm


def shared_expert_bytes(layout) -> int:
    """One layer's shared expert(s): Q8_0 gate, up and down of the routed experts' width (ds4-engine.md §2.1:
    "Q8_0, 4096->2048->4096, about 25.5 MiB per layer")."""
    return layout.n_shared_experts * _q("Q8_0", 3 * layout.hidden * layout.expert_width)


def resident_set(layout, family: str, profile, ctx_tokens: int, prefill_cap_tokens: int, domain) -> ResidentSet:
    """VRAM (and pinned host RAM) ds4 holds before the expert cache; `domain` records the calibration use."""
    reserved = profile.runtime_reserved_bytes
    if family == "deepseek-v4.1":  # its planner prints KV and buffers as one graph figure: held as the buffers
        graph = v41_graph_bytes(ctx_tokens, domain)
        return ResidentSet(int(V41_NON_ROUTED_GIB * GIB), 0, 0, graph, 0, reserved, "ds4-v41-graph-8k")
    if family == "deepseek-v4":
        record = domain.use("ds4-flash-buffers-503", "ds4 compute buffers")
        return ResidentSet(int(FLASH_NON_ROUTED_GIB * GIB), 0, flash_kv_bytes(ctx_tokens, prefill_cap_tokens),
                           flash_context_buffer_bytes(ctx_tokens, prefill_cap_tokens), record.bytes(), reserved,
                           record.id)
    record = domain.use("ds4-glm52-buffers-neutronstar", "ds4 compute buffers")
    kv = GLM52_KV_LAYERS * ctx_tokens * GLM52_MLA_ROW_FLOATS * FLASH_F32_BYTES
    return ResidentSet(glm52_non_routed_bytes(layout), GLM52_HOST_PINNED_GIB * GIB, kv, 0, record.bytes(),
                       reserved, record.id)


def records_read(scenario) -> tuple[str, ...]:
    """The calibration records (sim/engine/records.py) a run of the scenario reads: its family's resident-set
    record(s) (resident_set), the graph encode per decode token and, on the Metal backend, its host round trip
    per router readback."""
    by_family = {"deepseek-v4.1": ("ds4-v41-graph-8k", "ds4-v41-graph-400k"), "deepseek-v4": ("ds4-flash-buffers-503",)}
    metal = ("ds4-metal-round-trip-437",) if scenario.hardware_profile.gpu.api == "metal" else ()
    return (*by_family.get(model_family(scenario), ("ds4-glm52-buffers-neutronstar",)), "ds4-graph-encode-773", *metal)


V41_GRAPH_CONTEXTS = (8192, 400_000)  # the contexts of records ds4-v41-graph-8k and -400k


def v41_graph_bytes(ctx_tokens: int, domain) -> int:
    """DeepSeek-V4.1's graph (KV cache and buffers) at --ctx: the line through the two printed figures (records
    ds4-v41-graph-8k and -400k), never below the smaller; a stand-in until V4.1's KV formula is known."""
    low = domain.use("ds4-v41-graph-8k", "ds4 V4.1 graph (KV + buffers)").bytes()
    high = domain.use("ds4-v41-graph-400k", "ds4 V4.1 graph (KV + buffers)").bytes()
    (c0, c1) = V41_GRAPH_CONTEXTS
    return max(low, int(low + (high - low) * (ctx_tokens - c0) / (c1 - c0)))


def non_routed_bytes(layout, family: str) -> int:
    if family == "deepseek-v4.1":
        return int(V41_NON_ROUTED_GIB * GIB)
    return int(FLASH_NON_ROUTED_GIB * GIB) if family == "deepseek-v4" else glm52_non_routed_bytes(layout)


# ------------------------------------------------------------------------------------------ work per layer


def embedding_bytes(layout, family: str) -> int:
    """The token embedding, of which a token reads one row: F16 in the Flash files (ds4-engine.md §2.3; V4.1's
    vocabulary is V4's, its F16 embedding assumed as well), Q8_0 in the GLM-5.2 file (see glm52_non_routed_bytes)."""
    if family in ("deepseek-v4", "deepseek-v4.1"):
        return FLASH_VOCAB * layout.hidden * 2
    return _q("Q8_0", GLM52_VOCAB * layout.hidden)


def decode_bytes_by_layer(layout, family: str, layers: Sequence[int]) -> np.ndarray:
    """[layer, 3] bytes a decoded token reads in each layer: the attention/router/norm part (the non-routed
    weights less the embedding, spread evenly over the routed layers, less the shared expert), the shared
    expert, and top_k routed experts of the layer. Decode is memory-bound, so these bytes split a token's GPU
    time between the parts (and prefill's, for want of a finer figure)."""
    n = layout.n_routed_layers
    shared = shared_expert_bytes(layout)
    other = max((non_routed_bytes(layout, family) - embedding_bytes(layout, family)) / n - shared, 0.0)
    return np.array([[other, shared, layout.top_k * layout.layers[i].expert_bytes] for i in layers], np.float64)


# ------------------------------------------------------------------------------------------ the plan's knobs

DEFAULT_OBJECTIVE = "decode_tok_s"
KEY_VARIANT = "engine.variant"
KEY_BUDGET = "engine.flags.ssd-streaming-cache-experts"
KEY_RESERVE = "engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB"
KEY_CHUNK = "engine.flags.prefill-chunk"
# explore.plan's words for the knobs and some of their values
KNOB_NAMES = {KEY_VARIANT: "variant", KEY_BUDGET: "expert budget", KEY_RESERVE: "VRAM reserve (GiB)",
              KEY_CHUNK: "prefill chunk"}
KNOB_LABELS = {(KEY_VARIANT, "pr504"): "per-class caches (pr504)", (KEY_VARIANT, "pre-504"): "one slab (pre-504)"}


def _get(data: dict, key: str):
    node = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _values(base, *others) -> list:
    out = [] if base is None else [base]
    for v in others:
        if not any(type(v) is type(u) and v == u for u in out):
            out.append(v)
    return out


def knobs(data: dict) -> tuple[list[tuple[str, list]], list[tuple[str, list]]]:
    """explore.plan's default search: (primary, secondary) knobs, the scenario's own value first."""
    variant = (data.get("engine") or {}).get("variant")
    primary = []
    if variant in ("pre-504", "pr504"):
        primary.append((KEY_VARIANT, _values(variant, "pr504" if variant == "pre-504" else "pre-504")))
    primary.append((KEY_BUDGET, _values(_get(data, KEY_BUDGET), "4096")))
    secondary = [(KEY_RESERVE, _values(_get(data, KEY_RESERVE), "8", "16")),
                 (KEY_CHUNK, _values(_get(data, KEY_CHUNK), 4096, 8192))]
    return primary, secondary


def prune(scenario) -> str | None:
    """Why a candidate cannot fit before it runs: the reserve leaves no VRAM for any expert cache."""
    from sim.engine.records import Domain

    eng, profile = scenario.engine, scenario.hardware_profile
    reserve = vram_reserve_bytes(getattr(eng.env, "DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB", None),
                                 profile.vram_bytes)
    chunk = eng.flags.prefill_chunk or DEFAULT_CHUNK_TOKENS
    resident = resident_set(scenario.layout, model_family(scenario), profile, context_tokens(eng.flags), chunk,
                            Domain("ds4", scenario.layout.name, profile.name, None))
    free = profile.vram_bytes - resident.vram
    if live_budget(1, 1, max(free, 0), reserve).disabled:
        return f"reserve {reserve / GIB:.1f} GiB >= {free / GIB:.1f} GiB free before the cache: no expert cache"
    return None


def owned_buffers(settings: dict) -> bool:
    """Whether a candidate's prompt path has buffers of its own (ds4 has no loans)."""
    return False


DEFAULT_CHUNK_TOKENS = 4096  # the graph's prefill cap when --prefill-chunk is not given (ds4.c L8330, §1.7)
