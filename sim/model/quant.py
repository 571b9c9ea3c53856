"""GGML quantization block sizes: how many bytes a tensor of N weights takes on disk.

Every GGML type stores weights in fixed blocks along a row (ne0): `block_weights` weights in
`block_bytes` bytes. The table is written out here, not taken from the `gguf` package, so the package
stays an independent check (tests/test_quant.py) and types it does not know yet (Q2_0) still size.

Sources: `block_*` structs and their static_asserts in ggml-org/llama.cpp `ggml/src/ggml-common.h`
(commit 01243c58) and `GGML_QUANT_SIZES` in gguf-py 0.19.0 `gguf/constants.py`, as tabulated in
reference/hardware-and-gguf.md §3.1. QK_K = 256 weights per K-quant / IQ super-block.

A fork's own types (ik_llama.cpp's IQ*_K / IQ*_KS / Q6_0, the types of ubergarm's files) are sized here too, marked
with the fork: only an engine build that loads them runs such a file (Engine.unloadable_type). Some of them also
store a few bytes per row ahead of the row's blocks (ik's `row_meta_size`: the row's scale), so their tensors
size by rows, not by weights alone. Source: ikawrakow/ik_llama.cpp@8337e4cd3 ggml/src/ggml-common.h (`block_*` and
their static_asserts), ggml/include/ggml.h (the ids) and ggml/src/ggml.c (type_traits' row_meta_size).
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.errors import InputError


@dataclass(frozen=True)
class QuantType:
    name: str
    ggml_id: int
    block_weights: int
    block_bytes: int
    row_meta_bytes: int = 0  # bytes ahead of each row's blocks (ik_llama.cpp's per-row scale)
    fork: str | None = None  # the fork whose own type this is (None: mainline GGML's)


_QK_K = 256

_TYPES = (
    # Plain scalars: one "block" is one value.
    QuantType("F32", 0, 1, 4),
    QuantType("F16", 1, 1, 2),
    # Legacy 32-weight blocks: f16 scale d (and min m), 4-bit qs[16], 5th bits qh[4].
    QuantType("Q4_0", 2, 32, 2 + 16),
    QuantType("Q4_1", 3, 32, 2 + 2 + 16),
    QuantType("Q5_0", 6, 32, 2 + 4 + 16),
    QuantType("Q5_1", 7, 32, 2 + 2 + 4 + 16),
    QuantType("Q8_0", 8, 32, 2 + 32),
    # block_q8_1 is 2×f16 (d, s) + qs[32] = 36 B in ggml-common.h; gguf 0.19.0 says 4 + 4 + 32 = 40.
    # ggml-common.h is what the engines compile; Q8_1 only holds activations, never file weights.
    QuantType("Q8_1", 9, 32, 2 + 2 + 32),
    # K-quants, 256-weight super-blocks.
    QuantType("Q2_K", 10, _QK_K, _QK_K // 16 + _QK_K // 4 + 2 + 2),  # scales[16] + qs[64] + d, dmin
    QuantType("Q3_K", 11, _QK_K, _QK_K // 8 + _QK_K // 4 + 12 + 2),  # hmask[32] + qs[64] + scales[12] + d
    QuantType("Q4_K", 12, _QK_K, 2 + 2 + 12 + _QK_K // 2),  # d, dmin + scales[12] + qs[128]
    QuantType("Q5_K", 13, _QK_K, 2 + 2 + 12 + _QK_K // 8 + _QK_K // 2),  # + qh[32]
    QuantType("Q6_K", 14, _QK_K, _QK_K // 2 + _QK_K // 4 + _QK_K // 16 + 2),  # ql[128] + qh[64] + scales[16] + d
    QuantType("Q8_K", 15, _QK_K, 4 + _QK_K + 2 * (_QK_K // 16)),  # f32 d + qs[256] + bsums[16] i16
    # i-quants.
    QuantType("IQ2_XXS", 16, _QK_K, 2 + 2 * (_QK_K // 8)),  # d + qs[32] u16
    QuantType("IQ2_XS", 17, _QK_K, 2 + 2 * (_QK_K // 8) + _QK_K // 32),  # + scales[8]
    QuantType("IQ3_XXS", 18, _QK_K, 2 + 3 * (_QK_K // 8)),  # d + qs[96]
    QuantType("IQ1_S", 19, _QK_K, 2 + _QK_K // 8 + 2 * (_QK_K // 32)),  # d + qs[32] + qh[8] u16
    QuantType("IQ4_NL", 20, 32, 2 + 16),  # d + qs[16]
    QuantType("IQ3_S", 21, _QK_K, 2 + _QK_K // 4 + _QK_K // 32 + _QK_K // 8 + 4),  # qs[64] qh[8] signs[32] scales[4]
    QuantType("IQ2_S", 22, _QK_K, 2 + _QK_K // 4 + _QK_K // 32 + _QK_K // 32),  # qs[64] + qh[8] + scales[8]
    QuantType("IQ4_XS", 23, _QK_K, 2 + 2 + _QK_K // 64 + _QK_K // 2),  # d + scales_h + scales_l[4] + qs[128]
    QuantType("I8", 24, 1, 1),
    QuantType("I16", 25, 1, 2),
    QuantType("I32", 26, 1, 4),
    QuantType("I64", 27, 1, 8),
    QuantType("F64", 28, 1, 8),
    QuantType("IQ1_M", 29, _QK_K, _QK_K // 8 + _QK_K // 16 + _QK_K // 32),  # qs[32] + qh[16] + scales[8], no d
    QuantType("BF16", 30, 1, 2),
    # Ternary.
    QuantType("TQ1_0", 34, _QK_K, 48 + 4 + 2),  # qs[48] + qh[4] + d
    QuantType("TQ2_0", 35, _QK_K, _QK_K // 4 + 2),  # qs[64] + d
    # FP4 micro-scaling.
    QuantType("MXFP4", 39, 32, 1 + 16),  # E8M0 exponent + qs[16]
    QuantType("NVFP4", 40, 64, 4 + 32),  # 4 UE4M3 scales (one per 16) + qs[32]
    QuantType("Q1_0", 41, 128, 2 + 16),  # d + qs[16]
    # In ggml-common.h since llama.cpp PR #24448 (2026-06) and HF tasks/gguf as id 42; not in gguf 0.19.0.
    QuantType("Q2_0", 42, 64, 2 + 16),  # d + qs[16]
)

_IK = "ik_llama.cpp"
# ik_llama.cpp's own types (ggml.h ids 133-157; ggml-common.h blocks), the ones its published files' experts use
_FORK_TYPES = (
    QuantType("Q6_0", 133, 32, 2 + 32 // 4 + 32 // 2, 0, _IK),  # d + qh[8] + qs[16]
    QuantType("IQ2_K", 137, _QK_K, 2 + 2 + _QK_K // 32 + _QK_K // 4, 0, _IK),  # d + extra + scales[8] + qs[64]
    QuantType("IQ3_K", 138, _QK_K, 2 + 2 + 2 + _QK_K // 32 + _QK_K // 4 + _QK_K // 8, 0, _IK),  # + scales_h, qh[32]
    QuantType("IQ4_K", 139, _QK_K, 2 + 2 + _QK_K // 2 + 3 * _QK_K // 64, 0, _IK),  # d + extra + scales + qs[128]
    QuantType("IQ5_K", 140, _QK_K, 2 + 2 + _QK_K // 2 + _QK_K // 8 + 3 * _QK_K // 64, 0, _IK),  # + qh[32]
    QuantType("IQ6_K", 141, _QK_K, 2 + 2 + _QK_K // 2 + _QK_K // 4 + _QK_K // 16, 0, _IK),  # qs[128] qh[64] scales
    QuantType("IQ4_KS", 144, _QK_K, _QK_K // 32 + _QK_K // 2, 4, _IK),  # scales[8] + qs[128]; a float a row
    QuantType("IQ2_KS", 145, _QK_K, 2 + _QK_K // 64 + _QK_K // 4, 2, _IK),  # extra + scales[4] + qs[64]; f16 a row
    QuantType("IQ5_KS", 152, _QK_K, _QK_K // 32 + _QK_K // 2 + _QK_K // 8, 4, _IK),  # scales[8] qs[128] qh[32]
    QuantType("IQ3_KS", 156, _QK_K, 2 + _QK_K // 64 + _QK_K // 4 + _QK_K // 8, 2, _IK),  # extra scales[4] qs qh[32]
    QuantType("IQ2_KL", 157, _QK_K, 2 + _QK_K // 64 + _QK_K // 4 + _QK_K // 16, 2, _IK),  # scales_h/l, qs, qh[16]
)

QUANT_TYPES: dict[str, QuantType] = {t.name: t for t in _TYPES + _FORK_TYPES}
# mainline GGML's types: what a file any GGML build loads may hold
GGML_TYPES: tuple[str, ...] = tuple(t.name for t in _TYPES)
_BY_ID = {t.ggml_id: t for t in _TYPES + _FORK_TYPES}
# Ids that once existed and were taken out of the format: worth a clearer refusal than "unknown".
_REMOVED_IDS = {31: "Q4_0_4_4", 32: "Q4_0_4_8", 33: "Q4_0_8_8", 36: "IQ4_NL_4_4", 37: "IQ4_NL_4_8", 38: "IQ4_NL_8_8"}


def quant_type(name_or_id: str | int) -> QuantType:
    """Look a type up by name ('Q4_K', case-insensitive) or GGML id (12, or a gguf GGMLQuantizationType)."""
    if isinstance(name_or_id, str):
        found = QUANT_TYPES.get(name_or_id.upper())
    elif isinstance(name_or_id, int) and not isinstance(name_or_id, bool):
        found = _BY_ID.get(int(name_or_id))
        if found is None and int(name_or_id) in _REMOVED_IDS:
            raise InputError("quant table", "ggml type id", int(name_or_id),
                             f"{_REMOVED_IDS[int(name_or_id)]} was removed from the GGUF format")
    else:
        found = None
    if found is None:
        raise InputError("quant table", "ggml type", name_or_id,
                         "unknown GGML type (mainline's ids 0-42; ik_llama.cpp's own types: "
                         + ", ".join(t.name for t in _FORK_TYPES) + ")")
    return found


def tensor_bytes(type_name: str, n_weights: int, row_weights: int | None = None) -> int:
    """Bytes of n_weights weights stored as type_name in rows of row_weights (ggml's ne0); n_weights must fill whole
    blocks. A type with per-row bytes (QuantType.row_meta_bytes) needs the row length, and whole rows."""
    qt = quant_type(type_name)
    if n_weights < 0 or n_weights % qt.block_weights:
        raise InputError("quant table", f"{qt.name} weights", n_weights,
                         f"must be a non-negative multiple of the {qt.block_weights}-weight block")
    rows = 0
    if qt.row_meta_bytes:
        if row_weights is None or row_weights < 1 or row_weights % qt.block_weights or n_weights % row_weights:
            raise InputError("quant table", f"{qt.name} row", row_weights,
                             f"a {qt.name} tensor is sized by whole rows of whole {qt.block_weights}-weight blocks "
                             f"({qt.row_meta_bytes} bytes ahead of each row)")
        rows = n_weights // row_weights
    return n_weights // qt.block_weights * qt.block_bytes + rows * qt.row_meta_bytes
