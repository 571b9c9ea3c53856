"""What a llama.cpp run holds besides the routed experts, per model file: the weights it loads to the GPU (every
tensor but the routed experts and the token embedding: llama.cpp keeps the input layer on the CPU, where a token
reads one row of it) and the K/V bytes per context token. Only files with a sourced figure are run; another model is
refused naming these.

The GPU's time for those weights comes from the machine: in decode a layer streams its share of them out of VRAM
(Machine.vram_read_s); in a prompt ubatch the profile's prompt figure for the model class is split between them
and the routed experts by bytes (the reference's §9: no per-op figure of llama.cpp's kernels is published).
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.errors import InputError
from sim.model.quant import tensor_bytes
from sim.units import GIB, MIB

F16_BYTES = 2  # llama.cpp's default K/V cache type (-ctk/-ctv f16)


@dataclass(frozen=True)
class FileWeights:
    gpu_bytes: int  # every tensor but the routed experts and the token embedding
    kv_bytes_per_token: int  # K and V of every attention layer at F16
    state_bytes: int  # fixed recurrent state (linear-attention layers), independent of the context
    source: str


_QWEN38_KV = 12 * 2 * 256 * 2 * F16_BYTES  # 12 full-attention (QSA) layers x 2 KV heads x head_dim 256 x K,V
_QWEN38_STATE = 36 * 3 * MIB  # 36 GDN layers, ~3 MiB of state each (strata-engine.md §2.1)
_QWEN38_SOURCE = ("[M] the same GGUF's non-expert tensors as Strata's logs load them (1,466 MiB of weights + the "
                  "projections + the output head, sim/engines/strata/memory.py PACK_WEIGHTS; strata-engine.md §2.1 "
                  "for the 12 QSA layers' 2 KV heads of 256 and the 36 GDN layers' ~3 MiB of state)")


# Q4_K_M files of llamacpp-engine.md §11 P22 (sizes as llama-bench prints them): the file less the preset's expert
# tensors (llama.cpp's Q4_K_M rule) and the token embedding (the file type's Q4_K [E]; vocabularies: Qwen's 248,320
# rows as Qwen3.8's (strata-engine.md §2.1) [E], GLM-4.7-Flash's 154,880, hardware-and-gguf.md §4) is the rest.
# K/V at F16: Qwen3.6-35B-A3B has Qwen3.5's hybrid layout (a quarter of its 40 layers full attention, 2 KV heads of
# 256, as Qwen3-Next's full_attention_interval 4 and 2 KV heads of 256, hardware-and-gguf.md §4 [E]); GLM-4.7-Flash
# is MLA (a 512-wide latent + 64 rope dims cached per layer, as DeepSeek's MLA [E]) in 47 layers.
_Q4_K_M_FILES = {
    "qwen3.6-35b-a3b": (21.1, 248_320, 10 * 2 * 256 * 2 * F16_BYTES,
                        "[M] Qwen3.6-35B-A3B Q4_K_M 21.1 GiB (thecodacus/llama.cpp PR #5, llamacpp-engine.md §11 P22)"),
    "glm-4.7-flash": (17.1, 154_880, 47 * (512 + 64) * F16_BYTES,
                      "[M] GLM-4.7-Flash Q4_K_M 17.1 GiB (thecodacus/llama.cpp PR #6, llamacpp-engine.md §11 P22)"),
}


def _embedding(vocab: int, hidden: int, type_name: str) -> int:
    return tensor_bytes(type_name, vocab * hidden)


def _gpt_oss(file_gib: float, layout, n_layers: int, source: str) -> FileWeights:
    # the file less its routed experts and its token embedding (201,088 x 2880; Q8_0 in the MXFP4 files [E])
    gpu = int(file_gib * GIB) - layout.total_expert_bytes - _embedding(201_088, layout.hidden, "Q8_0")
    return FileWeights(gpu, n_layers * 8 * 64 * 2 * F16_BYTES, 0, source)


def file_weights(layout, where: str) -> FileWeights:
    """The figures of the model's file (the module docstring); a model without them is refused."""
    name = layout.name
    if name.startswith("qwen3.8-flash-next"):
        dense = {"qwen3.8-flash-next-iq3s": 3982, "qwen3.8-flash-next-iq2xs": 3263,
                 "qwen3.8-flash-next-iq3xxs": 3664}.get(name, (3982 + 3263 + 3664) // 3)
        return FileWeights(dense * MIB, _QWEN38_KV, _QWEN38_STATE, _QWEN38_SOURCE)
    if name == "gpt-oss-120b":
        return _gpt_oss(59.02, layout, 36,
                        "[M] the MXFP4 GGUF is 59.02 GiB as llama-bench prints it (llamacpp-engine.md §11, ik #683); "
                        "64 heads / 8 KV heads of 64 in 36 layers (hardware-and-gguf.md §4; the sliding-window "
                        "layers' smaller cache is not modelled)")
    if name == "gpt-oss-20b":
        return _gpt_oss(11.27, layout, 24,
                        "[M] the MXFP4 GGUF is 11.27 GiB as llama-bench prints it (llamacpp-engine.md §11, ik #683); "
                        "the same attention as gpt-oss-120b in 24 layers (hardware-and-gguf.md §4)")
    if name in _Q4_K_M_FILES:
        file_gib, vocab, kv, source = _Q4_K_M_FILES[name]
        gpu = int(file_gib * GIB) - layout.total_expert_bytes - _embedding(vocab, layout.hidden, "Q4_K")
        return FileWeights(gpu, kv, 0, source)
    raise InputError(where, "model", name, "llama.cpp is modelled for files whose non-expert weights are sourced: "
                                           f"the qwen3.8-flash-next packs, gpt-oss-20b, gpt-oss-120b, "
                                           f"{', '.join(_Q4_K_M_FILES)}")
