"""How a Strata build prices its prompt path: the streaming ring and Prefill::bytes_needed (strata-engine.md §3.2,
§4: affine, fitted), and the builds' later changes to both (0.1.39b's ring byte budget, 0.1.40's owned pages)."""

from __future__ import annotations

from dataclasses import dataclass

from sim.engines.strata.geometry import KV_BYTES_PER_CELL_LAYER
from sim.engines.strata.settings import STREAM_ALL_MIN_TOKENS_V0135, Build
from sim.errors import InputError
from sim.schema import check_int
from sim.units import MIB

# fmt: off
IQ3S_MAX_BLOB_BYTES = 2_662_400                    # IQ3_S pack's largest blob, IQ4_XS + IQ4_NL (§2.2)
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
Q2_0_BLOB_BYTES = 1_382_400                        # the Q2_0 pack's blob: 0.1.39b's ring unit (§3.2)
RING_SLOTS_FUSED = 1024                            # 0.1.39b: "1024 fused / 384 pinned / 96" (§3.2)
RING_CAP_NATIVE_SLOTS = 512                        # ring_cap() on native packs (prefill.cpp @ 06f7665f)
RING_BUDGET_FROM_CHUNK_TOKENS = 6144               # ring_cap_for: a chunk of 0.1.39's list >= 6,144 keeps its ring
OWNED_ALLOCATIONS = 35                             # 0.1.40 bytes_needed_owned: "~35 separate cudaMallocs" (§3.4)
OWNED_PAGE_BYTES = 2 * MIB                         # ... each rounded to a 2 MiB page (§3.4)
# fmt: on


def _check_share(where: str, value: float) -> float:
    if not 0.0 <= value <= 1.0:
        raise InputError(where, "pinned_share", value, "must be a fraction in 0..1")
    return value


def ring_slots(chunk_tokens: int, pinned_share: float, *, ring_override_slots: int | None = None,
               stream_all_min_tokens: int = STREAM_ALL_MIN_TOKENS_V0135) -> int:
    """ring_slots(T) (prefill.cpp, §3.2): 8 below STREAM_ALL_MIN; from it on 384 if pinned_share >= 0.9
    else 96, or STRATA_PREFILL_RING clamped to 16..512."""
    check_int("ring_slots", "chunk_tokens", chunk_tokens, 1)
    _check_share("ring_slots", pinned_share)
    if chunk_tokens < stream_all_min_tokens:
        return RING_SLOTS_SHORT_CHUNK
    if ring_override_slots is not None:
        return min(max(ring_override_slots, RING_OVERRIDE_MIN_SLOTS), RING_OVERRIDE_MAX_SLOTS)
    return RING_SLOTS_PINNED if pinned_share >= PINNED_SHARE_THRESHOLD else RING_SLOTS_UNPINNED


def kv_stage_bytes(max_context_tokens: int, bytes_per_cell: int = KV_BYTES_PER_CELL_LAYER["int8"]) -> int:
    """KV stage with --kv-resident streaming: one QSA layer's K/V at max context (264 MiB of INT8 at 262,144,
    §4.1)."""
    return check_int("kv stage", "max_context_tokens", max_context_tokens) * bytes_per_cell


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
    tokens = check_int(where, "chunk_tokens", chunk_tokens, 1)
    excess = 0 if max_cells is None else qsa_region_excess(tokens, check_int(where, "max_cells", max_cells, 1))
    return (PREFILL_FIXED_BYTES + tokens * check_int(where, "per_token_bytes", per_token_bytes, 1)
            + check_int(where, "ring", ring) * check_int(where, "max_blob_bytes", max_blob_bytes, 1)
            + check_int(where, "kv_stage", kv_stage) + excess)


def per_token_bytes(build: Build) -> int:
    """bytes_needed's per-token bytes: 0.1.39b (#583, with the ring byte budget) stopped counting xn."""
    return PREFILL_BYTES_PER_TOKEN - (PREFILL_XN_BYTES_PER_TOKEN if build.ring_bytes else 0)


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
                            per_token_bytes=per_token_bytes(self.build), max_cells=self.max_cells)

    def need_owned(self, chunk_tokens: int) -> int:
        """Owned buffers: the same bytes, plus (0.1.40) each allocation rounded to its 2 MiB page; the
        allocations' own sizes are not in the notes, so each wastes half a page on average."""
        extra = OWNED_ALLOCATIONS * OWNED_PAGE_BYTES // 2 if self.build.owned_pricing else 0
        return self.need(chunk_tokens) + extra
