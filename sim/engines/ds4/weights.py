"""The non-routed weights of ds4's model files, and the bytes a decoded token reads in each layer."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sim.units import GIB

# DeepSeek-V4-Flash's non-routed weights: "non-routed weights: 8.20 GiB" (antirez/ds4#488, ds4-engine.md §2.3).
FLASH_NON_ROUTED_GIB = 8.20
# DeepSeek-V4.1-Flash's: "V4.1 SSD prepared 9.37 GiB static weights" (the ROCm planner's line, antirez/ds4 PR #1036).
V41_NON_ROUTED_GIB = 9.37

# GLM-5.2's non-routed weights, [derived] from public geometry at the ds4 file's quants (no published
# figure of the GGUF's non-routed bytes is in our notes).
# Geometry: hardware-and-gguf.md §4 (hidden 6144, 64 heads MLA, dense FFN 12288, vocab 154,880, 3 dense +
# 75 MoE layers + 1 MTP, 256 experts, 1 shared expert of width 2048); MLA ranks from slime/miles
# scripts/models/glm5-744B-A40B.sh (q-lora 2048, kv-lora 512, qk head 192 + rope 64, v head 256); the DSA
# indexer from the GLM-5.2 config (index_n_heads 32, index_head_dim 128, index_topk_freq 4,
# index_skip_topk_offset 3; quoted in miles' GLM-5.2 launcher), whose weights exist only in the layers that
# compute the index: blocks 1-3 and every 4th after (1-based), 21 of 78, plus the MTP block.
# Check: these counts give 753.33 B parameters; at BF16 (router bias F32) that is 1,506,659,919,872 B,
# exactly the GLM-5.2 checkpoint's safetensors total_size (quoted in the same launcher and in GLM-5.2
# manifest tests); the 744 B headline is the same count without the MTP block.
# Quants: "everything that makes decisions stays at Q8_0/F32" (neutronstar README, the ds4 GLM-5.2 file):
# every 2-D non-routed matrix Q8_0, every 1-D tensor (norms, biases) F32, the MTP eh_proj Q8_0
# (neutronstar docs/glm-mtp-port.md); the MTP block shares the embedding and output head. Result: 18.70
# GiB. The README's "196.6 GiB file" less the routed bytes (176.98 GiB, block table) implies 19.62 GiB:
# the recipe keeps ~0.9 GiB more above Q8_0 than this derivation.
GLM52_MLA = dict(q_lora=2048, kv_lora=512, heads=64, qk_nope=192, qk_rope=64, v_head=256)
GLM52_DENSE_FFN = 12288
GLM52_VOCAB = 154_880
GLM52_INDEXER = dict(heads=32, head_dim=128, every=4, first=3)
FLASH_VOCAB = 129_280  # DS4_N_VOCAB
FLASH_EMBEDDING_BYTES = FLASH_VOCAB * 4096 * 2  # the F16 token embedding: only one row is read per token


def _q(type_name: str, n_weights: int) -> int:
    from sim.model.quant import QUANT_TYPES

    t = QUANT_TYPES[type_name]
    return n_weights // t.block_weights * t.block_bytes


def _glm52_layer_bytes(hidden: int, n_experts: int, width: int, moe: bool, indexer: bool) -> int:
    m = GLM52_MLA
    mats = [hidden * m["q_lora"], m["q_lora"] * m["heads"] * (m["qk_nope"] + m["qk_rope"]),
            hidden * (m["kv_lora"] + m["qk_rope"]), m["kv_lora"] * m["heads"] * (m["qk_nope"] + m["v_head"]),
            m["heads"] * m["v_head"] * hidden]
    vecs = [m["q_lora"], m["kv_lora"], hidden, hidden]  # q_a_norm, kv_a_norm, attention and FFN norms
    if indexer:
        ix = GLM52_INDEXER
        mats += [m["q_lora"] * ix["heads"] * ix["head_dim"], hidden * ix["head_dim"], hidden * ix["heads"]]
        vecs += [ix["head_dim"], ix["head_dim"]]  # k norm weight and bias
    if moe:
        mats += [3 * hidden * width, hidden * n_experts]  # one shared expert, the router
        vecs += [n_experts]  # router bias (e_score_correction)
    else:
        mats += [3 * hidden * GLM52_DENSE_FFN]
    return sum(_q("Q8_0", n) for n in mats) + sum(_q("F32", n) for n in vecs)


def glm52_non_routed_bytes(layout) -> int:
    """Non-routed bytes of the ds4 GLM-5.2 file (main blocks, MTP glue, embedding, head): see above."""
    ix = GLM52_INDEXER
    n_main = layout.n_blocks - layout.n_mtp_layers
    total = 0
    for block in range(n_main):
        one_based = block + 1
        indexer = one_based <= ix["first"] or (one_based - ix["first"]) % ix["every"] == 0
        total += _glm52_layer_bytes(layout.hidden, layout.n_experts, layout.expert_width,
                                    block not in layout.dense_blocks, indexer)
    for _ in range(layout.n_mtp_layers):  # a full MoE block with its indexer, plus eh_proj and 3 norms
        total += _glm52_layer_bytes(layout.hidden, layout.n_experts, layout.expert_width, True, True)
        total += _q("Q8_0", 2 * layout.hidden * layout.hidden) + _q("F32", 3 * layout.hidden)
    return total + 2 * _q("Q8_0", GLM52_VOCAB * layout.hidden) + _q("F32", layout.hidden)  # embd, head, norm


def shared_expert_bytes(layout) -> int:
    """One layer's shared expert(s): Q8_0 gate, up and down of the routed experts' width (ds4-engine.md §2.1:
    "Q8_0, 4096->2048->4096, about 25.5 MiB per layer")."""
    return layout.n_shared_experts * _q("Q8_0", 3 * layout.hidden * layout.expert_width)


def non_routed_bytes(layout, family: str) -> int:
    if family == "deepseek-v4.1":
        return int(V41_NON_ROUTED_GIB * GIB)
    return int(FLASH_NON_ROUTED_GIB * GIB) if family == "deepseek-v4" else glm52_non_routed_bytes(layout)


# ------------------------------------------------------------------------------------------ work per layer


def embedding_bytes(layout, family: str) -> int:
    """The token embedding, of which a token reads one row: F16 in the Flash files (ds4-engine.md §2.3; V4.1's
    vocabulary is V4's, its F16 embedding assumed as well), Q8_0 in the GLM-5.2 file (see glm52_non_routed_bytes)."""
    if family in ("deepseek-v4", "deepseek-v4.1"):
        return FLASH_VOCAB * layout.hidden * 2
    return _q("Q8_0", GLM52_VOCAB * layout.hidden)


def decode_bytes_by_layer(layout, family: str, layers: Sequence[int]) -> np.ndarray:
    """[layer, 3] bytes a decoded token reads in each layer: the attention/router/norm part (the non-routed
    weights less the embedding, spread evenly over the routed layers, less the shared expert), the shared
    expert, and top_k routed experts of the layer. Decode is memory-bound, so these bytes split a token's GPU
    time between the parts (and prefill's, for want of a finer figure)."""
    n = layout.n_routed_layers
    shared = shared_expert_bytes(layout)
    other = max((non_routed_bytes(layout, family) - embedding_bytes(layout, family)) / n - shared, 0.0)
    return np.array([[other, shared, layout.top_k * layout.layers[i].expert_bytes] for i in layers], np.float64)
