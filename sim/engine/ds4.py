"""ds4's SSD-streaming expert cache (CUDA, and the Metal backend below) as SimPy processes on the simulated machine (antirez/ds4 @80ebbc3,
PR #504 and its successors; the rules are in ds4_plan.py, the variants in ds4_plan.VARIANTS).

Scenario: one ds4 process serves a scenario's requests in order. Its threads are host-thread servers of the
machine (the main thread, the selected-load worker, #1082's pread pool); the GPU's legacy default stream,
the copy engines and the drive are the machine's. Each thread issues its work and waits on the event it gets
back, so what overlaps and what queues comes from who waits on what (reference/ds4-engine.md §1.6-§1.8):

decode, per token and layer (the "selected/shared overlap" path, §1.6):
  main     attention + router on the default stream, then a device sync (the selected readback)
  worker   device sync, the 6 ids read back (a small synchronous cudaMemcpy), the cache lookup (numba), then
           for each miss 3 x (read -> H2D -> stream sync) strictly in turn (QD1: the worker waits each time),
           then the hits and the loaded experts copied into compact staging (3 synchronous D2D cudaMemcpy each,
           on the default stream, so they queue behind the kernels), then the slot map uploaded
  main     meanwhile enqueues the shared expert on the default stream; joins the worker; enqueues the routed
           experts' kernel, which the next layer's work queues behind.
  Variants change who waits on what, not the arithmetic: pr605-cache gathers the hits with one kernel instead of
  the per-expert copies, and pr605 also copies a miss's parts straight from the mapped file without O_DIRECT
  (one sync per expert with it); pr1031 has no copy at all (kernels read the slots); pr1082 enqueues the hits' experts
  first and reads the misses with 8 pread workers, each with its own staging and stream, so reads overlap
  each other (the drive's queue depth) and the hits' compute. DS4_CUDA_DISABLE_STREAMING_SELECTED_SHARED_OVERLAP
  runs the fetch before the shared expert on the main thread.
prefill: prompts of <= 18 tokens (64 when layer 0 is Q4_K) run the decode path token by token; longer ones
  run layer-major in chunks: per layer the chunk's expert union is staged (grow-only; cudaMalloc on growth),
  looked up in append mode (pr504+: hits copied, misses fill free slots, the rest loaded directly, never an
  eviction) or, before #504, loaded whole after release_all frees every cache. The neutronstar GLM stack reads
  each layer's whole expert tensors instead (Variant.prefill_whole_layers).
a miss's bytes: with DS4_CUDA_NO_DIRECT_IO a buffered pread through the page cache (a hit is a host memcpy;
  a miss reads the drive, then copies), the pages dropped again unless DS4_CUDA_KEEP_MODEL_PAGES; otherwise
  O_DIRECT reads from the drive into pinned staging. The page cache is the RAM nobody holds (finite).
the Metal backend (a Metal profile, variant main-0814: ds4_metal.m and ds4.c read at upstream b0309611 for the
  build of @84cc882): the same decode layer (the async load worker beside the shared expert), but one cache table
  for the whole model evicting by route hotness (sim.cache.hotness), its slots wired as they fill (the pool of
  unified memory the page cache lives in shrinks with them); a miss is 3 buffered preads into the slot on a pool of
  9 threads, a hit is read in place; the non-routed weights are the mapped file's pages, faulted from the drive
  when the page cache lacks them; a warm page cache is what the same command's previous run left. The split
  hits-first path runs once the cache is warm. The GPU runs what the host has committed: a layer's routed experts
  wait for the next layer's encode, and every layer whose router picks its experts costs a host round trip
  (record ds4-metal-round-trip-437); the hash layers (0-2) get their ids on the host. Not modelled there: its batch
  prefill (prompts over 18 tokens, 64 for Q4_K/MXFP4 files) and mixed-quant files.
Every layer step is one row of steps.parquet; the copies of a step are rows of copy_plan.parquet.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import simpy

from sim.cache.hotness import SPLIT_MIN_MISSES, RouteHotnessCache
from sim.cache.kernels import DIRECT, EVICT, HIT, INSERT, MODE_APPEND, MODE_EVICT
from sim.cache.replay import Geometry, LRUCache, read_profile, trace_profile
from sim.engine import ds4_plan
from sim.engine.ds4_plan import PREAD_POOL_WORKERS, VARIANTS, env_count, env_set
from sim.engine.timeline import Recorder
from sim.engine.workload import WorkloadRouting
from sim.errors import InputError
from sim.trace.format import MISSING
from sim.trace.generate import HOTLIST_PROFILE_SEED, generate_trace, hotlist_profile_tokens
from sim.units import GIB, MIB

# fmt: off
DECODE_PATH_PREFILL_MAX_TOKENS = 18        # ds4.c L19505-19567: short prompts run the decode path (§1.7)
DECODE_PATH_PREFILL_MAX_TOKENS_Q4 = 64     # ... 64 when layer 0's experts are all Q4_K (§1.7)
DEFAULT_PREFILL_CHUNK_TOKENS = 4096        # ds4_prefill_cap_for_prompt, ds4.c L8330 (§1.7)
DEFAULT_PREFILL_CHUNK_TOKENS_PRO = 8192    # same, DeepSeek V4 Pro (§1.7)
PARTS_PER_EXPERT = 3                       # gate, up, down: three file ranges, three copies (§1.8)
PINNED_STAGING_BUFFERS = 4                 # the pinned host ring (§1.2, L218-222)
DEFAULT_COPY_CHUNK_MIB = 64                # DS4_CUDA_MODEL_COPY_CHUNK_MB default (§1.2)
ROCM_READ_WORKERS = 16                     # DS4_ROCM_STREAM_READ_DEFAULT_WORKERS (rocm/ds4_rocm_runtime.cuh @54b36ed)
WEIGHT_ARENA_CHUNK_MIB = 1792              # DS4_CUDA_WEIGHT_ARENA_CHUNK_MB default (ds4_cuda.cu @54b36ed L1759-1775)
SELECTED_IDS_BYTES = 6 * 4                 # the router's 6 int32 ids read back per layer (§1.6)
METAL_HASH_LAYERS = 3                      # DS4_N_HASH_LAYER, Flash (ds4.c @b0309611 L560): routed by the token's table
APPLE_PAGE_BYTES = 16 * 1024               # getpagesize() on Apple silicon macOS: the Metal cache's slots are page-rounded
METAL_CACHE_MEMORY = "expert cache (wired slots)"  # the Metal cache's share of the pool (an allocation's name)
# fmt: on


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


class Ds4:
    """One ds4 process serving a scenario's requests in order (see the module docstring)."""

    name = "ds4"

    def __init__(self, scenario, routing: WorkloadRouting, recorder: Recorder, machine, domain):
        self.scenario, self.routing, self.rec, self.m, self.domain = scenario, routing, recorder, machine, domain
        hw, layout, engine = scenario.hardware_profile, scenario.layout, scenario.engine
        where = str(scenario.path or "scenario")
        self.variant = VARIANTS[engine.variant]
        flags, env = engine.flags, engine.env
        self.per_class = self.variant.per_class
        self.n_layers = layout.n_routed_layers  # the forward pass; MTP layers (if run) come after them
        self.n_experts = layout.n_experts
        # --mtp on a variant that runs the draft under streaming: each decode token also routes the model's
        # MTP layers, layout.layers[n_routed:] (their own size class)
        self.mtp = flags.mtp is not None and layout.n_mtp_layers > 0
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
        # budget, reserve, context and chunk, as the engine parses them
        cli = None
        if flags.ssd_streaming_cache_experts is not None:
            cli = ds4_plan.parse_cache_experts_arg(flags.ssd_streaming_cache_experts, int(self.expert_bytes[0]))
        self.budget_experts = ds4_plan.requested_budget_experts(
            cli, getattr(env, "DS4_CUDA_STREAMING_EXPERT_CACHE_N", None))
        self.reserve_bytes = ds4_plan.vram_reserve_bytes(
            getattr(env, "DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB", None), hw.vram_bytes)
        self.ctx = ds4_plan.context_tokens(flags)
        pro = "pro" in layout.name
        self.chunk_default = DEFAULT_PREFILL_CHUNK_TOKENS_PRO if pro else DEFAULT_PREFILL_CHUNK_TOKENS
        # --prefill-chunk wins; DS4_METAL_PREFILL_CHUNK is read when the flag is absent (§4)
        self.chunk_flag = flags.prefill_chunk or env_count(where, env, "DS4_METAL_PREFILL_CHUNK", minimum=1)
        self.metal = hw.gpu.api == "metal"
        # the 64-token rule's types: Q4_K, and MXFP4 too in the Metal build (ds4.c @b0309611 L29861-L29870)
        wide = ("Q4_K", "MXFP4") if self.metal else ("Q4_K",)
        first = (self.layers[0].gate_type, self.layers[0].up_type, self.layers[0].down_type)
        q4_first = first[0] in wide and len(set(first)) == 1
        self.decode_path_max = DECODE_PATH_PREFILL_MAX_TOKENS_Q4 if q4_first else DECODE_PATH_PREFILL_MAX_TOKENS
        if env_set(env, "DS4_METAL_DISABLE_STREAMING_DECODE_PREFILL"):
            self.decode_path_max = 0
        elif (limit := env_count(where, env, "DS4_METAL_STREAMING_DECODE_PREFILL_MAX")) is not None:
            self.decode_path_max = limit
        self.overlap = not env_set(env, "DS4_CUDA_DISABLE_STREAMING_SELECTED_SHARED_OVERLAP")
        self.hits_first = self.variant.pread_pool and getattr(env, "DS4_CUDA_HITS_FIRST", None) != "0"
        self.pool_workers = PREAD_POOL_WORKERS if (self.variant.pread_pool and getattr(
            env, "DS4_CUDA_STREAMING_EXPERT_PREAD_POOL", None) != "0") else 0
        # the ROCm runtime of the planner builds reads every load, prompt and decode, through its own pool of
        # O_DIRECT readers, each with pinned staging and an upload stream (rocm/ds4_rocm_runtime.cuh @54b36ed)
        self.rocm_readers = hw.gpu.api == "hip" and self.variant.budget.startswith("planner")
        if self.rocm_readers:
            self.pool_workers = ROCM_READ_WORKERS
        # where a miss's bytes come from (§1.8)
        self.buffered = env_set(env, "DS4_CUDA_NO_DIRECT_IO")
        self.keep_pages = env_set(env, "DS4_CUDA_KEEP_MODEL_PAGES")
        # VRAM before the cache, derived (ds4_plan.resident_set), and the host side
        chunk_cap = self.chunk_flag or self.chunk_default
        self.family = ds4_plan.model_family(scenario)
        self.resident = ds4_plan.resident_set(layout, self.family, hw, self.ctx, chunk_cap, domain)
        mem = machine.memory
        mem.set("vram", "runtime reserved (driver, context)", self.resident.runtime_reserved)
        mem.set("vram", "KV cache", self.resident.kv)
        mem.set("vram", "prefill context buffers", self.resident.context_buffers)
        mem.set("vram", "compute buffers", self.resident.compute_buffers)
        mem.set("ram", "pinned non-routed weights", self.resident.host_pinned)
        copy_chunk = env_count(where, env, "DS4_CUDA_MODEL_COPY_CHUNK_MB") or DEFAULT_COPY_CHUNK_MIB
        copy_chunk = min(max(copy_chunk, ds4_plan.COPY_CHUNK_MIB_RANGE[0]), ds4_plan.COPY_CHUNK_MIB_RANGE[1])
        staging_buffers = PINNED_STAGING_BUFFERS + self.pool_workers
        if not self.metal:  # Metal preads straight into the cache's shared slots: no pinned ring
            mem.set("ram", "pinned staging", staging_buffers * copy_chunk * MIB)
        self.copy_chunk_bytes = copy_chunk * MIB
        self.staging_bytes = 0
        self.notices: list[str] = []
        self._plan_budget(where, hw)
        self.weight_pcie_bytes = self._place_weights(hw)
        if mem.vram_free() <= 0:
            raise InputError(where, "hardware", hw.name,
                             f"ds4 needs {self.resident.vram / GIB:.2f} GiB before its expert cache; the GPU has "
                             f"{hw.vram_bytes / GIB:.2f} GiB")
        # compute per layer: the profile's per-token figures split by the bytes each part reads
        compute = scenario.compute
        if compute.decode_us_per_token_layer is None:
            raise InputError(str(hw.path or hw.name), f"compute.{scenario.compute_key}.decode_us_per_token_layer", None,
                             "ds4's decode needs the GPU time per token and layer of this model class")
        work = ds4_plan.decode_bytes_by_layer(layout, self.family, range(len(self.layers)))
        share = work / work[: self.n_layers].sum() * self.n_layers  # mean layer = 1
        self.decode_s = compute.decode_us_per_token_layer.value * 1e-6 * share  # [layer, (other, shared, routed)]
        # non-routed weights past VRAM: their kernels read them over PCIe, the link's time in place of DRAM's
        over = self.weight_pcie_bytes / self.resident.non_routed if self.resident.non_routed else 0.0
        self.weight_link_s = over * work[:, :2].sum(axis=1) / machine.h2d.bytes_per_s  # per layer, per pass
        self.decode_link_s = np.maximum(self.weight_link_s - over * self.decode_s[:, :2].sum(axis=1), 0.0)
        # The main thread encodes each decode layer's graph before the GPU can run it: CPU time per token,
        # measured on a GB10 (record ds4-graph-encode-773), serial with the layer's kernels.
        encode = domain.use("ds4-graph-encode-773", "ds4's graph encode per decode token")
        self.encode_layer_s = encode.value * 1e-3 / self.n_layers
        self.prefill_s = compute.prefill_us_per_token_layer.value * 1e-6 * share
        fixed = compute.prefill_us_per_chunk_layer
        self.prefill_chunk_fixed_s = 0.0 if fixed is None else fixed.value * 1e-6
        # threads
        self.main = machine.threads("ds4 main thread")
        self.worker = machine.threads("ds4 selected-load worker")
        if self.metal:
            self.pool_workers = ds4_plan.metal_pread_threads(env)
        self.pool = [machine.threads(f"ds4 pread worker {i}") for i in range(self.pool_workers)] \
            if self.pool_workers else None
        # cache state: one LRU pool per class (#504 and later) or one pool for the slab (pre-504)
        n_pools = self.n_classes if self.per_class else 1
        self.cache = LRUCache(len(self.layers), self.n_experts, np.zeros(n_pools, np.int64))
        self.allocated = [False] * n_pools
        self.flushes = [0] * n_pools  # releases of a pool that held experts (their contents lost)
        self.size_changes = {"prefill": 0, "decode": 0}  # pre-504: slab released for another size class
        self.phase = "prefill"
        self.slab_class = -1
        self.dedup = [ds4_plan.NoticeDedup() for _ in range(self.n_classes if self.per_class else 1)]
        self.seed_steps = self._hotlist_seed_plan(where)
        self.seeding = {"passes": 0, "loaded": 0, "layers_skipped_full": 0}
        self.page_cache_reads = {"hits": 0, "misses": 0}
        if self.metal:
            self._metal_init(where, work)
        elif scenario.workload.page_cache == "warm":  # the file was read before: the page cache holds what fits
            machine.page_cache.warm(np.arange(self.n_layers * self.n_experts))

    # --- the budget of the later builds ----------------------------------------------------------

    def _plan_budget(self, where: str, hw) -> None:
        """The expert budget as the variant's build sizes it (ds4_plan.budget_plan): the planner's dynamic experts
        replace the live budget, its prefill headroom is held as staging from the start, and the planner's own
        accounting replaces the live reserve. CUDA @54b36ed plans a cache but never allocates it (the streaming
        cache API there is a stub: ds4_gpu_set_streaming_expert_cache_budget ignores its count)."""
        self.planned_experts = None
        mode = self.variant.budget
        if mode == "live":
            return
        flags, env = self.scenario.engine.flags, self.scenario.engine.env
        given = flags.ssd_streaming_cache_experts is not None or getattr(env, "DS4_CUDA_STREAMING_EXPERT_CACHE_N",
                                                                         None) is not None
        if mode == "auto-488" and given:  # #488 changes only the no-budget case
            return
        requested_bytes = ds4_plan.cache_budget_bytes(flags.ssd_streaming_cache_experts)
        layers_per_class = np.bincount(self.class_of_layer[: self.n_layers], minlength=self.n_classes)
        dominant = int(np.argmax(layers_per_class))  # the size most routed layers have, the first on ties
        r = self.resident
        plan = ds4_plan.budget_plan(
            mode, api=hw.gpu.api, working_set=hw.vram_bytes, requested_bytes=requested_bytes,
            requested_experts=self.budget_experts if given and requested_bytes is None else None,
            expert_size=self.class_bytes[dominant], n_experts=self.n_experts,
            cacheable_layers=int(layers_per_class[dominant]), non_routed=r.non_routed,
            context_bytes=r.context_memory, fixed_bytes=r.vram - r.runtime_reserved, where=where)
        self.notices.extend(plan.notices)
        self.planned_experts = plan.cache_experts
        self.budget_experts = plan.cache_experts
        if mode != "auto-488":
            self.reserve_bytes = 0
        if mode == "planner" and hw.gpu.api == "cuda":  # nor its headroom: the compact staging grows as before
            self.budget_experts = 0
            self.notices.append(f"CUDA at this build never allocates the planned {plan.cache_experts} experts: every "
                                "selected expert is read per use")
        elif plan.headroom_bytes and not self.metal:  # Metal allocates it in a batch prefill, which is not modelled
            self.staging_bytes = plan.headroom_bytes
            self.m.memory.set("vram", "compact staging", plan.headroom_bytes)

    def _place_weights(self, hw) -> int:
        """Non-routed weights on a discrete card for the builds whose weight cache fills VRAM arena chunks lazily
        (cuda_model_arena_alloc @54b36ed: 1,792 MiB each) and maps what does not fit from host memory: the chunks
        that fit beside everything else hold weights, the rest is read over PCIe at every use. Returns those
        bytes (0: all in VRAM)."""
        r, mem = self.resident, self.m.memory
        in_vram = r.non_routed - r.host_pinned
        if self.metal:  # no copy: Metal wraps the mapped file's pages (the page cache's, see _metal_init)
            return 0
        if not self.variant.weight_overflow or hw.is_unified:
            mem.set("vram", "non-routed weights", in_vram)
            return 0
        # what the weights may take: the first layer's staging (up to a whole layer of experts) is allocated before
        # the arena has filled, the arena's chunks coming one by one as the first pass meets the tensors
        first_staging = max(0, self.n_experts * max(self.class_bytes) - self.staging_bytes)
        free = mem.vram_free() - first_staging
        if in_vram <= free:
            mem.set("vram", "non-routed weights", in_vram)
            return 0
        chunks = max(0, free) // (WEIGHT_ARENA_CHUNK_MIB * MIB)
        placed = min(in_vram, chunks * WEIGHT_ARENA_CHUNK_MIB * MIB)
        mem.set("vram", "non-routed weights", placed)
        mem.set("ram", "mapped non-routed weights (read over PCIe)", in_vram - placed)
        self.notices.append(f"CUDA model arena full: {(in_vram - placed) / GIB:.2f} GiB of non-routed weights stay in "
                            "mapped host memory, read over PCIe at every use")
        return int(in_vram - placed)

    # --- VRAM ------------------------------------------------------------------------------------

    def _pool_bytes(self, pool: int) -> int:
        """VRAM of the pool's three slabs (0 when it is not allocated)."""
        if not self.allocated[pool]:
            return 0
        return int(self.cache.capacity[pool]) * self.class_bytes[pool if self.per_class else self.slab_class]

    def _cache_bytes(self) -> int:
        return sum(self._pool_bytes(pool) for pool in range(len(self.allocated)))

    def _set_pool_memory(self, pool: int) -> None:
        self.m.memory.set("vram", f"expert cache pool {pool}", self._pool_bytes(pool))

    def vram_used(self) -> int:
        return self.m.memory.used("vram")

    def _available(self) -> int:
        return self.m.memory.vram_free()

    def _free_pool(self, thread, pool: int):
        """cudaFree of one pool's slabs (the thread waits): its cached experts are lost."""
        yield thread.hold(self.m.alloc_seconds(self._pool_bytes(pool), release=True))
        self.flushes[pool] += self.cache.count(pool) > 0
        self.cache.flush(pool)
        self.cache.resize(pool, 0)
        self.allocated[pool] = False
        self._set_pool_memory(pool)

    def _release_all(self, thread):
        """cuda_stream_expert_cache_release_all: free every cache (their contents are lost)."""
        for pool, allocated in enumerate(self.allocated):
            if allocated:
                yield from self._free_pool(thread, pool)
        self.slab_class = -1

    def _prepare(self, thread, cls: int, target_experts: int | None = None):
        """prepare(): the cache of this size class for a target (default: the budget), through the pure rule
        ds4_plan.prepare_class_cache; the thread pays the frees and allocations. Returns the pool."""
        target = self.budget_experts if target_experts is None else min(target_experts, self.budget_experts)
        pool = cls if self.per_class else 0
        if not self.per_class and self.slab_class != cls:
            if self.allocated[0]:
                self.size_changes[self.phase] += 1
            self.dedup[0].reset()  # note_size() resets the cap and the notice on a size change
        if self.allocated[pool] and (self.per_class or self.slab_class == cls) and self.cache.capacity[pool] >= target:
            return pool  # the rule's "big enough: as is" answer, taken per layer step without building its inputs
        held = self.pool_state(pool)
        out = ds4_plan.prepare_class_cache(held, self.class_keys[cls], target, self._available(), self.reserve_bytes)
        if held is not None and out.state is held:
            return pool
        printed = self.dedup[pool].emit(out.notice)
        if printed is not None:
            self.notices.append(printed)
        if held is not None:  # a size change or growth releases the old allocation and its contents
            yield from self._free_pool(thread, pool)
        capacity = out.state.capacity_experts if out.state is not None else 0
        self.cache.resize(pool, capacity)
        self.allocated[pool] = out.state is not None
        self.slab_class = cls
        if capacity:
            yield thread.hold(self.m.alloc_seconds(capacity * self.class_bytes[cls], release=False))
        self._set_pool_memory(pool)
        return pool

    def pool_state(self, pool: int) -> ds4_plan.CacheState | None:
        """The pool's allocation as prepare() sees it: its size key and capacity, None when not allocated."""
        if not self.allocated[pool]:
            return None
        cls = pool if self.per_class else self.slab_class
        return ds4_plan.CacheState(self.class_keys[cls], int(self.cache.capacity[pool]))

    def _grow_staging(self, thread, n_bytes: int):
        """The grow-only compact staging buffer: on growth cudaFree the old one and cudaMalloc the new one;
        after #504 the caches are sacrificed only when VRAM is really short (begin_compact_load)."""
        if n_bytes <= self.staging_bytes:
            return
        if self.staging_bytes:
            yield thread.hold(self.m.alloc_seconds(self.staging_bytes, release=True))
        if self.per_class and n_bytes - self.staging_bytes > self._available():
            yield from self._release_all(thread)
        self.staging_bytes = n_bytes
        self.m.memory.set("vram", "compact staging", n_bytes)
        yield thread.hold(self.m.alloc_seconds(n_bytes, release=False))

    # --- hotlist ---------------------------------------------------------------------------------

    def _hotlist_seed_plan(self, where: str) -> list[tuple[int, np.ndarray]]:
        """The (layer, experts) steps of one seeding pass; empty when the engine would not seed (§1.9)."""
        scenario = self.scenario
        flags, env = scenario.engine.flags, scenario.engine.env
        if flags.ssd_streaming_cold or env_set(env, "DS4_METAL_DISABLE_STREAMING_EXPERT_HOTLIST"):
            return []
        # on CUDA the pass runs only when the budget is "visible" (L1482-1492)
        visible = (flags.ssd_streaming_cache_experts is not None
                   or getattr(env, "DS4_CUDA_STREAMING_EXPERT_CACHE_N", None) is not None
                   or env_set(env, "DS4_CUDA_ENABLE_STREAMING_EXPERT_HOTLIST")
                   or env_set(env, "DS4_CUDA_STREAMING_EXPERT_HOTLIST"))
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
        elif self.family == "deepseek-v4":
            raise InputError(where, "engine.env.DS4_METAL_STREAMING_EXPERT_HOTLIST", None,
                             "ds4 seeds its built-in hotlist here, whose expert ids only the real list has: give "
                             "it as a rank,layer,expert CSV, or set ssd-streaming-cold")
        else:
            return []
        preload = ds4_plan.hotlist_preload_experts(
            self.budget_experts, flags.ssd_streaming_preload_experts,
            getattr(env, "DS4_METAL_STREAMING_EXPERT_AUTO_PRELOAD_CAP", None))
        return ds4_plan.hotlist_seed_plan(ranking, self.n_experts, seeded_layers, preload)

    def _seed_from_hotlist(self, request: int, step_no: int):
        """metal_graph_seed_streaming_expert_cache_from_hotlist after a batch prefill (ds4.c L20814, §1.9): per
        layer, if its cache holds fewer than `preload` experts, prepare it for the layer's seed count and load
        each listed expert it lacks into its LRU slot (3 parts each, as a miss; no copy to staging)."""
        if not self.seed_steps:
            return
        self.seeding["passes"] += 1
        preload = sum(len(e) for _, e in self.seed_steps)
        for layer, experts in self.seed_steps:
            pool = int(self.class_of_layer[layer]) if self.per_class else 0
            if self.allocated[pool] and self.cache.count(pool) >= preload:
                self.seeding["layers_skipped_full"] += 1
                continue
            start = self.m.env.now
            pool = yield from self._prepare(self.main, int(self.class_of_layer[layer]), len(experts))
            outcome, _, _ = self.cache.access(layer, experts, pool, MODE_EVICT)
            missing = experts[(outcome == INSERT) | (outcome == EVICT)]
            yield from self._load(self.main, layer, missing)
            self.seeding["loaded"] += len(missing)
            self._record(dict(request=request, phase="seed", step=step_no, layer=layer, start_s=start,
                              lookups=len(experts), inserts=int((outcome == INSERT).sum()),
                              evictions=int((outcome == EVICT).sum())), layer, loaded=len(missing))

    # --- the bytes of a miss ---------------------------------------------------------------------

    def _read(self, thread, layer: int, experts: np.ndarray, depth: int = 1):
        """Read these experts' 3 parts each into pinned staging, the thread waiting (§1.8): buffered preads go
        through the page cache (a hit is a host memcpy, a miss a drive read plus the copy); O_DIRECT reads the
        drive. Returns the bytes that came from the drive."""
        if not len(experts):
            return 0
        m = self.m
        n_bytes = int(self.expert_bytes[layer]) * len(experts)
        if self.buffered:
            keys, in_ram, drive = self._page_cache_lookup(layer, experts)
            if drive:
                yield m.ssd.read(drive, PARTS_PER_EXPERT * int((~in_ram).sum()), depth)
            yield from m.memcpy(thread, n_bytes, 1, "pread copy")
            if not self.keep_pages:  # posix_fadvise / madvise DONTNEED after the copy
                m.page_cache.drop(keys)
            return drive
        yield m.ssd.read(n_bytes, PARTS_PER_EXPERT * len(experts), depth)
        return n_bytes

    def _load(self, thread, layer: int, experts: np.ndarray):
        """The engine's streamed copy for each expert: 3 x (read -> H2D on the upload stream -> stream sync),
        one part after another (QD1). Grouped per call: with one thread the chain's time is the sum either way.
        #605's later commits: with no O_DIRECT fd each part is a plain cudaMemcpy from the mapped file (the
        driver's pageable copy, 5930a3f); with one, the ring is kept across an expert's three parts and synced
        once (1c055bb), so the gate and up uploads run while the next part is read."""
        if not len(experts):
            return 0
        m = self.m
        n_parts = PARTS_PER_EXPERT * len(experts)
        n_bytes = int(self.expert_bytes[layer]) * len(experts)
        pr605 = self.variant.miss_copy == "pr605"
        if pr605 and self.buffered:
            drive = yield from self._map_in(layer, experts)
            end = m.h2d.book(n_bytes / m.rates["h2d_pageable"], n_bytes, n_parts, "pageable H2D")
            yield thread.hold(n_parts * m.memcpy_call_s, 0, n_parts, "cudaMemcpy (pageable)", ready_s=end)
            return drive
        drive = yield from self._read(thread, layer, experts)
        if pr605:  # 1c055bb: only the down parts' uploads are left after the reads
            m.h2d.book_copy(int(self.part_bytes[layer, 2]) * len(experts), len(experts))
            n_syncs = len(experts)
        else:
            m.h2d.book_copy(n_bytes, n_parts)  # the thread waits for the copy, then syncs the stream
            n_syncs = n_parts
        yield thread.hold(n_syncs * m.sync_s, 0, n_syncs, "stream sync", ready_s=m.h2d.end_of_last())
        return drive

    def _map_in(self, layer: int, experts: np.ndarray):
        """The pages of these experts in the mapped file, as a copy from the mapping touches them: page-cache
        hits are in RAM, misses fault in from the drive one after another; the pages dropped again unless
        DS4_CUDA_KEEP_MODEL_PAGES (as after a buffered pread). Returns the bytes that came from the drive."""
        m = self.m
        keys, _, drive = self._page_cache_lookup(layer, experts)
        if drive:
            yield m.ssd.read(drive, m.ssd.fault_reads(drive), 1)
        if not self.keep_pages:
            m.page_cache.drop(keys)
        return drive

    def _page_cache_lookup(self, layer: int, experts: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """These experts' file extents looked up (and inserted) in the page cache: their keys, which were
        resident, and the bytes the others read from the drive; the hits and misses counted."""
        keys = layer * self.n_experts + experts.astype(np.int64)
        in_ram = self.m.page_cache.access(keys, insert=True)
        n_miss = int((~in_ram).sum())
        self.page_cache_reads["hits"] += len(keys) - n_miss
        self.page_cache_reads["misses"] += n_miss
        return keys, in_ram, n_miss * int(self.expert_bytes[layer])

    def _stream_whole_layer(self, thread, layer: int):
        """Every expert of the layer through the weight cache's staged copy (cuda_model_range_ptr_from_fd,
        neutronstar @253cfb1 ds4_cuda.cu L1300-1390): one copy chunk read at a time into the pinned ring, each
        uploaded on the upload stream while the next is read, one stream sync at the end. Whole experts per
        chunk (the tensors' chunks do not end on experts; the bytes are the same). Returns the drive's bytes."""
        per_chunk = max(1, self.copy_chunk_bytes // int(self.expert_bytes[layer]))
        drive = 0
        for first in range(0, self.n_experts, per_chunk):
            group = np.arange(first, min(first + per_chunk, self.n_experts))
            drive += yield from self._read(thread, layer, group)
            self.m.h2d.book_copy(int(self.expert_bytes[layer]) * len(group), 1)
        yield thread.hold(self.m.sync_s, 0, 1, "stream sync", ready_s=self.m.h2d.end_of_last())
        return drive

    def _pool_load(self, layer: int, experts: np.ndarray):
        """#1082's pread pool (and the ROCm runtime's): the misses split over the workers, each reading (its own
        QD1) into its own pinned staging and uploading on its own stream; the reads overlap at the drive, the
        uploads queue on the copy engine. Returns the bytes that came from the drive."""
        env = self.m.env
        shares = [experts[i::self.pool_workers] for i in range(self.pool_workers)]
        jobs = [env.process(self._load(worker, layer, share)) for worker, share in zip(self.pool, shares) if len(share)]
        if jobs:
            yield env.all_of(jobs)
        return sum(job.value for job in jobs)

    def _to_staging(self, thread, layer: int, n_experts: int, then_s: float = 0.0, then_kind: str = ""):
        """Hand hits (and loaded experts) to the kernels (§1.5): 3 synchronous D2D cudaMemcpy each on the
        default stream (the thread waits; the copies queue behind the kernels); #605 one gather kernel; #1031
        nothing, the kernels read the slots. Then the thread's next call of then_s (the slot-map upload)."""
        ready = 0.0
        if n_experts and self.variant.hit_copy != "none":
            n_bytes = n_experts * int(self.expert_bytes[layer])
            rate = self.m.d2d.bytes_per_s
            if self.variant.hit_copy == "memcpy":
                n = PARTS_PER_EXPERT * n_experts
                self.m.gpu.book(n * self.m.memcpy_call_s + n_bytes / rate, n_bytes, n, "D2D memcpy")
            else:
                self.m.gpu.book(self.m.kernel_launch_s + n_bytes / rate, n_bytes, 1, "D2D gather kernel")
            ready = self.m.gpu.end_of_last()
        yield thread.hold(then_s, 0, 1 if then_s else 0, then_kind, ready_s=ready)

    def _record(self, row: dict, layer: int, hits: int = 0, loaded: int = 0, direct: int = 0, handed: int = 0,
                drive_bytes: int = 0) -> None:
        eb = int(self.expert_bytes[layer])
        fetched = loaded + direct
        sid = self.rec.step(**row, end_s=self.m.env.now, h2d_bytes=fetched * eb, d2d_bytes=handed * eb,
                            file_read_bytes=drive_bytes, file_blob_reads=fetched, direct_loads=direct,
                            vram_used_bytes=self.vram_used(), ram_used_bytes=self.m.memory.used("ram"))
        for part, part_bytes in zip(("gate", "up", "down"), self.part_bytes[layer]):
            self.rec.copy(sid, "H2D", loaded, part_bytes, "file", f"slab:{part}")
            self.rec.copy(sid, "H2D", direct, part_bytes, "file", f"staging:{part}")
            if self.variant.hit_copy != "none":
                self.rec.copy(sid, "D2D", handed, part_bytes, f"slab:{part}", f"staging:{part}")

    # --- the Metal backend (ds4_metal.m and ds4.c @b0309611, for the build of @84cc882) ---------------

    def _metal_init(self, where: str, work: np.ndarray) -> None:
        """The Metal path's state. The expert cache is one table for the whole model (sim.cache.hotness), its
        slots wired one by one as they fill: an expert's slot is a page-rounded share of a 4 GiB shared slab,
        mlocked when the slot is first used (ds4_metal.m L11412-L11720), so the pool the page cache lives in shrinks
        as the cache fills and grows back when the process exits. The non-routed weights are not copied: Metal
        wraps the mapped file's pages (newBufferWithBytesNoCopy, L10399) and in streaming mode asks for no
        residency or warm-up (L1648, L3586), so they are page-cache extents the GPU reads in place, faulted from
        the drive when they are not resident: one extent per layer, the bytes a token reads there."""
        scenario = self.scenario
        too_long = [i for i, r in enumerate(scenario.workload.requests) if r.prompt_tokens > self.decode_path_max]
        if too_long:
            raise InputError(where, f"workload.requests[{too_long[0]}].prompt_tokens",
                             scenario.workload.requests[too_long[0]].prompt_tokens,
                             f"not modelled: ds4's Metal batch prefill (prompts over {self.decode_path_max} tokens); "
                             "shorter prompts run the decode path, which is")
        self.slot_bytes = -(-int(self.expert_bytes[0]) // APPLE_PAGE_BYTES) * APPLE_PAGE_BYTES
        self.mcache = RouteHotnessCache(self.n_layers, self.n_experts, self.budget_experts)
        self.weight_bytes = work[: self.n_layers, :2].sum(axis=1).astype(np.int64)  # attention, router, shared
        self.weight_keys = self.m.page_cache.add_extents(self.weight_bytes)
        self.weight_fault_bytes = 0
        self.cache_peak_bytes = 0
        # the host round trip after each router signal, fitted on another box (record ds4-metal-round-trip-437)
        trip = self.domain.use("ds4-metal-round-trip-437", "ds4's Metal host round trip per router readback")
        self.round_trip_s = trip.value * 1e-6
        self.gpu_unsent: list[tuple[float, str]] = []  # kernels encoded into the open command buffer, not committed
        if scenario.workload.page_cache == "warm":
            self._metal_previous_run()

    def _set_cache_memory(self, count: int) -> None:
        n_bytes = count * self.slot_bytes
        self.m.memory.set("vram", METAL_CACHE_MEMORY, n_bytes)
        self.cache_peak_bytes = max(self.cache_peak_bytes, n_bytes)

    def _metal_previous_run(self) -> None:
        """A warm page cache: the same command ran once before in a process of its own (#810 ran each setting in
        a new process, its "warm" row after the "cold" one). That run's reads are replayed through the page cache
        in their order, timing aside: per token and layer the layer's non-routed pages, then the extents of the
        experts its cache missed, while its wired slots take their share of the pool; at its exit the slots are
        freed and the pages stay. The routing is this run's (the same prompt, greedy)."""
        cache = RouteHotnessCache(self.n_layers, self.n_experts, self.budget_experts)
        pc = self.m.page_cache
        for routing in self.routing.requests:
            cache.reset_hotness()  # each prompt runs the decode path from its first token
            for row in np.concatenate([routing.prompt, routing.decode])[:, : self.n_layers]:
                cache.note_token()
                for layer in range(self.n_layers):
                    pc.access(self.weight_keys[layer: layer + 1], insert=True)
                    experts = row[layer][row[layer] != MISSING]
                    loads = cache.access(layer, experts).loads
                    self.m.memory.set("vram", METAL_CACHE_MEMORY, cache.count * self.slot_bytes)
                    pc.access(layer * self.n_experts + loads.astype(np.int64), insert=True)
        self.m.memory.set("vram", METAL_CACHE_MEMORY, 0)

    def _metal_fault_weights(self, layer: int):
        """The layer's non-routed pages before its kernels run: resident, or read back from the drive by page
        faults (read-ahead sized requests, one after another)."""
        m = self.m
        if m.page_cache.access(self.weight_keys[layer: layer + 1], insert=True)[0]:
            return
        n_bytes = int(self.weight_bytes[layer])
        self.weight_fault_bytes += n_bytes
        yield m.ssd.read(n_bytes, m.ssd.fault_reads(n_bytes), 1)

    def _metal_read(self, layer: int, experts: np.ndarray):
        """The misses' preads (begin_selected_load, ds4_metal.m L14057): 3 tasks per expert (gate, up, down) on
        min(tasks, pool threads) workers taking the next task as they free up (the pool's shared counter, L11003);
        each task a buffered pread into the expert's slot: a copy out of the page cache, after a drive read when
        the pages are not resident (the pages stay: no DONTNEED unless asked, L11730). Returns the drive's bytes."""
        if not len(experts):
            return 0
        m, env = self.m, self.m.env
        _, in_ram, drive = self._page_cache_lookup(layer, experts)
        tasks = iter([(int(part), bool(cached)) for cached in in_ram for part in self.part_bytes[layer]])

        def worker(thread):
            for part, cached in tasks:  # the shared iterator: the next task to whichever worker is free
                if not cached:
                    yield m.ssd.read(part, 1, 1)
                yield from m.memcpy(thread, part, 1, "pread copy")

        n_workers = min(self.pool_workers, PARTS_PER_EXPERT * len(experts))
        yield env.all_of([env.process(worker(thread)) for thread in self.pool[:n_workers]])
        return drive

    def _metal_commit(self, ready_s: float) -> None:
        """[cb commit] of the open command buffer (ds4_gpu_flush_commands, ds4_metal.m L8221): the GPU gets the
        kernels encoded since the last commit, in order, once the host has encoded them (ready_s)."""
        for seconds, label in self.gpu_unsent:
            self.m.gpu.book(seconds, 0, 0, label, ready_s=ready_s)
        self.gpu_unsent.clear()

    def _metal_decode_layer(self, layer: int, experts: np.ndarray, row: dict):
        """One decode-path layer on Metal (ds4.c @b0309611 L23873-L23990). The GPU runs only what the host has
        committed, and the main thread commits at the router signal (the early commit) and after the shared expert,
        so a layer's routed experts go in the command buffer that the next layer's router signal closes: they wait
        for the host to encode that layer's attention. A layer whose router picks its experts signals the ids;
        the async load worker wakes on the event (a host round trip, record ds4-metal-round-trip-437, that also
        holds the main thread's wake and the GPU's start on the next commit), reads the ids back, looks them up,
        picks the victims and starts the pread pool (begin_selected_load); meanwhile the GPU runs the shared expert;
        the main thread joins the worker, commits the hits' experts first once the split is ready and worthwhile
        (sim.cache.hotness), then waits for the preads before it encodes the rest (the routed encode finishes the
        pending load, ds4_metal.m L14399). The hash layers (0-2) take their ids from the token on the host: the
        main thread starts their loads itself and commits nothing (metal_graph_decode_set_hash_selected_override,
        ds4.c L23221: no selected-id overlap for a layer with a token table), so their kernels wait for the first
        router signal. Hits are read in place from their slots, no copy."""
        m = self.m
        other_s, shared_s, routed_s = self.decode_s[layer]
        if layer == 0:
            self.mcache.note_token()
        encoded = self.main.book(self.encode_layer_s, 0, 1, "graph encode")
        yield from self._metal_fault_weights(layer)
        self.gpu_unsent.append((other_s, "attention + router"))
        hashed = layer < METAL_HASH_LAYERS
        if hashed:  # the ids are the token's: looked up on the main thread once it has encoded the router
            yield m.env.timeout(max(0.0, encoded - m.env.now))
            self.gpu_unsent.append((shared_s, "shared expert"))
        else:
            self._metal_commit(encoded)  # the early commit after the router's signal
            signalled = m.gpu.idle_at()
            self.gpu_unsent.append((shared_s, "shared expert"))
            self._metal_commit(encoded)  # flushed before the join
            yield self.worker.hold(self.round_trip_s, SELECTED_IDS_BYTES, 1, "selected-id round trip",
                                   ready_s=signalled)
        split_ready = self.mcache.split_ready()
        lookup = self.mcache.access(layer, experts)
        self._set_cache_memory(self.mcache.count)
        reads = m.env.process(self._metal_read(layer, lookup.loads))
        if not hashed:  # the main thread joins the worker
            yield m.env.timeout(max(0.0, self.worker.end_of_last() - m.env.now))
        k, hits = len(experts), lookup.hits
        split = split_ready and hits >= 1 and lookup.misses >= SPLIT_MIN_MISSES
        if split:  # the hits' experts committed before the preads are waited for
            self.gpu_unsent.append((routed_s * hits / k, "routed experts (hits)"))
            self._metal_commit(m.env.now)
        drive = yield reads
        self.gpu_unsent.append((routed_s * (k - hits) / k if split else routed_s,
                                "routed experts (misses)" if split else "routed experts"))
        evictions = int(np.count_nonzero(lookup.victims >= 0))
        row.update(lookups=k, hits=hits, inserts=len(lookup.loads) - evictions, evictions=evictions)
        self._record(row, layer, hits, len(lookup.loads), 0, 0, drive)

    # --- decode ----------------------------------------------------------------------------------

    def _select_and_load(self, thread, layer: int, experts: np.ndarray, row: dict, routed_s: float,
                         ready_s: float):
        """begin_compact_load for one decode layer: ids back, lookup, misses, hand-over (see the module doc)."""
        m = self.m
        yield thread.hold(m.sync_s + m.memcpy_call_s, SELECTED_IDS_BYTES, 1, "ids readback", ready_s=ready_s)
        yield from self._grow_staging(thread, int(len(experts) * self.expert_bytes[layer]))
        pool = yield from self._prepare(thread, int(self.class_of_layer[layer]))
        outcome, _, _ = self.cache.access(layer, experts, pool, MODE_EVICT)
        n = np.bincount(outcome.astype(np.int64), minlength=4)
        hits, inserts, evictions, direct = int(n[HIT]), int(n[INSERT]), int(n[EVICT]), int(n[DIRECT])
        loaded = inserts + evictions
        fetch = experts[outcome != HIT]
        k = len(experts)
        if self.hits_first:  # #1082: the hits' experts run while the misses are read
            m.gpu.book(routed_s * hits / k, 0, 0, "routed experts (hits)")
            drive = yield from (self._pool_load(layer, fetch) if self.pool is not None else
                                self._load(thread, layer, fetch))
            m.gpu.book(routed_s * (k - hits) / k, 0, 0, "routed experts (misses)")
        else:
            drive = yield from (self._pool_load(layer, fetch) if self.pool is not None else
                                self._load(thread, layer, fetch))
        yield from self._to_staging(thread, layer, hits + loaded, m.memcpy_call_s, "slot map upload")
        row.update(lookups=k, hits=hits, inserts=inserts, evictions=evictions)
        self._record(row, layer, hits, loaded, direct, hits + loaded, drive)

    def _decode_layer(self, layer: int, experts: np.ndarray, row: dict):
        m = self.m
        other_s, shared_s, routed_s = self.decode_s[layer]
        encoded = self.main.book(self.encode_layer_s, 0, 1, "graph encode")
        # the main thread's sync waits for it
        m.gpu.book(other_s + self.decode_link_s[layer], 0, 0, "attention + router", ready_s=encoded)
        # the sync is booked, not waited on by itself: what comes next starts at its end (ready_s), and the
        # first wait is the ids readback after it
        synced = self.main.book(m.sync_s, 0, 1, "device sync", ready_s=m.gpu.idle_at())
        if self.overlap:
            # the main thread enqueues the shared expert and joins the worker, which does the fetch meanwhile.
            # The worker is this process: the main thread has nothing else to do until the join, and its enqueue
            # lands on the stream before any of the worker's copies (FIFO on the stream either way).
            m.gpu.book(shared_s, 0, 0, "shared expert", ready_s=synced)
            yield from self._select_and_load(self.worker, layer, experts, row, routed_s, synced)
            # the join waits for the worker's copies on the stream; with hits first the worker has also queued the
            # routed kernels, which the join does not wait for (the next layer's kernels queue behind them)
            yield self.main.hold(m.sync_s, 0, 1, "flush + join",
                                 ready_s=m.h2d.end_of_last() if self.hits_first else m.gpu.idle_at())
        else:  # the synchronous path: the main thread fetches, then enqueues the shared expert
            yield from self._select_and_load(self.main, layer, experts, row, routed_s, synced)
            m.gpu.book(shared_s, 0, 0, "shared expert")
        if not self.hits_first:
            m.gpu.book(routed_s, 0, 0, "routed experts")  # enqueued; the next layer's work queues behind it

    def _decode_token(self, request: int, phase: str, step_no: int, routing: np.ndarray,
                      mtp_routing: np.ndarray | None = None):
        """One token through the decode path; mtp_routing [mtp layers, k]: the draft step's experts, run after
        the forward pass (decode tokens only, when the scenario runs MTP)."""
        self.phase = phase
        steps = [(layer, routing[layer]) for layer in range(self.n_layers)]
        if mtp_routing is not None:
            steps += list(zip(self.mtp_layers, mtp_routing))
        decode_layer = self._metal_decode_layer if self.metal else self._decode_layer
        for layer, experts in steps:
            row = dict(request=request, phase=phase, step=step_no, layer=layer, start_s=self.m.env.now, tokens=1)
            yield from decode_layer(layer, experts, row)
        if self.metal:  # the last layer's routed experts go with the output head, committed at the token's end
            self._metal_commit(self.m.env.now)
        # the token exists once the last layer's kernels (queued on the stream) are done
        yield self.m.gpu.drained()

    # --- prefill ---------------------------------------------------------------------------------

    def _prefill_layer(self, layer: int, rows: np.ndarray, row: dict):
        m = self.m
        T = len(rows)
        other_s, shared_s, routed_s = self.prefill_s[layer] * T
        yield m.gpu.hold(other_s + self.prefill_chunk_fixed_s + self.weight_link_s[layer], 0, 0,
                         "attention + router (chunk)")
        yield self.main.hold(m.sync_s + m.memcpy_call_s, T * SELECTED_IDS_BYTES, 1, "ids readback")
        union = np.unique(rows[:, layer])
        union = union[union != MISSING]
        n_bytes = int(len(union) * self.expert_bytes[layer])
        if self.variant.prefill_whole_layers:
            drive = yield from self._stream_whole_layer(self.main, layer)
            hits, inserts, direct, handed = 0, 0, self.n_experts, 0
            row.update(lookups=len(union), hits=0, inserts=0)
        elif self.per_class:
            yield from self._grow_staging(self.main, n_bytes)
            pool = yield from self._prepare(self.main, int(self.class_of_layer[layer]))
            outcome, _, _ = self.cache.access(layer, union, pool, MODE_APPEND)
            n = np.bincount(outcome.astype(np.int64), minlength=4)
            hits, inserts, direct = int(n[HIT]), int(n[INSERT]), int(n[DIRECT])
            fetch = union[outcome != HIT]
            drive = yield from (self._pool_load(layer, fetch) if self.rocm_readers else
                                self._load(self.main, layer, fetch))
            yield from self._to_staging(self.main, layer, hits + inserts)
            row.update(lookups=len(union), hits=hits, inserts=inserts)
            handed = hits + inserts
        else:
            yield from self._release_all(self.main)  # pre-504: every batch call frees the resident cache first
            yield from self._grow_staging(self.main, n_bytes)
            drive = yield from self._load(self.main, layer, union)
            hits, inserts, direct, handed = 0, 0, len(union), 0
            row.update(lookups=len(union))
        yield self.main.hold(m.memcpy_call_s, 0, 1, "slot map upload")
        m.gpu.book(shared_s + routed_s, 0, 0, "shared + routed experts (chunk)")
        self._record(row, layer, hits, inserts, direct, handed, drive)

    def _prefill_chunk(self, request: int, step_no: int, rows: np.ndarray):
        self.phase = "prefill"
        for layer in range(self.n_layers):
            row = dict(request=request, phase="prefill", step=step_no, layer=layer, start_s=self.m.env.now,
                       tokens=len(rows))
            yield from self._prefill_layer(layer, rows, row)
        yield self.m.gpu.drained()

    # --- serve -----------------------------------------------------------------------------------

    def serve(self, env: simpy.Environment, timings: list):
        room_notice = False
        for request, (spec, routing) in enumerate(zip(self.scenario.workload.requests, self.routing.requests)):
            if spec.think_time_s:
                yield env.timeout(spec.think_time_s)
            arrival = env.now
            prompt = routing.prompt
            if len(prompt) <= self.decode_path_max:
                if self.metal:  # a decode-style prompt from its first token clears the route hotness
                    self.mcache.reset_hotness()
                for i, row in enumerate(prompt):
                    yield from self._decode_token(request, "prefill", i, row)
            else:
                chunk = self.chunk_flag or (len(prompt) if len(prompt) <= self.chunk_default else self.chunk_default)
                step_no = 0
                for step_no, first in enumerate(range(0, len(prompt), chunk)):
                    yield from self._prefill_chunk(request, step_no, prompt[first: first + chunk])
                yield from self._seed_from_hotlist(request, step_no + 1)
            prefill_end = env.now
            first_token = None
            mtp = routing.mtp if self.mtp else None
            if self.mtp and (mtp is None or len(mtp) < len(routing.decode)):
                raise InputError("scenario", "trace", "no MTP routing", "--mtp needs the MTP layer's routing")
            # the CLI stops generating when the context is full (room - 1 tokens, ds4_cli.c)
            room = max(0, self.ctx - len(prompt) - 1)
            decode = routing.decode[:room]
            if len(decode) < len(routing.decode) and not room_notice:
                self.notices.append(f"context full: ds4 generates at most --ctx {self.ctx} - prompt - 1 = {room} "
                                    f"tokens; request {request} asked for {len(routing.decode)}")
                room_notice = True
            for i, row in enumerate(decode):
                yield from self._decode_token(request, "decode", i, row, None if mtp is None else mtp[i])
                if first_token is None:
                    first_token = env.now
            timings.append({"request": request, "arrival_s": arrival, "prefill_end_s": prefill_end,
                            "first_token_s": first_token if first_token is not None else prefill_end,
                            "end_s": env.now, "prompt_tokens": len(prompt), "decode_tokens": len(decode)})

    # --- results ---------------------------------------------------------------------------------

    def bounds(self, request: int) -> dict:
        """The Belady bound's decode hit rate with the same class pools and slot counts: the most decode hits
        any cache of those sizes can get on the request's routing, its prompt warming the cache first
        (sim.cache.replay.decode_bound_hits); None for the slab, whose capacity changes with every size change."""
        return {"belady_decode_hit_rate": self._belady(request) if self.per_class or self.metal else None}

    def _belady(self, request: int) -> float | None:
        from sim.cache.replay import decode_bound_hits, last_access_rows
        from sim.trace.format import PHASE_DECODE, PHASE_PREFILL, Trace, TraceHeader

        r = self.routing.requests[request]
        if not len(r.decode):
            return None
        # the prompt's last access of each key: the bound is the same (last_access_rows), its memory per key
        prompt = last_access_rows(r.prompt[:, : self.n_layers], self.n_experts)
        decode = r.decode[:, : self.n_layers]
        if self.mtp:  # the draft runs on decode tokens only: its prompt cells are missing
            pad = np.full((len(prompt), len(self.mtp_layers), prompt.shape[2]), MISSING, np.uint16)
            prompt = np.concatenate([prompt, pad], axis=1)
            decode = np.concatenate([decode, r.mtp[: len(decode)]], axis=1)
        rows = np.concatenate([prompt, decode])
        phase = np.r_[np.full(len(prompt), PHASE_PREFILL), np.full(len(decode), PHASE_DECODE)].astype(np.uint8)
        header = TraceHeader(self.scenario.layout.name, rows.shape[1], self.n_experts, rows.shape[2], "run", "")
        trace = Trace(header, np.zeros(len(rows)), np.arange(len(rows)), phase, rows)
        capacity = np.array([self.budget_experts]) if self.metal else np.array(self.cache.capacity)
        hits = decode_bound_hits(trace, Geometry.of(trace, self.scenario.layout), capacity)
        return float(hits.sum() / np.count_nonzero(decode != MISSING))

    def state(self) -> dict:
        caps = [self.budget_experts] if self.metal else [int(c) for c in self.cache.capacity]
        r = self.resident
        pc = self.m.page_cache
        metal = {"metal": {"cache_experts_held": self.mcache.count, "cache_evictions": self.mcache.evictions,
                           "cache_peak_gib": self.cache_peak_bytes / GIB,
                           "weight_fault_gib": self.weight_fault_bytes / GIB}} if self.metal else {}
        return {"cache_slots": int(sum(caps)), "cache_slots_per_class": caps,
                "cache_mib": (self.cache_peak_bytes if self.metal else self._cache_bytes()) / MIB, "lent_slots": 0,
                **metal,
                "prefill_buffer_mib": self.staging_bytes / MIB, "notices": list(self.notices),
                "variant": self.variant.name, "variant_source": self.variant.source,
                "reserve_gib": self.reserve_bytes / GIB, "budget_experts": self.budget_experts, "ctx": self.ctx,
                "budget_mode": self.variant.budget, "planned_cache_slots": self.planned_experts
                if self.planned_experts is not None else int(sum(caps)),
                "non_routed_over_pcie_gib": self.weight_pcie_bytes / GIB,
                "miss_source": ("page cache (buffered pread)" if self.buffered or self.metal else "SSD (O_DIRECT)")
                + (f", {self.pool_workers} pread workers" if self.pool_workers else ", QD1"),
                "hits_first": self.hits_first, "selected_shared_overlap": self.overlap,
                "page_cache": {"capacity_gib": pc.capacity_bytes / GIB, "used_gib": pc.used_bytes / GIB,
                               "read_hits": self.page_cache_reads["hits"],
                               "read_misses": self.page_cache_reads["misses"],
                               "keep_model_pages": self.keep_pages or self.metal},
                "class_expert_bytes": [int(b) for b in self.class_bytes],
                "mtp_layers": [int(x) for x in self.mtp_layers],
                "flushes_per_pool": list(self.flushes), "hotlist_seeding": dict(self.seeding),
                "hotlist_seed_experts": int(sum(len(e) for _, e in self.seed_steps)),
                "slab_size_changes": dict(self.size_changes),
                "vram_before_cache_gib": r.vram / GIB,
                "vram_before_cache": {"non_routed_gib": r.non_routed / GIB, "host_pinned_gib": r.host_pinned / GIB,
                                      "kv_gib": r.kv / GIB, "context_buffers_gib": r.context_buffers / GIB,
                                      "compute_buffers_gib": r.compute_buffers / GIB,
                                      "compute_buffers_record": r.record,
                                      "runtime_reserved_gib": r.runtime_reserved / GIB},
                "memory": self.m.memory.allocations()}
