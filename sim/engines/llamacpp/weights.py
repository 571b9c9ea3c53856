"""What a llama.cpp run holds besides the routed experts, per model file: the weights it loads to the GPU (every
tensor but the routed experts and the token embedding: llama.cpp keeps the input layer on the CPU, where a token
reads one row of it), and what its attention costs per position of context (`Attention`). Only files with a sourced
figure are run; another model is refused naming these.

The GPU's time for those weights comes from the machine: in decode a layer streams its share of them (the output
projection once a token), and the K/V of the positions it attends to, out of VRAM (Machine.vram_read_s); in a prompt
ubatch the profile's prompt figure for the model class is split between them and the routed experts by bytes, and the
attention over the context adds its FLOPs at the GPU's measured attention rate, else at that figure's time per FLOP
(Machine.attention_s; the reference's §9: no per-op figure of llama.cpp's kernels is published).
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.errors import InputError
from sim.hardware import Compute
from sim.model.quant import tensor_bytes
from sim.units import GIB, MIB

F16_BYTES = 2  # llama.cpp's default K/V cache type (-ctk/-ctv f16)
QWEN_VOCAB = 248_320  # Qwen3.8-Flash-Next's vocabulary (strata-engine.md §2.1), taken for Qwen3.6 too [E]
GPT_OSS_VOCAB = 201_088  # gpt-oss's o200k_harmony vocabulary
QWEN3_VOCAB = 151_936  # Qwen3's (tokenizer.ggml.tokens arr[str,151936] in a Qwen3 GGUF's load log, ollama#10740)


@dataclass(frozen=True)
class Attention:
    """What a token's context costs in the attention layers: the K/V bytes each caches per token (F16), how many
    layers attend to every past position and how many to a window of the last `window`, and, for the prompt, the
    FLOPs of one query against one past position (QK and AV: 2 x 2 x query heads x head_dim) with the matmul weights a
    token passes through per layer (its active parameters), which the profile's prompt figure is the time of."""

    kv_bytes_per_token_layer: int
    full_layers: int
    window_layers: int = 0
    window: int = 0
    flops_per_position: int | None = None  # None: the prompt's attention is not priced (its head layout not held)
    active_params_per_layer: float | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes_per_token_layer * (self.full_layers + self.window_layers)

    def cache_bytes(self, ctx: int, ubatch: int) -> int:
        """The K/V cache llama.cpp allocates: every position of the context in a full-attention layer, the window and a
        ubatch in a window layer (its SWA cache; --swa-full would give those the context too) [E from C: the iSWA
        cache's size is read from the flag's help, not from the code]."""
        per_layer = self.kv_bytes_per_token_layer
        return per_layer * (self.full_layers * ctx + self.window_layers * min(ctx, self.window + ubatch))

    def positions(self, first: int, n: int) -> float:
        """Layer-positions that queries at positions first .. first+n-1 attend to, each to itself and what precedes
        it (a window layer to at most `window` of them)."""
        full = n * first + n * (n + 1) / 2
        below = max(0, min(first + n, self.window) - first)  # queries whose window is not full yet
        capped = below * first + below * (below + 1) / 2 + (n - below) * self.window
        return self.full_layers * full + self.window_layers * capped


@dataclass(frozen=True)
class FileWeights:
    gpu_bytes: int  # every tensor but the routed experts and the token embedding
    attention: Attention
    state_bytes: int  # fixed recurrent state (linear-attention layers), independent of the context
    vocab: int  # rows of the output projection: a ubatch's logits are vocab x tokens fp32
    output_bytes: int  # the output projection (vocab x hidden), one of gpu_bytes: on the CPU with -ngl 0
    source: str

    @property
    def kv_bytes_per_token(self) -> int:
        return self.attention.kv_bytes_per_token


# 12 QSA layers x 2 KV heads x head_dim 256 x K,V; a query reads the ~2,048 cells QSA selects (strata-engine.md §2.1),
# taken as a window of 2,048 [E: the indexer's pass over every cell is not priced]
_QWEN38_ATTENTION = Attention(2 * 256 * 2 * F16_BYTES, 0, 12, 2048)
_QWEN38_STATE = 36 * 3 * MIB  # 36 GDN layers, ~3 MiB of state each (strata-engine.md §2.1)
# the output head of the IQ2_XS pack's 3,263 MiB of dense weights (record strata-decode-layer-latency's RTX 3060 log),
# taken for every pack [E from M]
_QWEN38_HEAD_MIB = 322
_QWEN38_SOURCE = ("[M] the same GGUF's non-expert tensors as Strata's logs load them (1,466 MiB of weights + the "
                  "projections + the output head, sim/engines/strata/memory.py PACK_WEIGHTS; strata-engine.md §2.1 "
                  "for the 12 QSA layers' 2 KV heads of 256 and the 36 GDN layers' ~3 MiB of state)")


def _mla(layers: int, heads: int | None = None, active_params: float | None = None) -> Attention:
    """DeepSeek's MLA as llama.cpp caches it: a 512-wide latent and 64 rope dims per token and layer (F16); a query
    scores 576 dims and reads 512 a head. Without the head count the prompt's attention is not priced."""
    if heads is None:
        return Attention((512 + 64) * F16_BYTES, layers,
                         active_params_per_layer=None if active_params is None else active_params / layers)
    return Attention((512 + 64) * F16_BYTES, layers, flops_per_position=2 * heads * (576 + 512),
                     active_params_per_layer=active_params / layers)


# Files of llamacpp-engine.md §11: the file less the preset's expert tensors and the token embedding (the file type's
# type [E]; vocabularies: Qwen's 248,320 rows as Qwen3.8's (strata-engine.md §2.1) [E], GLM-4.7-Flash's 154,880,
# hardware-and-gguf.md §4) is the rest. K/V at F16: Qwen3.6-35B-A3B has Qwen3.5's hybrid layout (a quarter of its 40
# layers full attention, 2 KV heads of 256, as Qwen3-Next's full_attention_interval 4 and 2 KV heads of 256,
# hardware-and-gguf.md §4 [E]); GLM-4.7-Flash is MLA (a 512-wide latent + 64 rope dims cached per layer, as DeepSeek's
# MLA [E]) in 47 layers.
_QWEN36_ATTENTION = Attention(2 * 256 * 2 * F16_BYTES, 10, flops_per_position=4 * 16 * 256,
                              active_params_per_layer=3e9 / 40)
_QWEN36_HEADS = "16 query heads of 256 as Qwen3-Next [E]; 3 B active (A3B) over 40 layers"
# Qwen3.6-35B-A3B has 35.51 B parameters as llama-bench prints them (ggml-org/llama.cpp PR #26678, its UD-Q4_K_M
# file); a Q8_0 file stores them at 34 bytes per 32 weights (GGML's block table; norms and the small recurrent tensors
# at F32 are neglected) [D]
_QWEN36_Q8_0_GIB = 35.51e9 * 34 / 32 / GIB
_FILES = {
    "qwen3.6-35b-a3b": (21.1, QWEN_VOCAB, _QWEN36_ATTENTION, "Q4_K",
                        "[M] Qwen3.6-35B-A3B Q4_K_M 21.1 GiB (thecodacus/llama.cpp PR #5, llamacpp-engine.md §11 P22); "
                        + _QWEN36_HEADS),
    "qwen3.6-35b-a3b-q8_0": (_QWEN36_Q8_0_GIB, QWEN_VOCAB, _QWEN36_ATTENTION, "Q8_0",
                             f"[D] Qwen3.6-35B-A3B Q8_0 {_QWEN36_Q8_0_GIB:.2f} GiB: 35.51 B parameters (llama-bench, "
                             f"ggml-org/llama.cpp PR #26678) at Q8_0's 8.5 bits; " + _QWEN36_HEADS),
    "qwen3-30b-a3b-q4_k_m": (17.28, QWEN3_VOCAB,
                             Attention(4 * 128 * 2 * F16_BYTES, 48, flops_per_position=4 * 32 * 128,
                                       active_params_per_layer=3e9 / 48), "Q4_K",
                             "[M] Qwen3-30B-A3B Q4_K_M 17.28 GiB as llama-bench prints it ('qwen3moe 30B.A3B Q4_K - "
                             "Medium | 17.28 GiB | 30.53 B' in published tables, indexed copies 68998277046, "
                             "43444007762); 32 query heads and 4 KV heads of 128 in 48 full-attention layers "
                             "(hardware-and-gguf.md §4); 3 B active (A3B) over 48 layers"),
    "qwen3.5-35b-a3b": (20.49, QWEN_VOCAB, _QWEN36_ATTENTION, "Q4_K",
                        "[M] Qwen3.5-35B-A3B Q4_K_M 20.49 GiB (kenimoto.dev, llamacpp-engine.md §11 P11); "
                        + _QWEN36_HEADS),
    "mixtral-8x7b-q4_k_m": (26.4e9 / GIB, 32_000,
                            Attention(8 * 128 * 2 * F16_BYTES, 32, flops_per_position=4 * 32 * 128,
                                      active_params_per_layer=12.9e9 / 32), "Q4_K",
                            "[M] mixtral-8x7b-v0.1.Q4_K_M.gguf 26.4 GB (TheBloke/Mixtral-8x7B-v0.1-GGUF's listing, "
                            "indexed copy 57454187032); 32 query heads and 8 KV heads of 128 in 32 full-attention "
                            "layers, 12.9 B active (hardware-and-gguf.md §4); Mistral's 32,000-token vocabulary"),
    "deepseek-v2-lite-q4_k_m": (9.78, 102_400, _mla(27), "Q4_K",
                                "[M] DeepSeek-Lite Q4_K_M 9.78 GiB as llama-bench prints it (ik_llama.cpp PR #232, "
                                "llamacpp-engine.md §11 P06); MLA (a 512-wide latent + 64 rope dims cached) in its 27 "
                                "layers, its heads not held: the prompt's attention is not priced; DeepSeek-V2's "
                                "102,400-token vocabulary"),
    "deepseek-v3.2-q8_0": (678.56, 129_280, _mla(61, 128, 37e9), "Q8_0",
                           "[M] DeepSeek-V3.2 Q8_0 678.56 GiB as llama-bench prints it (llama.cpp PR #23346, "
                           "llamacpp-engine.md §11 P19); MLA in 61 layers, 128 query heads (hardware-and-gguf.md "
                           "§4); 37 B active over 61 layers; DeepSeek-V3's 129,280-token vocabulary; DSA's indexer "
                           "not priced (it keeps 2,048 positions: a context up to that attends to all of them)"),
    "glm-5.1-iq3_ks": (320.216, 154_880, _mla(78, 64, 40e9), "Q8_0",
                       "[M] GLM-5.1 IQ3_KS 320.216 GiB (ubergarm's file, loftllc.dev, llamacpp-engine.md §11 P13); "
                       "MLA in its 78 layers, 64 query heads (hardware-and-gguf.md §4: MLA + DSA), the MTP block not "
                       "run; 40 B active over 78 layers; vocabulary 154,880; the token embedding and output taken "
                       "at Q8_0 [E]; DSA's indexer not priced"),
    "glm-4.7-flash": (17.1, 154_880, _mla(47, active_params=3e9), "Q4_K",
                      "[M] GLM-4.7-Flash Q4_K_M 17.1 GiB (thecodacus/llama.cpp PR #6, llamacpp-engine.md §11 P22); its "
                      "MLA heads are not held: the prompt's attention is not priced; ~3 B active over 47 layers "
                      "(hardware-and-gguf.md §4: 31B / 3B)"),
}
# gpt-oss: 64 query heads and 8 KV heads of 64, layers alternating a 128-token sliding window and full attention
# (hardware-and-gguf.md §4); active parameters 3.6 B (20b) and 5.1 B (120b) over 24 and 36 layers (§4).
_GPT_OSS_KV = 8 * 64 * 2 * F16_BYTES


def _embedding(vocab: int, hidden: int, type_name: str) -> int:
    return tensor_bytes(type_name, vocab * hidden, hidden)


def _gpt_oss(file_gib: float, layout, n_layers: int, active_params: float, source: str) -> FileWeights:
    # the file less its routed experts and its token embedding (201,088 x 2880; Q8_0 in the MXFP4 files [E])
    embedding = _embedding(GPT_OSS_VOCAB, layout.hidden, "Q8_0")  # the output projection is taken as the same
    gpu = int(file_gib * GIB) - layout.total_expert_bytes - embedding
    attention = Attention(_GPT_OSS_KV, n_layers // 2, n_layers - n_layers // 2, 128, 4 * 64 * 64,
                          active_params / n_layers)
    return FileWeights(gpu, attention, 0, GPT_OSS_VOCAB, embedding, source)


def file_weights(layout, where: str) -> FileWeights:
    """The figures of the model's file (the module docstring); a model without them is refused."""
    name = layout.name
    if name.startswith("qwen3.8-flash-next"):
        dense = {"qwen3.8-flash-next-iq3s": 3982, "qwen3.8-flash-next-iq2xs": 3263,
                 "qwen3.8-flash-next-iq3xxs": 3664}.get(name, (3982 + 3263 + 3664) // 3)
        return FileWeights(dense * MIB, _QWEN38_ATTENTION, _QWEN38_STATE, QWEN_VOCAB, _QWEN38_HEAD_MIB * MIB,
                           _QWEN38_SOURCE)
    if name == "gpt-oss-120b":
        return _gpt_oss(59.02, layout, 36, 5.1e9,
                        "[M] the MXFP4 GGUF is 59.02 GiB as llama-bench prints it (llamacpp-engine.md §11, ik #683); "
                        "64 heads / 8 KV heads of 64 in 36 layers, half of them a 128-token window (hardware-and-gguf.md "
                        "§4)")
    if name == "gpt-oss-20b":
        return _gpt_oss(11.27, layout, 24, 3.6e9,
                        "[M] the MXFP4 GGUF is 11.27 GiB as llama-bench prints it (llamacpp-engine.md §11, ik #683); "
                        "the same attention as gpt-oss-120b in 24 layers (hardware-and-gguf.md §4)")
    if name in _FILES:
        file_gib, vocab, attention, embedding_type, source = _FILES[name]
        gpu = int(file_gib * GIB) - layout.total_expert_bytes - _embedding(vocab, layout.hidden, embedding_type)
        # llama.cpp's quantiser gives the output projection Q6_K in a K-quant file (src/llama-quant.cpp,
        # llama_tensor_get_type [E from C: not in the reference's reading]); a Q8_0 file keeps Q8_0
        output_type = "Q8_0" if embedding_type == "Q8_0" else "Q6_K"
        return FileWeights(gpu, attention, 0, vocab, _embedding(vocab, layout.hidden, output_type), source)
    raise InputError(where, "model", name, "llama.cpp is modelled for files whose non-expert weights are sourced: "
                                           f"the qwen3.8-flash-next packs, gpt-oss-20b, gpt-oss-120b, "
                                           f"{', '.join(_FILES)}")


# The prompt figure a profile without the model's [compute] table gets: its DeepSeek-V4-Flash figure (every profile
# has one) scaled by active parameters per token and layer, as the profiles' own derived tables are (rtx-4090.toml's
# gpt-oss, rtx-2080-10900x.toml's qwen3-30b-a3b): V4-Flash's 13 B active over its 43 layers (hardware-and-gguf.md §4)
REFERENCE_CLASS = "deepseek-v4-flash"
REFERENCE_ACTIVE_PER_LAYER = 13e9 / 43


def derived_compute(layout, profile):
    """The compute figures of a file the profile has no table for (Engine.derived_compute): the prompt figure of
    its DeepSeek-V4-Flash table times the file's active parameters per layer over V4-Flash's (a prompt's matmuls are
    compute-bound), the same record and calibration flag, the range scaled alike; the per-chunk fixed cost (launches,
    not parameters) as it is. None where the file's active parameters or the reference table are not held."""
    try:
        active = file_weights(layout, "model").attention.active_params_per_layer
    except InputError:
        return None
    base = profile.compute.get(REFERENCE_CLASS)
    if active is None or base is None:
        return None
    figure = base.prefill_us_per_token_layer
    scale = active / REFERENCE_ACTIVE_PER_LAYER
    value = figure.value * scale
    derived = figure.model_copy(update={
        "value": value,
        "source": f"[E] derived by expertsim: the profile's {REFERENCE_CLASS} prompt figure scaled by active "
                  f"parameters per token and layer, {layout.name} {active / 1e6:.1f} M against V4-Flash's "
                  f"{REFERENCE_ACTIVE_PER_LAYER / 1e6:.1f} M (13 B / 43, hardware-and-gguf.md §4), the profile "
                  f"having no compute table for {layout.name} (add compute.\"{layout.name}\" to it to use a "
                  "measured figure)",
        "derivation": f"{figure.value:g} us x {active / 1e6:.1f} M / {REFERENCE_ACTIVE_PER_LAYER / 1e6:.1f} M = "
                      f"{value:.3f} us",
        "range": None if figure.range is None else [bound * scale for bound in figure.range]})
    return Compute(prefill_us_per_token_layer=derived, prefill_us_per_chunk_layer=base.prefill_us_per_chunk_layer)
