"""Built-in model layouts: public MoE geometries with one concrete quantization recipe each.

Geometry comes from reference/hardware-and-gguf.md §4 (and ds4-engine.md §2, strata-engine.md §2 for
the engines' own models); bytes come from the GGML block table (sim.model.quant), never typed in.
Where no real file's recipe is documented, the preset picks a common one and says so: read a real
file with `sim.model.layout_from_gguf` when exact bytes matter (Q4_K_M files, for instance, mix
Q4_K/Q5_K/Q6_K/Q8_0 per tensor, hardware-and-gguf.md §3.1).
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType

from sim.errors import InputError
from sim.model.layout import ExpertLayer, ModelLayout

Recipe = Callable[[int], tuple[str, str, str]]  # block -> (gate type, up type, down type)


def _layout(name: str, source: str, *, n_blocks: int, n_experts: int, top_k: int, n_shared: int, hidden: int,
            expert_width: int, recipe: Recipe, dense: range = range(0), mtp: range = range(0),
            fused_gate_up: bool = False) -> ModelLayout:
    """Every block not dense is routed; mtp blocks (the last ones) are routed MTP layers."""
    layers = tuple(
        ExpertLayer.from_types(block, hidden, expert_width, *recipe(block), fused_gate_up=fused_gate_up,
                               mtp=block in mtp)
        for block in range(n_blocks) if block not in dense)
    return ModelLayout(name, source, n_blocks, n_experts, top_k, n_shared, hidden, expert_width,
                       tuple(dense), layers)


def _uniform(gate_up: str, down: str) -> Recipe:
    return lambda block: (gate_up, gate_up, down)


# Stand-in for Q4_K_M where the reference names no file: Q4_K gate/up with Q6_K down. Q4_K_M gives
# ffn_down more bits than gate/up; doing so in every layer keeps one size class.
_Q4_K_M_LIKE = _uniform("Q4_K", "Q6_K")

# DeepSeek-V4-Flash: ds4-engine.md §2.1 (DS4_SHAPE_FLASH, antirez/ds4 ds4.c @80ebbc3 L177-212) and
# hardware-and-gguf.md §4: 43 blocks, all routed (blocks 0-2 are hash-routed MoE, not dense), 256 experts,
# top-6, 1 shared, n_embd 4096, n_ff_exp 2048. Its MTP layer ships as a separate GGUF that ds4 refuses
# with --ssd-streaming (ds4-engine.md §2.1), so no MTP layer here.
_FLASH = dict(n_blocks=43, n_experts=256, top_k=6, n_shared=1, hidden=4096, expert_width=2048)
_FLASH_SOURCE = "ds4-engine.md §2.1 (DS4_SHAPE_FLASH, antirez/ds4 @80ebbc3) and §2.3 (official GGUF {}); " \
                "hardware-and-gguf.md §4"
# The ds4 q2 GGUF: IQ2_XXS gate/up, Q2_K down in all 43 layers: 6.75 MiB per expert (ds4-engine.md §2.3).
_DS4_Q2 = _uniform("IQ2_XXS", "Q2_K")
# The ds4 q2-q4 GGUF spliced Q4_K experts into layers 37-42 (--q4-layers 37-42, ds4-engine.md §2.3).
_DS4_Q4_LAYERS = range(37, 43)

# Qwen 3.8 Flash Next as the Strata engine runs it (strata-engine.md §2.1-2.2): 48 blocks, 512 experts,
# top-10, 1 shared, n_embd 2560, expert width 640, gate/up fused (1280 x 2560), IQ4_NL down (640-weight
# rows cannot hold a 256-weight block). The per-layer gate/up types of the IQ3_S file are not published;
# strata-engine.md §2.2 suggests 36 IQ2_S + 6 IQ3_XXS + 4 IQ3_S + 2 IQ4_XS as a stand-in, but its arithmetic
# uses 2.5 bpw for IQ2_S where ggml has 82 B / 256 = 2.5625 bpw, which moves that mix's mean to 1.960 MiB.
# With one IQ3_S layer turned into IQ2_S the mean is 2,048,000 B = 1.953 MiB, matching the observed arena
# mean (46.84 GiB / 24,576 experts = 1.952 MiB) and the sized-slot ratios (1.94 +- 0.01 MiB, §2.3); the
# largest blob stays IQ4_XS + IQ4_NL = 2,662,400 B, the observed max_blob.
# Placement (deterministic, our choice): the richest types go to the layers nearest either end, edges
# first (0, 47, 1, 46, 2, ...), as llama.cpp's quantizer gives extra bits to the first and last layers.
_QWEN38_MIX = (("IQ4_XS", 2), ("IQ3_S", 3), ("IQ3_XXS", 6), ("IQ2_S", 37))


def _q4_k_m(n_blocks: int) -> Recipe:
    """llama.cpp's Q4_K_M for expert tensors: Q4_K gate and up; ffn_down at Q6_K in the blocks use_more_bits picks
    (the first and last eighth and every third block between), else Q4_K (src/llama-quant.cpp, llama_tensor_get_type;
    the layer counted as the block, which the ffn_down_exps tensors of an all-MoE model share)."""
    def more_bits(block: int) -> bool:
        eighth = n_blocks // 8
        return block < eighth or block >= 7 * n_blocks // 8 or (block - eighth) % 3 == 2

    return lambda block: ("Q4_K", "Q4_K", "Q6_K" if more_bits(block) else "Q4_K")


# llama.cpp's quantiser falls back when a tensor's rows are not a whole number of 256-weight super-blocks (its ne[0]
# % QK_K != 0): Q4_K becomes Q5_0, Q6_K Q8_0 (src/llama-quant.cpp, llama_tensor_get_type's fallback switch; ik_llama.cpp
# keeps the same two).
_K_QUANT_FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}


def _with_fallback(recipe: Recipe, expert_width: int) -> Recipe:
    """A k-quant recipe as llama.cpp writes it where ffn_down's rows (expert_width weights) hold no whole super-block."""
    if expert_width % 256 == 0:
        return recipe

    def quantised(block: int) -> tuple[str, str, str]:
        gate, up, down = recipe(block)
        return gate, up, _K_QUANT_FALLBACK.get(down, down)

    return quantised


def _edges_first_recipe(n_blocks: int, mix: tuple[tuple[str, int], ...], down: str) -> Recipe:
    order = [block for pair in zip(range(n_blocks), reversed(range(n_blocks))) for block in pair]
    order = list(dict.fromkeys(order))  # drop the repeats once the two ends meet
    types = [t for t, count in mix for _ in range(count)]
    assert len(types) == n_blocks, "the mix must cover every layer"
    by_block = dict(zip(order, types))
    return lambda block: (by_block[block], by_block[block], down)


PRESETS: MappingProxyType[str, ModelLayout] = MappingProxyType({layout.name: layout for layout in (
    _layout("deepseek-v4-flash-q2", _FLASH_SOURCE.format("q2-imatrix: IQ2_XXS gate/up, Q2_K down"),
            **_FLASH, recipe=_DS4_Q2),
    _layout("deepseek-v4-flash-q2-q4",
            _FLASH_SOURCE.format("q2-q4-imatrix: layers 37-42 Q4_K gate/up/down, others IQ2_XXS gate/up + Q2_K down"),
            **_FLASH, recipe=lambda block: ("Q4_K",) * 3 if block in _DS4_Q4_LAYERS else _DS4_Q2(block)),
    _layout("deepseek-v4-flash-q4", _FLASH_SOURCE.format("q4-imatrix: Q4_K gate/up/down"),
            **_FLASH, recipe=_uniform("Q4_K", "Q4_K")),
    # DeepSeek-V4-Pro: ds4-engine.md §2.1 (DS4_SHAPE_PRO, ds4.c L214): 61 blocks (3 hash-routed, all MoE),
    # 384 experts, top-6, 1 shared, n_embd 7168, n_ff_exp 3072. No Pro GGUF recipe is documented; we reuse
    # the Flash q2 recipe (IQ2_XXS gate/up, Q2_K down).
    _layout("deepseek-v4-pro",
            "ds4-engine.md §2.1 (DS4_SHAPE_PRO, antirez/ds4 @80ebbc3); hardware-and-gguf.md §4; "
            "quant: the ds4 Flash q2 recipe (IQ2_XXS gate/up, Q2_K down) applied to Pro, our choice",
            n_blocks=61, n_experts=384, top_k=6, n_shared=1, hidden=7168, expert_width=3072, recipe=_DS4_Q2),
    # DeepSeek-V4.1-Flash as ds4 runs it (DS4_SHAPE_FLASH41: upstream tests and a transcription of the shape table,
    # indexed copy 70323830557; ds4_deepseek41_gpu.h @ 30ac654): 40 layers, all routed, no hash-routed layers, 384
    # experts, top-6, 1 shared, n_embd 5120, n_ff_exp 2304. The Q2 GGUF: IQ2_XXS gate/up, Q2_K down (strix-llama.cpp
    # #48 on the published file): 9,953,280 B per expert, "about 9.5 MB each at Q2" (antirez/ds4 PR #1082).
    _layout("deepseek-v4.1-flash-q2",
            "DS4_SHAPE_FLASH41 (antirez/ds4 tests; a transcription of the shape table, indexed copy 70323830557); "
            "the Q2 GGUF's IQ2_XXS gate/up + Q2_K down (strix-llama.cpp#48), 9,953,280 B per expert (ds4 PR #1082: "
            "'about 9.5 MB each')",
            n_blocks=40, n_experts=384, top_k=6, n_shared=1, hidden=5120, expert_width=2304, recipe=_DS4_Q2),
    _layout("qwen3.8-flash-next-iq3s",
            "strata-engine.md §2.1-2.2 (geometry, IQ3_S pack max blob 2,662,400 B, mean ~1.95 MiB); "
            "per-layer mix 37 IQ2_S / 6 IQ3_XXS / 3 IQ3_S / 2 IQ4_XS gate/up + IQ4_NL down, edges first: "
            "a stand-in fitted to the observed mean, not the file's table",
            n_blocks=48, n_experts=512, top_k=10, n_shared=1, hidden=2560, expert_width=640,
            recipe=_edges_first_recipe(48, _QWEN38_MIX, "IQ4_NL"), fused_gate_up=True),
    # The same geometry in Strata's other packs (strata-engine.md §2.2). Q2_0 canonical pack: every blob
    # 1,382,400 B (experts.bin = 48 x 512 x 1,382,400 B [code]) = Q2_0 gate/up and down.
    _layout("qwen3.8-flash-next-q2_0",
            "strata-engine.md §2.1-2.2: the Q2_0 canonical pack, uniform 1,382,400 B blobs (2.25 bpw)",
            n_blocks=48, n_experts=512, top_k=10, n_shared=1, hidden=2560, expert_width=640,
            recipe=_uniform("Q2_0", "Q2_0"), fused_gate_up=True),
    # IQ3_XXS pack: mean 1.665 MiB (arena 40,925 MiB / 24,576), per-layer types not published. Stand-in: IQ2_XXS
    # gate/up + IQ4_NL down (1,766,400 B) in 46 layers and IQ2_XXS + Q2_0 down (1,305,600 B) in the two edge
    # layers: mean 1,747,200 B = 1.6663 MiB, fitted to the arena's mean as the IQ3_S stand-in is.
    _layout("qwen3.8-flash-next-iq3xxs",
            "strata-engine.md §2.2 (IQ3_XXS pack mean 1.665 MiB, arena 40,925 MiB); per-layer mix 46 x IQ2_XXS "
            "gate/up + IQ4_NL down, 2 edge layers IQ2_XXS + Q2_0 down: a stand-in fitted to the mean",
            n_blocks=48, n_experts=512, top_k=10, n_shared=1, hidden=2560, expert_width=640,
            recipe=lambda block: ("IQ2_XXS", "IQ2_XXS", "Q2_0" if block in (0, 47) else "IQ4_NL"),
            fused_gate_up=True),
    # IQ2_XS (GSQ-RCO) pack: "34 GB experts.bin" and 12,702 slots = 17.02 GiB (1.372 MiB per hot slot) in the
    # S10 report (indexed copy 70653081590); per-layer types not published. Stand-in: IQ2_XS gate/up + Q2_0 down
    # (640-weight rows hold no 256-weight block) in every layer: 1,408,000 B = 1.343 MiB, 34.6 GB for 24,576 blobs.
    _layout("qwen3.8-flash-next-iq2xs",
            "S10 report (IQ2_XS native pack, 34 GB experts.bin, 17.02 GiB for 12,702 slots); IQ2_XS gate/up + Q2_0 "
            "down in every layer: a stand-in for the unpublished per-layer types",
            n_blocks=48, n_experts=512, top_k=10, n_shared=1, hidden=2560, expert_width=640,
            recipe=_uniform("IQ2_XS", "Q2_0"), fused_gate_up=True),
    # Huihui IQ3_S/IQ4_NL pack: 2.2217 MiB per slot (1,900 slots = 4,221 MiB, strata-engine.md §2.2) = IQ3_S
    # gate/up + IQ4_NL down in every layer (2,329,600 B = 2.2217 MiB).
    _layout("qwen3.8-flash-next-huihui-iq3s",
            "strata-engine.md §2.2 (Huihui IQ3_S/IQ4_NL, 2.2217 MiB per slot): IQ3_S gate/up + IQ4_NL down",
            n_blocks=48, n_experts=512, top_k=10, n_shared=1, hidden=2560, expert_width=640,
            recipe=_uniform("IQ3_S", "IQ4_NL"), fused_gate_up=True),
    # Qwen3-30B-A3B: hardware-and-gguf.md §4 (InferSim qwen3-30B-A3B_config.json): 48 layers, 128 experts,
    # top-8, no shared, hidden 2048, moe width 768.
    _layout("qwen3-30b-a3b",
            "hardware-and-gguf.md §4 (alibaba/InferSim qwen3-30B-A3B_config.json); quant: Q4_K gate/up + "
            "Q6_K down, our Q4_K_M-like choice",
            n_blocks=48, n_experts=128, top_k=8, n_shared=0, hidden=2048, expert_width=768, recipe=_Q4_K_M_LIKE),
    # The same geometry as llama.cpp quantises a Q4_K_M file (AlexsJones/llmfit #755, validation case L10).
    _layout("qwen3-30b-a3b-q4_k_m",
            "hardware-and-gguf.md §4 (alibaba/InferSim qwen3-30B-A3B_config.json); quant: llama.cpp's Q4_K_M rule for "
            "the expert tensors",
            n_blocks=48, n_experts=128, top_k=8, n_shared=0, hidden=2048, expert_width=768, recipe=_q4_k_m(48)),
    # Qwen3-Next-80B-A3B: hardware-and-gguf.md §4 (InferSim qwen3-next-80B-A3B_config.json): 48 layers,
    # 512 experts, top-10, 1 shared (resident), hidden 2048, moe width 512.
    _layout("qwen3-next-80b-a3b",
            "hardware-and-gguf.md §4 (alibaba/InferSim qwen3-next-80B-A3B_config.json); quant: Q4_K gate/up + "
            "Q6_K down, our Q4_K_M-like choice",
            n_blocks=48, n_experts=512, top_k=10, n_shared=1, hidden=2048, expert_width=512, recipe=_Q4_K_M_LIKE),
    # Mixtral-8x7B: hardware-and-gguf.md §4 (keras-hub mixtral README): 32 layers, 8 experts, top-2,
    # hidden 4096, width 14336.
    _layout("mixtral-8x7b",
            "hardware-and-gguf.md §4 (keras-team/keras-hub mixtral README); quant: Q4_K gate/up + Q6_K down, "
            "our Q4_K_M-like choice",
            n_blocks=32, n_experts=8, top_k=2, n_shared=0, hidden=4096, expert_width=14336, recipe=_Q4_K_M_LIKE),
    # Mixtral-8x7B's Q4_K_M file of its day (llama.cpp #4729, January 2024; validation case L24): TheBloke's 26.4 GB
    # over 46.7 B parameters is 4.52 bits a weight, which leaves the experts at Q4_K (4.5) throughout [E from M]; a
    # later quantiser's Q6_K ffn_down (the use_more_bits rule) would not fit that file.
    _layout("mixtral-8x7b-q4_k_m",
            "hardware-and-gguf.md §4 (keras-team/keras-hub mixtral README); quant: Q4_K experts, as the 26.4 GB "
            "Q4_K_M file of early 2024 (TheBloke/Mixtral-8x7B-v0.1-GGUF) holds them",
            n_blocks=32, n_experts=8, top_k=2, n_shared=0, hidden=4096, expert_width=14336,
            recipe=_uniform("Q4_K", "Q4_K")),
    # OLMoE-1B-7B: hardware-and-gguf.md §4 (GPULlama3 OlmoeConfiguration): 16 layers, 64 experts, top-8,
    # hidden 2048, width 1024 (the checkpoint's value, not transformers' default 2048).
    _layout("olmoe-1b-7b",
            "hardware-and-gguf.md §4 (beehive-lab GPULlama3 OlmoeConfiguration); quant: Q4_K gate/up + Q6_K "
            "down, our Q4_K_M-like choice",
            n_blocks=16, n_experts=64, top_k=8, n_shared=0, hidden=2048, expert_width=1024, recipe=_Q4_K_M_LIKE),
    # GLM-5.2: ds4-engine.md §2.4 (DS4_SHAPE_GLM52 in giannisanni/neutronstar ds4.c L271) and
    # hardware-and-gguf.md §4: 79 blocks = 3 dense + 75 routed + MTP blk.78, 256 experts, top-8, 1 shared,
    # n_embd 6144, n_ff_exp 2048. neutronstar's recipe: uniform IQ2_XXS, blk.78 at Q2_K (a size class of its own).
    _layout("glm-5.2",
            "ds4-engine.md §2.4 (DS4_SHAPE_GLM52, giannisanni/neutronstar; recipe uniform IQ2_XXS, MTP blk.78 "
            "Q2_K); hardware-and-gguf.md §4",
            n_blocks=79, n_experts=256, top_k=8, n_shared=1, hidden=6144, expert_width=2048,
            recipe=lambda block: ("Q2_K",) * 3 if block == 78 else ("IQ2_XXS",) * 3,
            dense=range(0, 3), mtp=range(78, 79)),
    # GLM-5.1: GLM-5.2's geometry (hardware-and-gguf.md §4 lists GLM-5 / 5.1 / 5.2 as one: 78 blocks + the MTP block
    # 78, 0-2 dense, 256 experts, top-8, 1 shared, 6144 x 2048). As ubergarm's IQ3_KS file (320.216 GiB, 3.65 BPW;
    # ik_llama.cpp, validation case L13): ik_llama.cpp's own IQ3_KS gate/up and IQ4_KS down, the routed experts of
    # ubergarm's IQ3_KS recipes [E: the GLM-5.1 file's recipe was not read; 3.55 bpw a routed weight, 303.4 GiB with
    # the MTP block's, which leaves the file 16.8 GiB for its ~19 B non-routed weights (the BF16 file's 1404.4 GiB at
    # 16.003 BPW, less 734.5 B routed), ~7.4 bpw]. Only ik_llama.cpp loads it.
    _layout("glm-5.1-iq3_ks",
            "hardware-and-gguf.md §4 (GLM-5 / 5.1 / 5.2: 78 blocks + MTP, 3 dense, 256 x top-8, 6144 x 2048); quant: "
            "ik_llama.cpp's IQ3_KS gate/up + IQ4_KS down, ubergarm's IQ3_KS recipe for routed experts (llamacpp-engine.md "
            "§11 P13)",
            n_blocks=79, n_experts=256, top_k=8, n_shared=1, hidden=6144, expert_width=2048,
            recipe=_uniform("IQ3_KS", "IQ4_KS"), dense=range(0, 3), mtp=range(78, 79)),
    # gpt-oss-120b: hardware-and-gguf.md §4 (transformers GptOssConfig): 36 layers, 128 experts, top-4,
    # hidden 2880, width 2880. Experts ship as MXFP4 (2880 is not a multiple of 256, §3.1). The per-expert
    # f32 biases (3 x 2880 x 4 B, 0.3 % of an expert) are not counted.
    _layout("gpt-oss-120b",
            "hardware-and-gguf.md §3.1 (MXFP4 experts) and §4 (transformers GptOssConfig)",
            n_blocks=36, n_experts=128, top_k=4, n_shared=0, hidden=2880, expert_width=2880,
            recipe=_uniform("MXFP4", "MXFP4")),
    # Qwen3.6-35B-A3B: the Qwen3.5-35B-A3B geometry (hardware-and-gguf.md §4, alibaba/InferSim
    # qwen3.5-35B-A3B_config.json: 40 layers, 256 experts, top-8, 1 shared of width 512, hidden 2048, moe width 512);
    # the 3.6 release's 256 experts per layer (llamacpp-engine.md §11 P22) agree, the rest is assumed unchanged.
    _layout("qwen3.6-35b-a3b",
            "hardware-and-gguf.md §4 (the Qwen3.5-35B-A3B config; 3.6 assumed the same); quant: llama.cpp's Q4_K_M rule "
            "for the expert tensors",
            n_blocks=40, n_experts=256, top_k=8, n_shared=1, hidden=2048, expert_width=512, recipe=_q4_k_m(40)),
    # Qwen3.5-35B-A3B itself (the config the Qwen3.6 preset takes; validation case L11): the same Q4_K_M rule.
    _layout("qwen3.5-35b-a3b",
            "hardware-and-gguf.md §4 (alibaba/InferSim qwen3.5-35B-A3B_config.json); quant: llama.cpp's Q4_K_M rule "
            "for the expert tensors",
            n_blocks=40, n_experts=256, top_k=8, n_shared=1, hidden=2048, expert_width=512, recipe=_q4_k_m(40)),
    # The same model's Q8_0 file (ik_llama.cpp #2262, validation case L07): every expert tensor Q8_0.
    _layout("qwen3.6-35b-a3b-q8_0",
            "hardware-and-gguf.md §4 (the Qwen3.5-35B-A3B config; 3.6 assumed the same); quant: Q8_0 expert tensors "
            "(a Q8_0 file)",
            n_blocks=40, n_experts=256, top_k=8, n_shared=1, hidden=2048, expert_width=512,
            recipe=_uniform("Q8_0", "Q8_0")),
    # GLM-4.7-Flash: hardware-and-gguf.md §4 (THUDM/slime glm4.7-30B-A3B.sh): 47 layers, block 0 dense, 64 experts,
    # top-4, 1 shared, hidden 2048, moe width 1536.
    _layout("glm-4.7-flash",
            "hardware-and-gguf.md §4 (THUDM/slime scripts/models/glm4.7-30B-A3B.sh); quant: llama.cpp's Q4_K_M rule "
            "for the expert tensors",
            n_blocks=47, n_experts=64, top_k=4, n_shared=1, hidden=2048, expert_width=1536, recipe=_q4_k_m(47),
            dense=range(0, 1)),
    # DeepSeek-V2-Lite (deepseek2, 15.7 B): 27 blocks, block 0 dense (first_k_dense_replace = 1), 64 routed experts,
    # top-6, 2 shared, n_embd 2048, moe width 1408 (its GGUF's metadata as llama.cpp prints it, ggml-org/llama.cpp PR
    # #7519; routing-traces.md §6). As a Q4_K_M file (ik_llama.cpp #232, validation case L06): the Q4_K_M rule over its
    # 27 blocks, ffn_down's 1408-weight rows falling back to Q5_0 and Q8_0.
    _layout("deepseek-v2-lite-q4_k_m",
            "DeepSeek-V2-Lite's GGUF metadata (ggml-org/llama.cpp PR #7519: block_count 27, embedding_length 2048) and "
            "routing-traces.md §6 (64 routed, top-6, 2 shared, the first block dense); quant: llama.cpp's Q4_K_M rule, "
            "ffn_down falling back to Q5_0 / Q8_0 (1408 is no multiple of 256)",
            n_blocks=27, n_experts=64, top_k=6, n_shared=2, hidden=2048, expert_width=1408,
            recipe=_with_fallback(_q4_k_m(27), 1408), dense=range(0, 1)),
    # DeepSeek-V3.2 (deepseek2 with DSA's indexer; DeepSeek-V3's geometry, hardware-and-gguf.md §4): 61 blocks, 0-2 dense,
    # 256 routed experts, top-8, 1 shared, n_embd 7168, moe width 2048, and the MTP block 61 that its 685.36 B
    # parameters count (671 B + the MTP module [D]). As a Q8_0 file (llama.cpp PR #23346, validation case L19): every
    # expert tensor Q8_0.
    _layout("deepseek-v3.2-q8_0",
            "hardware-and-gguf.md §4 (DeepSeek-V3/R1 geometry: 61 blocks, 3 dense, 256 x top-8, 1 shared, 7168 x 2048); "
            "the MTP block 61 in the file (685.36 B parameters, llamacpp-engine.md §11 P19); quant: Q8_0 experts",
            n_blocks=62, n_experts=256, top_k=8, n_shared=1, hidden=7168, expert_width=2048,
            recipe=_uniform("Q8_0", "Q8_0"), dense=range(0, 3), mtp=range(61, 62)),
    # gpt-oss-20b: hardware-and-gguf.md §4 (EchoCog/gpt-oss-20b architecture notes): 24 layers, 32 experts, top-4,
    # hidden 2880, width 2880, the same MXFP4 experts (12.61 MiB each, §4.1); biases not counted, as for 120b.
    _layout("gpt-oss-20b",
            "hardware-and-gguf.md §3.1 (MXFP4 experts) and §4 (EchoCog/gpt-oss-20b docs/gpt-oss-20b-architecture.md)",
            n_blocks=24, n_experts=32, top_k=4, n_shared=0, hidden=2880, expert_width=2880,
            recipe=_uniform("MXFP4", "MXFP4")),
)})


def preset_names() -> list[str]:
    return sorted(PRESETS)


def get_preset(name: str) -> ModelLayout:
    try:
        return PRESETS[name]
    except (KeyError, TypeError):
        raise InputError("model preset", "name", name, f"unknown; valid: {', '.join(preset_names())}") from None
