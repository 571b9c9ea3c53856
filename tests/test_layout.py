"""ModelLayout validation, size classes, and the presets against the reference numbers."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sim.errors import InputError
from sim.model import PRESETS, ExpertLayer, ModelLayout, get_preset, preset_names
from sim.units import GIB, MIB

MiB = MIB
DOCS = Path(__file__).resolve().parents[1] / "docs" / "models.md"


def layer(block, gate=100, down=300, up=None, mtp=False, types=("Q4_K", "Q4_K", "Q6_K")):
    return ExpertLayer(block, *types, gate, gate if up is None else up, down, mtp=mtp)


def layout(layers, **overrides):
    fields = dict(name="toy", source="test", n_blocks=8, n_experts=4, top_k=2, n_shared_experts=0, hidden=256,
                  expert_width=256, dense_blocks=(), layers=tuple(layers))
    fields.update(overrides)
    return ModelLayout(**fields)


# ---------------------------------------------------------------------------------------------- layers

def test_from_types_sizes_each_part_from_its_rows():
    # 4096 x 2048 parts: IQ2_XXS 66 B / 256 weights, Q2_K 84 B / 256 (ds4-engine.md §2.2).
    part = ExpertLayer.from_types(5, 4096, 2048, "IQ2_XXS", "IQ2_XXS", "Q2_K")
    assert (part.gate_bytes, part.up_bytes, part.down_bytes) == (2_162_688, 2_162_688, 2_752_512)
    assert part.expert_bytes == 7_077_888 == 6.75 * MiB
    assert (part.block, part.fused_gate_up, part.mtp) == (5, False, False)


def test_from_types_refuses_rows_that_are_not_whole_blocks():
    # gpt-oss rows are 2880 weights: 11.25 Q4_K blocks (hardware-and-gguf.md §3.1), though 2880^2 is 32,400 blocks.
    with pytest.raises(InputError, match="gate row = 2880"):
        ExpertLayer.from_types(0, 2880, 2880, "Q4_K", "Q4_K", "Q4_K")
    # Qwen 3.8 down rows are 640 weights: IQ4_NL (32) fits, IQ4_XS (256) does not.
    with pytest.raises(InputError, match="down row = 640"):
        ExpertLayer.from_types(0, 2560, 640, "IQ4_XS", "IQ4_XS", "IQ4_XS")


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(gate_type="Q4_K_M"), "gate_type"),
    (dict(down_type="q6_k"), "down_type"),
    (dict(up_bytes=0), "up_bytes"),
    (dict(down_bytes=-5), "down_bytes"),
    (dict(gate_bytes=1.5), "gate_bytes"),
    (dict(block=-1), "block"),
    (dict(fused_gate_up=True, up_bytes=99), "fused_gate_up"),
])
def test_expert_layer_validation(kwargs, field):
    fields = dict(block=3, gate_type="Q4_K", up_type="Q4_K", down_type="Q6_K", gate_bytes=100, up_bytes=100,
                  down_bytes=300)
    fields.update(kwargs)
    with pytest.raises(InputError) as info:
        ExpertLayer(**fields)
    assert f": {field} = " in str(info.value) and "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------- layouts

@pytest.mark.parametrize(("overrides", "field"), [
    (dict(n_experts=0), "n_experts"),
    (dict(n_experts=65535), "n_experts"),  # 0xFFFF marks a missing trace cell
    (dict(top_k=0), "top_k"),
    (dict(top_k=5), "top_k"),
    (dict(n_shared_experts=-1), "n_shared_experts"),
    (dict(hidden=0), "hidden"),
    (dict(expert_width=True), "expert_width"),
    (dict(n_blocks=0), "n_blocks"),
    (dict(n_blocks=np.int64(8)), "n_blocks"),  # numpy ints would not survive to_dict's JSON
    (dict(name=""), "name"),
    (dict(source=""), "source"),
    (dict(layers=()), "layers"),
    (dict(layers=(layer(1), layer(1))), "layers[1].block"),
    (dict(layers=(layer(2), layer(1))), "layers[1].block"),
    (dict(layers=(layer(1), layer(8))), "layers[1].block"),
    (dict(layers=(layer(1), layer(2, mtp=True), layer(3))), "layers[2].mtp"),
    (dict(layers=(layer(7, mtp=True),)), "layers"),
    (dict(layers=("blk.1",)), "layers[0]"),
    (dict(dense_blocks=(1,)), "dense_blocks"),
    (dict(dense_blocks=(0, 0)), "dense_blocks"),
    (dict(dense_blocks=(9,)), "dense_blocks"),
])
def test_layout_validation(overrides, field):
    fields = dict(layers=(layer(1), layer(2)))
    fields.update(overrides)
    with pytest.raises(InputError) as info:
        layout(**fields)
    assert f": {field} = " in str(info.value) and "\n" not in str(info.value)


def test_layout_is_hashable_and_takes_lists():
    a = layout([layer(1), layer(2)], dense_blocks=[0])
    b = layout((layer(1), layer(2)), dense_blocks=(0,))
    assert a == b and hash(a) == hash(b) and isinstance(a.layers, tuple)
    assert {a: 1}[b] == 1


def test_counts_and_totals():
    toy = layout([layer(0), layer(1, gate=50, down=70), layer(7, mtp=True, gate=10, down=10)])
    assert (toy.n_routed_layers, toy.n_mtp_layers) == (2, 1)
    assert toy.expert_bytes_per_layer().tolist() == [500, 170, 30]
    assert toy.expert_bytes_per_layer().dtype == np.int64
    assert toy.max_expert_bytes == 500
    assert toy.total_expert_bytes == 4 * (500 + 170 + 30)


def test_size_classes_follow_first_touch_and_fit_the_largest_expert():
    toy = layout([layer(0, gate=50, down=70), layer(1), layer(2, gate=50, down=70, up=60), layer(3)])
    classes = toy.size_classes()
    assert classes.keys == ((50, 70), (100, 300))
    assert classes.class_of_layer.tolist() == [0, 1, 0, 1]
    assert classes.class_of_layer.dtype == np.int16
    assert classes.expert_bytes.tolist() == [180, 500]  # 50 + 60 + 70: a slot holds any expert of its class
    assert classes.layers_per_class.tolist() == [2, 2]
    assert classes.n_classes == 2
    with pytest.raises(ValueError):
        classes.expert_bytes[0] = 1


def test_to_dict_is_json_and_complete():
    toy = layout([layer(0), layer(1, mtp=True)])
    record = json.loads(json.dumps(toy.to_dict()))
    assert record["name"] == "toy" and record["n_experts"] == 4 and record["dense_blocks"] == []
    assert record["layers"][1] == dict(block=1, gate_type="Q4_K", up_type="Q4_K", down_type="Q6_K", gate_bytes=100,
                                       up_bytes=100, down_bytes=300, fused_gate_up=False, mtp=True, expert_bytes=500)
    assert record["total_expert_bytes"] == toy.total_expert_bytes


layer_sizes = st.tuples(st.integers(1, 4), st.integers(1, 4)).map(lambda gd: (gd[0] * 1000, gd[1] * 1000))


@given(st.lists(layer_sizes, min_size=1, max_size=40), st.integers(0, 3))
def test_size_class_invariants(sizes, n_mtp):
    n_mtp = min(n_mtp, len(sizes) - 1)
    layers = [layer(i, gate=g, down=d, mtp=i >= len(sizes) - n_mtp) for i, (g, d) in enumerate(sizes)]
    toy = layout(layers, n_blocks=len(sizes))
    classes = toy.size_classes()
    assert list(classes.keys) == list(dict.fromkeys(sizes))  # distinct keys in first-touch order
    assert [classes.keys[c] for c in classes.class_of_layer] == sizes
    assert classes.layers_per_class.sum() == len(sizes)
    first_touch = [classes.class_of_layer.tolist().index(c) for c in range(len(classes.keys))]
    assert first_touch == sorted(first_touch)
    assert classes.expert_bytes.tolist() == [2 * g + d for g, d in classes.keys]


# ---------------------------------------------------------------------------------------------- presets

def test_preset_names_are_exactly_the_agreed_ones():
    assert preset_names() == sorted([
        "deepseek-v4-flash-q2", "deepseek-v4-flash-q2-q4", "deepseek-v4-flash-q4", "deepseek-v4-pro",
        "deepseek-v4.1-flash-q2",
        "qwen3.8-flash-next-iq3s", "qwen3.8-flash-next-q2_0", "qwen3.8-flash-next-iq3xxs",
        "qwen3.8-flash-next-huihui-iq3s", "qwen3.8-flash-next-iq2xs", "qwen3-30b-a3b", "qwen3-next-80b-a3b", "mixtral-8x7b", "olmoe-1b-7b",
        "glm-5.2", "gpt-oss-120b", "gpt-oss-20b", "qwen3.6-35b-a3b", "glm-4.7-flash",
        "qwen3.6-35b-a3b-q8_0", "qwen3-30b-a3b-q4_k_m", "qwen3.5-35b-a3b", "mixtral-8x7b-q4_k_m",
        "deepseek-v2-lite-q4_k_m", "deepseek-v3.2-q8_0", "glm-5.1-iq3_ks"])
    assert all(get_preset(name) is PRESETS[name] and PRESETS[name].name == name for name in preset_names())


def test_unknown_preset_lists_the_valid_names():
    with pytest.raises(InputError) as info:
        get_preset("deepseek-v3")
    message = str(info.value)
    assert message.startswith("model preset: name = deepseek-v3:") and "glm-5.2" in message and "\n" not in message


def test_deepseek_v4_flash_presets_match_ds4():
    # ds4-engine.md §2.3: q2 6.75 MiB per expert, q4 13.5 MiB; q2-q4 has Q4_K in layers 37-42.
    q2, mixed, q4 = (get_preset(f"deepseek-v4-flash-{v}") for v in ("q2", "q2-q4", "q4"))
    assert q2.max_expert_bytes == 7_077_888 == 6.75 * MiB
    assert q4.max_expert_bytes == 14_155_776 == 13.5 * MiB
    assert (q2.n_routed_layers, q2.n_experts, q2.top_k, q2.n_shared_experts, q2.dense_blocks) == (43, 256, 6, 1, ())
    assert len(q2.size_classes().keys) == len(q4.size_classes().keys) == 1
    classes = mixed.size_classes()
    assert classes.keys == ((2_162_688, 2_752_512), (4_718_592, 4_718_592))  # q2 touched first (layer 0)
    assert classes.expert_bytes.tolist() == [7_077_888, 14_155_776]
    assert classes.layers_per_class.tolist() == [37, 6]
    assert np.flatnonzero(classes.class_of_layer == 1).tolist() == list(range(37, 43))
    # "9472 = 37 x 256, exactly all the q2 experts of the mixed model" (ds4-engine.md §1.12).
    assert classes.layers_per_class[0] * mixed.n_experts == 9472
    # All routed experts: 72.56 / 82.69 / 145.1 GiB (ds4-engine.md §2.3).
    assert [round(p.total_expert_bytes / GIB, 2) for p in (q2, mixed, q4)] == [72.56, 82.69, 145.12]


def test_deepseek_v4_pro_uses_the_q2_recipe():
    pro = get_preset("deepseek-v4-pro")
    assert (pro.n_routed_layers, pro.n_experts, pro.top_k, pro.hidden, pro.expert_width) == (61, 384, 6, 7168, 3072)
    assert {(l.gate_type, l.up_type, l.down_type) for l in pro.layers} == {("IQ2_XXS", "IQ2_XXS", "Q2_K")}
    assert pro.n_routed_layers * pro.n_experts == 23424  # ds4's 61 x 384 clamp (ds4-engine.md §2.1)


def test_glm_5_2_mtp_layer_is_its_own_class():
    glm = get_preset("glm-5.2")
    assert (glm.n_blocks, glm.dense_blocks, glm.n_routed_layers, glm.n_mtp_layers) == (79, (0, 1, 2), 75, 1)
    assert glm.layers[0].block == 3 and glm.layers[-1].block == 78 and glm.layers[-1].mtp
    # "An IQ2_XXS part is 3.09 MiB. An all-IQ2 expert is 9.28 MiB" (ds4-engine.md §2.4).
    assert round(glm.layers[0].gate_bytes / MiB, 2) == 3.09 and round(glm.layers[0].expert_bytes / MiB, 2) == 9.28
    classes = glm.size_classes()
    assert classes.layers_per_class.tolist() == [75, 1]
    assert classes.class_of_layer[-1] == 1 and classes.expert_bytes[1] == 3 * 4_128_768  # Q2_K 6144 x 2048
    # "600 experts per token ≈ 5.4 GiB per token" (75 layers x top-8).
    assert round(glm.n_routed_layers * glm.top_k * glm.layers[0].expert_bytes / GIB, 1) == 5.4


def test_qwen38_iq3s_blob_sizes_match_strata():
    qwen = get_preset("qwen3.8-flash-next-iq3s")
    geometry = (qwen.n_routed_layers, qwen.n_experts, qwen.top_k, qwen.hidden, qwen.expert_width)
    assert geometry == (48, 512, 10, 2560, 640)
    assert all(l.fused_gate_up and l.gate_bytes == l.up_bytes and l.down_type == "IQ4_NL" for l in qwen.layers)
    assert qwen.max_expert_bytes == 2_662_400  # observed max_blob (strata-engine.md §2.2)
    mean_mib = qwen.expert_bytes_per_layer().mean() / MiB
    assert 1.93 <= mean_mib <= 1.96  # sized-slot ratios 1.94 ± 0.01, arena mean 1.952 (§2.2-2.3)
    assert round(qwen.total_expert_bytes / GIB, 1) == 46.9  # arena 46.84 GiB for 24,576 experts
    counts = {}
    for l in qwen.layers:
        counts[l.gate_type] = counts.get(l.gate_type, 0) + 1
    assert counts == {"IQ4_XS": 2, "IQ3_S": 3, "IQ3_XXS": 6, "IQ2_S": 37}
    edges_and_middle = (qwen.layers[0].gate_type, qwen.layers[47].gate_type, qwen.layers[24].gate_type)
    assert edges_and_middle == ("IQ4_XS", "IQ4_XS", "IQ2_S")


def test_gpt_oss_experts_are_mxfp4():
    oss = get_preset("gpt-oss-120b")
    # 3 parts x 2880 x 2880 weights x 17 B / 32 = 13,219,200 B = 12.61 MiB (hardware-and-gguf.md §4.1).
    assert {(l.gate_type, l.expert_bytes) for l in oss.layers} == {("MXFP4", 13_219_200)}
    assert (oss.n_routed_layers, oss.n_experts, oss.top_k) == (36, 128, 4)


@pytest.mark.parametrize(("name", "advertised_params", "min_share"), [
    # Advertised total parameters (hardware-and-gguf.md §4 / §4.1 sanity list); routed experts are the bulk.
    ("deepseek-v4-flash-q2", 284e9, 0.95),
    ("deepseek-v4-pro", 1.6e12, 0.95),
    ("glm-5.2", 744e9, 0.95),
    ("gpt-oss-120b", 116.8e9, 0.95),
    ("qwen3-next-80b-a3b", 80e9, 0.95),
    ("qwen3-30b-a3b", 30.5e9, 0.95),
    ("mixtral-8x7b", 46.7e9, 0.95),
    # A 7B model's embeddings (2 x 50,304 x 2048) and attention (16 x 4 x 2048^2) are 7 % of it.
    ("olmoe-1b-7b", 6.9e9, 0.93),
    # Smaller models again: their embeddings (2 x 201,088 x 2880 for gpt-oss, 2 x 154,880 x 2048 and a dense block for
    # GLM-4.7-Flash) and attention are 8-11 % of them.
    ("gpt-oss-20b", 20.9e9, 0.9),
    ("qwen3.6-35b-a3b", 35e9, 0.9),
    ("glm-4.7-flash", 31e9, 0.89),
    # DeepSeek-V2-Lite: 15.7 B in all (its model card); 2 shared experts a layer, embeddings and MLA are 8 % of it
    ("deepseek-v2-lite-q4_k_m", 15.7e9, 0.9),
    # DeepSeek-V3.2's 685.36 B as llama-bench prints it (its MTP block counted; the routed total here leaves it out)
    ("deepseek-v3.2-q8_0", 685.36e9, 0.95),
    ("glm-5.1-iq3_ks", 744e9, 0.95),
])
def test_routed_params_match_advertised_sizes(name, advertised_params, min_share):
    preset = get_preset(name)
    routed = 3 * preset.hidden * preset.expert_width * preset.n_experts * preset.n_routed_layers
    assert min_share * advertised_params <= routed <= advertised_params


def test_a_k_quant_whose_rows_hold_no_super_block_falls_back_as_llama_cpp_writes_it():
    """DeepSeek-V2-Lite's ffn_down rows are 1408 weights, not a multiple of 256: Q6_K is written Q8_0 and Q4_K Q5_0
    (src/llama-quant.cpp's fallback), in the blocks llama.cpp's Q4_K_M rule picks (27 blocks: 0-2, 23-26 and every
    third between)."""
    layers = {layer.block: layer for layer in get_preset("deepseek-v2-lite-q4_k_m").layers}
    assert layers[1].down_type == "Q8_0" and layers[3].down_type == "Q5_0" and layers[5].down_type == "Q8_0"
    assert layers[1].gate_type == "Q4_K"
    # GGML's block table: Q8_0 = 34 B and Q5_0 = 22 B per 32 weights, 2048 rows of 1408
    assert layers[1].down_bytes == 2048 * 1408 // 32 * 34 and layers[3].down_bytes == 2048 * 1408 // 32 * 22


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_bytes_come_from_the_block_table(name):
    preset = get_preset(name)
    for l in preset.layers:
        rebuilt = ExpertLayer.from_types(l.block, preset.hidden, preset.expert_width, l.gate_type, l.up_type,
                                         l.down_type, fused_gate_up=l.fused_gate_up, mtp=l.mtp)
        assert rebuilt == l
    assert preset.source and json.dumps(preset.to_dict())


def test_docs_table_matches_the_presets():
    rows = {}
    for line in DOCS.read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if cells and cells[0] in PRESETS:
            rows[cells[0]] = cells
    assert set(rows) == set(PRESETS)
    for name, cells in rows.items():
        classes = get_preset(name).size_classes()
        documented = [int(x.replace(",", "")) for x in re.findall(r"\d{1,3}(?:,\d{3})+", cells[-2])]
        assert documented == classes.expert_bytes.tolist(), name
