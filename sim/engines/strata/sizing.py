"""Strata's sized-slot expert cache at startup (strata-engine.md §2.3, §3.1), as pure functions:

  cache      --expert-cache N: byte budget N x max_blob; walk the profile ranking adding
             roundup256(blob(layer)) while used <= min(budget, free - reserve - other) (sized_slot_walk);
             auto: uniform count from free VRAM, then the same walk (auto_expert_cache); post-write
             shrink when free VRAM after the write is below the reserve (post_write_shrink); #496's adapted
             default reserve (adapted_vram_reserve)

Cache order is profile rank order: slot i holds the i-th ranked (layer, expert) pair, so the tail slots are the
coldest. Inputs are bytes unless a name says otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from sim.engines.strata.settings import NO_BORROW_CHUNK_TOKENS
from sim.errors import InputError
from sim.schema import check_int
from sim.units import GIB, MIB

# fmt: off
SLOT_ALIGN_BYTES = 256                             # roundup256(blob) per sized slot (generate.cpp, §2.3, §3.1)
OWNED_PREFILL_BASE_MIB = 160                       # auto sizing without borrowing: 160 + chunk*680/1024 MiB (§3.1)
OWNED_PREFILL_MIB_PER_1024_TOKENS = 680            # same rule (§3.1)
POST_WRITE_TOLERANCE_MIB = 64                      # post-write check: below reserve by more than 64 MiB (§3.1)
POST_WRITE_ZERO_READ_GIVEBACK_GIB = 1              # WDDM: a 0 MiB free read gives back 1 GiB ... (§3.1)
POST_WRITE_ZERO_READS_WITH_FIXED_GIVEBACK = 2      # ... for the first two such reads (§3.1)
POST_WRITE_SHORTFALL_MARGIN_MIB = 64               # later shortfalls give back deficit + 64 MiB (§3.1)
POST_WRITE_QUARTER_DIVISOR = 4                     # ... "or a quarter" (§3.1; see post_write_shrink)
POST_WRITE_MAX_ROUNDS = 6                          # up to 6 rounds (§3.1)
SMALL_RESERVE_MIB = 300                            # #496: the adapted default reserve's floor (vram_plan.hpp
# fmt: on


def roundup(n: int, granule: int) -> int:
    return -(-n // granule) * granule


def interleaved_profile_layers(n_layers: int, n_experts: int) -> np.ndarray:
    """A stand-in profile ranking: rank r is layer r % n_layers (expert r // n_layers).

    The engine ranks (layer, expert) pairs by measured routing frequency (--expert-profile, §3.1); no
    such profile is published, so this ranking walks the layers round robin, every layer equally hot.
    Returns int64 [n_layers * n_experts] of layer indices in rank order.
    """
    check_int("profile", "n_layers", n_layers, 1)
    check_int("profile", "n_experts", n_experts, 1)
    return np.tile(np.arange(n_layers, dtype=np.int64), n_experts)


def ranked_blob_bytes(layer_blob_bytes: Sequence[int] | np.ndarray, ranked_layers: np.ndarray) -> np.ndarray:
    """Blob bytes of each ranked pair: layer_blob_bytes[ranked_layers[r]] (int64)."""
    return np.asarray(layer_blob_bytes, dtype=np.int64)[np.asarray(ranked_layers, dtype=np.int64)]


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
    limit = check_int(where, "budget_bytes", budget_bytes)
    if free_vram_bytes is not None:
        check_int(where, "free_vram_bytes", free_vram_bytes)
        limit = max(0, min(limit, free_vram_bytes - check_int(where, "vram_reserve_bytes", vram_reserve_bytes)
                           - check_int(where, "other_bytes", other_bytes)))
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
    return (check_int("--expert-cache", "N", expert_cache_n, 1)
            * check_int("--expert-cache", "max_blob", max_blob_bytes, 1))


def owned_prefill_mib(chunk_tokens: int) -> int:
    """Auto sizing's prefill allowance when NOT borrowing: 160 + chunk*680/1024 MiB (integer, §3.1)."""
    return OWNED_PREFILL_BASE_MIB + check_int("auto sizing", "chunk_tokens", chunk_tokens) \
        * OWNED_PREFILL_MIB_PER_1024_TOKENS // 1024


def auto_expert_cache(ranked_blobs: np.ndarray, max_blob_bytes: int, free_vram_bytes: int, vram_reserve_bytes: int,
                      *, borrowing: bool = True, owned_chunk_tokens: int = NO_BORROW_CHUNK_TOKENS,
                      mtp_bind_bytes: int = 0) -> SizedCache:
    """--expert-cache auto (§3.1): uniform count = (free - (reserve + prefill) - mtp_bind) / max_blob capped at
    the profile length, prefill = 160 + chunk*680/1024 MiB only when not borrowing; then the sized walk
    under min(count x max_blob, free - reserve - prefill - mtp_bind)."""
    where = "auto expert cache"
    prefill_bytes = 0 if borrowing else owned_prefill_mib(owned_chunk_tokens) * MIB
    spare = (check_int(where, "free_vram_bytes", free_vram_bytes)
             - check_int(where, "vram_reserve_bytes", vram_reserve_bytes) - prefill_bytes
             - check_int(where, "mtp_bind_bytes", mtp_bind_bytes))
    count = min(max(0, spare) // check_int(where, "max_blob_bytes", max_blob_bytes, 1), len(ranked_blobs))
    return sized_slot_walk(ranked_blobs, count * max_blob_bytes, free_vram_bytes, vram_reserve_bytes,
                           prefill_bytes + mtp_bind_bytes)


def auto_cache_free_vram_range(ranked_blobs: np.ndarray, max_blob_bytes: int, target_slots: int,
                               vram_reserve_bytes: int, *, other_bytes: int = 0) -> tuple[int, int] | None:
    """The free VRAM [lo, hi) for which auto_expert_cache (borrowing) gives exactly target_slots, or None
    when no uniform count does. other_bytes: MTP bind and owned-prefill allowance, if any. Inverts the
    auto rule to calibrate a box's free VRAM from a logged slot count."""
    ends = np.cumsum(roundup(np.asarray(ranked_blobs, dtype=np.int64), SLOT_ALIGN_BYTES))
    t = check_int("auto cache calibration", "target_slots", target_slots, 1)
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
    check_int("post-write shrink", "vram_reserve_bytes", vram_reserve_bytes)
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
