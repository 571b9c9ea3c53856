"""Strata's memory planning (v0.1.35, Niko1221/Strata, and the #658 fork spideytznn/Strata), as pure functions.

Sources: reference/strata-engine.md §2-§5 ([code] engine facts, [doc] project documents, [derived] the
notes' arithmetic and fits) and the #658 proposal text (seeds/strata-658-...). The rules:

  cache      --expert-cache N: byte budget N x max_blob; walk the profile ranking adding
             roundup256(blob(layer)) while used <= min(budget, free - reserve - other) (sized_slot_walk);
             auto: uniform count from free VRAM, then the same walk (auto_expert_cache); post-write
             shrink when free VRAM after the write is below the reserve (post_write_shrink)
  prefill    ring_slots(T, pinned_share) and bytes_needed(T, ring, kv_stage) (§4: affine, fitted)
  lending    plan_lend: the auto chunk list, k(c) tail slots >= bytes_needed(c), k + 128 <= slots,
             100 k <= LendPct x slots; lend(tokens) per request
  #658       independent_prefill_chunk, conversation_expert_headroom
  RAM        complement of the GPU cache must fit available - headroom; lend region covered from the
             last slot backwards (resident_ram_plan); uncovered lent slots are file-blob reads per refill
  parking    conversation cache make_room / physical-RAM floor admission (park_conversation)

Inputs are bytes unless a name says otherwise. Cache order is profile rank order: slot i holds the i-th
ranked (layer, expert) pair, so the tail slots are the coldest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from sim.errors import InputError

# fmt: off
MIB_BYTES = 1 << 20
GIB_BYTES = 1 << 30
U64_MAX = (1 << 64) - 1                            # size_t saturation in the fork's helpers (§3.5)

SLOT_ALIGN_BYTES = 256                             # roundup256(blob) per sized slot (generate.cpp, §2.3, §3.1)
IQ3S_MAX_BLOB_BYTES = 2_662_400                    # IQ3_S pack's largest blob, IQ4_XS + IQ4_NL (§2.2)
FORK_VRAM_RESERVE_MIB = 1536                       # the #658 fork's reserve (§5.1, seed)
OWNED_PREFILL_BASE_MIB = 160                       # auto sizing without borrowing: 160 + chunk*680/1024 MiB (§3.1)
OWNED_PREFILL_MIB_PER_1024_TOKENS = 680            # same rule (§3.1)
POST_WRITE_TOLERANCE_MIB = 64                      # post-write check: below reserve by more than 64 MiB (§3.1)
POST_WRITE_ZERO_READ_GIVEBACK_GIB = 1              # WDDM: a 0 MiB free read gives back 1 GiB ... (§3.1)
POST_WRITE_ZERO_READS_WITH_FIXED_GIVEBACK = 2      # ... for the first two such reads (§3.1)
POST_WRITE_SHORTFALL_MARGIN_MIB = 64               # later shortfalls give back deficit + 64 MiB (§3.1)
POST_WRITE_QUARTER_DIVISOR = 4                     # ... "or a quarter" (§3.1; see post_write_shrink)
POST_WRITE_MAX_ROUNDS = 6                          # up to 6 rounds (§3.1)

STREAM_ALL_MIN_TOKENS_V0135 = 2048                 # STREAM_ALL_MIN in v0.1.35 (1024 from 0.1.39) (§3.2)
RING_SLOTS_SHORT_CHUNK = 8                         # ring_slots below STREAM_ALL_MIN (§3.2, §4.3 T=256 row)
RING_SLOTS_PINNED = 384                            # pinned_share >= 0.9 (§3.2)
RING_SLOTS_UNPINNED = 96                           # otherwise (§3.2)
PINNED_SHARE_THRESHOLD = 0.9                       # ring 384 and LendPct 90 at or above this share (§3.2, §3.3)
RING_OVERRIDE_MIN_SLOTS, RING_OVERRIDE_MAX_SLOTS = 16, 512   # STRATA_PREFILL_RING clamp (§3.2)
# Prefill::bytes_needed, [derived] fit (§4.2, §4.3): NOT engine constants. The fixed part is the notes'
# theory (163.4 MiB from the allocation replay, §4.1) rounded as in table §4.3; the per-token part is the
# fit of the two 96 GB measurements (0.41458 MiB = 434,722 B, 0.9 % above the 430,588 B theory).
PREFILL_FIXED_BYTES = 163 * MIB_BYTES              # [derived] fit, §4.1/§4.3
PREFILL_BYTES_PER_TOKEN = 434_722                  # [derived] fit, §4.2
KV_STAGE_BYTES_PER_CELL_INT8 = 1_056               # one QSA layer's INT8 K+V per cell (§2.1, §4.1)

AUTO_CHUNKS_V0135 = (8192, 6144, 4096, 3072, 2048, 1024, 512, 256)   # plan_lend's --prefill auto list (§3.3)
INDEPENDENT_CHUNKS_FORK = (32768, 16384, 8192, 6144, 4096, 3072, 2048, 1024, 512, 256)  # #658 candidates (seed)
MIN_KEEP_SLOTS = 128                               # non-lendable floor of the cache (§3.3)
LEND_PCT_PINNED, LEND_PCT_UNPINNED = 90, 85        # STRATA_PREFILL_LEND_PCT defaults (§3.3)
OWNED_FALLBACK_CHUNK_TOKENS = 1024                 # nothing lendable: the prompt path owns 1024-token buffers (§3.3)
NO_BORROW_CHUNK_TOKENS = 2048                      # --no-prefill-borrow or no profile: owned 2048 (§3.3)
LOAN_GRANULE_TOKENS = 256                          # lend(): want = min(chunk, roundup256(tokens)) (§3.3)

CONVERSATION_HEADROOM_MARGIN_MIB = 256             # fork: budget + min_free + 256 MiB (§3.5, seed)
RESIDENT_HEADROOM_GIB = 4                          # --resident-experts / --resident-budget-gib (§3.5)
MMAP_CPU_HEADROOM_GIB = 8                          # other resident modes (§3.5)
BUDGET_MODE_MARGIN_MIB = 256                       # --resident-budget-gib clamp: available - headroom - 256 MiB (§3.5)
# fmt: on


def _check_int(where: str, field: str, value: object, minimum: int = 0) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise InputError(where, field, value, f"must be an integer >= {minimum}")
    return int(value)


def _check_share(where: str, value: float) -> float:
    if not 0.0 <= value <= 1.0:
        raise InputError(where, "pinned_share", value, "must be a fraction in 0..1")
    return value


def roundup(n: int, granule: int) -> int:
    return -(-n // granule) * granule


# ------------------------------------------------------------------------------------------ profile


def interleaved_profile_layers(n_layers: int, n_experts: int) -> np.ndarray:
    """A stand-in profile ranking: rank r is layer r % n_layers (expert r // n_layers).

    The engine ranks (layer, expert) pairs by measured routing frequency (--expert-profile, §3.1); no
    such profile is published, so this ranking walks the layers round robin, every layer equally hot.
    Returns int64 [n_layers * n_experts] of layer indices in rank order.
    """
    _check_int("profile", "n_layers", n_layers, 1)
    _check_int("profile", "n_experts", n_experts, 1)
    return np.tile(np.arange(n_layers, dtype=np.int64), n_experts)


def ranked_blob_bytes(layer_blob_bytes: Sequence[int] | np.ndarray, ranked_layers: np.ndarray) -> np.ndarray:
    """Blob bytes of each ranked pair: layer_blob_bytes[ranked_layers[r]] (int64)."""
    return np.asarray(layer_blob_bytes, dtype=np.int64)[np.asarray(ranked_layers, dtype=np.int64)]


# ------------------------------------------------------------------------------------------ sized cache


@dataclass(frozen=True, eq=False)
class SizedCache:
    """A profile-filled sized-slot cache. slot_bytes[i] = roundup256(blob) of the i-th ranked pair;
    slot_offsets[i] its byte offset (the engine's off_). Arrays are read-only int64."""

    slots: int
    bytes: int
    slot_bytes: np.ndarray
    slot_offsets: np.ndarray
    budget_bytes: int  # the walk's limit: min(budget, free - reserve - other)


def sized_slot_walk(ranked_blobs: np.ndarray, budget_bytes: int, free_vram_bytes: int | None = None,
                    vram_reserve_bytes: int = 0, other_bytes: int = 0) -> SizedCache:
    """generate.cpp sized-slot fill (§2.3, §3.1): add roundup256(blob) in rank order while
    used <= min(budget, free - reserve - other); the walk stops at the first blob that does not fit
    (or at the end of the profile). free_vram_bytes None: only the budget limits the walk."""
    where = "sized slot walk"
    blobs = np.asarray(ranked_blobs, dtype=np.int64)
    if blobs.ndim != 1 or (blobs.size and blobs.min() < 1):
        raise InputError(where, "ranked_blobs", blobs.shape, "must be a 1-D array of positive blob bytes")
    limit = _check_int(where, "budget_bytes", budget_bytes)
    if free_vram_bytes is not None:
        _check_int(where, "free_vram_bytes", free_vram_bytes)
        limit = max(0, min(limit, free_vram_bytes - _check_int(where, "vram_reserve_bytes", vram_reserve_bytes)
                           - _check_int(where, "other_bytes", other_bytes)))
    slot_bytes = roundup(blobs, SLOT_ALIGN_BYTES)
    ends = np.cumsum(slot_bytes)
    slots = int(np.searchsorted(ends, limit, side="right"))  # ends are increasing: first that overflows stops it
    slot_bytes = slot_bytes[:slots].copy()
    offsets = np.concatenate(([0], ends[: slots - 1])) if slots else np.zeros(0, dtype=np.int64)
    for arr in (slot_bytes, offsets):
        arr.setflags(write=False)
    return SizedCache(slots, int(ends[slots - 1]) if slots else 0, slot_bytes, offsets, limit)


def expert_cache_budget_bytes(expert_cache_n: int, max_blob_bytes: int) -> int:
    """--expert-cache N on a native pack: a byte budget of N x max_blob (§2.3, VRAM_TIER.md)."""
    return (_check_int("--expert-cache", "N", expert_cache_n, 1)
            * _check_int("--expert-cache", "max_blob", max_blob_bytes, 1))


def owned_prefill_mib(chunk_tokens: int) -> int:
    """Auto sizing's prefill allowance when NOT borrowing: 160 + chunk*680/1024 MiB (integer, §3.1)."""
    return OWNED_PREFILL_BASE_MIB + _check_int("auto sizing", "chunk_tokens", chunk_tokens) \
        * OWNED_PREFILL_MIB_PER_1024_TOKENS // 1024


def auto_expert_cache(ranked_blobs: np.ndarray, max_blob_bytes: int, free_vram_bytes: int, vram_reserve_bytes: int,
                      *, borrowing: bool = True, owned_chunk_tokens: int = NO_BORROW_CHUNK_TOKENS,
                      mtp_bind_bytes: int = 0) -> SizedCache:
    """--expert-cache auto (§3.1): uniform count = (free - (reserve + prefill) - mtp_bind) / max_blob capped at
    the profile length, prefill = 160 + chunk*680/1024 MiB only when not borrowing; then the sized walk
    under min(count x max_blob, free - reserve - prefill - mtp_bind)."""
    where = "auto expert cache"
    prefill_bytes = 0 if borrowing else owned_prefill_mib(owned_chunk_tokens) * MIB_BYTES
    spare = (_check_int(where, "free_vram_bytes", free_vram_bytes)
             - _check_int(where, "vram_reserve_bytes", vram_reserve_bytes) - prefill_bytes
             - _check_int(where, "mtp_bind_bytes", mtp_bind_bytes))
    count = min(max(0, spare) // _check_int(where, "max_blob_bytes", max_blob_bytes, 1), len(ranked_blobs))
    return sized_slot_walk(ranked_blobs, count * max_blob_bytes, free_vram_bytes, vram_reserve_bytes,
                           prefill_bytes + mtp_bind_bytes)


def auto_cache_free_vram_range(ranked_blobs: np.ndarray, max_blob_bytes: int, target_slots: int,
                               vram_reserve_bytes: int, *, other_bytes: int = 0) -> tuple[int, int] | None:
    """The free VRAM [lo, hi) for which auto_expert_cache (borrowing) gives exactly target_slots, or None
    when no uniform count does. other_bytes: MTP bind and owned-prefill allowance, if any. Inverts the
    auto rule to calibrate a box's free VRAM from a logged slot count."""
    ends = np.cumsum(roundup(np.asarray(ranked_blobs, dtype=np.int64), SLOT_ALIGN_BYTES))
    t = _check_int("auto cache calibration", "target_slots", target_slots, 1)
    if t > len(ends):
        return None
    count_lo = -(-int(ends[t - 1]) // max_blob_bytes)
    count_hi = (int(ends[t]) - 1) // max_blob_bytes if t < len(ends) else len(ends)
    if count_lo > min(count_hi, len(ends)):
        return None
    base = vram_reserve_bytes + other_bytes
    return count_lo * max_blob_bytes + base, (count_hi + 1) * max_blob_bytes + base


@dataclass(frozen=True, eq=False)
class ShrinkResult:
    cache: SizedCache
    rounds: tuple[tuple[int, int], ...]  # (free VRAM read, bytes given back) per shrinking round


def post_write_shrink(ranked_blobs: np.ndarray, cache: SizedCache, vram_reserve_bytes: int,
                      free_after_write: Callable[[int], int], *, wddm: bool = False) -> ShrinkResult:
    """Post-write check (§3.1): after the slots are zeroed free VRAM is read again; while it is below the
    reserve by more than 64 MiB the cache is reopened smaller (re-walked under a lower byte limit), up to
    6 rounds.

    free_after_write(cache_bytes) stands for the device: the free VRAM read with a cache of that many
    bytes. Give-back per round, our reading of the notes' "under WDDM the first two reads that show 0 MiB
    free each give back 1 GiB; later shortfalls give back the deficit + 64 MiB, or a quarter":
    a 0 read under WDDM gives back 1 GiB the first two times and a quarter of the cache after that (the
    deficit is unknown when the driver reads 0); any other shortfall gives back deficit + 64 MiB.
    """
    _check_int("post-write shrink", "vram_reserve_bytes", vram_reserve_bytes)
    rounds, zero_reads = [], 0
    for _ in range(POST_WRITE_MAX_ROUNDS):
        free = free_after_write(cache.bytes)
        if free + POST_WRITE_TOLERANCE_MIB * MIB_BYTES >= vram_reserve_bytes or cache.slots == 0:
            break
        if wddm and free <= 0:
            zero_reads += 1
            fixed = zero_reads <= POST_WRITE_ZERO_READS_WITH_FIXED_GIVEBACK
            give = POST_WRITE_ZERO_READ_GIVEBACK_GIB * GIB_BYTES if fixed else cache.bytes // POST_WRITE_QUARTER_DIVISOR
        else:
            give = vram_reserve_bytes - free + POST_WRITE_SHORTFALL_MARGIN_MIB * MIB_BYTES
        rounds.append((free, give))
        cache = sized_slot_walk(ranked_blobs, max(0, cache.bytes - give))
    return ShrinkResult(cache, tuple(rounds))


# ------------------------------------------------------------------------------------------ bytes_needed


def ring_slots(chunk_tokens: int, pinned_share: float, *, ring_override_slots: int | None = None,
               stream_all_min_tokens: int = STREAM_ALL_MIN_TOKENS_V0135) -> int:
    """ring_slots(T) (prefill.cpp, §3.2): 8 below STREAM_ALL_MIN; from it on 384 if pinned_share >= 0.9
    else 96, or STRATA_PREFILL_RING clamped to 16..512."""
    _check_int("ring_slots", "chunk_tokens", chunk_tokens, 1)
    _check_share("ring_slots", pinned_share)
    if chunk_tokens < stream_all_min_tokens:
        return RING_SLOTS_SHORT_CHUNK
    if ring_override_slots is not None:
        return min(max(ring_override_slots, RING_OVERRIDE_MIN_SLOTS), RING_OVERRIDE_MAX_SLOTS)
    return RING_SLOTS_PINNED if pinned_share >= PINNED_SHARE_THRESHOLD else RING_SLOTS_UNPINNED


def kv_stage_bytes(max_context_tokens: int, bytes_per_cell: int = KV_STAGE_BYTES_PER_CELL_INT8) -> int:
    """KV stage with --kv-resident streaming: one QSA layer's K/V at max context (264 MiB at 262,144, §4.1)."""
    return _check_int("kv stage", "max_context_tokens", max_context_tokens) * bytes_per_cell


def bytes_needed(chunk_tokens: int, ring: int, kv_stage: int = 0, *,
                 max_blob_bytes: int = IQ3S_MAX_BLOB_BYTES) -> int:
    """Prefill::bytes_needed (v0.1.33-0.1.35, MMQ on) as the notes' affine fit (§4.2-4.3) [derived]:
    163 MiB fixed + 434,722 B per token + ring x max_blob + KV stage."""
    where = "bytes_needed"
    return (PREFILL_FIXED_BYTES + _check_int(where, "chunk_tokens", chunk_tokens, 1) * PREFILL_BYTES_PER_TOKEN
            + _check_int(where, "ring", ring) * _check_int(where, "max_blob_bytes", max_blob_bytes, 1)
            + _check_int(where, "kv_stage", kv_stage))


# bytes_needed_owned (0.1.40: every cudaMalloc rounded to a 2 MiB page, ~35 of them) is left out: the
# sizes of the individual allocations are not in the notes, and v0.1.35's owned buffers were measured at
# 3,805 MiB for 8192 tokens, ring 96, which bytes_needed already gives (3,803 MiB). See docs/planning.md.


# ------------------------------------------------------------------------------------------ lending


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
              has_profile: bool = True, lend_pct_override: int | None = None) -> LendPlan:
    """plan_lend (generate.cpp, one GPU, §3.3).

    auto: the first c in candidates (c <= max_context) with k(c) + 128 <= slots and 100 k(c) <= LendPct x
    slots, k(c) the smallest tail whose bytes >= bytes_needed(c); nothing fits -> owned 1024-token buffers.
    explicit C: halve C until k + 128 <= slots (no percentage cap); below 256 tokens -> owned 1024 (our
    choice: the notes do not say where halving stops). --no-prefill-borrow or no profile -> owned buffers
    of the explicit chunk, or 2048 tokens with auto.
    """
    where = "plan_lend"
    slot_bytes = np.asarray(slot_bytes, dtype=np.int64)
    slots = len(slot_bytes)
    _check_int(where, "max_context_tokens", max_context_tokens, 1)
    pct = lend_pct(pinned_share) if lend_pct_override is None else _check_int(where, "lend_pct", lend_pct_override, 0)

    def need(c: int) -> int:
        return bytes_needed(c, ring_slots(c, pinned_share), kv_stage, max_blob_bytes=max_blob_bytes)

    def owned(c: int) -> LendPlan:
        return LendPlan(c, 0, 0, None, True, need(c), pinned_share, kv_stage, max_blob_bytes)

    def lent(c: int, k: int) -> LendPlan:
        return LendPlan(c, k, _tail_bytes(slot_bytes, k), slots - k, False, need(c), pinned_share, kv_stage,
                        max_blob_bytes)

    if explicit_chunk_tokens is not None:
        chunk = _check_int(where, "explicit_chunk_tokens", explicit_chunk_tokens, 1)
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
    for c in candidates:
        if c > max_context_tokens:
            continue
        k = tail_slots_for(slot_bytes, need(c))
        if k is not None and k + MIN_KEEP_SLOTS <= slots and k * 100 <= pct * slots:
            return lent(c, k)
    return owned(OWNED_FALLBACK_CHUNK_TOKENS)


@dataclass(frozen=True)
class Loan:
    want_tokens: int
    lent_slots: int
    first_lent_slot: int | None
    lend_bytes: int
    changed: bool  # False: the current loan already covered want


def lend(plan: LendPlan, slot_bytes: np.ndarray, tokens: int, current_first_slot: int | None = None) -> Loan:
    """lend(tokens) per request (§3.3): want = min(chunk, roundup256(tokens)); first = max(plan first,
    slots - k(want)); a current loan starting at or before that first slot is kept as is."""
    slot_bytes = np.asarray(slot_bytes, dtype=np.int64)
    slots = len(slot_bytes)
    want = min(plan.chunk_tokens, roundup(_check_int("lend", "tokens", tokens, 1), LOAN_GRANULE_TOKENS))
    if plan.owned:
        return Loan(want, 0, None, 0, False)
    need = bytes_needed(want, ring_slots(want, plan.pinned_share), plan.kv_stage, max_blob_bytes=plan.max_blob_bytes)
    k = tail_slots_for(slot_bytes, need)
    first = max(plan.first_lent_slot, slots - (k if k is not None else slots))
    if current_first_slot is not None and current_first_slot <= first:
        first = current_first_slot
        return Loan(want, slots - first, first, _tail_bytes(slot_bytes, slots - first), False)
    return Loan(want, slots - first, first, _tail_bytes(slot_bytes, slots - first), True)


# ------------------------------------------------------------------------------------------ #658 helpers


def independent_prefill_chunk(candidates: Sequence[tuple[int, int]], free_bytes: int, reserve_bytes: int,
                              max_chunk: int, borrowed_chunk: int) -> int:
    """The fork's independent_prefill_chunk (local_memory_plan.hpp, §3.4): the largest candidate
    (chunk_tokens, buffer_bytes) with chunk <= max_chunk, chunk >= borrowed_chunk and
    buffer_bytes <= free - reserve; 0 (keep borrowing) when none qualifies. Never shrinks the cache."""
    where = "independent_prefill_chunk"
    free_bytes = _check_int(where, "free_bytes", free_bytes)
    reserve_bytes = _check_int(where, "reserve_bytes", reserve_bytes)
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


def conversation_expert_headroom(existing_headroom_bytes: int, conv_budget_bytes: int, conv_slots: int,
                                 conv_min_free_bytes: int, *, resident_experts: bool = True,
                                 prompt_cache_entries: int = 6) -> int:
    """The fork's conversation_expert_headroom (§3.5, seed): with resident experts and an enabled
    conversation cache (budget > 0, slots > 0, prompt cache > 0) the headroom is
    max(existing, budget + min_free + 256 MiB), saturating at 2^64 - 1; otherwise unchanged."""
    where = "conversation_expert_headroom"
    existing = _check_int(where, "existing_headroom_bytes", existing_headroom_bytes)
    budget = _check_int(where, "conv_budget_bytes", conv_budget_bytes)
    min_free = _check_int(where, "conv_min_free_bytes", conv_min_free_bytes)
    if not (resident_experts and budget > 0 and _check_int(where, "conv_slots", conv_slots) > 0
            and _check_int(where, "prompt_cache_entries", prompt_cache_entries) > 0):
        return existing
    wanted = min(budget + min_free + CONVERSATION_HEADROOM_MARGIN_MIB * MIB_BYTES, U64_MAX)
    return max(existing, wanted)


# ------------------------------------------------------------------------------------------ RAM tiers

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
        return int(gib * GIB_BYTES)
    return (MMAP_CPU_HEADROOM_GIB if mode == "resident-cpu-experts" else RESIDENT_HEADROOM_GIB) * GIB_BYTES


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
    complement = _check_int(where, "total_expert_bytes", total_expert_bytes) - int(blobs.sum())
    if complement < 0:
        raise InputError(where, "total_expert_bytes", total_expert_bytes, "is smaller than the cached blobs")
    budget = (_check_int(where, "available_ram_bytes", available_ram_bytes)
              - _check_int(where, "headroom_bytes", headroom_bytes))
    lent = 0 if lend_first_slot is None else slots - _check_int(where, "lend_first_slot", lend_first_slot)
    if lent < 0:
        raise InputError(where, "lend_first_slot", lend_first_slot, f"beyond the cache's {slots} slots")
    if mode == "resident-budget":
        clamp = max(0, budget - BUDGET_MODE_MARGIN_MIB * MIB_BYTES)
        asked = -1 if resident_budget_bytes is None else resident_budget_bytes
        asked = _check_int(where, "resident_budget_bytes", asked)
        copy = min(asked, clamp, complement)
        return ResidentPlan("budget", complement, budget, 0, 0, lent, None, copy, None)
    if complement > budget:
        gib = f"{complement / GIB_BYTES:.2f} GiB complement > {max(budget, 0) / GIB_BYTES:.2f} GiB budget " \
              f"(available {available_ram_bytes / GIB_BYTES:.2f} - headroom {headroom_bytes / GIB_BYTES:.2f} GiB)"
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


# ------------------------------------------------------------------------------------------ conversations


@dataclass(frozen=True)
class ParkedConversation:
    name: str
    bytes: int
    tokens: int = 0
    pinned: bool = False


@dataclass(frozen=True)
class ParkResult:
    entries: tuple[ParkedConversation, ...]  # oldest first
    evicted: tuple[ParkedConversation, ...]
    parked: bool
    reason: str | None  # why parking was skipped


def conversation_budget_bytes(conv_cache_mib: int, prompt_cache_entries: int) -> int:
    """ConversationCache(budget = M MiB if prompt_cache > 0, else 0 = off) (§3.7)."""
    return _check_int("conversation cache", "mib", conv_cache_mib) * MIB_BYTES if prompt_cache_entries > 0 else 0


def make_room(entries: Sequence[ParkedConversation], slots: int, budget_bytes: int, held_bytes: int,
              incoming_bytes: int) -> tuple[tuple[ParkedConversation, ...], tuple[ParkedConversation, ...], bool]:
    """ConversationCache::make_room (§3.7): evict the oldest non-pinned entries while size >= slots or
    parked bytes > budget - held - incoming. Returns (kept, evicted, room); room False when only pinned
    entries remain and the condition still holds (parking is then skipped)."""
    kept, evicted = list(entries), []

    def crowded() -> bool:
        return len(kept) >= slots or sum(e.bytes for e in kept) > budget_bytes - held_bytes - incoming_bytes

    while crowded():
        victim = next((e for e in kept if not e.pinned), None)
        if victim is None:
            return tuple(kept), tuple(evicted), False
        kept.remove(victim)
        evicted.append(victim)
    return tuple(kept), tuple(evicted), True


def physical_ram_admits(available_ram_bytes: int, min_free_bytes: int, additional_bytes: int) -> bool:
    """Physical-RAM admission (conversation_memory.cpp, §3.7): available - floor >= additional bytes."""
    return available_ram_bytes - min_free_bytes >= additional_bytes


def park_conversation(entries: Sequence[ParkedConversation], incoming: ParkedConversation, *, slots: int,
                      budget_bytes: int, held_bytes: int, available_ram_bytes: int,
                      min_free_bytes: int) -> ParkResult:
    """Park a session (§3.7): make_room for its estimate, check the physical-RAM floor, then put it as the
    newest entry. A disabled cache (budget 0 or no slots) parks nothing. The engine checks the floor
    again after capture; with a fixed estimate that second check is the same one."""
    if budget_bytes <= 0 or slots <= 0:
        return ParkResult(tuple(entries), (), False, "conversation cache disabled")
    kept, evicted, room = make_room(entries, slots, budget_bytes, held_bytes, incoming.bytes)
    if not room:
        return ParkResult(kept, evicted, False, "only pinned entries remain")
    if not physical_ram_admits(available_ram_bytes, min_free_bytes, incoming.bytes):
        return ParkResult(kept, evicted, False, "below the physical-RAM floor")
    return ParkResult(kept + (incoming,), evicted, True, None)
