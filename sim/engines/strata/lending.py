"""Strata's prompt buffers borrowed from the cold tail of its expert cache (strata-engine.md §3.3, §3.4), as pure
functions:

  lending    plan_lend: the auto chunk list, k(c) tail slots >= bytes_needed(c), k + 128 <= slots,
             100 k <= LendPct x slots; lend(tokens) per request
  #658       independent_prefill_chunk: owned buffers when spare VRAM pays for them
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from sim.engines.strata.pricing import (IQ3S_MAX_BLOB_BYTES, PINNED_SHARE_THRESHOLD, RING_BUDGET_FROM_CHUNK_TOKENS,
                                        Pricing, _check_share, bytes_needed, ring_slots)
from sim.engines.strata.settings import MIN_KEEP_SLOTS, NO_BORROW_CHUNK_TOKENS
from sim.engines.strata.sizing import roundup
from sim.schema import check_int

# fmt: off
AUTO_CHUNKS_V0135 = (8192, 6144, 4096, 3072, 2048, 1024, 512, 256)   # plan_lend's --prefill auto list (§3.3)
INDEPENDENT_CHUNKS_FORK = (32768, 16384, 8192, 6144, 4096, 3072, 2048, 1024, 512, 256)  # #658 candidates (seed)
AUTO_CHUNKS_V0139 = INDEPENDENT_CHUNKS_FORK        # 0.1.39's --prefill auto list (vram_plan.cpp, #669)
LEND_PCT_PINNED, LEND_PCT_UNPINNED = 90, 85        # STRATA_PREFILL_LEND_PCT defaults (§3.3)
OWNED_FALLBACK_CHUNK_TOKENS = 1024                 # nothing lendable: the prompt path owns 1024-token buffers (§3.3)
LOAN_GRANULE_TOKENS = 256                          # lend(): want = min(chunk, roundup256(tokens)) (§3.3)
AUTO_CHUNK_CEILING_TOKENS = 8192                   # --prefill auto's largest chunk unless auto:N asks more (vram_plan.hpp)
                                                   # small_reserve_mib @ 0cb61d22)
MIN_LOAN_CHUNK_TOKENS = 256                        # the smallest prompt chunk a loan is priced for (vram_plan.cpp)
# fmt: on


def tail_slots_for(slot_bytes: np.ndarray, need_bytes: int) -> int | None:
    """k: the smallest number of tail slots whose bytes reach need_bytes (None if the whole cache is short)."""
    tail = np.cumsum(np.asarray(slot_bytes, dtype=np.int64)[::-1])
    k = int(np.searchsorted(tail, need_bytes, side="left")) + 1
    return k if k <= len(tail) else None


def _tail_bytes(slot_bytes: np.ndarray, k: int) -> int:
    return int(np.asarray(slot_bytes, dtype=np.int64)[len(slot_bytes) - k:].sum()) if k else 0


def lend_pct(pinned_share: float) -> int:
    return LEND_PCT_PINNED if _check_share("lend_pct", pinned_share) >= PINNED_SHARE_THRESHOLD else LEND_PCT_UNPINNED


@dataclass(frozen=True)
class LendPlan:
    """plan_lend's startup decision. owned: the prompt path has its own buffers (buffer_bytes of them)
    and lends nothing; else lent_slots = k tail slots from first_lent_slot, lend_bytes of them."""

    chunk_tokens: int
    lent_slots: int
    lend_bytes: int
    first_lent_slot: int | None
    owned: bool
    buffer_bytes: int  # bytes_needed(chunk_tokens)
    pinned_share: float
    kv_stage: int
    max_blob_bytes: int


def plan_lend(slot_bytes: np.ndarray, *, pinned_share: float, max_context_tokens: int,
              explicit_chunk_tokens: int | None = None, candidates: Sequence[int] = AUTO_CHUNKS_V0135,
              max_blob_bytes: int = IQ3S_MAX_BLOB_BYTES, kv_stage: int = 0, borrow: bool = True,
              has_profile: bool = True, lend_pct_override: int | None = None,
              pricing: "Pricing | None" = None, grid_ceiling_tokens: int | None = None,
              pressure_min_keep: int | None = None) -> LendPlan:
    """plan_lend (generate.cpp, one GPU, §3.3).

    auto: the first c in candidates (c <= max_context) with k(c) + 128 <= slots and 100 k(c) <= LendPct x
    slots, k(c) the smallest tail whose bytes >= bytes_needed(c); nothing fits -> owned 1024-token buffers.
    explicit C: halve C until k + 128 <= slots (no percentage cap); below 256 tokens -> owned 1024 (our
    choice: the notes do not say where halving stops). --no-prefill-borrow or no profile -> owned buffers
    of the explicit chunk, or 2048 tokens with auto.
    pressure_min_keep (0.1.42's --live-prefill-min-retained N < 128, live memory): when the 128-slot floor cannot
    fund even the 256-token loan, keep the largest prefix between N and 128 that can, and take the largest chunk
    of the list whose loan fits beside it (docs/PRESSURE_PREFILL_FLOOR.md).
    """
    where = "plan_lend"
    slot_bytes = np.asarray(slot_bytes, dtype=np.int64)
    slots = len(slot_bytes)
    check_int(where, "max_context_tokens", max_context_tokens, 1)
    pct = lend_pct(pinned_share) if lend_pct_override is None else check_int(where, "lend_pct", lend_pct_override, 0)

    def need(c: int) -> int:
        if pricing is not None:
            return pricing.need(c)
        return bytes_needed(c, ring_slots(c, pinned_share), kv_stage, max_blob_bytes=max_blob_bytes)

    def owned(c: int) -> LendPlan:
        return LendPlan(c, 0, 0, None, True, pricing.need_owned(c) if pricing is not None else need(c),
                        pinned_share, kv_stage, max_blob_bytes)

    def lent(c: int, k: int) -> LendPlan:
        return LendPlan(c, k, _tail_bytes(slot_bytes, k), slots - k, False, need(c), pinned_share, kv_stage,
                        max_blob_bytes)

    if explicit_chunk_tokens is not None:
        chunk = check_int(where, "explicit_chunk_tokens", explicit_chunk_tokens, 1)
        if not (borrow and has_profile):
            return owned(chunk)
        while chunk >= min(AUTO_CHUNKS_V0135):
            k = tail_slots_for(slot_bytes, need(chunk))
            if k is not None and k + MIN_KEEP_SLOTS <= slots:
                return lent(chunk, k)
            chunk //= 2
        return owned(OWNED_FALLBACK_CHUNK_TOKENS)
    if not (borrow and has_profile):
        return owned(NO_BORROW_CHUNK_TOKENS)
    def fits(c: int) -> int | None:
        k = tail_slots_for(slot_bytes, need(c))
        return k if k is not None and k + MIN_KEEP_SLOTS <= slots and k * 100 <= pct * slots else None

    small = next(((c, k) for c in candidates if c <= max_context_tokens for k in [fits(c)] if k is not None), None)
    if grid_ceiling_tokens is not None and (small is None or small[0] < RING_BUDGET_FROM_CHUNK_TOKENS):
        # 0.1.39b (#583): when the list's chunk is short, bisect the 256-token grid for the largest chunk whose
        # loan (with the ring the byte budget gives) still fits; keep the list's chunk if that is no larger
        best = largest_grid_chunk(min(grid_ceiling_tokens, max_context_tokens), lambda c: fits(c) is not None)
        if best and (small is None or best > small[0]):
            return lent(best, fits(best))
    if small is not None:
        return lent(*small)
    smallest = tail_slots_for(slot_bytes, need(min(candidates)))
    if pressure_min_keep is not None and smallest is not None and slots - smallest >= pressure_min_keep:
        keep = min(MIN_KEEP_SLOTS, slots - smallest)
        for c in candidates:
            k = tail_slots_for(slot_bytes, need(c)) if c <= max_context_tokens else None
            if k is not None and k + keep <= slots:
                return lent(c, k)
    return owned(OWNED_FALLBACK_CHUNK_TOKENS)


def largest_grid_chunk(ceiling_tokens: int, ok: Callable[[int], bool]) -> int:
    """The largest multiple of 256 tokens <= ceiling for which ok holds (ok monotone: a smaller chunk needs
    fewer bytes), by bisection as biggest_lend_chunk does (vram_plan.hpp, #583); 0 when not even 256 fits."""
    lo, hi = 0, ceiling_tokens // LOAN_GRANULE_TOKENS
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid * LOAN_GRANULE_TOKENS):
            lo = mid
        else:
            hi = mid - 1
    return lo * LOAN_GRANULE_TOKENS


@dataclass(frozen=True)
class Loan:
    want_tokens: int
    lent_slots: int
    first_lent_slot: int | None
    lend_bytes: int
    changed: bool  # False: the current loan already covered want


def lend(plan: LendPlan, slot_bytes: np.ndarray, tokens: int, current_first_slot: int | None = None,
         pricing: "Pricing | None" = None) -> Loan:
    """lend(tokens) per request (§3.3): want = min(chunk, roundup256(tokens)); first = max(plan first,
    slots - k(want)); a current loan starting at or before that first slot is kept as is."""
    slot_bytes = np.asarray(slot_bytes, dtype=np.int64)
    slots = len(slot_bytes)
    want = min(plan.chunk_tokens, roundup(check_int("lend", "tokens", tokens, 1), LOAN_GRANULE_TOKENS))
    if plan.owned:
        return Loan(want, 0, None, 0, False)
    need = pricing.need(want) if pricing is not None else \
        bytes_needed(want, ring_slots(want, plan.pinned_share), plan.kv_stage, max_blob_bytes=plan.max_blob_bytes)
    k = tail_slots_for(slot_bytes, need)
    first = max(plan.first_lent_slot, slots - (k if k is not None else slots))
    if current_first_slot is not None and current_first_slot <= first:
        first = current_first_slot
        return Loan(want, slots - first, first, _tail_bytes(slot_bytes, slots - first), False)
    return Loan(want, slots - first, first, _tail_bytes(slot_bytes, slots - first), True)


def independent_prefill_chunk(candidates: Sequence[tuple[int, int]], free_bytes: int, reserve_bytes: int,
                              max_chunk: int, borrowed_chunk: int) -> int:
    """The fork's independent_prefill_chunk (local_memory_plan.hpp, §3.4): the largest candidate
    (chunk_tokens, buffer_bytes) with chunk <= max_chunk, chunk >= borrowed_chunk and
    buffer_bytes <= free - reserve; 0 (keep borrowing) when none qualifies. Never shrinks the cache."""
    where = "independent_prefill_chunk"
    free_bytes = check_int(where, "free_bytes", free_bytes)
    reserve_bytes = check_int(where, "reserve_bytes", reserve_bytes)
    if free_bytes <= reserve_bytes:
        return 0
    spare = free_bytes - reserve_bytes
    best = 0
    for chunk, buffer in candidates:
        if borrowed_chunk <= chunk <= max_chunk and buffer <= spare and chunk > best:
            best = chunk
    return best


def independent_candidates(chunks: Sequence[int], pinned_share: float, kv_stage: int = 0, *,
                           max_blob_bytes: int = IQ3S_MAX_BLOB_BYTES) -> tuple[tuple[int, int], ...]:
    """(chunk, bytes_needed(chunk)) pairs priced as the fork does with Prefill::bytes_needed (seed)."""
    return tuple((c, bytes_needed(c, ring_slots(c, pinned_share), kv_stage, max_blob_bytes=max_blob_bytes))
                 for c in chunks)


def min_working_slots(pricing: "Pricing", borrow: bool) -> int:
    """#496's working cache: the uniform slots (max_blob each) of a 256-token loan plus the 128 a loan leaves, when
    the prompt path borrows; one slot otherwise."""
    if not borrow:
        return 1
    return -(-pricing.need(MIN_LOAN_CHUNK_TOKENS) // pricing.max_blob_bytes) + MIN_KEEP_SLOTS
