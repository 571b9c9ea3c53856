"""layout_from_gguf / read_gguf on small GGUF files written with gguf's own writer, and fuzzing of the reader.

Expected bytes are worked out by hand from the block table (hardware-and-gguf.md §3.1) or, in the
random round trip, from gguf's GGML_QUANT_SIZES: both independent of sim.model.quant.
"""

import os
import resource
import struct
import tempfile
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.errors import InputError
from sim.model import ExpertLayer, ModelLayout, get_preset, layout_from_gguf, read_gguf

ARCH = "testmoe"
PARTS = ("gate", "up", "down")


def marker(block: int, part: str, expert: int) -> int:
    """A byte value per (layer, part, expert): neighbours differ, so an off-by-one offset shows."""
    return 1 + (block * 7 + PARTS.index(part) * 3 + expert) % 250


def quant_array(ne, qtype) -> np.ndarray:
    """Zeroed raw bytes for a tensor of GGML shape ne (numpy order reversed, last axis in bytes)."""
    block_weights, block_bytes = GGML_QUANT_SIZES[qtype]
    return np.zeros((*reversed(ne[1:]), ne[0] // block_weights * block_bytes), np.uint8)


def expert_tensors(block, n_experts, hidden, width, types, form="3d"):
    """(name, data, qtype) for one routed layer; every expert part's bytes are filled with its marker."""
    gate_t, up_t, down_t = types
    if form == "legacy":
        out = []
        for part, t, ne in (("gate", gate_t, [hidden, width]), ("up", up_t, [hidden, width]),
                            ("down", down_t, [width, hidden])):
            for e in range(n_experts):
                out.append((f"blk.{block}.ffn_{part}.{e}.weight", quant_array(ne, t) + marker(block, part, e), t))
        return out
    down = quant_array([width, hidden, n_experts], down_t)
    for e in range(n_experts):
        down[e] = marker(block, "down", e)
    if form == "fused":
        gate_up = quant_array([hidden, 2 * width, n_experts], gate_t)
        for e in range(n_experts):
            gate_up[e, :width] = marker(block, "gate", e)
            gate_up[e, width:] = marker(block, "up", e)
        return [(f"blk.{block}.ffn_gate_up_exps.weight", gate_up, gate_t),
                (f"blk.{block}.ffn_down_exps.weight", down, down_t)]
    out = []
    for part, t in (("gate", gate_t), ("up", up_t)):
        data = quant_array([hidden, width, n_experts], t)
        for e in range(n_experts):
            data[e] = marker(block, part, e)
        out.append((f"blk.{block}.ffn_{part}_exps.weight", data, t))
    return out + [(f"blk.{block}.ffn_down_exps.weight", down, down_t)]


def write_gguf(path, tensors, kv, arch=ARCH):
    """Write a GGUF with gguf's writer: kv maps full key -> int (uint32), str or list; tensors are raw bytes."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in kv.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, value)
    for name, data, qtype in tensors:
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def moe_kv(n_blocks, n_experts, top_k, **extra):
    kv = {f"{ARCH}.block_count": n_blocks, f"{ARCH}.expert_count": n_experts, f"{ARCH}.expert_used_count": top_k}
    kv.update({f"{ARCH}.{key}": value for key, value in extra.items()})
    return kv


def assert_offsets_hold_markers(model, path):
    """Every part of every expert lies where offsets say: its bytes are all its marker."""
    raw = np.fromfile(path, np.uint8)
    for i, layer in enumerate(model.layout.layers):
        for p, part in enumerate(PARTS):
            size = getattr(layer, f"{part}_bytes")
            for e in range(model.layout.n_experts):
                start = model.offsets[i, p, e]
                assert (raw[start:start + size] == marker(layer.block, part, e)).all(), (layer.block, part, e)


def assert_input_error(path, *needles):
    with pytest.raises(InputError) as info:
        read_gguf(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(path)), message
    for needle in needles:
        assert needle in message, message
    return message


# ---------------------------------------------------------------------------------------------- known files

def test_3d_experts_with_dense_shared_and_attention_tensors(tmp_path):
    # Block 0 dense, blocks 1-3 routed (IQ2_XXS gate/up, Q2_K down, like ds4's q2 file), 4 experts, 512 x 256.
    tensors = [("token_embd.weight", quant_array([512, 16], Q.F16), Q.F16),
               ("blk.0.ffn_gate.weight", quant_array([512, 1024], Q.Q8_0), Q.Q8_0),
               ("blk.0.ffn_up.weight", quant_array([512, 1024], Q.Q8_0), Q.Q8_0),
               ("blk.0.ffn_down.weight", quant_array([1024, 512], Q.Q8_0), Q.Q8_0)]
    for block in (1, 2, 3):
        tensors += [(f"blk.{block}.attn_q.weight", quant_array([512, 512], Q.Q8_0), Q.Q8_0),
                    (f"blk.{block}.ffn_gate_inp.weight", quant_array([512, 4], Q.F32), Q.F32),
                    (f"blk.{block}.ffn_gate_shexp.weight", quant_array([512, 256], Q.Q8_0), Q.Q8_0)]
        tensors += expert_tensors(block, 4, 512, 256, (Q.IQ2_XXS, Q.IQ2_XXS, Q.Q2_K))
    path = write_gguf(tmp_path / "moe.gguf", tensors,
                      moe_kv(4, 4, 2, expert_shared_count=1, embedding_length=512, expert_feed_forward_length=256)
                      | {"general.name": "tiny-moe"})
    model = read_gguf(path)
    lay = model.layout
    # 512 x 256 = 131,072 weights = 512 blocks: IQ2_XXS 512 x 66 = 33,792 B; Q2_K 512 x 84 = 43,008 B.
    assert [(l.block, l.gate_bytes, l.up_bytes, l.down_bytes) for l in lay.layers] == [
        (b, 33_792, 33_792, 43_008) for b in (1, 2, 3)]
    assert {(l.gate_type, l.up_type, l.down_type) for l in lay.layers} == {("IQ2_XXS", "IQ2_XXS", "Q2_K")}
    assert (lay.name, lay.n_blocks, lay.n_experts, lay.top_k, lay.n_shared_experts) == ("tiny-moe", 4, 4, 2, 1)
    assert (lay.hidden, lay.expert_width, lay.dense_blocks, lay.n_mtp_layers) == (512, 256, (0,), 0)
    assert lay.size_classes().keys == ((33_792, 43_008),)
    assert model.offsets.shape == (3, 3, 4) and model.offsets.dtype == np.int64
    assert_offsets_hold_markers(model, path)
    # Cross-check against gguf's own reader: part starts are its data_offset + e * bytes-per-expert.
    theirs = {t.name: t for t in gguf.GGUFReader(path).tensors}
    down = theirs["blk.2.ffn_down_exps.weight"]
    assert model.offsets[1, 2].tolist() == [down.data_offset + e * down.n_bytes // 4 for e in range(4)]
    assert layout_from_gguf(path) == lay and layout_from_gguf(str(path)) == lay


def test_fused_gate_up(tmp_path):
    # Qwen-3.8-like shape scaled down: hidden 512, width 64 -> fused ne1 = 128; IQ4_XS gate/up, IQ4_NL down.
    tensors = []
    for block in (0, 1):
        tensors += expert_tensors(block, 3, 512, 64, (Q.IQ4_XS, Q.IQ4_XS, Q.IQ4_NL), form="fused")
    path = write_gguf(tmp_path / "fused.gguf", tensors, moe_kv(2, 3, 2))
    model = read_gguf(path)
    # gate+up: 512 x 128 = 256 IQ4_XS blocks x 136 B = 34,816 B, split in halves; down 64 x 512 = 1024 IQ4_NL
    # blocks x 18 B = 18,432 B.
    first = model.layout.layers[0]
    assert (first.gate_bytes, first.up_bytes, first.down_bytes, first.fused_gate_up) == (17_408, 17_408, 18_432, True)
    assert (first.gate_type, first.up_type, first.down_type) == ("IQ4_XS", "IQ4_XS", "IQ4_NL")
    assert (model.layout.hidden, model.layout.expert_width) == (512, 64)
    assert (model.offsets[:, 1] - model.offsets[:, 0] == 17_408).all()  # up right behind gate
    assert_offsets_hold_markers(model, path)


def test_legacy_per_expert_tensors(tmp_path):
    # Mixtral before llama.cpp PR #6387: blk.N.ffn_{gate,up,down}.E.weight, 8 experts, Q4_K / Q6_K.
    tensors = []
    for block in range(2):
        tensors += expert_tensors(block, 8, 256, 256, (Q.Q4_K, Q.Q4_K, Q.Q6_K), form="legacy")
    path = write_gguf(tmp_path / "legacy.gguf", tensors, moe_kv(2, 8, 2))
    model = read_gguf(path)
    # 256 x 256 = 256 blocks: Q4_K 256 x 144 = 36,864 B; Q6_K 256 x 210 = 53,760 B.
    assert {(l.gate_bytes, l.up_bytes, l.down_bytes) for l in model.layout.layers} == {(36_864, 36_864, 53_760)}
    assert model.layout.n_experts == 8
    assert_offsets_hold_markers(model, path)


def test_mtp_layer_and_mixed_quant_types(tmp_path):
    # 6 blocks: dense 0; routed 1-4 with four recipes; block 5 is the nextn (MTP) layer at Q2_K.
    recipes = {1: (Q.Q4_K, Q.Q4_K, Q.Q6_K), 2: (Q.IQ2_XXS, Q.IQ2_XXS, Q.Q2_K), 3: (Q.Q4_K, Q.Q4_K, Q.Q6_K),
               4: (Q.MXFP4, Q.MXFP4, Q.MXFP4), 5: (Q.Q2_K, Q.Q2_K, Q.Q2_K)}
    tensors = [("blk.0.ffn_gate.weight", quant_array([256, 256], Q.F16), Q.F16)]
    for block, types in recipes.items():
        tensors += expert_tensors(block, 2, 256, 256, types, form="legacy" if block == 3 else "3d")
    path = write_gguf(tmp_path / "mtp.gguf", tensors, moe_kv(6, 2, 1, nextn_predict_layers=1))
    lay = read_gguf(path).layout
    # 65,536 weights = 256 K-blocks or 2,048 MXFP4 blocks: Q4_K 36,864; Q6_K 53,760; IQ2_XXS 16,896;
    # Q2_K 21,504; MXFP4 2,048 x 17 = 34,816.
    assert [(l.block, l.gate_bytes, l.down_bytes, l.mtp) for l in lay.layers] == [
        (1, 36_864, 53_760, False), (2, 16_896, 21_504, False), (3, 36_864, 53_760, False),
        (4, 34_816, 34_816, False), (5, 21_504, 21_504, True)]
    assert (lay.n_routed_layers, lay.n_mtp_layers, lay.dense_blocks) == (4, 1, (0,))
    classes = lay.size_classes()
    assert classes.keys == ((36_864, 53_760), (16_896, 21_504), (34_816, 34_816), (21_504, 21_504))
    assert classes.class_of_layer.tolist() == [0, 1, 0, 2, 3]
    assert classes.expert_bytes.tolist() == [127_488, 55_296, 104_448, 64_512]


def test_declared_mtp_block_without_tensors(tmp_path):
    # antirez's DeepSeek-V4 GGUFs declare n_layer=44, nextn_predict_layers=1 but lack the MTP block (§2.1).
    tensors = expert_tensors(0, 2, 256, 256, (Q.Q4_K,) * 3) + expert_tensors(1, 2, 256, 256, (Q.Q4_K,) * 3)
    lay = read_gguf(write_gguf(tmp_path / "m.gguf", tensors, moe_kv(3, 2, 1, nextn_predict_layers=1))).layout
    assert (lay.n_blocks, lay.n_routed_layers, lay.n_mtp_layers) == (3, 2, 0)


def test_optional_kvs_are_derived(tmp_path):
    # No block_count / expert_count / shared count: taken from the tensors (a shexp tensor means 1 shared).
    tensors = expert_tensors(2, 3, 256, 256, (Q.Q8_0,) * 3)
    tensors.append(("blk.2.ffn_up_shexp.weight", quant_array([256, 256], Q.Q8_0), Q.Q8_0))
    lay = read_gguf(write_gguf(tmp_path / "m.gguf", tensors, {f"{ARCH}.expert_used_count": 1})).layout
    assert (lay.n_blocks, lay.n_experts, lay.n_shared_experts, lay.name) == (3, 3, 1, "m")
    # 256 x 256 = 2,048 Q8_0 blocks x 34 B = 69,632 B per part.
    assert lay.layers[0].expert_bytes == 3 * 69_632


def type_field_offset(path, tensor_name):
    """File offset of a tensor-info's u32 type id: after name (u64 len + bytes), n_dims u32, ne u64s."""
    reader = gguf.GGUFReader(path)
    tensor = next(t for t in reader.tensors if t.name == tensor_name)
    return tensor.field.offset + 8 + len(tensor_name.encode()) + 4 + 8 * len(tensor.shape)


def patch_u32(path, offset, value):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack("<I", value))


def test_q2_0_is_sized_although_gguf_does_not_know_it(tmp_path):
    # gguf 0.19.0 cannot write id 42, so write Q8_0 downs and patch their type to Q2_0 (64 weights / 18 B).
    path = write_gguf(tmp_path / "q2_0.gguf", expert_tensors(0, 2, 256, 256, (Q.Q4_K, Q.Q4_K, Q.Q8_0)),
                      moe_kv(1, 2, 1))
    patch_u32(path, type_field_offset(path, "blk.0.ffn_down_exps.weight"), 42)
    layer = read_gguf(path).layout.layers[0]
    assert (layer.down_type, layer.down_bytes) == ("Q2_0", 65_536 // 64 * 18)


def test_ik_types_are_sized_by_rows_as_ik_llama_cpp_writes_them(tmp_path):
    """ik_llama.cpp@8337e4cd3's llama-quantize (--custom-q ffn_*_exps=iq3_ks, sim.calibrate.ggml_kernels --ik) wrote
    a 16-expert layer's IQ3_KS gate, ne [2048, 768, 16], in 10,051,584 bytes and its down, ne [768, 2048, 16], in
    10,092,544: the distance from each tensor's data to the next one's in its file (2026-12-07). Written here as Q8_0
    (gguf 0.19.0 cannot write id 156) and patched to IQ3_KS, whose bytes are fewer."""
    path = write_gguf(tmp_path / "iq3_ks.gguf", expert_tensors(0, 16, 2048, 768, (Q.Q8_0,) * 3), moe_kv(1, 16, 8))
    for offset in [type_field_offset(path, f"blk.0.ffn_{part}_exps.weight") for part in PARTS]:  # gguf reads it first
        patch_u32(path, offset, 156)
    layer = read_gguf(path).layout.layers[0]
    assert (layer.gate_type, layer.down_type) == ("IQ3_KS", "IQ3_KS")
    assert (16 * layer.gate_bytes, 16 * layer.up_bytes, 16 * layer.down_bytes) == (10_051_584, 10_051_584, 10_092_544)


def test_full_size_sparse_file_matches_the_preset(tmp_path):
    """The real DeepSeek-V4-Flash q2-q4 tensor infos over an 83 GiB sparse file: the weights are never read."""
    preset = get_preset("deepseek-v4-flash-q2-q4")
    path = tmp_path / "flash-q2-q4.gguf"
    writer = gguf.GGUFWriter(str(path), "deepseek4")
    for key, value in moe_kv(43, 256, 6, expert_shared_count=1, embedding_length=4096,
                             expert_feed_forward_length=2048).items():
        writer.add_uint32(key.replace(ARCH, "deepseek4"), value)
    total = 0
    for block in range(43):
        types = (Q.Q4_K,) * 3 if block >= 37 else (Q.IQ2_XXS, Q.IQ2_XXS, Q.Q2_K)
        for part, qtype, ne in zip(PARTS, types, ([4096, 2048], [4096, 2048], [2048, 4096])):
            block_weights, block_bytes = GGML_QUANT_SIZES[qtype]
            byte_shape = (256, ne[1], ne[0] // block_weights * block_bytes)
            nbytes = int(np.prod(byte_shape))
            writer.add_tensor_info(f"blk.{block}.ffn_{part}_exps.weight", byte_shape, np.dtype(np.uint8), nbytes,
                                   raw_dtype=qtype)
            total += gguf.GGUFWriter.ggml_pad(nbytes, writer.data_alignment)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    data_start = gguf.GGUFWriter.ggml_pad(writer.fout[0].tell(), writer.data_alignment)
    writer.close()
    try:
        os.truncate(path, data_start + total)
    except OSError as exc:
        pytest.skip(f"no sparse files here: {exc}")
    # page faults, not seconds (no test times a wall clock): reading the weights would touch 83 GiB of pages
    before = resource.getrusage(resource.RUSAGE_SELF)
    lay = read_gguf(path).layout
    after = resource.getrusage(resource.RUSAGE_SELF)
    touched = (after.ru_minflt + after.ru_majflt - before.ru_minflt - before.ru_majflt) * resource.getpagesize()
    assert touched < 256 * 2**20, f"{touched / 2**20:.0f} MiB of pages touched"
    assert lay.layers == preset.layers
    assert (lay.n_blocks, lay.n_experts, lay.top_k, lay.hidden, lay.expert_width) == (43, 256, 6, 4096, 2048)
    assert lay.size_classes().keys == preset.size_classes().keys


# ---------------------------------------------------------------------------------------------- refusals

def good_file(tmp_path, name="good.gguf", **kv_extra):
    tensors = expert_tensors(0, 2, 256, 256, (Q.Q4_K, Q.Q4_K, Q.Q6_K)) + expert_tensors(1, 2, 256, 256, (Q.Q4_K,) * 3)
    return write_gguf(tmp_path / name, tensors, moe_kv(2, 2, 1) | kv_extra)


def test_missing_file_and_directory(tmp_path):
    assert_input_error(tmp_path / "nope.gguf", "path", "no such file")
    assert_input_error(tmp_path, "path", "is a folder, not a GGUF file")


@pytest.mark.parametrize("content", [b"", b"GGUF", b"not a gguf file at all, just text\n" * 4,
                                     b"GGUF\x03\x00\x00\x00" + b"\xff" * 16, b"GGUF\x09\x00\x00\x00" + b"\x00" * 16])
def test_not_gguf(tmp_path, content):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    assert_input_error(path, "GGUF header")


@pytest.mark.parametrize("keep", [0.1, 0.5, 0.9, 0.99])
def test_truncated(tmp_path, keep):
    path = good_file(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    message = assert_input_error(path)
    assert "truncated" in message or "GGUF header" in message


@pytest.mark.parametrize(("type_id", "needle"), [(99, "unknown GGML type"), (31, "Q4_0_4_4 was removed")])
def test_unknown_type_id(tmp_path, type_id, needle):
    path = good_file(tmp_path)
    patch_u32(path, type_field_offset(path, "blk.1.ffn_up_exps.weight"), type_id)
    assert_input_error(path, "blk.1.ffn_up_exps.weight type", str(type_id), needle)


def test_rows_not_whole_blocks(tmp_path):
    # ne0 = 96 F16 rows, then retyped as Q4_K (256-weight blocks).
    tensors = expert_tensors(0, 2, 256, 96, (Q.F16, Q.F16, Q.F16))
    path = write_gguf(tmp_path / "rows.gguf", tensors, moe_kv(1, 2, 1))
    patch_u32(path, type_field_offset(path, "blk.0.ffn_down_exps.weight"), int(Q.Q4_K))
    assert_input_error(path, "blk.0.ffn_down_exps.weight ne0 = 96", "256-weight blocks")


def test_no_experts(tmp_path):
    path = write_gguf(tmp_path / "dense.gguf", [("blk.0.ffn_gate.weight", quant_array([256, 256], Q.F16), Q.F16)],
                      moe_kv(1, 2, 1))
    assert_input_error(path, "tensors = 1 tensors", "no routed-expert tensors")


def refusal_cases():
    k = (Q.Q4_K,) * 3
    return {
        "inconsistent expert counts": (
            expert_tensors(0, 2, 256, 256, k) + expert_tensors(1, 3, 256, 256, k), moe_kv(2, 2, 1),
            ("blk.1.ffn_gate_exps.weight n_expert = 3", "inconsistent expert counts")),
        "expert_count KV disagrees": (
            expert_tensors(0, 2, 256, 256, k), moe_kv(1, 4, 1),
            (f"{ARCH}.expert_count = 4", "inconsistent expert counts")),
        "missing part": (
            [t for t in expert_tensors(0, 2, 256, 256, k) if "down" not in t[0]], moe_kv(1, 2, 1),
            ("blk.0.ffn_down_exps.weight = absent",)),
        "missing legacy part": (
            [t for t in expert_tensors(0, 2, 256, 256, k, form="legacy") if "up" not in t[0]], moe_kv(1, 2, 1),
            ("blk.0.ffn_up.E.weight = absent",)),
        "fused and separate": (
            expert_tensors(0, 2, 256, 256, k, form="fused") + expert_tensors(0, 2, 256, 256, k)[:1], moe_kv(1, 2, 1),
            ("blk.0.ffn_gate_up_exps.weight", "either a fused")),
        "3d and legacy in one layer": (
            expert_tensors(0, 2, 256, 256, k) + expert_tensors(0, 2, 256, 256, k, form="legacy"), moe_kv(1, 2, 1),
            ("blk.0", "one expert form")),
        "legacy gap": (
            [t for t in expert_tensors(0, 3, 256, 256, k, form="legacy") if ".1.weight" not in t[0]],
            moe_kv(1, 2, 1), ("blk.0.ffn_gate.E.weight = experts [0, 2]",)),
        "legacy experts differ": (
            [t for t in expert_tensors(0, 2, 256, 256, k, form="legacy") if t[0] != "blk.0.ffn_down.1.weight"]
            + [("blk.0.ffn_down.1.weight", quant_array([256, 256], Q.Q8_0), Q.Q8_0)], moe_kv(1, 2, 1),
            ("blk.0.ffn_down.1.weight = Q8_0", "experts of one layer differ")),
        "down shape": (
            expert_tensors(0, 2, 256, 256, k)[:2] + [("blk.0.ffn_down_exps.weight",
                                                       quant_array([256, 512, 2], Q.Q4_K), Q.Q4_K)],
            moe_kv(1, 2, 1), ("blk.0.ffn_down_exps.weight ne = [256, 512]", "expected [256, 256]")),
        "width KV disagrees": (
            expert_tensors(0, 2, 256, 256, k), moe_kv(1, 2, 1, expert_feed_forward_length=512),
            (f"{ARCH}.expert_feed_forward_length = 512",)),
        "no top-k": (
            expert_tensors(0, 2, 256, 256, k), {f"{ARCH}.expert_count": 2},
            (f"{ARCH}.expert_used_count = absent",)),
        "top-k above experts": (
            expert_tensors(0, 2, 256, 256, k), moe_kv(1, 2, 3), ("top_k = 3",)),
        "block_count too small": (
            expert_tensors(3, 2, 256, 256, k), moe_kv(2, 2, 1), (f"{ARCH}.block_count = 2", "blk.3")),
        "all blocks MTP": (
            expert_tensors(0, 2, 256, 256, k), moe_kv(1, 2, 1, nextn_predict_layers=1),
            (f"{ARCH}.nextn_predict_layers = 1",)),
        "top-k as a string": (
            expert_tensors(0, 2, 256, 256, k), {f"{ARCH}.expert_used_count": "six"},
            (f"{ARCH}.expert_used_count = STRING", "expected one integer")),
        "split shard": (
            expert_tensors(0, 2, 256, 256, k), moe_kv(1, 2, 1) | {"split.count": 3}, ("split.count = 3",)),
    }


@pytest.mark.parametrize("case", sorted(refusal_cases()))
def test_refusals(tmp_path, case):
    tensors, kv, needles = refusal_cases()[case]
    assert_input_error(write_gguf(tmp_path / "bad.gguf", tensors, kv), *needles)


def test_missing_architecture(tmp_path):
    # GGUFWriter skips empty strings, so arch "" leaves general.architecture out.
    path = write_gguf(tmp_path / "noarch.gguf", expert_tensors(0, 2, 256, 256, (Q.Q4_K,) * 3), {}, arch="")
    assert_input_error(path, "general.architecture = absent")



@pytest.mark.timeout(20)
@pytest.mark.parametrize("count", [2**31, 2**62, 2**64 - 1])
def test_huge_array_length_is_refused_fast(tmp_path, count):
    # gguf's parser loops once per claimed array item, even past the end of the file; over a 4 GiB (sparse)
    # file a corrupt count would take minutes, so it must be refused before the loop.
    path = good_file(tmp_path, **{"test.ints": [1, 2, 3]})
    field = gguf.GGUFReader(path).fields["test.ints"]
    count_at = field.offset + 8 + len("test.ints") + 4 + 4  # key (u64 length + bytes), value type, item type
    with open(path, "r+b") as f:
        f.seek(count_at)
        f.write(struct.pack("<Q", count))
    try:
        os.truncate(path, 2**32)
    except OSError as exc:
        pytest.skip(f"no sparse files here: {exc}")
    assert_input_error(path, "GGUF header", "past the end of the file")


def test_latent_moe_may_differ_from_embedding_length(tmp_path):
    # A latent MoE (ffn_latent_down/up) feeds its experts a narrower vector than n_embd.
    tensors = expert_tensors(0, 2, 256, 256, (Q.Q4_K,) * 3)
    kv = moe_kv(1, 2, 1, embedding_length=1024)
    assert_input_error(write_gguf(tmp_path / "plain.gguf", tensors, kv), f"{ARCH}.embedding_length = 1024")
    tensors.append(("blk.0.ffn_latent_down.weight", quant_array([1024, 256], Q.F16), Q.F16))
    assert read_gguf(write_gguf(tmp_path / "latent.gguf", tensors, kv)).layout.hidden == 256

# ---------------------------------------------------------------------------------------------- fuzzing

class Scratch:
    """One file path reused by every example; each write is a new inode, so a reader's old mmap is untouched."""

    def __init__(self):
        self.dir = tempfile.TemporaryDirectory()
        self.path = Path(self.dir.name) / "fuzz.gguf"

    def write(self, data: bytes) -> Path:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, self.path)
        return self.path


@pytest.fixture(scope="module")
def scratch():
    s = Scratch()
    yield s
    s.dir.cleanup()


@pytest.fixture(scope="module")
def base_file(scratch):
    """A small file exercising every path the parser has: arrays, strings, 3D, fused, legacy, dense, MTP."""
    tensors = [("blk.0.ffn_gate.weight", quant_array([64, 32], Q.F16), Q.F16)]
    tensors += expert_tensors(1, 2, 256, 32, (Q.IQ4_NL, Q.IQ4_NL, Q.Q8_0))
    tensors += expert_tensors(2, 2, 256, 32, (Q.MXFP4, Q.MXFP4, Q.Q4_0), form="fused")
    tensors += expert_tensors(3, 2, 256, 32, (Q.Q8_0, Q.Q8_0, Q.Q8_0), form="legacy")
    kv = moe_kv(4, 2, 1, nextn_predict_layers=1, embedding_length=256, expert_feed_forward_length=32)
    kv |= {"general.name": "fuzz", "test.ints": [1, 2, 3, 4], "test.tokens": ["a", "bc", "def"]}
    path = write_gguf(Path(scratch.dir.name) / "base.gguf", tensors, kv)
    data = path.read_bytes()
    model = read_gguf(path)
    assert model.layout.n_mtp_layers == 1 and model.layout.dense_blocks == (0,)
    header_bytes = int(model.offsets.min())  # the tensor data starts no earlier than the first expert
    return data, model.layout, header_bytes


def read_or_refuse(path):
    """What a caller may see: a layout or an InputError with a one-line message naming the file."""
    try:
        return read_gguf(path).layout
    except InputError as exc:
        assert "\n" not in str(exc) and str(exc).startswith(str(path))
        return None


def fuzz(max_examples):
    # Module-scoped fixtures are shared on purpose (one scratch file); no deadline, the suite timeout bounds it.
    return settings(max_examples=max_examples, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@fuzz(600)
@given(prefix=st.sampled_from([b"", b"GGUF", b"GGUF\x03\x00\x00\x00", b"GGUF\x02\x00\x00\x00"]),
       tail=st.binary(max_size=300))
def test_fuzz_random_bytes(scratch, prefix, tail):
    assert read_or_refuse(scratch.write(prefix + tail)) is None


@fuzz(500)
@given(data=st.data())
def test_fuzz_truncation(scratch, base_file, data):
    raw, layout, _ = base_file
    cut = data.draw(st.integers(0, len(raw) - 1))
    result = read_or_refuse(scratch.write(raw[:cut]))
    assert result is None or result == layout  # only trailing padding can go unnoticed


@fuzz(1500)
@given(data=st.data())
def test_fuzz_header_corruption(scratch, base_file, data):
    raw, _, header_bytes = base_file
    mutated = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, header_bytes - 1))
        kind = data.draw(st.sampled_from(["flip", "byte", "u64"]))
        if kind == "flip":
            mutated[at] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "byte":
            mutated[at] = data.draw(st.integers(0, 255))
        else:  # lengths, counts, dims and offsets are u64: try huge, small and off-by-some values there
            value = data.draw(st.sampled_from([0, 1, 2**31, 2**63, 2**64 - 1]) | st.integers(0, 2**64 - 1))
            mutated[at:at + 8] = struct.pack("<Q", value)[: len(mutated) - at]
    result = read_or_refuse(scratch.write(bytes(mutated[: len(raw)])))
    assert result is None or isinstance(result, ModelLayout)


# A random small model: per routed layer a form and a type per part, any type whose block fits its rows.
# Q8_1 holds activations and its block size is disputed (test_quant); types over 2 bytes a weight only
# make the files bigger.
WRITABLE = [t for t in Q if t != Q.Q8_1 and GGML_QUANT_SIZES[t][1] <= 2 * GGML_QUANT_SIZES[t][0]]


def types_for(row_weights):
    return [t for t in WRITABLE if row_weights % GGML_QUANT_SIZES[t][0] == 0]


@st.composite
def small_models(draw):
    hidden = draw(st.sampled_from([256, 512]))
    width = draw(st.sampled_from([32, 64, 256]))
    n_experts = draw(st.integers(1, 4))
    n_dense = draw(st.integers(0, 2))
    n_routed = draw(st.integers(1, 4))
    n_mtp = draw(st.integers(0, 1))
    layers = []
    for block in range(n_dense, n_dense + n_routed + n_mtp):
        form = draw(st.sampled_from(["3d", "fused", "legacy"]))
        gate = draw(st.sampled_from(types_for(hidden)))
        up = gate if form == "fused" else draw(st.sampled_from(types_for(hidden)))
        down = draw(st.sampled_from(types_for(width)))
        layers.append((block, form, (gate, up, down)))
    top_k = draw(st.integers(1, n_experts))
    return hidden, width, n_experts, top_k, n_dense, n_mtp, layers


def oracle_bytes(qtype, n_weights):
    block_weights, block_bytes = GGML_QUANT_SIZES[qtype]
    return n_weights // block_weights * block_bytes


@fuzz(250)
@given(model=small_models())
def test_fuzz_round_trip(scratch, model):
    hidden, width, n_experts, top_k, n_dense, n_mtp, layers = model
    n_blocks = n_dense + len(layers)
    tensors = [(f"blk.{b}.ffn_down.weight", quant_array([32, 256], Q.F16), Q.F16) for b in range(n_dense)]
    for block, form, types in layers:
        tensors += expert_tensors(block, n_experts, hidden, width, types, form)
    path = write_gguf(scratch.path, tensors, moe_kv(n_blocks, n_experts, top_k, nextn_predict_layers=n_mtp))
    got = read_gguf(path)
    expected = tuple(
        ExpertLayer(block, gate.name, up.name, down.name,
                    *(oracle_bytes(t, hidden * width) for t in (gate, up, down)),
                    fused_gate_up=form == "fused", mtp=block >= n_blocks - n_mtp)
        for block, form, (gate, up, down) in layers)
    assert got.layout.layers == expected
    assert (got.layout.n_blocks, got.layout.n_experts, got.layout.top_k) == (n_blocks, n_experts, top_k)
    assert got.layout.dense_blocks == tuple(range(n_dense))
    assert_offsets_hold_markers(got, path)
