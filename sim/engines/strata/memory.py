"""What Strata holds in VRAM when it sizes the expert cache, from the scenario alone: the memory plan its startup
allocates.

cudaMemGetInfo is read "after weights, session, drafter, head" (vram_plan.hpp @ 0cb61d22, free_bytes), and an auto
cache gets free - --vram-reserve-mib - the draft head's bind (it is allocated after the cache, but booked before
it). Every term below is read from Strata's own loading logs on boxes that are not validation cases (the research
notes behind this module's history; sources per figure), except the runtime's own buffers, a calibration record
per platform.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.engines.base import Allocation, MemoryPlan
from sim.engines.strata.geometry import KV_BYTES_PER_CELL_LAYER, QSA_LAYERS
from sim.engines.strata.settings import KEY_RESERVE, Knobs
from sim.errors import InputError
from sim.machine import Memory
from sim.units import GIB, MIB

PINNED_STAGING_BUFFERS = 16  # the stager's kRing pinned host buffers (§3.2)


@dataclass(frozen=True)
class PackWeights:
    """The dense weights a pack loads to VRAM: the pack's canonical tensors (norms, BF16 routers and gates,
    hyper-connection and PLE projections, FP32 GDN/QSA tensors), the natively served projections (36 GDN x
    3 + 12 QSA x 4 + 48 shared-expert matrices) and the output head; the token embedding (mapped host memory)
    and the PLE n-gram table (read from the drive) stay off the GPU."""

    dense_bytes: int
    head_bytes: int  # the native output head (248,320 rows): the draft head binds a subset of its rows
    source: str


CANONICAL_PACK_MIB = 1466                          # "1466 MiB of weights loaded" on every GSQ-RCO pack logged
PACK_WEIGHTS = {
    "qwen3.8-flash-next-iq3s": PackWeights(
        int((CANONICAL_PACK_MIB + 2018.88) * MIB) + 521_472_000, 521_472_000,
        "[M] Strata engine logs (bench/results/2026-10-06-community-rtx5070ti-5900x/engine.log @ a2653966, "
        "2026-10-04-community-rtx-4090-laptop @ 84f2e9f4): 1,466 MiB pack weights + 2,018.88 MiB native "
        "projections + a 521,472,000 B native head = 3,982 MiB"),
    "qwen3.8-flash-next-iq2xs": PackWeights(
        int((CANONICAL_PACK_MIB + 1474.85) * MIB) + 337_715_200, 337_715_200,
        "[M] Strata engine log (bench/results/2026-10-05-community-rx-6700-xt/engine.log @ 282c55e9): 1,466 + "
        "1,474.85 MiB + a 337,715,200 B head = 3,263 MiB"),
    "qwen3.8-flash-next-iq3xxs": PackWeights(
        int((CANONICAL_PACK_MIB + 1781.11) * MIB) + 437_043_200, 437_043_200,
        "[M from another pack] the Swift 1.5 IQ3_XXS pack's logs (a V100 ledger and an A4500 log, indexed copies "
        "70762382992, 71284340493): 1,466 + 1,781.11 MiB + a 437,043,200 B head = 3,664 MiB; no log of the "
        "GSQ-RCO IQ3_XXS pack"),
}
# No log of the Q2_0 canonical pack or the Huihui IQ3_S/IQ4_NL pack: the mean of the three logged packs.
_MEAN_DENSE = sum(w.dense_bytes for w in PACK_WEIGHTS.values()) // len(PACK_WEIGHTS)
_MEAN_HEAD = sum(w.head_bytes for w in PACK_WEIGHTS.values()) // len(PACK_WEIGHTS)
PACK_WEIGHTS_UNLOGGED = PackWeights(_MEAN_DENSE, _MEAN_HEAD, "[E] no log of this pack's weights: the mean of the "
                                    "three logged GSQ-RCO packs (IQ3_S 3,982, IQ2_XS 3,263, IQ3_XXS 3,664 MiB)")
VOCAB_ROWS = 248_320                               # Qwen3.8-Flash-Next vocabulary (§2.1)
DRAFT_HEAD_ROWS_CJK = 106_299                      # the MTP draft head's default token subset ("+218 MiB" on IQ3_S)
DRAFT_HEAD_BIND_MARGIN_MIB = 5                     # bind = the subset's head rows + ~5 MiB (218 = 212.9 + 5, logs)
MTP_DRAFT_LAYER_BYTES = (675 + 111) * MIB          # "draft layer loaded, 835 MiB of VRAM (experts 675, dense 111)"
MTP_KV_BYTES_PER_CELL = 1_184                      # the draft layer's K/V: 1,098 - 795 MiB over 262,144 - 4,096 cells
MTP_WINDOW_CELLS = 32_768                          # with K/V streaming the draft keeps a 32,768-cell ring (Options)
SESSION_FIXED_BYTES = 121 * MIB                    # GDN states (36 x 3.117 MiB) + ~9 MiB: session_bytes at 0 cells
SESSION_BYTES_PER_CELL = 1_804                     # indexer pooled keys 12 x 128 + RoPE table 256 + page tables ~12
# "8.67 GiB free" vs "7.69 GiB" with the GPU vision encoder (5060 Ti logs)
GPU_VISION_BYTES = 1004 * MIB


def pack_weights(model_name: str) -> PackWeights:
    return PACK_WEIGHTS.get(model_name, PACK_WEIGHTS_UNLOGGED)


def draft_head_bind_bytes(weights: PackWeights) -> int:
    """The MTP draft head's rows (the default CJK subset of the native head) + the bind margin."""
    return weights.head_bytes * DRAFT_HEAD_ROWS_CJK // VOCAB_ROWS + DRAFT_HEAD_BIND_MARGIN_MIB * MIB


def kv_streamed(max_context_tokens: int, kv_resident_cells: int | None) -> bool:
    return kv_resident_cells is not None and kv_resident_cells < max_context_tokens


def mtp_bytes(max_context_tokens: int, kv_resident_cells: int | None) -> int:
    """The MTP draft layer (its Q2_0 experts and dense weights) and its K/V: every cell of the context, or a
    32,768-cell ring when the K/V is streamed."""
    cells = min(max_context_tokens, MTP_WINDOW_CELLS) if kv_streamed(max_context_tokens, kv_resident_cells) \
        else max_context_tokens
    return MTP_DRAFT_LAYER_BYTES + cells * MTP_KV_BYTES_PER_CELL


def session_bytes(max_context_tokens: int, kv: str, kv_resident_cells: int | None) -> int:
    """session_bytes(g, max_context, K), allocated at startup for the whole --max-context: GDN states, the
    indexer's pooled keys, RoPE and page tables for every cell, and the K/V of the 12 QSA layers for every cell
    (or only --kv-resident cells when the K/V is streamed from host RAM)."""
    resident = max_context_tokens if kv_resident_cells is None else min(kv_resident_cells, max_context_tokens)
    return (SESSION_FIXED_BYTES + max_context_tokens * SESSION_BYTES_PER_CELL
            + resident * QSA_LAYERS * KV_BYTES_PER_CELL_LAYER[kv])


def kv_host_bytes(max_context_tokens: int, kv: str, kv_resident_cells: int | None) -> int:
    """Pinned host RAM of K/V streaming: the whole K/V ("the K/V in 6.19 GiB of pinned RAM" at 524,288 INT8
    cells); none when it all stays in VRAM."""
    if not kv_streamed(max_context_tokens, kv_resident_cells):
        return 0
    return max_context_tokens * QSA_LAYERS * KV_BYTES_PER_CELL_LAYER[kv]


def runtime_record_id(profile) -> str:
    """The calibration record of Strata's runtime buffers on this platform (sim/engines/records.py)."""
    if profile.gpu.api == "hip":
        return "strata-runtime-hip"
    return "strata-runtime-windows-cuda" if profile.os == "windows" else "strata-runtime-linux-cuda"


def vram_before_cache(scenario, domain) -> tuple[tuple[str, int], ...]:
    """What VRAM holds when Strata reads free memory to size its cache, by name (bytes): the driver's context
    (the hardware profile), Strata's runtime buffers (a record), the pack's dense weights, the MTP draft layer,
    the session at --max-context and a GPU vision encoder. The draft head's bind is booked at sizing too
    (draft_head_bind_bytes), beside the reserve."""
    profile, flags = scenario.hardware_profile, scenario.engine.flags
    runtime = domain.use(runtime_record_id(profile), "Strata's runtime buffers in VRAM")
    cells = flags.kv_resident_cells
    items = [("runtime reserved (driver, context)", profile.runtime_reserved_bytes),
             ("runtime buffers (modules, cuBLAS)", runtime.bytes()),
             ("dense weights", pack_weights(scenario.layout.name).dense_bytes),
             ("MTP draft layer", mtp_bytes(flags.max_context, cells)),
             ("session (K/V, indexer keys, RoPE)", session_bytes(flags.max_context, flags.kv, cells))]
    if flags.vision == "gpu":
        items.append(("GPU vision encoder", GPU_VISION_BYTES))
    return tuple(items)


@dataclass(frozen=True, kw_only=True)
class StrataMemory(MemoryPlan):
    """Strata's plan: the generic one, and its terms by name."""

    vram_before: tuple[tuple[str, int], ...]  # vram_before_cache
    draft_head_bind_bytes: int  # booked at sizing beside the reserve, bound after the cache
    runtime_record: str  # the calibration record of its runtime buffers on this platform


def plan_memory(scenario, knobs: Knobs, domain, where: str) -> StrataMemory:
    """Strata's startup before the cache, in the order it allocates: VRAM before the cache, then the host RAM of
    K/V streaming and of the stager's pinned buffers. Refuses a session the GPU cannot hold at --max-context."""
    hw, layout, flags = scenario.hardware_profile, scenario.layout, scenario.engine.flags
    memory, allocations = Memory(hw), []

    def hold(pool: str, name: str, n_bytes: int) -> None:
        if n_bytes:
            memory.set(pool, name, n_bytes)
            allocations.append(Allocation(pool, name, int(n_bytes)))

    before = vram_before_cache(scenario, domain)
    for name, n_bytes in before:
        hold("vram", name, n_bytes)
    notices = ()
    if layout.name not in PACK_WEIGHTS:
        notices = (f"dense weights: no Strata log of the {layout.name} pack's weights; taking "
                   f"{PACK_WEIGHTS_UNLOGGED.dense_bytes / MIB:,.0f} MiB, the mean of the logged packs",)
    hold("ram", "K/V streamed from host (--kv-resident)", kv_host_bytes(flags.max_context, flags.kv,
                                                                       flags.kv_resident_cells))
    max_blob = max(layout.expert_bytes_per_layer()[: layout.n_routed_layers])
    hold("ram", "stager pinned buffers", PINNED_STAGING_BUFFERS * max_blob)
    free = memory.vram_free()
    if free < 0:  # the K/V allocation at --max-context fails before any expert slot is sized
        raise InputError(where, "engine.flags.max-context", flags.max_context,
                         f"Strata cannot allocate it: the runtime, the weights, the draft layer and the session "
                         f"at this context need {memory.used('vram') / GIB:.2f} GiB of the "
                         f"{memory.vram_total / GIB:.2f} GiB the GPU has (lower max-context or set kv-resident)")
    bind = draft_head_bind_bytes(pack_weights(layout.name))
    why = None
    if knobs.reserve_bytes + bind >= free:
        why = (f"reserve {knobs.reserve_mib} MiB + the draft head's {bind / MIB:,.0f} MiB >= {free / MIB:,.0f} "
               "MiB free at sizing: no expert cache")
    return StrataMemory(allocations=tuple(allocations), free_at_sizing_bytes=free, why_no_cache=why, knob=KEY_RESERVE,
                        notices=notices, vram_before=before, draft_head_bind_bytes=bind,
                        runtime_record=runtime_record_id(hw))
