"""What ds4 holds before its expert cache, from the scenario alone: the memory plan its startup allocates.

VRAM before the cache = the non-routed weights it keeps on the GPU + the KV cache and the prefill context buffers at
--ctx (their formula below, from the graph allocation) + its compute buffers (a calibration record: fitted, see
sim/engines/records.py) + the driver/runtime reservation of the hardware profile; beside them the pinned staging
ring in RAM, the later builds' prefill headroom (their budget planner) and where the non-routed weights go when
VRAM cannot hold them all. `plan_memory` is that startup, run without a clock: the process allocates its plan,
plan prunes on it and validate refuses what cannot start.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.engines.base import Allocation, MemoryPlan
from sim.engines.ds4.geometry import Layers, model_family
from sim.engines.ds4.planner import budget_plan
from sim.engines.ds4.settings import KEY_RESERVE, Knobs
from sim.engines.ds4.sizing import live_budget
from sim.engines.ds4.weights import FLASH_NON_ROUTED_GIB, V41_NON_ROUTED_GIB, glm52_non_routed_bytes
from sim.errors import InputError
from sim.machine import Memory
from sim.units import GIB, MIB

WEIGHT_ARENA_CHUNK_MIB = 1792  # DS4_CUDA_WEIGHT_ARENA_CHUNK_MB default (ds4_cuda.cu @54b36ed L1759-1775)

FLASH_KV_LAYERS = 43          # DS4_N_LAYER
FLASH_HEAD_DIM = 512          # DS4_N_HEAD_DIM: one KV row (f32)
FLASH_INDEXER_HEAD_DIM = 128  # DS4_N_INDEXER_HEAD_DIM
FLASH_SWA_TOKENS = 128        # DS4_N_SWA: the sliding attention window
FLASH_RAW_ROW_ALIGN = 256     # the raw KV rows are padded to a 256-row multiple (ds4.c, raw cap)
FLASH_RAW_ROWS_MAX = 8192     # and capped at 8192 rows
FLASH_F32_BYTES = 4           # KV rows are stored as f32 on the GPU


def flash_compress_ratio(layer: int) -> int:
    """DeepSeek-V4 attention compression per layer (ds4.c ds4_layer_compress_ratio): the first two layers
    are dense (0), then the layers alternate: even ones ratio 4 with an indexer, odd ones ratio 128."""
    if layer < 2:
        return 0
    return 4 if layer % 2 == 0 else 128


def flash_raw_rows(ctx_tokens: int, prefill_cap_tokens: int) -> int:
    """Rows of each layer's raw (sliding-window) KV: during a batched prefill it holds the chunk plus the
    previous window, padded to a multiple of 256 rows and capped at 8192 (ds4.c
    metal_graph_raw_cap_for_context)."""
    window = max(1, min(FLASH_SWA_TOKENS, ctx_tokens))
    wanted = max(1, min(window + prefill_cap_tokens, ctx_tokens))
    wanted = min(-(-wanted // FLASH_RAW_ROW_ALIGN) * FLASH_RAW_ROW_ALIGN, FLASH_RAW_ROWS_MAX)
    return max(wanted, window)


def flash_kv_bytes(ctx_tokens: int, prefill_cap_tokens: int) -> int:
    """The KV cache ds4 allocates on the GPU for a session of ctx_tokens (DeepSeek-V4 Flash): per layer the
    raw rows (flash_raw_rows), and per compressed layer ctx / ratio + 2 compressed rows (plus the indexer's
    rows on ratio-4 layers), every row f32 (ds4.c metal_graph_kv_cache_bytes_for_context)."""
    total = FLASH_KV_LAYERS * flash_raw_rows(ctx_tokens, prefill_cap_tokens) * FLASH_HEAD_DIM * FLASH_F32_BYTES
    for layer in range(FLASH_KV_LAYERS):
        ratio = flash_compress_ratio(layer)
        if ratio:
            rows = ctx_tokens // ratio + 2
            total += rows * FLASH_HEAD_DIM * FLASH_F32_BYTES
            if ratio == 4:
                total += rows * FLASH_INDEXER_HEAD_DIM * FLASH_F32_BYTES
    return total


def flash_context_buffer_bytes(ctx_tokens: int, prefill_cap_tokens: int) -> int:
    """The prefill's attention context buffers beside the KV cache: 2 x (ctx / 4 + 2) x prefill chunk f32
    (ds4.c metal_graph_context_bytes_for_kv_policy)."""
    return 2 * (ctx_tokens // 4 + 2) * prefill_cap_tokens * FLASH_F32_BYTES


# GLM-5.2's MLA cache: per layer and token the compressed KV (kv-lora 512) and the rope key (64), f32 on the
# neutronstar stack ("78 x ctx x (512 + 64) x 4 B", the cross-check of the GLM-5.2 resident set).
GLM52_MLA_ROW_FLOATS = 512 + 64
GLM52_KV_LAYERS = 78
# GLM-5.2 on the neutronstar rig keeps "~8 GiB pinned host RAM" of its resident weights in host memory
# (giannisanni/neutronstar README): those bytes are not in VRAM.
GLM52_HOST_PINNED_GIB = 8


@dataclass(frozen=True)
class ResidentSet:
    """What ds4 holds before its expert cache (bytes): in VRAM and in pinned host RAM."""

    non_routed: int  # the file's non-routed weights
    host_pinned: int  # the part of them kept in pinned host RAM instead of VRAM
    kv: int  # KV cache at --ctx
    context_buffers: int  # the prefill's attention context buffers at --ctx
    compute_buffers: int  # compute buffers and scratch (a calibration record)
    runtime_reserved: int  # the driver's and runtime's own reservation (hardware profile)
    record: str  # the calibration record of compute_buffers (V4.1: of its graph, held as context_buffers)

    @property
    def context_memory(self) -> int:
        """The context's memory the later builds' budget cap leaves room for: KV and context buffers."""
        return self.kv + self.context_buffers

    @property
    def vram(self) -> int:
        return (self.non_routed - self.host_pinned + self.kv + self.context_buffers + self.compute_buffers
                + self.runtime_reserved)


def resident_set(layout, family: str, profile, ctx_tokens: int, prefill_cap_tokens: int, domain) -> ResidentSet:
    """VRAM (and pinned host RAM) ds4 holds before the expert cache; `domain` records the calibration use."""
    reserved = profile.runtime_reserved_bytes
    if family == "deepseek-v4.1":  # its planner prints KV and buffers as one graph figure: held as the buffers
        graph = v41_graph_bytes(ctx_tokens, domain)
        return ResidentSet(int(V41_NON_ROUTED_GIB * GIB), 0, 0, graph, 0, reserved, "ds4-v41-graph-8k")
    if family == "deepseek-v4":
        record = domain.use("ds4-flash-buffers-503", "ds4 compute buffers")
        return ResidentSet(int(FLASH_NON_ROUTED_GIB * GIB), 0, flash_kv_bytes(ctx_tokens, prefill_cap_tokens),
                           flash_context_buffer_bytes(ctx_tokens, prefill_cap_tokens), record.bytes(), reserved,
                           record.id)
    record = domain.use("ds4-glm52-buffers-neutronstar", "ds4 compute buffers")
    kv = GLM52_KV_LAYERS * ctx_tokens * GLM52_MLA_ROW_FLOATS * FLASH_F32_BYTES
    return ResidentSet(glm52_non_routed_bytes(layout), GLM52_HOST_PINNED_GIB * GIB, kv, 0, record.bytes(),
                       reserved, record.id)


V41_GRAPH_CONTEXTS = (8192, 400_000)  # the contexts of records ds4-v41-graph-8k and -400k


def v41_graph_bytes(ctx_tokens: int, domain) -> int:
    """DeepSeek-V4.1's graph (KV cache and buffers) at --ctx: the line through the two printed figures (records
    ds4-v41-graph-8k and -400k), never below the smaller; a stand-in until V4.1's KV formula is known."""
    low = domain.use("ds4-v41-graph-8k", "ds4 V4.1 graph (KV + buffers)").bytes()
    high = domain.use("ds4-v41-graph-400k", "ds4 V4.1 graph (KV + buffers)").bytes()
    (c0, c1) = V41_GRAPH_CONTEXTS
    return max(low, int(low + (high - low) * (ctx_tokens - c0) / (c1 - c0)))


@dataclass(frozen=True, kw_only=True)
class Ds4Memory(MemoryPlan):
    """ds4's plan: the generic one, and what its startup decided on the way."""

    resident: ResidentSet
    budget_experts: int  # what each cache is sized for: the live request, or the planner's count
    planned_experts: int | None  # the planner's count (None: the live budget, no planner)
    reserve_bytes: int  # the live reserve (0 under the planner, which has its own accounting)
    staging_bytes: int  # compact staging held from the start (the planner's prefill headroom)
    weight_pcie_bytes: int  # non-routed weights VRAM cannot hold, read over PCIe at every use


def plan_memory(scenario, knobs: Knobs, layers: Layers, domain, where: str) -> Ds4Memory:
    """ds4's startup before the expert cache (module docstring), in the order it allocates; raises the engine's
    refusals (a budget its planner rejects, a GPU too small for what comes before the cache)."""
    hw, variant = scenario.hardware_profile, knobs.variant
    resident = resident_set(scenario.layout, model_family(scenario), hw, knobs.ctx, knobs.chunk_cap, domain)
    memory, allocations, notices = Memory(hw), [], list(knobs.ignored_env)

    def hold(pool: str, name: str, n_bytes: int) -> None:
        if n_bytes:
            memory.set(pool, name, n_bytes)
            allocations.append(Allocation(pool, name, int(n_bytes)))

    hold("vram", "runtime reserved (driver, context)", resident.runtime_reserved)
    hold("vram", "KV cache", resident.kv)
    hold("vram", "prefill context buffers", resident.context_buffers)
    hold("vram", "compute buffers", resident.compute_buffers)
    hold("ram", "pinned non-routed weights", resident.host_pinned)
    hold("ram", "pinned staging", knobs.pinned_staging_bytes)
    # the later builds size the expert budget first: the planner's dynamic experts replace the live budget, its
    # prefill headroom is held as staging from the start, and its own accounting replaces the live reserve. CUDA
    # @54b36ed plans a cache but never allocates it (the streaming cache API there is a stub:
    # ds4_gpu_set_streaming_expert_cache_budget ignores its count)
    budget, planned, reserve, staging = knobs.budget_experts, None, knobs.reserve_bytes, 0
    mode = variant.budget
    if mode != "live" and not (mode == "auto-488" and knobs.budget_given):  # #488 changes only the no-budget case
        per_class = np.bincount(layers.class_of_layer[: layers.n_routed], minlength=layers.n_classes)
        dominant = int(np.argmax(per_class))  # the size most routed layers have, the first on ties
        plan = budget_plan(
            mode, api=hw.gpu.api, working_set=hw.vram_bytes, requested_bytes=knobs.budget_bytes,
            requested_experts=budget if knobs.budget_given and knobs.budget_bytes is None else None,
            expert_size=layers.class_bytes[dominant], n_experts=layers.n_experts,
            cacheable_layers=int(per_class[dominant]), non_routed=resident.non_routed,
            context_bytes=resident.context_memory, fixed_bytes=resident.vram - resident.runtime_reserved, where=where)
        notices.extend(plan.notices)
        planned = budget = plan.cache_experts
        if mode != "auto-488":
            reserve = 0
        if mode == "planner" and hw.gpu.api == "cuda":  # nor its headroom: the compact staging grows as before
            budget = 0
            notices.append(f"CUDA at this build never allocates the planned {plan.cache_experts} experts: every "
                           "selected expert is read per use")
        elif plan.headroom_bytes and not knobs.metal:  # Metal allocates it in a batch prefill, not modelled
            staging = plan.headroom_bytes
            hold("vram", "compact staging", staging)
    weight_pcie = _place_weights(memory, hold, notices, knobs, layers, resident, staging, hw.is_unified)
    if memory.vram_free() <= 0:
        raise InputError(where, "hardware", hw.name,
                         f"ds4 needs {resident.vram / GIB:.2f} GiB before its expert cache; the GPU has "
                         f"{hw.vram_bytes / GIB:.2f} GiB")
    free = memory.vram_free()
    why = None
    if live_budget(1, 1, max(free, 0), reserve).disabled:
        why = f"reserve {reserve / GIB:.1f} GiB >= {free / GIB:.1f} GiB free before the cache: no expert cache"
    return Ds4Memory(allocations=tuple(allocations), free_at_sizing_bytes=free, why_no_cache=why, knob=KEY_RESERVE,
                     notices=tuple(notices), resident=resident, budget_experts=budget, planned_experts=planned,
                     reserve_bytes=reserve, staging_bytes=staging, weight_pcie_bytes=weight_pcie)


def _place_weights(memory: Memory, hold, notices: list, knobs: Knobs, layers: Layers, resident: ResidentSet,
                   staging: int, unified: bool) -> int:
    """Non-routed weights on a discrete card for the builds whose weight cache fills VRAM arena chunks lazily
    (cuda_model_arena_alloc @54b36ed: 1,792 MiB each) and maps what does not fit from host memory: the chunks
    that fit beside everything else hold weights, the rest is read over PCIe at every use. Returns those
    bytes (0: all in VRAM)."""
    in_vram = resident.non_routed - resident.host_pinned
    if knobs.metal:  # no copy: Metal wraps the mapped file's pages (the page cache's, see metal.py)
        return 0
    if not knobs.variant.weight_overflow or unified:
        hold("vram", "non-routed weights", in_vram)
        return 0
    # what the weights may take: the first layer's staging (up to a whole layer of experts) is allocated before
    # the arena has filled, the arena's chunks coming one by one as the first pass meets the tensors
    first_staging = max(0, layers.n_experts * max(layers.class_bytes) - staging)
    free = memory.vram_free() - first_staging
    if in_vram <= free:
        hold("vram", "non-routed weights", in_vram)
        return 0
    chunks = max(0, free) // (WEIGHT_ARENA_CHUNK_MIB * MIB)
    placed = min(in_vram, chunks * WEIGHT_ARENA_CHUNK_MIB * MIB)
    hold("vram", "non-routed weights", placed)
    hold("ram", "mapped non-routed weights (read over PCIe)", in_vram - placed)
    notices.append(f"CUDA model arena full: {(in_vram - placed) / GIB:.2f} GiB of non-routed weights stay in "
                   "mapped host memory, read over PCIe at every use")
    return int(in_vram - placed)
