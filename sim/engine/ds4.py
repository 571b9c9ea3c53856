"""ds4's CUDA SSD-streaming expert cache as a SimPy process (antirez/ds4 @80ebbc3, and PR #504).

What the model does, per the engine's code paths (reference/ds4-engine.md §1.5-§1.10):
- decode, per token and layer: the router's top-k experts (6 on Flash, 8 on GLM-5.2) are looked up in the
  cache of their size class (pr504, pr1082, neutronstar-glm) or in the single slab keyed on the last size
  seen (pre-504, neutronstar-glm-slab: a size change releases the slab and allocates one for the new size).
  A hit is 3 synchronous D2D copies (gate, up, down) into the compact staging buffer; a miss loads the 3
  parts into a slab slot (each read -> H2D -> stream sync, the engine's QD1 streamed copy) and then makes
  the same 3 D2D copies. Per layer the engine also syncs the device, reads the ids back and uploads the
  slot map; only the shared-expert kernels overlap the fetch.
- prefill: prompts of <= 18 tokens (64 when layer 0 is Q4_K) go through the decode path; longer ones run
  layer-major in chunks (--prefill-chunk, default the prompt up to 4096, else 4096; 8192 for Pro). Per
  layer the chunk's expert union is staged in a grow-only compact buffer. pre-504 (and the slab twin):
  every batch call first releases all caches and loads the whole union directly. pr504 (and the other
  per-class variants): staging first, then hits are D2D copies, misses fill free slots (append) and the
  rest load directly: a prefill never evicts.
- MTP draft steps (variants neutronstar-glm*, `--mtp`): the GLM stack of giannisanni/neutronstar runs the
  in-file MTP layer (GLM-5.2's blk.78) once per decode token, after the routed layers, through the same
  selected-expert path ("MTP draft layer experts are Q2_K: they stream through the same expert path",
  neutronstar docs/glm-mtp-port.md). Prefill does not run it ("prefill does not populate" the draft's
  cache, same file). Its experts are their own size class: per-class caches keep them in their own pool;
  the slab releases itself on every entry to and exit from that class (ds4 #595). No draft is accepted:
  this is the fork's probe mode, so the MTP step only adds time (its accept loop is "a net slowdown" on
  streaming, neutronstar README); the draft's eh_proj and second output-head pass are not charged.
Everything here is serial on the host (the engine syncs after every part), so the layer step's time is
the sum of its operations; the links keep the books per path (file, host memcpy, PCIe, D2D, compute).

VRAM before the expert cache (free VRAM = VRAM - non-routed weights on the GPU - runtime overhead) is
per model, each with its source (resident_set): DeepSeek-V4-Flash is calibrated on the #503 log (96 GB
card); GLM-5.2 is derived from its public geometry and the neutronstar 16 GB rig (glm52_non_routed_bytes).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import simpy

from sim.cache.kernels import DIRECT, EVICT, HIT, INSERT, MODE_APPEND, MODE_EVICT
from sim.cache.replay import Geometry, LRUCache, read_profile, trace_profile
from sim.engine import ds4_plan
from sim.engine.timeline import Link, Recorder, serial
from sim.engine.workload import WorkloadRouting
from sim.errors import InputError
from sim.model.quant import QUANT_TYPES
from sim.trace.format import MISSING
from sim.trace.generate import HOTLIST_PROFILE_SEED, generate_trace, hotlist_profile_tokens

# fmt: off
MIB = 1 << 20
GIB = 1 << 30
DECODE_PATH_PREFILL_MAX_TOKENS = 18        # ds4.c L19505-19567: short prompts run the decode path (§1.7)
DECODE_PATH_PREFILL_MAX_TOKENS_Q4 = 64     # ... 64 when layer 0's experts are all Q4_K (§1.7)
DEFAULT_PREFILL_CHUNK_TOKENS = 4096        # ds4_prefill_cap_for_prompt, ds4.c L8330 (§1.7)
DEFAULT_PREFILL_CHUNK_TOKENS_PRO = 8192    # same, DeepSeek V4 Pro (§1.7)
PARTS_PER_EXPERT = 3                       # gate, up, down: three file ranges, three copies (§1.8)
SLAB_VARIANTS = ("pre-504", "neutronstar-glm-slab")  # one slab keyed on the last size; the rest per class
DEVICE_SYNCS_PER_DECODE_LAYER = 3          # "roughly 43 x (2-4) syncs per token": device sync after the router,
                                           # the worker's sync, flush_commands (§1.6 steps 1, 2, 4)
# fmt: on

# ------------------------------------------------------------------------------------------ VRAM before the cache
#
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
# the recipe keeps ~0.9 GiB more above Q8_0 than this derivation (an F16 token embedding alone would be
# 0.83 GiB); the per-tensor recipe on the model card is not in our notes.
GLM52_MLA = dict(q_lora=2048, kv_lora=512, heads=64, qk_nope=192, qk_rope=64, v_head=256)
GLM52_DENSE_FFN = 12288
GLM52_VOCAB = 154_880
GLM52_INDEXER = dict(heads=32, head_dim=128, every=4, first=3)


def _q(type_name: str, n_weights: int) -> int:
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


@dataclass(frozen=True)
class ResidentSet:
    """VRAM taken before the expert cache: free VRAM = VRAM - (non_routed - host_pinned) - runtime_overhead.

    non_routed: the file's non-routed weights; host_pinned: the part the engine keeps in pinned host RAM
    instead of VRAM; runtime_overhead: KV cache, compute buffers and the CUDA context."""

    non_routed_bytes: int
    host_pinned_bytes: int
    runtime_overhead_bytes: int
    source: str
    ctx_tokens: int  # --ctx of the run the runtime overhead comes from: KV buffers scale with it

    @property
    def vram_bytes(self) -> int:
        return self.non_routed_bytes - self.host_pinned_bytes + self.runtime_overhead_bytes


# DeepSeek-V4-Flash: ds4's #503 log gives "available 81.57 GiB" for the q2-q4 file on the 96 GB card
# (§1.12); with 8.20 GiB non-routed (antirez/ds4#488, §2.3) the runtime overhead is 96 - 81.57 - 8.20.
FLASH_NON_ROUTED_GIB = 8.20
FLASH_RUNTIME_OVERHEAD_GIB = 96 - 81.57 - 8.20  # [derived] from the #503 log on the RTX PRO 6000 96 GB
FLASH_CALIBRATION_CTX_TOKENS = 32768  # the #503 command line: --ctx 32768
# GLM-5.2 on the neutronstar rig (RTX 4060 Ti 16 GB), giannisanni/neutronstar README: "the resident
# weights want ~9-13 GiB VRAM plus ~8 GiB pinned host RAM". We keep the 8 GiB in host RAM and take the
# upper 13 GiB as all VRAM in use before the expert cache; the runtime overhead is what the derived
# non-routed weights on the GPU leave of it: 13 - (18.70 - 8) = 2.30 GiB [derived]. Cross-check: the f32
# compact MLA cache at the rig's --ctx 4096 is 78 x 4096 x (512 + 64) x 4 B = 0.69 GiB [derived], the rest
# compute buffers and the CUDA context. Calibrated for that 16 GB rig, not for other cards.
GLM52_HOST_PINNED_GIB = 8
GLM52_RESIDENT_VRAM_GIB = 13
GLM52_CALIBRATION_CTX_TOKENS = 4096  # the rig's --ctx 4096 (same README)


def resident_set(layout) -> ResidentSet:
    name = layout.name
    if name.startswith("deepseek-v4-flash"):
        return ResidentSet(int(FLASH_NON_ROUTED_GIB * GIB), 0, int(FLASH_RUNTIME_OVERHEAD_GIB * GIB),
                           "antirez/ds4#488 non-routed 8.20 GiB; runtime overhead from the #503 log (96 GB card)",
                           FLASH_CALIBRATION_CTX_TOKENS)
    if name.startswith("glm-5.2"):
        non_routed = glm52_non_routed_bytes(layout)
        host = GLM52_HOST_PINNED_GIB * GIB
        return ResidentSet(non_routed, host, GLM52_RESIDENT_VRAM_GIB * GIB - (non_routed - host),
                           "non-routed derived from GLM-5.2 geometry at Q8_0/F32; host-pinned part and "
                           "resident VRAM from the neutronstar README (16 GB rig)", GLM52_CALIBRATION_CTX_TOKENS)
    raise InputError("scenario", "model", name, "ds4 is modelled for deepseek-v4-flash and glm-5.2 only")


def _env_set(env, name: str) -> bool:
    return getattr(env, name, None) not in (None, "0", "")


def _env_count(where: str, env, name: str, minimum: int = 0) -> int | None:
    text = getattr(env, name, None)
    if text is None:
        return None
    if not text.strip().isdigit() or int(text) < minimum:
        raise InputError(where, f"engine.env.{name}", text, f"must be a whole number >= {minimum}")
    return int(text)


@functools.lru_cache(maxsize=8)
def builtin_hotlist(preset: str) -> np.ndarray | None:
    """Stand-in for ds4's built-in popularity list on a generator preset's expert ids (None: the preset's
    model has none): the preset's own profile run, as long as the run behind ds4's list, ranked by hits
    (sim.trace.generate.hotlist_profile_tokens says why). Read-only: the memo hands out one array."""
    tokens = hotlist_profile_tokens(preset)
    if tokens is None:
        return None
    keys = trace_profile(generate_trace(preset, tokens, 0, HOTLIST_PROFILE_SEED))
    keys.flags.writeable = False
    return keys


class Ds4Engine:
    """One ds4 process serving a scenario's requests in order."""

    def __init__(self, scenario, routing: WorkloadRouting, recorder: Recorder):
        self.scenario, self.routing, self.rec = scenario, routing, recorder
        hw, layout, engine = scenario.hardware_profile, scenario.layout, scenario.engine
        self.variant = engine.variant
        if self.variant == "pr1082":
            raise InputError(str(scenario.path or "scenario"), "engine.variant", self.variant,
                             "hits-first and the pread pool of ds4 #1082 are not modelled yet; use pr504")
        self.per_class = self.variant not in SLAB_VARIANTS
        self.compute = scenario.compute
        self.n_layers = layout.n_routed_layers  # the forward pass; MTP layers (if run) come after them
        self.n_experts = layout.n_experts
        # --mtp on a variant that runs the draft under streaming (validated by sim.scenario): each decode
        # token also routes the model's MTP layers, which are layout.layers[n_routed:] (its own size class)
        self.mtp = engine.flags.mtp is not None and layout.n_mtp_layers > 0
        self.mtp_layers = list(range(self.n_layers, self.n_layers + layout.n_mtp_layers)) if self.mtp else []
        self.layers = layout.layers[: self.n_layers + len(self.mtp_layers)]
        self.part_bytes = np.array([[x.gate_bytes, x.up_bytes, x.down_bytes] for x in self.layers], np.int64)
        self.expert_bytes = self.part_bytes.sum(axis=1)
        classes: dict = {}
        for x in self.layers:
            classes.setdefault((x.gate_bytes, x.down_bytes), len(classes))
        self.class_of_layer = np.array([classes[(x.gate_bytes, x.down_bytes)] for x in self.layers])
        self.class_keys = list(classes)
        self.class_bytes = [ds4_plan.expert_bytes(g, d) for g, d in classes]
        self.n_classes = len(classes)
        # budget and reserve, as the engine parses them
        flags, env = engine.flags, engine.env
        cli = None
        if flags.ssd_streaming_cache_experts is not None:
            cli = ds4_plan.parse_cache_experts_arg(flags.ssd_streaming_cache_experts, int(self.expert_bytes[0]))
        self.budget_experts = ds4_plan.requested_budget_experts(
            cli, getattr(env, "DS4_CUDA_STREAMING_EXPERT_CACHE_N", None))
        self.vram_total = int(hw.gpu.vram_gib.value * GIB)
        self.reserve_bytes = ds4_plan.vram_reserve_bytes(
            getattr(env, "DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB", None), self.vram_total)
        self.resident = resident_set(layout)
        if flags.ctx is not None and flags.ctx != self.resident.ctx_tokens:
            raise InputError(str(scenario.path or "scenario"), "engine.flags.ctx", flags.ctx,
                             f"not modelled: the VRAM ds4 holds before the expert cache ({self.resident.source}) "
                             f"is known at --ctx {self.resident.ctx_tokens} only")
        self.vram_free = self.vram_total - self.resident.vram_bytes
        pro = "pro" in layout.name
        self.chunk_default = DEFAULT_PREFILL_CHUNK_TOKENS_PRO if pro else DEFAULT_PREFILL_CHUNK_TOKENS
        where = str(scenario.path or "scenario")
        # --prefill-chunk wins; DS4_METAL_PREFILL_CHUNK is read when the flag is absent (§4)
        self.chunk_flag = flags.prefill_chunk or _env_count(where, env, "DS4_METAL_PREFILL_CHUNK", minimum=1)
        q4_first = all(t == "Q4_K" for t in (self.layers[0].gate_type, self.layers[0].up_type, self.layers[0].down_type))
        self.decode_path_max = DECODE_PATH_PREFILL_MAX_TOKENS_Q4 if q4_first else DECODE_PATH_PREFILL_MAX_TOKENS
        if _env_set(env, "DS4_METAL_DISABLE_STREAMING_DECODE_PREFILL"):
            self.decode_path_max = 0
        elif (limit := _env_count(where, env, "DS4_METAL_STREAMING_DECODE_PREFILL_MAX")) is not None:
            self.decode_path_max = limit
        self.seed_steps = self._hotlist_seed_plan(where)
        self.seeding = {"passes": 0, "loaded": 0, "layers_skipped_full": 0}
        # where a miss's bytes come from: the page cache (buffered pread of a file kept in RAM) or the SSD
        no_direct_io = _env_set(env, "DS4_CUDA_NO_DIRECT_IO")
        keep_pages = _env_set(env, "DS4_CUDA_KEEP_MODEL_PAGES")
        fits_in_ram = layout.total_expert_bytes + self.resident.non_routed_bytes < hw.host.ram_gib.value * GIB
        self.page_cache = no_direct_io and keep_pages and fits_in_ram
        lat = hw.latency
        self.memcpy_call_s = lat.memcpy_call_us.value * 1e-6
        self.sync_s = lat.device_sync_us.value * 1e-6
        self.malloc = (lat.cuda_malloc_us.value * 1e-6, lat.cuda_malloc_us_per_gib.value * 1e-6)
        self.free = (lat.cuda_free_us.value * 1e-6, lat.cuda_free_us_per_gib.value * 1e-6)
        self.links = {
            "file": Link("file", hw.ssd_read_gbps(1) * 1e9, hw.ssd.request_latency_us.value * 1e-6),
            "memcpy": Link("host memcpy", hw.host.memcpy_gbps.value * 1e9),
            "h2d": Link("PCIe H2D", hw.pcie.h2d_pinned_gbps.value * 1e9, hw.pcie.copy_fixed_latency_us.value * 1e-6),
            "d2d": Link("D2D", hw.d2d.copy_gbps.value * 1e9, self.memcpy_call_s),
            "compute": Link("GPU compute", 0.0),
            "host": Link("host calls", 0.0),
            "sync": Link("stream syncs", 0.0, self.sync_s),
        }
        # cache state: one LRU pool per class (pr504) or one pool for the slab (pre-504)
        n_pools = self.n_classes if self.per_class else 1
        self.cache = LRUCache(len(self.layers), self.n_experts, np.zeros(n_pools, np.int64))
        self.allocated = [False] * n_pools
        self.flushes = [0] * n_pools  # releases of a pool that held experts (their contents lost)
        self.size_changes = {"prefill": 0, "decode": 0}  # pre-504: slab released for another size class
        self.phase = "prefill"
        self.slab_class = -1
        self.staging_bytes = 0
        self.notices: list[str] = []
        # notice de-duplication: one state per class after #504, one global state before it
        self.dedup = [ds4_plan.NoticeDedup() for _ in range(self.n_classes if self.per_class else 1)]

    # --- VRAM ------------------------------------------------------------------------------------

    def _pool_bytes(self, pool: int) -> int:
        """VRAM of the pool's three slabs (0 when it is not allocated)."""
        if not self.allocated[pool]:
            return 0
        return int(self.cache.capacity[pool]) * self.class_bytes[pool if self.per_class else self.slab_class]

    def _cache_bytes(self) -> int:
        return sum(self._pool_bytes(pool) for pool in range(len(self.allocated)))

    def vram_used(self) -> int:
        return self.vram_total - self.vram_free + self._cache_bytes() + self.staging_bytes

    def _available(self) -> int:
        return self.vram_free - self._cache_bytes() - self.staging_bytes

    def _alloc_cost(self, n_bytes: int, release: bool) -> float:
        fixed, per_gib = self.free if release else self.malloc
        return fixed + per_gib * n_bytes / GIB

    def _release_all(self, t: float) -> float:
        """cuda_stream_expert_cache_release_all: free every cache (their contents are lost)."""
        for pool, allocated in enumerate(self.allocated):
            if allocated:
                t = self._free_pool(t, pool)
        self.slab_class = -1
        return t

    def _free_pool(self, t: float, pool: int) -> float:
        """cudaFree of one pool's slabs: its cached experts are lost."""
        t = self.links["host"].hold(t, self._alloc_cost(self._pool_bytes(pool), release=True))
        self.flushes[pool] += self.cache.count(pool) > 0
        self.cache.flush(pool)
        self.cache.resize(pool, 0)
        self.allocated[pool] = False
        return t

    def _prepare(self, t: float, cls: int, target_experts: int | None = None) -> tuple[float, int]:
        """prepare(): the cache of this size class for a target (default: the budget), through the pure
        rule ds4_plan.prepare_class_cache; pays the frees and allocations it makes; returns (time, pool)."""
        target = self.budget_experts if target_experts is None else min(target_experts, self.budget_experts)
        pool = cls if self.per_class else 0
        if not self.per_class and self.slab_class != cls:
            if self.allocated[0]:
                self.size_changes[self.phase] += 1
            self.dedup[0].reset()  # note_size() resets the cap and the notice on a size change
        if self.allocated[pool] and (self.per_class or self.slab_class == cls) and self.cache.capacity[pool] >= target:
            return t, pool  # the rule's "big enough: as is" answer, taken per layer step without building its inputs
        held = self.pool_state(pool)
        out = ds4_plan.prepare_class_cache(held, self.class_keys[cls], target, self._available(), self.reserve_bytes)
        if held is not None and out.state is held:
            return t, pool
        printed = self.dedup[pool].emit(out.notice)
        if printed is not None:
            self.notices.append(printed)
        if held is not None:  # a size change or growth releases the old allocation and its contents
            t = self._free_pool(t, pool)
        capacity = out.state.capacity_experts if out.state is not None else 0
        self.cache.resize(pool, capacity)
        self.allocated[pool] = out.state is not None
        self.slab_class = cls
        if capacity:
            t = self.links["host"].hold(t, self._alloc_cost(capacity * self.class_bytes[cls], release=False))
        return t, pool

    def pool_state(self, pool: int) -> ds4_plan.CacheState | None:
        """The pool's allocation as prepare() sees it: its size key and capacity, None when not allocated."""
        if not self.allocated[pool]:
            return None
        cls = pool if self.per_class else self.slab_class
        return ds4_plan.CacheState(self.class_keys[cls], int(self.cache.capacity[pool]))

    def _hotlist_seed_plan(self, where: str) -> list[tuple[int, np.ndarray]]:
        """The (layer, experts) steps of one seeding pass; empty when the engine would not seed (§1.9)."""
        scenario = self.scenario
        flags, env = scenario.engine.flags, scenario.engine.env
        if flags.ssd_streaming_cold or _env_set(env, "DS4_METAL_DISABLE_STREAMING_EXPERT_HOTLIST"):
            return []
        # on CUDA the pass runs only when the budget is "visible" (L1482-1492)
        visible = (flags.ssd_streaming_cache_experts is not None
                   or getattr(env, "DS4_CUDA_STREAMING_EXPERT_CACHE_N", None) is not None
                   or _env_set(env, "DS4_CUDA_ENABLE_STREAMING_EXPERT_HOTLIST")
                   or _env_set(env, "DS4_CUDA_STREAMING_EXPERT_HOTLIST"))
        seeded_layers = [i for i, x in enumerate(self.layers[: self.n_layers]) if x.gate_type.startswith("IQ2")]
        if not visible or not seeded_layers:
            return []
        path = getattr(env, "DS4_METAL_STREAMING_EXPERT_HOTLIST", None)
        if path:
            file = Path(path) if scenario.path is None else Path(scenario.path).parent / path
            ranking = read_profile(file, Geometry.of_layout(scenario.layout, self.n_layers))
        elif scenario.trace.generator is not None:
            ranking = builtin_hotlist(scenario.trace.generator)
            if ranking is None:  # ds4 ships lists for DeepSeek V4 Flash and Pro only
                return []
        elif scenario.layout.name.startswith("deepseek-v4"):
            raise InputError(where, "engine.env.DS4_METAL_STREAMING_EXPERT_HOTLIST", None,
                             "ds4 seeds its built-in hotlist here, whose expert ids only the real list has: give "
                             "it as a rank,layer,expert CSV, or set ssd-streaming-cold")
        else:
            return []
        preload = ds4_plan.hotlist_preload_experts(
            self.budget_experts, flags.ssd_streaming_preload_experts,
            getattr(env, "DS4_METAL_STREAMING_EXPERT_AUTO_PRELOAD_CAP", None))
        return ds4_plan.hotlist_seed_plan(ranking, self.n_experts, seeded_layers, preload)

    def _seed_from_hotlist(self, t: float, request: int, step_no: int) -> float:
        """metal_graph_seed_streaming_expert_cache_from_hotlist after a batch prefill (ds4.c L20814, §1.9):
        per layer, if its cache holds fewer than `preload` experts, prepare it for the layer's seed count and
        load each listed expert it lacks into its LRU slot (3 parts each, as a miss; no copy to staging)."""
        if not self.seed_steps:
            return t
        self.seeding["passes"] += 1
        preload = sum(len(e) for _, e in self.seed_steps)
        for layer, experts in self.seed_steps:
            pool = int(self.class_of_layer[layer]) if self.per_class else 0
            if self.allocated[pool] and self.cache.count(pool) >= preload:
                self.seeding["layers_skipped_full"] += 1
                continue
            t, loaded = self._fetch(t, layer, experts, MODE_EVICT,
                                    dict(request=request, phase="seed", step=step_no, layer=layer, start_s=t),
                                    target_experts=len(experts), to_kernel=False)
            self.seeding["loaded"] += loaded
        return t

    def _grow_staging(self, t: float, n_bytes: int) -> float:
        if n_bytes <= self.staging_bytes:
            return t
        if self.staging_bytes:
            t = self.links["host"].hold(t, self._alloc_cost(self.staging_bytes, release=True))
        if self.per_class and n_bytes - self.staging_bytes > self._available():
            t = self._release_all(t)  # pr504: sacrifice the caches only when VRAM is really short
        self.staging_bytes = n_bytes
        return self.links["host"].hold(t, self._alloc_cost(n_bytes, release=False))

    # --- copies ----------------------------------------------------------------------------------

    def _load_parts(self, t: float, layer: int, n_experts: int) -> float:
        """n experts' 3 parts, each read -> H2D -> stream sync, strictly one after another (QD1)."""
        if not n_experts:
            return t
        n_bytes = n_experts * int(self.expert_bytes[layer])
        n_ops = PARTS_PER_EXPERT * n_experts
        source = self.links["memcpy"] if self.page_cache else self.links["file"]
        return serial(t, [(source, n_bytes, n_ops), (self.links["h2d"], n_bytes, n_ops),
                          (self.links["sync"], 0, n_ops)])

    def _d2d(self, t: float, layer: int, n_experts: int) -> float:
        """n experts' 3 parts copied slab -> staging with one synchronous cudaMemcpy each."""
        if not n_experts:
            return t
        return serial(t, [(self.links["d2d"], n_experts * int(self.expert_bytes[layer]), PARTS_PER_EXPERT * n_experts)])

    def _fetch(self, t: float, layer: int, experts: np.ndarray, mode: int, step: dict,
               target_experts: int | None = None, to_kernel: bool = True) -> tuple[float, int]:
        """Look the experts up in their class cache (prepared for target_experts, default the budget) and move
        their bytes; records the step; returns (time, experts loaded into slots). to_kernel=False is a seeding
        pass: misses are loaded into their slots and nothing is copied to staging (nor loaded without a slot)."""
        cls = int(self.class_of_layer[layer])
        t, pool = self._prepare(t, cls, target_experts)
        outcome, _, _ = self.cache.access(layer, experts, pool, mode)
        n = np.bincount(outcome.astype(np.int64), minlength=4)
        hits, inserts, evictions, direct = (int(n[HIT]), int(n[INSERT]), int(n[EVICT]), int(n[DIRECT]))
        loaded = inserts + evictions
        if not to_kernel:
            direct = 0
        handed = hits + loaded if to_kernel else 0
        t = self._load_parts(t, layer, loaded + direct)
        t = self._d2d(t, layer, handed)
        step.update(lookups=len(experts), hits=hits, inserts=inserts, evictions=evictions, direct_loads=direct,
                    h2d_bytes=int((loaded + direct) * self.expert_bytes[layer]),
                    d2d_bytes=int(handed * self.expert_bytes[layer]),
                    file_read_bytes=int((loaded + direct) * self.expert_bytes[layer]),
                    file_blob_reads=loaded + direct)
        sid = self.rec.step(**step, end_s=t, vram_used_bytes=self.vram_used())
        for part, part_bytes in zip(("gate", "up", "down"), self.part_bytes[layer]):
            self.rec.copy(sid, "H2D", loaded, part_bytes, "file", f"slab:{part}")
            self.rec.copy(sid, "H2D", direct, part_bytes, "file", f"staging:{part}")
            self.rec.copy(sid, "D2D", handed, part_bytes, f"slab:{part}", f"staging:{part}")
        return t, loaded

    # --- the engine's paths ----------------------------------------------------------------------

    def _decode_token(self, t: float, request: int, phase: str, step_no: int, routing: np.ndarray,
                      mtp_routing: np.ndarray | None = None) -> float:
        """One token through the decode path; mtp_routing [mtp layers, k]: the draft step's experts, run
        after the forward pass (decode tokens only, when the scenario runs MTP)."""
        self.phase = phase
        steps = [(layer, routing[layer]) for layer in range(self.n_layers)]
        if mtp_routing is not None:
            steps += list(zip(self.mtp_layers, mtp_routing))
        for layer, experts in steps:
            start = t
            t = self.links["compute"].hold(t, self.compute.decode_us_per_token_layer.value * 1e-6)
            t = self.links["host"].hold(t, DEVICE_SYNCS_PER_DECODE_LAYER * self.sync_s + 2 * self.memcpy_call_s)
            t = self._grow_staging(t, int(len(experts) * self.expert_bytes[layer]))
            t, _ = self._fetch(t, layer, experts, MODE_EVICT,
                               dict(request=request, phase=phase, step=step_no, layer=layer, start_s=start, tokens=1))
        return t

    def _prefill_chunk(self, t: float, request: int, step_no: int, rows: np.ndarray) -> float:
        self.phase = "prefill"
        for layer in range(self.n_layers):
            start = t
            union = np.unique(rows[:, layer])
            union = union[union != 0xFFFF]
            t = self.links["host"].hold(t, self.sync_s + 2 * self.memcpy_call_s)  # ids read back, slot map
            if self.per_class:
                t = self._grow_staging(t, int(len(union) * self.expert_bytes[layer]))
                t, _ = self._fetch(t, layer, union, MODE_APPEND, dict(request=request, phase="prefill", step=step_no,
                                                                       layer=layer, start_s=start, tokens=len(rows)))
            else:
                t = self._release_all(t)  # pre-504: every batch call frees the resident cache first
                t = self._grow_staging(t, int(len(union) * self.expert_bytes[layer]))
                t = self._load_parts(t, layer, len(union))
                nbytes = int(len(union) * self.expert_bytes[layer])
                sid = self.rec.step(request=request, phase="prefill", step=step_no, layer=layer, start_s=start,
                                    end_s=t, tokens=len(rows), lookups=len(union), direct_loads=len(union),
                                    h2d_bytes=nbytes, file_read_bytes=nbytes, file_blob_reads=len(union),
                                    vram_used_bytes=self.vram_used())
                for part, part_bytes in zip(("gate", "up", "down"), self.part_bytes[layer]):
                    self.rec.copy(sid, "H2D", len(union), part_bytes, "file", f"staging:{part}")
            t = self.links["compute"].hold(t, len(rows) * self.compute.prefill_us_per_token_layer.value * 1e-6)
        return t

    def serve(self, env: simpy.Environment, timings: list):
        for request, (spec, routing) in enumerate(zip(self.scenario.workload.requests, self.routing.requests)):
            if spec.think_time_s:
                yield env.timeout(spec.think_time_s)
            arrival = env.now
            t = env.now
            prompt = routing.prompt
            if len(prompt) <= self.decode_path_max:
                for i, row in enumerate(prompt):
                    t = self._decode_token(t, request, "prefill", i, row)
                    yield env.timeout(t - env.now)
            else:
                chunk = self.chunk_flag or (len(prompt) if len(prompt) <= self.chunk_default else self.chunk_default)
                for step_no, first in enumerate(range(0, len(prompt), chunk)):
                    t = self._prefill_chunk(t, request, step_no, prompt[first: first + chunk])
                    yield env.timeout(t - env.now)
                t = self._seed_from_hotlist(t, request, step_no + 1)
                yield env.timeout(t - env.now)
            prefill_end = t
            first_token = None
            mtp = routing.mtp if self.mtp else None
            if self.mtp and (mtp is None or len(mtp) < len(routing.decode)):
                raise InputError("scenario", "trace", "no MTP routing", "--mtp needs the MTP layer's routing")
            for i, row in enumerate(routing.decode):
                t = self._decode_token(t, request, "decode", i, row, None if mtp is None else mtp[i])
                if first_token is None:
                    first_token = t
                yield env.timeout(t - env.now)
            timings.append({"request": request, "arrival_s": arrival, "prefill_end_s": prefill_end,
                            "first_token_s": first_token if first_token is not None else prefill_end, "end_s": t,
                            "prompt_tokens": len(prompt), "decode_tokens": len(routing.decode)})

    def belady_decode_hit_rate(self, request: int) -> float | None:
        """Decode hit rate of the Belady bound with the same class pools and slot counts: the most decode hits
        any cache of those sizes can get on the request's routing, its prompt warming the cache first
        (sim.cache.replay.decode_bound_hits); None for the slab, whose capacity changes with every size change."""
        if not self.per_class:
            return None
        from sim.cache.replay import Geometry, decode_bound_hits
        from sim.trace.format import PHASE_DECODE, PHASE_PREFILL, Trace, TraceHeader

        r = self.routing.requests[request]
        if not len(r.decode):
            return None
        prompt, decode = r.prompt[:, : self.n_layers], r.decode[:, : self.n_layers]
        if self.mtp:  # the draft runs on decode tokens only: its prompt cells are missing
            pad = np.full((len(prompt), len(self.mtp_layers), prompt.shape[2]), MISSING, np.uint16)
            prompt = np.concatenate([prompt, pad], axis=1)
            decode = np.concatenate([decode, r.mtp[: len(decode)]], axis=1)
        rows = np.concatenate([prompt, decode])
        phase = np.r_[np.full(len(prompt), PHASE_PREFILL), np.full(len(decode), PHASE_DECODE)].astype(np.uint8)
        header = TraceHeader(self.scenario.layout.name, rows.shape[1], self.n_experts, rows.shape[2], "run", "")
        trace = Trace(header, np.zeros(len(rows)), np.arange(len(rows)), phase, rows)
        hits = decode_bound_hits(trace, Geometry.of(trace, self.scenario.layout), np.array(self.cache.capacity))
        return float(hits.sum() / np.count_nonzero(decode != MISSING))

    def state(self) -> dict:
        caps = [int(c) for c in self.cache.capacity]
        return {"cache_slots": int(sum(caps)), "cache_slots_per_class": caps,
                "cache_mib": self._cache_bytes() / MIB, "lent_slots": 0,
                "prefill_buffer_mib": self.staging_bytes / MIB, "notices": list(self.notices),
                "reserve_gib": self.reserve_bytes / GIB, "budget_experts": self.budget_experts,
                "miss_source": "page cache" if self.page_cache else "SSD (O_DIRECT, QD1)",
                "class_expert_bytes": [int(b) for b in self.class_bytes],
                "mtp_layers": [int(x) for x in self.mtp_layers],
                "flushes_per_pool": list(self.flushes), "hotlist_seeding": dict(self.seeding),
                "hotlist_seed_experts": int(sum(len(e) for _, e in self.seed_steps)), "slab_size_changes": dict(self.size_changes),
                "vram_before_cache_gib": self.resident.vram_bytes / GIB,
                "non_routed_gib": self.resident.non_routed_bytes / GIB,
                "host_pinned_non_routed_gib": self.resident.host_pinned_bytes / GIB,
                "runtime_overhead_gib": self.resident.runtime_overhead_bytes / GIB,
                "resident_set_source": self.resident.source}
