"""The fixed costs of a llama.cpp decode layer, beside the bytes its kernels read (records llamacpp-gpu-node-graphs,
llamacpp-gpu-node-launch and llamacpp-cpu-moe-split, measured with python -m sim.calibrate.llamacpp_layers).

A decode token's graph is many small kernels: a qwen3moe layer is 41 graph nodes on the GPU (norms, the
projections, RoPE, the K/V writes, attention, the router's softmax and top-k, the experts, their weighted sum). With
weights that take under a microsecond to read, such a layer still took 44 us on an H100: every node has a floor, the
GPU's own with CUDA graphs (one launch replays a split's kernels; ggml-cuda's default for one-token graphs,
ggml-cuda.cu ggml_backend_cuda_graph_compute; HIP builds compile the same code with GGML_HIP_GRAPHS, on by default,
ggml/CMakeLists.txt:216; off before #22254, 2026-04-23: an older ROCm build runs as GGML_CUDA_DISABLE_GRAPHS
does), the host's launch of each kernel without them (GGML_CUDA_DISABLE_GRAPHS set, ggml-cuda/common.cuh:1289); lines of llama.cpp@0c1e57098, the tree measured.
A layer whose experts are in host memory moves four of its nodes to the CPU (the three mul_mat_id and the SwiGLU) and
pays for the split: the CPU backend's compute of those nodes, their thread barriers and the second GPU graph, on top
of the two GPU<->CPU switches the machine prices (process.py).
"""

from __future__ import annotations

import numpy as np

# [H] a qwen3moe decode layer on CUDA: nodes per backend in the scheduler's dump (GGML_SCHED_DEBUG=2), 8- and
# 48-layer models (scenarios/hardware/calibration/llamacpp-layers-h100.json) [E for other architectures: their
# graphs were not counted; gpt-oss's and DeepSeek's layers have a few more nodes, so their floors are lower bounds]
DECODE_NODES_PER_LAYER = 41
CPU_MOE_NODES = 4  # [H] the same dump with the experts on the CPU: gate, up, SwiGLU and down there, 37 on the GPU


def gpu_node_s(graphs: bool, domain) -> float:
    """One decode graph node's floor on the GPU (s): with CUDA graphs, or launched one by one."""
    record = "llamacpp-gpu-node-graphs" if graphs else "llamacpp-gpu-node-launch"
    return domain.use(record).value * 1e-6


def decode_gpu_nodes(cpu_moe_layer) -> np.ndarray:
    """Graph nodes each routed layer runs on the GPU in decode: all of them, less the experts' for a CPU MoE layer."""
    return DECODE_NODES_PER_LAYER - CPU_MOE_NODES * np.asarray(cpu_moe_layer, dtype=np.int64)


def cpu_moe_split_s(domain) -> float:
    """What one CPU MoE layer's split costs the token besides its switches and its expert compute (s)."""
    return domain.use("llamacpp-cpu-moe-split").value * 1e-6
