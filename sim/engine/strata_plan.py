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
from typing import Annotated, ClassVar, Literal

import numpy as np
from pydantic import Field, PlainValidator, model_validator

from sim.errors import InputError
from sim.schema import Strict, count_or_keyword, digits, env_table, written
from sim.units import GIB, MIB

# fmt: off
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
PREFILL_FIXED_BYTES = 163 * MIB              # [derived] fit, §4.1/§4.3
PREFILL_BYTES_PER_TOKEN = 434_722                  # [derived] fit, §4.2
# From 0.1.39b the buffer count leaves out the FP32 xn copy of each token (10,240 floats, 40,960 B), which the
# fused hyper-connection read no longer allocates (prefill.cpp @ 06f7665f, bytes_needed's comment: the old count
# "counted xn unconditionally"): the same fit less that term.
PREFILL_XN_BYTES_PER_TOKEN = 10_240 * 4
# The shared scratch region is max(GDN, QSA, MoE set) (§4.1); the per-token fit assumes the MoE set, which
# dominates except for short chunks at long contexts, where QSA's block scores (256 B per context cell) and its
# attention scratch (32 selection-wide tiles) outgrow it.
MOE_SET_BYTES_PER_TOKEN = 234_052                  # MoE with MMQ (§4.1)
QSA_SET_BYTES_PER_TOKEN = 117_248 + 4 * 2048       # 117,248 + 4 x cap, cap ~2048 selected cells (§4.1)
QSA_BLOCK_SCORE_BYTES_PER_CELL = 256               # 256 x max_blocks x 4 B, max_blocks = cells / 4 + 2 (§4.1)
QSA_ATTENTION_SCRATCH_BYTES = 26_200_000           # 32 x attn_scratch at cap 2048 (prefill.cpp @ 06f7665f)
KV_BYTES_PER_CELL_LAYER = {                        # one QSA layer's K+V per cell (2 KV heads x 256)
    "int8": 1_056,                                 # kv_q8.hpp: 1,024 B + FP16 group scales (§2.1, §4.1)
    "fp16": 2_048,                                 # 2 x 2 x 256 x 2 B
    "k8v4": 816,                                   # §2.1
    "q4_0": 576,                                   # [derived] GGML Q4_0: 18 B per 32 values, 1,024 values
}

AUTO_CHUNKS_V0135 = (8192, 6144, 4096, 3072, 2048, 1024, 512, 256)   # plan_lend's --prefill auto list (§3.3)
INDEPENDENT_CHUNKS_FORK = (32768, 16384, 8192, 6144, 4096, 3072, 2048, 1024, 512, 256)  # #658 candidates (seed)
AUTO_CHUNKS_V0139 = INDEPENDENT_CHUNKS_FORK        # 0.1.39's --prefill auto list (vram_plan.cpp, #669)
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
    prefill_bytes = 0 if borrowing else owned_prefill_mib(owned_chunk_tokens) * MIB
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
        if free + POST_WRITE_TOLERANCE_MIB * MIB >= vram_reserve_bytes or cache.slots == 0:
            break
        if wddm and free <= 0:
            zero_reads += 1
            fixed = zero_reads <= POST_WRITE_ZERO_READS_WITH_FIXED_GIVEBACK
            give = POST_WRITE_ZERO_READ_GIVEBACK_GIB * GIB if fixed else cache.bytes // POST_WRITE_QUARTER_DIVISOR
        else:
            give = vram_reserve_bytes - free + POST_WRITE_SHORTFALL_MARGIN_MIB * MIB
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


def kv_stage_bytes(max_context_tokens: int, bytes_per_cell: int = KV_BYTES_PER_CELL_LAYER["int8"]) -> int:
    """KV stage with --kv-resident streaming: one QSA layer's K/V at max context (264 MiB of INT8 at 262,144,
    §4.1)."""
    return _check_int("kv stage", "max_context_tokens", max_context_tokens) * bytes_per_cell


def qsa_region_excess(chunk_tokens: int, max_cells: int) -> int:
    """Bytes the QSA set adds over the MoE set in the shared scratch region, at a context of max_cells (0 when
    the MoE set is the larger one, as the per-token fit assumes)."""
    qsa = (chunk_tokens * QSA_SET_BYTES_PER_TOKEN + (max_cells // 4 + 2) * 4 * QSA_BLOCK_SCORE_BYTES_PER_CELL
           + QSA_ATTENTION_SCRATCH_BYTES)
    return max(0, qsa - chunk_tokens * MOE_SET_BYTES_PER_TOKEN)


def bytes_needed(chunk_tokens: int, ring: int, kv_stage: int = 0, *,
                 max_blob_bytes: int = IQ3S_MAX_BLOB_BYTES, per_token_bytes: int = PREFILL_BYTES_PER_TOKEN,
                 max_cells: int | None = None) -> int:
    """Prefill::bytes_needed (MMQ on) as the notes' affine fit (§4.2-4.3) [derived]: 163 MiB fixed + per-token
    bytes (434,722 B for v0.1.33-0.1.35; 0.1.39b drops the xn copy) + ring x max_blob + KV stage, plus, when the
    context is given, what the QSA set adds over the MoE set in the shared region (short chunks, long contexts)."""
    where = "bytes_needed"
    tokens = _check_int(where, "chunk_tokens", chunk_tokens, 1)
    excess = 0 if max_cells is None else qsa_region_excess(tokens, _check_int(where, "max_cells", max_cells, 1))
    return (PREFILL_FIXED_BYTES + tokens * _check_int(where, "per_token_bytes", per_token_bytes, 1)
            + _check_int(where, "ring", ring) * _check_int(where, "max_blob_bytes", max_blob_bytes, 1)
            + _check_int(where, "kv_stage", kv_stage) + excess)


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
    _check_int(where, "max_context_tokens", max_context_tokens, 1)
    pct = lend_pct(pinned_share) if lend_pct_override is None else _check_int(where, "lend_pct", lend_pct_override, 0)

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
    want = min(plan.chunk_tokens, roundup(_check_int("lend", "tokens", tokens, 1), LOAN_GRANULE_TOKENS))
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
    wanted = min(budget + min_free + CONVERSATION_HEADROOM_MARGIN_MIB * MIB, U64_MAX)
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
    complement = _check_int(where, "total_expert_bytes", total_expert_bytes) - int(blobs.sum())
    if complement < 0:
        raise InputError(where, "total_expert_bytes", total_expert_bytes, "is smaller than the cached blobs")
    budget = (_check_int(where, "available_ram_bytes", available_ram_bytes)
              - _check_int(where, "headroom_bytes", headroom_bytes))
    lent = 0 if lend_first_slot is None else slots - _check_int(where, "lend_first_slot", lend_first_slot)
    if lent < 0:
        raise InputError(where, "lend_first_slot", lend_first_slot, f"beyond the cache's {slots} slots")
    if mode == "resident-budget":
        clamp = max(0, budget - BUDGET_MODE_MARGIN_MIB * MIB)
        asked = -1 if resident_budget_bytes is None else resident_budget_bytes
        asked = _check_int(where, "resident_budget_bytes", asked)
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
    return _check_int("conversation cache", "mib", conv_cache_mib) * MIB if prompt_cache_entries > 0 else 0


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


# ------------------------------------------------------------------------------------------ builds
#
# What each Strata build does differently. The seeds are v0.1.35 and the #658 fork on it; the later builds
# change how the prompt path is priced and planned (strata-engine.md §0, §3.2, §3.3, §4.3).

Q2_0_BLOB_BYTES = 1_382_400                        # the Q2_0 pack's blob: 0.1.39b's ring unit (§3.2)
RING_SLOTS_FUSED = 1024                            # 0.1.39b: "1024 fused / 384 pinned / 96" (§3.2)
RING_CAP_NATIVE_SLOTS = 512                        # ring_cap() on native packs (prefill.cpp @ 06f7665f)
RING_BUDGET_FROM_CHUNK_TOKENS = 6144               # ring_cap_for: a chunk of 0.1.39's list >= 6,144 keeps its ring
STREAM_ALL_MIN_TOKENS_V0139 = 1024                 # STREAM_ALL_MIN from 0.1.39 (§3.2)
AUTO_CHUNK_CEILING_TOKENS = 8192                   # --prefill auto's largest chunk unless auto:N asks more (vram_plan.hpp)
OWNED_ALLOCATIONS = 35                             # 0.1.40 bytes_needed_owned: "~35 separate cudaMallocs" (§3.4)
OWNED_PAGE_BYTES = 2 * MIB                         # ... each rounded to a 2 MiB page (§3.4)
KV_RESIDENT_MIN_CELLS = 20480                      # --kv-resident N: "minimum 20480" (Niko1221/Strata docs/FLAGS.md)
SMALL_RESERVE_MIB = 300                            # #496: the adapted default reserve's floor (vram_plan.hpp
                                                   # small_reserve_mib @ 0cb61d22)
MIN_LOAN_CHUNK_TOKENS = 256                        # the smallest prompt chunk a loan is priced for (vram_plan.cpp)
QSA_EVERY = 4                                      # every 4th layer is QSA, the rest GDN (the Qwen3-Next family's
                                                   # full_attention_interval 4, hardware-and-gguf.md §4)
QSA_LAYERS = 48 // QSA_EVERY                       # Qwen3.8-Flash-Next: 12 QSA sparse-attention layers hold K/V (§2.1)
DEFAULT_MAX_CONTEXT_TOKENS = 4096                  # Options::max_context (generate.cpp; setup.py writes larger ones)
DEFAULT_KV = "fp16"                                # Options::kv ("setup" picks int8 above an 8K context)


def adapted_vram_reserve(free_vram_bytes: int, reserve_bytes: int, mtp_bind_bytes: int, cache_slots: int,
                         min_slots: int, max_blob_bytes: int) -> int:
    """#496 in the startup plan (plan_startup_vram, src/prefill/vram_plan.cpp @ 0cb61d22): an auto cache whose
    default reserve (not given on the command line, above 300 MiB) leaves fewer than `min_slots` slots gets the
    reserve that leaves exactly min_slots uniform slots of max_blob, never below 300 MiB nor above the default; the
    reserve is kept when even 300 MiB cannot. min_slots: the 256-token loan's slots + the 128 kept when borrowing
    (min_working_slots), 1 otherwise. Returns the reserve to size the cache with."""
    if reserve_bytes <= SMALL_RESERVE_MIB * MIB or cache_slots >= min_slots:
        return reserve_bytes
    fit_mib = (free_vram_bytes - mtp_bind_bytes - min_slots * max_blob_bytes) // MIB
    if fit_mib < SMALL_RESERVE_MIB:
        return reserve_bytes
    return min(fit_mib * MIB, reserve_bytes)


def min_working_slots(pricing: "Pricing", borrow: bool) -> int:
    """#496's working cache: the uniform slots (max_blob each) of a 256-token loan plus the 128 a loan leaves, when
    the prompt path borrows; one slot otherwise."""
    if not borrow:
        return 1
    return -(-pricing.need(MIN_LOAN_CHUNK_TOKENS) // pricing.max_blob_bytes) + MIN_KEEP_SLOTS


@dataclass(frozen=True)
class Build:
    name: str
    stream_all_min_tokens: int
    ring_bytes: bool  # 0.1.39b (#583): the ring is a byte budget, not a slot count
    grid_auto: bool  # 0.1.39b: --prefill auto bisects on a 256-token grid up to max(8192, min(auto:N, ctx))
    auto_n: bool  # #669: --prefill auto:N is parsed
    owned_pricing: bool  # 0.1.40: owned buffers priced per cudaMalloc (2 MiB pages)
    startup_plan: bool  # #765: the owned prompt path is booked before the cache is sized
    independent_buffers: bool  # the #658 fork: owned buffers when spare VRAM pays for them
    conversation_headroom: bool  # the #658 fork: the conversation budget inside the RAM headroom
    live_memory: bool  # the live-memory build: loans get RAM coverage from the resident budget
    loan_donors: bool  # live memory's current-loan coverage: a lent expert without a RAM copy takes a donor's slot
    source: str

    @property
    def prefill_bytes_per_token(self) -> int:
        """bytes_needed's per-token bytes: 0.1.39b (#583, with the ring byte budget) stopped counting xn."""
        return PREFILL_BYTES_PER_TOKEN - (PREFILL_XN_BYTES_PER_TOKEN if self.ring_bytes else 0)


BUILDS = {b.name: b for b in (
    Build("v0.1.35", 2048, False, False, False, False, False, False, False, False, False,
          "Niko1221/Strata d9ab8435 (strata-engine.md §3)"),
    Build("fork-658", 2048, False, False, False, False, False, True, True, False, False,
          "spideytznn/Strata on v0.1.35: proposal #658 (seed)"),
    Build("v0.1.39", STREAM_ALL_MIN_TOKENS_V0139, False, False, True, False, False, False, False, False, False,
          "0.1.39: #669 --prefill auto:N (the chunk list up to 32768, entries above 8192 only when asked for), "
          "STREAM_ALL_MIN 1024; the ring still 384 pinned / 96"),
    Build("v0.1.39b", STREAM_ALL_MIN_TOKENS_V0139, True, True, True, False, False, False, False, False, False,
          "0.1.39b: #583 ring byte budget and 256-token chunk bisection, #669 --prefill auto:N, STREAM_ALL_MIN 1024"),
    Build("v0.1.40", STREAM_ALL_MIN_TOKENS_V0139, True, True, True, True, True, False, False, False, False,
          "0.1.40: bytes_needed_owned (2 MiB pages), #765 plan_startup_vram, on 0.1.39b"),
    Build("v0.1.40-live-guarded", STREAM_ALL_MIN_TOKENS_V0139, True, True, True, True, True, False, False, True, False,
          "the live-memory build's guarded borrowing (docs/LIVE_MEMORY.md, PR #726 before 'Refreshing current loan "
          "coverage'), priced as 0.1.40: lent GPU experts get RAM copies from the resident budget at startup; a lent "
          "expert without one (an adaptive swap moved a file-tier expert into a covered slot) falls back to the file"),
    Build("v0.1.40-live", STREAM_ALL_MIN_TOKENS_V0139, True, True, True, True, True, False, False, True, True,
          "the live-memory build on 0.1.40 (docs/LIVE_MEMORY.md): lent GPU experts get RAM copies that share the "
          "resident budget; a lent expert without one takes a same-layer RAM slot's place (a donor: a GPU-backed "
          "duplicate first, else the coldest RAM-only expert) before the loan, else falls back to the file"),
)}


@dataclass(frozen=True)
class Pricing:
    """How a build prices its prompt path for a cache: the streaming ring and Prefill::bytes_needed."""

    build: Build
    pinned_share: float
    max_blob_bytes: int
    kv_stage: int = 0
    ring_override_slots: int | None = None
    fused: bool = False  # STRATA_PF_FUSED: the fused int8 experts (CUDA), whose ring is 1,024 slots
    max_cells: int | None = None  # --max-context: the QSA set's share of the scratch region

    def ring(self, chunk_tokens: int) -> int:
        """ring_slots(T): below STREAM_ALL_MIN the 8-slot stage; STRATA_PREFILL_RING wins; up to 0.1.39 384 slots
        (pinned) or 96. 0.1.39b (#583) keeps 0.1.39's ring for chunks of 6,144 tokens and more (ring_cap_for) and
        otherwise sizes a pinned ring as a byte budget of 384 Q2_0 blobs; the unpinned ring keeps its measured
        96. The fused experts (STRATA_PF_FUSED) take 1,024 where 384 would be, capped at 512 on native packs."""
        if not self.build.ring_bytes or chunk_tokens < self.build.stream_all_min_tokens:
            return ring_slots(chunk_tokens, self.pinned_share, ring_override_slots=self.ring_override_slots,
                              stream_all_min_tokens=self.build.stream_all_min_tokens)
        if self.ring_override_slots is not None:
            return min(max(self.ring_override_slots, RING_OVERRIDE_MIN_SLOTS), RING_OVERRIDE_MAX_SLOTS)
        if self.pinned_share < PINNED_SHARE_THRESHOLD:
            return RING_SLOTS_UNPINNED
        units = RING_SLOTS_FUSED if self.fused else RING_SLOTS_PINNED
        if chunk_tokens >= RING_BUDGET_FROM_CHUNK_TOKENS:
            return min(units, RING_CAP_NATIVE_SLOTS)
        return max(1, min(RING_CAP_NATIVE_SLOTS, units * Q2_0_BLOB_BYTES // self.max_blob_bytes))

    def need(self, chunk_tokens: int) -> int:
        return bytes_needed(chunk_tokens, self.ring(chunk_tokens), self.kv_stage, max_blob_bytes=self.max_blob_bytes,
                            per_token_bytes=self.build.prefill_bytes_per_token, max_cells=self.max_cells)

    def need_owned(self, chunk_tokens: int) -> int:
        """Owned buffers: the same bytes, plus (0.1.40) each allocation rounded to its 2 MiB page; the
        allocations' own sizes are not in the notes, so each wastes half a page on average."""
        extra = OWNED_ALLOCATIONS * OWNED_PAGE_BYTES // 2 if self.build.owned_pricing else 0
        return self.need(chunk_tokens) + extra


# ------------------------------------------------------------------------------------------ VRAM before the cache
#
# What Strata holds in VRAM when it sizes the expert cache: cudaMemGetInfo is read "after weights, session,
# drafter, head" (vram_plan.hpp @ 0cb61d22, free_bytes), and an auto cache gets free - --vram-reserve-mib - the
# draft head's bind (it is allocated after the cache, but booked before it). Every term below is read from
# Strata's own loading logs on boxes that are not validation cases (the research notes behind this module's
# history; sources per figure), except the runtime's own buffers, a calibration record per platform.


@dataclass(frozen=True)
class PackWeights:
    """The dense weights a pack loads to VRAM: the pack's canonical tensors (norms, BF16 routers and gates,
    hyper-connection and PLE projections, FP32 GDN/QSA tensors), the natively served projections (36 GDN x
    3 + 12 QSA x 4 + 48 shared-expert matrices) and the output head; the token embedding (mapped host memory)
    and the PLE n-gram table (read from the drive) stay off the GPU."""

    dense_bytes: int
    head_bytes: int  # the native output head (248,320 rows): the draft head binds a subset of its rows
    source: str


CANONICAL_PACK_MIB = 1466                          # "1466 MiB of weights loaded" on every GSQ-RCO pack logged
PACK_WEIGHTS = {
    "qwen3.8-flash-next-iq3s": PackWeights(
        int((CANONICAL_PACK_MIB + 2018.88) * MIB) + 521_472_000, 521_472_000,
        "[M] Strata engine logs (bench/results/2026-10-06-community-rtx5070ti-5900x/engine.log @ a2653966, "
        "2026-10-04-community-rtx-4090-laptop @ 84f2e9f4): 1,466 MiB pack weights + 2,018.88 MiB native "
        "projections + a 521,472,000 B native head = 3,982 MiB"),
    "qwen3.8-flash-next-iq2xs": PackWeights(
        int((CANONICAL_PACK_MIB + 1474.85) * MIB) + 337_715_200, 337_715_200,
        "[M] Strata engine log (bench/results/2026-10-05-community-rx-6700-xt/engine.log @ 282c55e9): 1,466 + "
        "1,474.85 MiB + a 337,715,200 B head = 3,263 MiB"),
    "qwen3.8-flash-next-iq3xxs": PackWeights(
        int((CANONICAL_PACK_MIB + 1781.11) * MIB) + 437_043_200, 437_043_200,
        "[M from another pack] the Swift 1.5 IQ3_XXS pack's logs (a V100 ledger and an A4500 log, indexed copies "
        "70762382992, 71284340493): 1,466 + 1,781.11 MiB + a 437,043,200 B head = 3,664 MiB; no log of the "
        "GSQ-RCO IQ3_XXS pack"),
}
# No log of the Q2_0 canonical pack or the Huihui IQ3_S/IQ4_NL pack: the mean of the three logged packs.
_MEAN_DENSE = sum(w.dense_bytes for w in PACK_WEIGHTS.values()) // len(PACK_WEIGHTS)
_MEAN_HEAD = sum(w.head_bytes for w in PACK_WEIGHTS.values()) // len(PACK_WEIGHTS)
PACK_WEIGHTS_UNLOGGED = PackWeights(_MEAN_DENSE, _MEAN_HEAD, "[E] no log of this pack's weights: the mean of the "
                                    "three logged GSQ-RCO packs (IQ3_S 3,982, IQ2_XS 3,263, IQ3_XXS 3,664 MiB)")
VOCAB_ROWS = 248_320                               # Qwen3.8-Flash-Next vocabulary (§2.1)
DRAFT_HEAD_ROWS_CJK = 106_299                      # the MTP draft head's default token subset ("+218 MiB" on IQ3_S)
DRAFT_HEAD_BIND_MARGIN_MIB = 5                     # bind = the subset's head rows + ~5 MiB (218 = 212.9 + 5, logs)
MTP_DRAFT_LAYER_BYTES = (675 + 111) * MIB          # "draft layer loaded, 835 MiB of VRAM (experts 675, dense 111)"
MTP_KV_BYTES_PER_CELL = 1_184                      # the draft layer's K/V: 1,098 - 795 MiB over 262,144 - 4,096 cells
MTP_WINDOW_CELLS = 32_768                          # with K/V streaming the draft keeps a 32,768-cell ring (Options)
SESSION_FIXED_BYTES = 121 * MIB                    # GDN states (36 x 3.117 MiB) + ~9 MiB: session_bytes at 0 cells
SESSION_BYTES_PER_CELL = 1_804                     # indexer pooled keys 12 x 128 + RoPE table 256 + page tables ~12
# "8.67 GiB free" vs "7.69 GiB" with the GPU vision encoder (5060 Ti logs)
GPU_VISION_BYTES = 1004 * MIB


def pack_weights(model_name: str) -> PackWeights:
    return PACK_WEIGHTS.get(model_name, PACK_WEIGHTS_UNLOGGED)


def draft_head_bind_bytes(weights: PackWeights) -> int:
    """The MTP draft head's rows (the default CJK subset of the native head) + the bind margin."""
    return weights.head_bytes * DRAFT_HEAD_ROWS_CJK // VOCAB_ROWS + DRAFT_HEAD_BIND_MARGIN_MIB * MIB


def kv_streamed(max_context_tokens: int, kv_resident_cells: int | None) -> bool:
    return kv_resident_cells is not None and kv_resident_cells < max_context_tokens


def mtp_bytes(max_context_tokens: int, kv_resident_cells: int | None) -> int:
    """The MTP draft layer (its Q2_0 experts and dense weights) and its K/V: every cell of the context, or a
    32,768-cell ring when the K/V is streamed."""
    cells = min(max_context_tokens, MTP_WINDOW_CELLS) if kv_streamed(max_context_tokens, kv_resident_cells) \
        else max_context_tokens
    return MTP_DRAFT_LAYER_BYTES + cells * MTP_KV_BYTES_PER_CELL


def session_bytes(max_context_tokens: int, kv: str, kv_resident_cells: int | None) -> int:
    """session_bytes(g, max_context, K), allocated at startup for the whole --max-context: GDN states, the
    indexer's pooled keys, RoPE and page tables for every cell, and the K/V of the 12 QSA layers for every cell
    (or only --kv-resident cells when the K/V is streamed from host RAM)."""
    resident = max_context_tokens if kv_resident_cells is None else min(kv_resident_cells, max_context_tokens)
    return (SESSION_FIXED_BYTES + max_context_tokens * SESSION_BYTES_PER_CELL
            + resident * QSA_LAYERS * KV_BYTES_PER_CELL_LAYER[kv])


def kv_host_bytes(max_context_tokens: int, kv: str, kv_resident_cells: int | None) -> int:
    """Pinned host RAM of K/V streaming: the whole K/V ("the K/V in 6.19 GiB of pinned RAM" at 524,288 INT8
    cells); none when it all stays in VRAM."""
    if not kv_streamed(max_context_tokens, kv_resident_cells):
        return 0
    return max_context_tokens * QSA_LAYERS * KV_BYTES_PER_CELL_LAYER[kv]


def runtime_record_id(profile) -> str:
    """The calibration record of Strata's runtime buffers on this platform (sim/engine/records.py)."""
    if profile.gpu.api == "hip":
        return "strata-runtime-hip"
    return "strata-runtime-windows-cuda" if profile.os == "windows" else "strata-runtime-linux-cuda"


def records_read(scenario) -> tuple[str, ...]:
    """The calibration records (sim/engine/records.py) a run of the scenario reads: the runtime buffers of its
    platform, the decode window's layer latency and a short part's window time."""
    return (runtime_record_id(scenario.hardware_profile), "strata-decode-layer-latency", "strata-short-read")


def vram_before_cache(scenario, domain) -> tuple[tuple[str, int], ...]:
    """What VRAM holds when Strata reads free memory to size its cache, by name (bytes): the driver's context
    (the hardware profile), Strata's runtime buffers (a record), the pack's dense weights, the MTP draft layer,
    the session at --max-context and a GPU vision encoder. The draft head's bind is booked at sizing too
    (draft_head_bind_bytes), beside the reserve."""
    profile, flags = scenario.hardware_profile, scenario.engine.flags
    runtime = domain.use(runtime_record_id(profile), "Strata's runtime buffers in VRAM")
    cells = flags.kv_resident_cells
    items = [("runtime reserved (driver, context)", profile.runtime_reserved_bytes),
             ("runtime buffers (modules, cuBLAS)", runtime.bytes()),
             ("dense weights", pack_weights(scenario.layout.name).dense_bytes),
             ("MTP draft layer", mtp_bytes(flags.max_context, cells)),
             ("session (K/V, indexer keys, RoPE)", session_bytes(flags.max_context, flags.kv, cells))]
    if flags.vision == "gpu":
        items.append(("GPU vision encoder", GPU_VISION_BYTES))
    return tuple(items)


# ------------------------------------------------------------------------------------------ decode
#
# A decode step is a verify window: the MTP draft proposes tokens, one CUDA graph runs the window's T tokens through
# the 48 layers, and the window emits the accepted drafts + 1 (verify.cpp @ 0165063d). Per layer the GPU runs the
# dense chain, then the host plans each distinct routed expert: a VRAM hit, a PCIe read by the GPU (a share of the
# misses whose blob is in pinned RAM), or the CPU expert pool; the GPU's hits and PCIe share run while the pool
# computes its misses, and the next layer waits for both (expert_pool_dispatch_multi).

PCIE_FRAC_NATIVE = 0.55                            # default share of the misses read over PCIe, native packs
PCIE_FRAC_CANONICAL_Q2_0 = 0.2                     # the canonical Q2_0 pack's fixed share ("never measured
                                                   # against the link")
PCIE_PROBE_FULL_GBPS = 20.0                        # probe >= 20 GB/s: the full default share
PCIE_PROBE_NONE_GBPS = 4.0                         # probe < 4 GB/s: no PCIe share
PCIE_PROBE_SCALE_GBPS = 26.0                       # between: base x bw / 26 ("measured on x16 links (~26-28 GB/s)")
PCIE_FRAC_FLOOR = 0.05                             # ... but at least 0.05
PCIE_SHARE_UNITS = 256                             # m = floor(nmiss x round(256 f) / 256)
PCIE_STAGING_BLOBS = 16                            # kStagingBlobs: at most 16 PCIe blobs per window layer
MAX_VERIFY_TOKENS = 8                              # kVerifyMaxT: a verify window's tokens (o.spec = min(spec + 2, 8))


def pcie_frac(probe_gbps: float, canonical_q2_0: bool) -> float:
    """--pcie-frac when not given (generate.cpp probe_pcie_h2d_gbps): 0.2 for the canonical Q2_0 pack; for native
    packs 0.55 at >= 20 GB/s, none below 4 GB/s, else min(0.55, max(0.05, 0.55 x bw / 26))."""
    if canonical_q2_0:
        return PCIE_FRAC_CANONICAL_Q2_0
    if probe_gbps >= PCIE_PROBE_FULL_GBPS:
        return PCIE_FRAC_NATIVE
    if probe_gbps < PCIE_PROBE_NONE_GBPS:
        return 0.0
    return min(PCIE_FRAC_NATIVE, max(PCIE_FRAC_FLOOR, PCIE_FRAC_NATIVE * probe_gbps / PCIE_PROBE_SCALE_GBPS))


def pcie_share(misses: np.ndarray, pinned_misses: np.ndarray, frac: float) -> np.ndarray:
    """Per layer, how many of its distinct missed experts the GPU reads over PCIe: floor(nmiss x round(256 f) /
    256), at most the 16 staging blobs, and only blobs in pinned host memory."""
    num = round(PCIE_SHARE_UNITS * frac)
    m = (np.asarray(misses, np.int64) * num) // PCIE_SHARE_UNITS
    return np.minimum(np.minimum(m, PCIE_STAGING_BLOBS), np.asarray(pinned_misses, np.int64))


def spread(mean: float, count: int) -> np.ndarray:
    """`count` whole numbers whose running sum follows count x mean as closely as whole numbers can (a window of
    2.8 tokens on average: 3, 3, 2, 3, 3, ...)."""
    edges = np.floor(np.arange(count + 1) * mean + 0.5).astype(np.int64)
    return np.diff(edges)


# ------------------------------------------------------------------------------------------ knobs

ONLY_IN: dict[str, tuple[str, ...]] = {
    "STRATA_PREFILL_OWN_AUTO": ("fork-658",),  # spideytznn/Strata: independent prefill buffers (#658)
}
ENV_NAMES = (
    "STRATA_PREFILL_OWN_AUTO",  # fork-658: "0" turns the independent-buffer choice off (default on)
    "STRATA_RESIDENT_HEADROOM_GIB",  # RAM headroom of the resident modes (default 4 GiB, 8 otherwise)
    "STRATA_PREFILL_RING", "STRATA_PREFILL_LEND_PCT", "STRATA_STAGER_THREADS", "STRATA_ARENA_PIN_GIB",
    "STRATA_PF_FUSED",  # "1": the fused int8 expert kernels (CUDA), whose prompt ring is 1,024 slots (capped at 512)
)
Env = env_table("StrataEnv", "strata environment variable", ENV_NAMES)
# How the engine parses each value (strata-engine.md §3): the kind and the least value it accepts. Checked when
# the scenario loads, so a bad value is named with its file, not found in the middle of a run.
ENV_VALUES: dict[str, tuple[type, float]] = {
    "STRATA_PREFILL_OWN_AUTO": (int, 0), "STRATA_RESIDENT_HEADROOM_GIB": (float, 0),
    "STRATA_PREFILL_RING": (int, 0), "STRATA_PREFILL_LEND_PCT": (int, 0), "STRATA_STAGER_THREADS": (int, 1),
    "STRATA_ARENA_PIN_GIB": (float, 0), "STRATA_PF_FUSED": (int, 0),
}


def _check_env_value(where: str, name: str, text: str) -> None:
    kind, least = ENV_VALUES[name]
    try:
        value = kind(text)
    except ValueError:
        raise InputError(where, f"engine.env.{name}", text,
                         "must be an integer" if kind is int else "must be a number") from None
    if not value >= least:  # also refuses nan
        raise InputError(where, f"engine.env.{name}", text, f"must be >= {least:g}")


def _check_expert_cache(value: object) -> str | int:
    return count_or_keyword(value, '"auto" or a number of experts', lambda v: v == "auto")


def _check_prefill(value: object) -> str | int:
    return count_or_keyword(value, '"auto", "auto:N" or a chunk size in tokens',
                            lambda v: v == "auto" or (v.startswith("auto:") and digits(v[5:]) and int(v[5:]) >= 1))


class Flags(Strict):
    """Strata CLI flags (src/program/generate.cpp, strata-engine.md §3). Defaults are the engine's."""

    KEY_KIND: ClassVar[str] = "strata flag"
    # "auto", or N: a byte budget of N x the largest expert blob, filled with sized slots (§2.3).
    expert_cache: Annotated[str | int, PlainValidator(_check_expert_cache)] = Field("auto", alias="expert-cache")
    vram_reserve_mib: Annotated[int, Field(ge=0)] = Field(700, alias="vram-reserve-mib")
    prefill: Annotated[str | int, PlainValidator(_check_prefill)] = "auto"  # "auto" | "auto:N" | C
    no_prefill_borrow: bool = Field(False, alias="no-prefill-borrow")
    # A profile ranking (layer, expert) pairs; "@trace" ranks them by the scenario trace's own counts.
    expert_profile: Annotated[str, Field(min_length=1)] | None = Field(None, alias="expert-profile")
    # RAM mode: arena (default), resident-experts, or resident-budget-gib G (§3.5); --mmap-experts alone serves
    # every expert the GPU lacks from the mapped model files (no RAM copy: the page cache), as the ROCm container
    # does ("ROCm: large pinned allocations fail even with free RAM", docker/entrypoint-hip.sh)
    mmap_experts: bool = Field(False, alias="mmap-experts")
    resident_experts: bool = Field(False, alias="resident-experts")
    resident_budget_gib: Annotated[float, Field(gt=0)] | None = Field(None, alias="resident-budget-gib")
    max_context: Annotated[int, Field(ge=256)] = Field(DEFAULT_MAX_CONTEXT_TOKENS, alias="max-context")
    kv: Literal["fp16", "int8", "k8v4", "q4_0"] = DEFAULT_KV  # the K/V cache's type
    # N cells of each QSA layer's K/V in VRAM, the rest in pinned host RAM (KV streaming); unset: all in VRAM
    kv_resident: Annotated[int, Field(ge=1)] | None = Field(None, alias="kv-resident")
    # The vision encoder: none, on the CPU, or on the GPU (it starts before the engine, so its VRAM is taken
    # when the cache is sized)
    vision: Literal["none", "cpu", "gpu"] = "none"
    conversation_cache_mib: Annotated[int, Field(ge=0)] = Field(0, alias="conversation-cache-mib")  # 0 = off
    conversation_cache_slots: Annotated[int, Field(ge=1)] = Field(4, alias="conversation-cache-slots")
    conversation_cache_min_free_mib: Annotated[int, Field(ge=0)] = Field(2560, alias="conversation-cache-min-free-mib")
    prompt_cache: Annotated[int, Field(ge=0)] = Field(6, alias="prompt-cache")  # in-session checkpoints
    prompt_cache_every: Annotated[int, Field(ge=1)] = Field(16384, alias="prompt-cache-every")
    adapt_every: Annotated[int, Field(ge=0)] = Field(4, alias="adapt-every")  # 0: no adaptive tier
    # --pcie-frac: the share of a window's missed experts the GPU reads over PCIe; unset: the startup probe's rule
    pcie_frac: Annotated[float, Field(ge=0, le=1)] | None = Field(None, alias="pcie-frac")
    adapt_swaps: Annotated[int, Field(ge=0)] = Field(96, alias="adapt-swaps")
    short_read: Annotated[int, Field(ge=0)] = Field(64, alias="short-read")
    # --live-prefill-min-retained N (0..128, live memory): the slots a prompt loan may leave unlent under pressure
    live_prefill_min_retained: Annotated[int, Field(ge=0, le=128)] = Field(128, alias="live-prefill-min-retained")
    # --spec: MTP draft tokens per verify window; with prompt lookup (on by default) the window widens by 2, to at
    # most 8 (o.spec = min(spec + 2, 8))
    spec: Annotated[int, Field(ge=0, le=8)] = 4

    @property
    def ram_mode(self) -> str:
        if self.resident_budget_gib is not None:
            return "resident-budget"
        if self.resident_experts:
            return "resident-experts"
        return "mmap" if self.mmap_experts else "arena"

    @property
    def kv_resident_cells(self) -> int | None:
        """--kv-resident N as the engine applies it: at least 20480 cells (FLAGS.md)."""
        return None if self.kv_resident is None else max(self.kv_resident, KV_RESIDENT_MIN_CELLS)


class Drafts(Strict):
    """How the MTP draft fares on the workload's text: the tokens a verify window runs and the tokens it emits (the
    accepted drafts + 1), on average. Not engine flags: they depend on the text and the draft model. Defaults:
    "2.4-3.2 tokens per pass on average" (Strata docs/DETAILS.md @ 0173fc46, the middle) and a window of 3 tokens
    (2.85 on a 2 x RTX 4090 decode timing log, indexed copy 71542003190; --spec-min-p 0.5 grows a window only while
    the draft is confident)."""

    KEY_KIND: ClassVar[str] = "strata draft key"
    window_tokens: Annotated[float, Field(ge=1, le=8)] = 3.0
    tokens_per_window: Annotated[float, Field(ge=1, le=8)] = 2.8

    @model_validator(mode="after")
    def _accepted_within_window(self) -> "Drafts":
        if self.tokens_per_window > self.window_tokens:
            raise ValueError(f"tokens_per_window {self.tokens_per_window} > window_tokens {self.window_tokens}: a "
                             "window emits at most the tokens it verified")
        return self


class Settings(Strict):
    KEY_KIND: ClassVar[str] = "strata engine key"
    name: Literal["strata"]
    variant: Literal["v0.1.35", "fork-658", "v0.1.39", "v0.1.39b", "v0.1.40", "v0.1.40-live-guarded", "v0.1.40-live"]
    flags: Flags = Field(default_factory=Flags)
    env: Env = Field(default_factory=Env)
    drafts: Drafts = Field(default_factory=Drafts)


# Strata's kernels are built for one geometry (compile-time constants checked against the model,
# strata-engine.md §2.1, §4.1): Qwen3.8-Flash-Next, 512 experts (256 in the Coder prune), top-10, n_embd 2560.
GEOMETRY = {"hidden": (2560,), "top_k": (10,), "n_experts": (512, 256)}


def geometry_mismatch(layout) -> tuple[str, tuple] | None:
    """The first GEOMETRY field whose value the layout does not have, with the values Strata runs; None when
    Strata runs the layout."""
    return next(((field, allowed) for field, allowed in GEOMETRY.items() if getattr(layout, field) not in allowed),
                None)


def validate(scenario, where: str) -> None:
    """Strata's refusals: what the engine would refuse, and what the model does not simulate."""
    profile, layout, engine = scenario.hardware_profile, scenario.layout, scenario.engine
    flags, env = engine.flags, engine.env
    build = BUILDS[engine.variant]
    for name in sorted(set(env.model_fields_set)):
        if written(env, name) is not None:
            _check_env_value(where, name, written(env, name))
        allowed = ONLY_IN.get(name)
        if allowed is not None and engine.variant not in allowed:
            raise InputError(where, f"engine.env.{name}", written(env, name),
                             f"read only by variant {' or '.join(allowed)}; this scenario's variant is "
                             f"{engine.variant}")
    mismatch = geometry_mismatch(layout)
    if mismatch is not None:
        field, allowed = mismatch
        raise InputError(where, "model", scenario.model,
                         f"Strata runs only Qwen3.8-Flash-Next geometry ({field} {' or '.join(map(str, allowed))}"
                         f"); {layout.name} has {field} {getattr(layout, field)}")
    if flags.resident_experts and flags.resident_budget_gib is not None:
        raise InputError(where, "engine.flags.resident-budget-gib", flags.resident_budget_gib,
                         "choose one RAM mode: resident-experts or resident-budget-gib")
    if isinstance(flags.prefill, str) and flags.prefill.startswith("auto:") and not build.auto_n:
        raise InputError(where, "engine.flags.prefill", flags.prefill,
                         f"{engine.variant} does not parse auto:N (upstream #669 came with 0.1.39): use auto, a "
                         "chunk, or variant v0.1.39b or later")
    if flags.live_prefill_min_retained != MIN_KEEP_SLOTS and not build.live_memory:
        raise InputError(where, "engine.flags.live-prefill-min-retained", flags.live_prefill_min_retained,
                         f"a live-memory option (docs/PRESSURE_PREFILL_FLOOR.md); variant {engine.variant} has no "
                         "live memory")
    if build.live_memory and (flags.resident_budget_gib is None or flags.expert_profile is None):
        raise InputError(where, "engine.variant", engine.variant,
                         "live memory needs --resident-budget-gib and an --expert-profile (docs/LIVE_MEMORY.md)")
    total = layout.n_routed_layers * layout.n_experts
    if isinstance(flags.expert_cache, int) and flags.expert_cache > total:
        raise InputError(where, "engine.flags.expert-cache", flags.expert_cache,
                         f"more than the model's {total} routed experts")
    if flags.vram_reserve_mib * MIB >= profile.vram_bytes:
        raise InputError(where, "engine.flags.vram-reserve-mib", flags.vram_reserve_mib,
                         f"a reserve >= the GPU's VRAM ({profile.vram_bytes // MIB} MiB on {profile.name})")
    for i, request in enumerate(scenario.workload.requests):
        # "prompt + max_new exceeds max-context" (Qwen35Runtime::generate, Niko1221/Strata indexed copy id
        # 71027611532: the dense path's check; the MoE server's own check was not in the copies read)
        if request.prompt_tokens + request.decode_tokens > flags.max_context:
            raise InputError(where, f"workload.requests[{i}].prompt_tokens", request.prompt_tokens,
                             f"Strata refuses a request beyond --max-context {flags.max_context}: "
                             f"{request.prompt_tokens} prompt + {request.decode_tokens} output tokens")


# ------------------------------------------------------------------------------------------ the plan's knobs

DEFAULT_OBJECTIVE = "prefill_tok_s"
KEY_CACHE = "engine.flags.expert-cache"
KEY_RESERVE = "engine.flags.vram-reserve-mib"
KEY_PREFILL = "engine.flags.prefill"
KEY_OWN = "engine.env.STRATA_PREFILL_OWN_AUTO"
KEY_NO_BORROW = "engine.flags.no-prefill-borrow"
KEY_HEADROOM = "engine.env.STRATA_RESIDENT_HEADROOM_GIB"
KEY_CONV = "engine.flags.conversation-cache-mib"
KNOB_NAMES = {KEY_CACHE: "expert cache", KEY_RESERVE: "VRAM reserve (MiB)", KEY_PREFILL: "prefill chunk",
              KEY_OWN: "own vs borrow", KEY_NO_BORROW: "own vs borrow", KEY_HEADROOM: "RAM headroom (GiB)",
              KEY_CONV: "conversation cache (MiB)"}
KNOB_LABELS = {(KEY_OWN, "1"): "own buffers", (KEY_OWN, "0"): "borrowed buffers",
               (KEY_NO_BORROW, True): "own buffers", (KEY_NO_BORROW, False): "borrowed buffers"}


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
    cache = _get(data, KEY_CACHE) or "auto"
    primary = [(KEY_CACHE, _values(cache, "auto", 5400) if cache == "auto" else _values(cache, "auto"))]
    if BUILDS[variant].independent_buffers if variant in BUILDS else False:
        primary.append((KEY_OWN, _values(_get(data, KEY_OWN), "1", "0")))
    else:
        primary.append((KEY_NO_BORROW, _values(_get(data, KEY_NO_BORROW) or False, True)))
    primary.append((KEY_PREFILL, _values(_get(data, KEY_PREFILL) or "auto", 4096)))
    secondary = [(KEY_RESERVE, _values(_get(data, KEY_RESERVE), 700, 1536)),
                 (KEY_HEADROOM, _values(_get(data, KEY_HEADROOM), "4", "6")),
                 (KEY_CONV, _values(_get(data, KEY_CONV), 0, 2048))]
    return primary, secondary


def prune(scenario) -> str | None:
    """Why a candidate cannot fit before it runs: the reserve exceeds the VRAM free at sizing."""
    from sim.engine.records import Domain

    profile, layout = scenario.hardware_profile, scenario.layout
    flags = scenario.engine.flags
    before = sum(n for _, n in vram_before_cache(scenario, Domain("strata", layout.name, profile.name, None)))
    bind = draft_head_bind_bytes(pack_weights(layout.name))
    free = profile.vram_bytes - before
    if flags.vram_reserve_mib * MIB + bind >= free:
        return (f"reserve {flags.vram_reserve_mib} MiB + the draft head's {bind / MIB:,.0f} MiB >= {free / MIB:,.0f} "
                "MiB free at sizing: no expert cache")
    return None


def owned_buffers(settings: dict) -> bool:
    """Whether a candidate's settings give the prompt path buffers of its own."""
    return settings.get(KEY_OWN) == "1" or settings.get(KEY_NO_BORROW) is True
