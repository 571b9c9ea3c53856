"""Qwen3.8-Flash-Next as Strata's kernels see it (strata-engine.md §2.1): the one geometry they are built for, the
QSA layers that hold K/V, and the K/V bytes per cell of each K/V type."""

from __future__ import annotations

import numpy as np

# fmt: off
QSA_EVERY = 4                                      # every 4th layer is QSA, the rest GDN (the Qwen3-Next family's
                                                   # full_attention_interval 4, hardware-and-gguf.md §4)
LAYERS = 48                                        # Qwen3.8-Flash-Next (§2.1)
QSA_LAYERS = LAYERS // QSA_EVERY                   # Qwen3.8-Flash-Next: 12 QSA sparse-attention layers hold K/V (§2.1)
KV_BYTES_PER_CELL_LAYER = {                        # one QSA layer's K+V per cell (2 KV heads x 256)
    "int8": 1_056,                                 # kv_q8.hpp: 1,024 B + FP16 group scales (§2.1, §4.1)
    "fp16": 2_048,                                 # 2 x 2 x 256 x 2 B
    "k8v4": 816,                                   # §2.1
    "q4_0": 576,                                   # [derived] GGML Q4_0: 18 B per 32 values, 1,024 values
}
# fmt: on

def qsa_layers(n_layers: int) -> np.ndarray:
    """Which of the layers are QSA (hold K/V): every QSA_EVERY-th, the rest GDN."""
    return (np.arange(n_layers) + 1) % QSA_EVERY == 0


# Strata's kernels are built for one geometry (compile-time constants checked against the model,
# strata-engine.md §2.1, §4.1): Qwen3.8-Flash-Next, 512 experts (256 in the Coder prune), top-10, n_embd 2560.
GEOMETRY = {"hidden": (2560,), "top_k": (10,), "n_experts": (512, 256)}


def geometry_mismatch(layout) -> tuple[str, tuple] | None:
    """The first GEOMETRY field whose value the layout does not have, with the values Strata runs; None when
    Strata runs the layout."""
    return next(((field, allowed) for field, allowed in GEOMETRY.items() if getattr(layout, field) not in allowed),
                None)
