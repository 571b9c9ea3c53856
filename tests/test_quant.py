"""The GGML block table against gguf-py's own (an independent copy) and known answers."""

import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from hypothesis import given
from hypothesis import strategies as st

from sim.errors import InputError
from sim.model.quant import GGML_TYPES, QUANT_TYPES, quant_type, tensor_bytes

# Where ggml-common.h and gguf-py 0.19.0 disagree (hardware-and-gguf.md §3.1 notes): block_q8_1 is
# 2 x f16 + 32 = 36 bytes, gguf-py says 4 + 4 + 32 = 40. We follow ggml-common.h.
KNOWN_DISAGREEMENTS = {"Q8_1": (36, 40)}

# ik_llama.cpp's own types as its gguf-py states them (ikawrakow/ik_llama.cpp@8337e4cd3 gguf-py/gguf/constants.py:
# GGMLQuantizationType ids and GGML_QUANT_SIZES (block weights, block bytes)) and its ggml.c type_traits'
# row_meta_size: an independent copy of what sim/model/quant.py derives from the block structs.
IK_GGUF_PY = {  # name: (id, block weights, block bytes, row meta bytes)
    "Q6_0": (133, 32, 26, 0), "IQ2_K": (137, 256, 76, 0), "IQ3_K": (138, 256, 110, 0), "IQ4_K": (139, 256, 144, 0),
    "IQ5_K": (140, 256, 176, 0), "IQ6_K": (141, 256, 212, 0), "IQ4_KS": (144, 256, 136, 4),
    "IQ2_KS": (145, 256, 70, 2), "IQ5_KS": (152, 256, 168, 4), "IQ3_KS": (156, 256, 102, 2),
    "IQ2_KL": (157, 256, 86, 2),
}


@pytest.mark.parametrize("ggml_type", list(GGMLQuantizationType), ids=lambda t: t.name)
def test_every_gguf_type_is_in_the_table_with_the_same_block(ggml_type):
    ours = QUANT_TYPES[ggml_type.name]
    block_weights, block_bytes = GGML_QUANT_SIZES[ggml_type]
    assert ours.ggml_id == int(ggml_type)
    assert ours.block_weights == block_weights
    if ggml_type.name in KNOWN_DISAGREEMENTS:
        assert (ours.block_bytes, block_bytes) == KNOWN_DISAGREEMENTS[ggml_type.name]
    else:
        assert ours.block_bytes == block_bytes


def test_table_has_exactly_the_reference_types():
    # hardware-and-gguf.md §3.1: every mainline id, plus Q2_0 (42), which gguf 0.19.0 does not have yet; and the
    # ik_llama.cpp types sized here, marked as its own.
    gguf_names = {t.name for t in GGMLQuantizationType}
    assert set(GGML_TYPES) == gguf_names | {"Q2_0"}
    assert set(QUANT_TYPES) == set(GGML_TYPES) | set(IK_GGUF_PY)
    assert {n for n, t in QUANT_TYPES.items() if t.fork is None} == set(GGML_TYPES)
    assert {QUANT_TYPES[n].fork for n in IK_GGUF_PY} == {"ik_llama.cpp"}
    assert len({t.ggml_id for t in QUANT_TYPES.values()}) == len(QUANT_TYPES)
    assert all(name == t.name for name, t in QUANT_TYPES.items())


def test_q2_0_matches_the_reference_row():
    q2_0 = quant_type("Q2_0")
    assert (q2_0.ggml_id, q2_0.block_weights, q2_0.block_bytes) == (42, 64, 18)
    if hasattr(GGMLQuantizationType, "Q2_0"):  # a newer gguf: it must agree with us
        assert GGML_QUANT_SIZES[GGMLQuantizationType.Q2_0] == (64, 18)


@pytest.mark.parametrize(("type_name", "n_weights", "expected_bytes"), [
    # One DeepSeek-V4-Flash expert part, 4096 x 2048 weights (ds4-engine.md §2.2).
    ("IQ2_XXS", 4096 * 2048, 2_162_688),
    ("Q2_K", 4096 * 2048, 2_752_512),
    ("Q4_K", 4096 * 2048, 4_718_592),
    ("MXFP4", 4096 * 2048, 4_456_448),  # 4.25 MiB
    # gpt-oss-120b part, 2880 x 2880 MXFP4: 259,200 blocks x 17 B.
    ("MXFP4", 2880 * 2880, 4_406_400),
    # Strata Qwen fused gate/up (3,276,800 weights) and down (1,638,400), strata-engine.md §2.2.
    ("IQ4_XS", 3_276_800, 1_740_800),
    ("IQ4_NL", 1_638_400, 921_600),
    ("F32", 10, 40),
    ("BF16", 10, 20),
    ("Q4_K", 0, 0),
])
def test_known_answers(type_name, n_weights, expected_bytes):
    assert tensor_bytes(type_name, n_weights) == expected_bytes


@pytest.mark.parametrize("name", sorted(IK_GGUF_PY))
def test_ik_types_match_ik_gguf_py(name):
    qt = quant_type(name)
    assert (qt.ggml_id, qt.block_weights, qt.block_bytes, qt.row_meta_bytes) == IK_GGUF_PY[name]
    assert quant_type(qt.ggml_id) is qt


def test_row_meta_types_size_by_rows():
    # one GLM-5.1 expert's gate (2048 rows of 6144) at IQ3_KS: 24 blocks of 102 B + a 2-byte f16 scale a row
    assert tensor_bytes("IQ3_KS", 6144 * 2048, 6144) == 2048 * (24 * 102 + 2) == 5_017_600
    # its down (6144 rows of 2048) at IQ4_KS: 8 blocks of 136 B + a 4-byte float a row
    assert tensor_bytes("IQ4_KS", 2048 * 6144, 2048) == 6144 * (8 * 136 + 4) == 6_709_248
    for bad_row in (None, 0, 100, 6144 * 5):  # no row, a partial block, rows that do not divide the tensor
        with pytest.raises(InputError, match="IQ3_KS row"):
            tensor_bytes("IQ3_KS", 6144 * 2048, bad_row)
    assert tensor_bytes("Q4_K", 4096, 256) == tensor_bytes("Q4_K", 4096)  # mainline types have no row bytes


def test_lookup_by_name_id_and_gguf_enum():
    assert quant_type("q4_k") is quant_type("Q4_K") is quant_type(12) is quant_type(GGMLQuantizationType.Q4_K)
    assert quant_type(42).name == "Q2_0"


@pytest.mark.parametrize(("bad", "needle"), [
    ("Q4_K_M", "Q4_K_M"),  # a file type (llama_ftype), not a tensor type
    ("IQ4_KSS", "IQ4_KSS"),  # an ik_llama.cpp type not sized here
    (146, "146"),
    (31, "Q4_0_4_4"),  # removed from the format
    (-1, "-1"),
    (True, "True"),
    (None, "None"),
    (12.0, "12.0"),
])
def test_unknown_types_are_refused_by_name(bad, needle):
    with pytest.raises(InputError) as info:
        quant_type(bad)
    message = str(info.value)
    assert needle in message and "\n" not in message


@pytest.mark.parametrize(("type_name", "n_weights"), [("Q4_K", 255), ("Q4_K", 257), ("MXFP4", 31), ("F16", -2)])
def test_partial_blocks_are_refused(type_name, n_weights):
    with pytest.raises(InputError, match=rf"{type_name} weights = {n_weights}"):
        tensor_bytes(type_name, n_weights)


def test_unknown_type_in_tensor_bytes_is_refused():
    with pytest.raises(InputError, match="Q3_K_S"):
        tensor_bytes("Q3_K_S", 256)


@given(st.sampled_from(sorted(GGML_TYPES)), st.integers(0, 10**9), st.integers(0, 10**9))
def test_bytes_scale_with_whole_blocks(type_name, a_blocks, b_blocks):
    qt = QUANT_TYPES[type_name]
    a, b = a_blocks * qt.block_weights, b_blocks * qt.block_weights
    assert tensor_bytes(type_name, a) == a_blocks * qt.block_bytes
    assert tensor_bytes(type_name, a + b) == tensor_bytes(type_name, a) + tensor_bytes(type_name, b)

