"""What llama.cpp's load puts on the GPU, in the order it allocates (the reference's §2.2, §5.1), and mainline's
--fit, which sizes a placement from it: split from memory.py so that settings.py can place with --fit without the
two importing each other."""

from __future__ import annotations

import numpy as np

from sim.engines.base import Allocation
from sim.engines.llamacpp.weights import file_weights
from sim.units import GIB

FP32_BYTES = 4
# The compute buffer holds a ubatch's activations; llama.cpp sizes it from a worst-case graph: the prompt graph reserved
# with every token of a ubatch producing logits (src/llama-context.cpp, graph_reserve(n_tokens, n_seqs, n_tokens)).
# Counted: those logits (vocab x ubatch fp32), the ubatch's hidden state in and out of a layer (fp32), and, under op
# offload, the staging of one CPU expert tensor (§3: the offloaded gate, up and down reuse one compute-buffer space).
# The graph's other intermediates are not: a lower bound.
ACTIVATION_COPIES = 2


def part_bytes(layout) -> np.ndarray:
    """int64 [routed layers, 3]: bytes of one expert's gate, up and down slices."""
    return np.array([[x.gate_bytes, x.up_bytes, x.down_bytes] for x in layout.layers], np.int64)


def part_types(layout) -> np.ndarray:
    """str [routed layers, 3]: GGML type names of one expert's gate, up and down slices (part_bytes' order)."""
    return np.array([[x.gate_type, x.up_type, x.down_type] for x in layout.layers])


def layer_weight_bytes(weights, n_layers: int) -> float:
    """A routed layer's share of the non-expert weights besides the output projection: attention, router, shared
    expert, norms (and the dense blocks' FFNs), spread evenly over the routed layers [E: per-block sizes not held]."""
    return (weights.gpu_bytes - weights.output_bytes) / n_layers


def split_by_device(layout, weights, cpu_layers: int, output_on_gpu: bool, ctx: int, ubatch: int) -> dict:
    """Bytes of the non-expert weights and of the K/V cache (with the recurrent state) on each side when the first
    `cpu_layers` routed layers run whole on the CPU (-ngl): a layer's K/V lives on its layer's device."""
    n = layout.n_routed_layers
    per_layer = layer_weight_bytes(weights, n)
    cache = weights.attention.cache_bytes(ctx, ubatch) + weights.state_bytes
    cpu_weights = int(per_layer * cpu_layers) + (0 if output_on_gpu else weights.output_bytes)
    cpu_cache = int(cache * cpu_layers / n)
    return {"gpu_weights": weights.gpu_bytes - cpu_weights, "cpu_weights": cpu_weights,
            "gpu_cache": cache - cpu_cache, "cpu_cache": cpu_cache}


# the VRAM parts a setting other than --n-cpu-moe shrinks (memory.plan_memory names it when the load fails)
NON_EXPERT_WEIGHTS, KV_CACHE, COMPUTE_BUFFER = "non-expert weights", "K/V cache and recurrent state", "compute buffer"


def vram_allocations(layout, profile, weights, on_cpu: np.ndarray, ctx: int, ubatch: int, op_offload: bool,
                     split: dict | None = None) -> list[Allocation]:
    """What the GPU holds once loaded, in the order llama.cpp allocates it (the module docstring); `split` is
    split_by_device's for a placement with -ngl (None: every layer on the GPU)."""
    parts = part_bytes(layout) * layout.n_experts  # whole tensors
    staging = int(parts[on_cpu].max()) if op_offload and on_cpu.any() else 0
    activations = (ACTIVATION_COPIES * layout.hidden + weights.vocab) * ubatch * FP32_BYTES
    split = split or split_by_device(layout, weights, 0, True, ctx, ubatch)
    return [Allocation("vram", "runtime reserved (driver, context)", profile.runtime_reserved_bytes),
            Allocation("vram", NON_EXPERT_WEIGHTS, split["gpu_weights"]),
            Allocation("vram", "expert tensors on the GPU", int(parts[~on_cpu].sum())),
            Allocation("vram", KV_CACHE, split["gpu_cache"]),
            Allocation("vram", COMPUTE_BUFFER, activations + staging)]


# --fit's free margin per device (common/common.h:473, llamacpp-engine.md §2.3): what llama.cpp's own placement leaves
FIT_MARGIN_BYTES = GIB


def fit_placement(layout, profile, ctx: int, ubatch: int, op_offload: bool, where: str) -> np.ndarray:
    """Mainline's --fit for a MoE model on one GPU (common/fit.cpp, llamacpp-engine.md §2.3): whole layers on the GPU
    first, then the layers that do not fit keep their expert tensors in host RAM, at the end of the device's range;
    the fewest such layers that leave the 1 GiB margin. When even every layer's experts on the CPU leave no margin,
    fit cannot place the rest [E: it would then move whole layers, not modelled]: every expert stays on the CPU."""
    n_layers = len(layout.layers)
    weights = file_weights(layout, where)
    for n_cpu in range(n_layers + 1):
        on_cpu = np.zeros((n_layers, 3), bool)
        on_cpu[n_layers - n_cpu:] = True
        used = sum(a.bytes for a in vram_allocations(layout, profile, weights, on_cpu, ctx, ubatch, op_offload))
        if used + FIT_MARGIN_BYTES <= profile.vram_bytes:
            return on_cpu
    return np.ones((n_layers, 3), bool)
