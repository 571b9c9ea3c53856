"""ds4's [engine] table and its knobs, each parsed here once, as the engine parses it (ds4-engine.md §4).

The scenario's table uses the engine's own flag and environment names, its variants (builds), and refuses
settings the model does not simulate. Values the real engine accepts and then reads its own way are kept raw in
`Settings` (a reserve of "0.5" keeps the 16 GiB default, as ds4 does); `Knobs` is what the engine makes of them:

  budget     --ssd-streaming-cache-experts N | NGB, DS4_CUDA_STREAMING_EXPERT_CACHE_N, default 512,
             clamped to 23424 (requested_budget_experts)
  reserve    DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB: integer GiB, default 16, <= total VRAM / 2
  context    --ctx, default 32768; the prefill chunk --prefill-chunk, else DS4_METAL_PREFILL_CHUNK
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

from pydantic import Field, PlainValidator

from sim.errors import InputError
from sim.schema import Strict, check_int, digits, env_table, written
from sim.units import GIB, MIB

# fmt: off
DS4_CUDA_STREAM_EXPERT_DEFAULT_EXPERTS = 512       # ds4_cuda.cu L38: budget when none is given (§1.2)
DS4_CUDA_STREAM_EXPERT_MAX_EXPERTS = 61 * 384      # ds4_cuda.cu L39: 23424, the Pro model's expert count (§1.2)
DEFAULT_VRAM_RESERVE_GIB = 16                      # live_budget L1510-1579: reserve default (§1.3)
VRAM_RESERVE_MAX_FRACTION_OF_TOTAL = 0.5           # live_budget: reserve clamped to total VRAM / 2 (§1.3)
AUTO_PRELOAD_CAP_EXPERTS = 4096                    # DS4_METAL_STREAMING_EXPERT_AUTO_PRELOAD_CAP default (§1.9)
DEFAULT_CTX_TOKENS = 32768                         # ds4_cli.c: "-c, --ctx N  Context size ... Default: 32768"
DEFAULT_PREFILL_CHUNK_TOKENS = 4096                # ds4_prefill_cap_for_prompt, ds4.c L8330 (§1.7)
DEFAULT_PREFILL_CHUNK_TOKENS_PRO = 8192            # same, DeepSeek V4 Pro (§1.7)
DECODE_PATH_PREFILL_MAX_TOKENS = 18                # ds4.c L19505-19567: short prompts run the decode path (§1.7)
DECODE_PATH_PREFILL_MAX_TOKENS_Q4 = 64             # ... 64 when layer 0's experts are all Q4_K (§1.7)
DEFAULT_COPY_CHUNK_MIB = 64                        # DS4_CUDA_MODEL_COPY_CHUNK_MB default (§1.2)
COPY_CHUNK_MIB_RANGE = (16, 4096)                  # DS4_CUDA_MODEL_COPY_CHUNK_MB clamp (ds4-engine.md §1.2, L218-222)
PINNED_STAGING_BUFFERS = 4                         # the pinned host ring (§1.2, L218-222)
PREAD_POOL_WORKERS = 8                             # #1082: "a pread pool of 8 workers, each with pinned staging and
                                                   # its own CUDA stream"
ROCM_READ_WORKERS = 16                             # DS4_ROCM_STREAM_READ_DEFAULT_WORKERS (rocm/ds4_rocm_runtime.cuh
                                                   # @54b36ed)
METAL_PREAD_THREADS_DEFAULT = 9                    # ds4_gpu_stream_expert_pread_thread_limit (ds4_metal.m @b0309611
                                                   # L10878)
METAL_PREAD_THREADS_RANGE = (1, 18)                # DS4_METAL_STREAMING_EXPERT_PREAD_THREADS, clamped there to 1..18
# fmt: on

CLI_CACHE_EXPERTS = "--ssd-streaming-cache-experts"
KEY_VARIANT = "engine.variant"
KEY_BUDGET = "engine.flags.ssd-streaming-cache-experts"
KEY_RESERVE = "engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB"
KEY_CHUNK = "engine.flags.prefill-chunk"

_CACHE_ARG = re.compile(r"([0-9]+)(GB)?")


# ------------------------------------------------------------------------------------------ variants


@dataclass(frozen=True)
class Variant:
    """What a ds4 build does differently (ds4-engine.md §1.13-§1.14)."""

    name: str
    per_class: bool  # caches per (gate, down) size class (#504); else one slab keyed on the last size
    prefill_reads_cache: bool  # prefill hits copy from the cache and misses append (#504); else release_all
    hit_copy: str  # "memcpy": 3 synchronous D2D copies per expert into compact staging; "gather": one
    #               kernel per layer through a device table (#605); "none": kernels read the slots (#1031)
    pread_pool: bool  # #1082: hits first + 8 pread workers with their own staging and stream
    mtp_streaming: bool  # runs the in-file MTP draft layer together with --ssd-streaming
    source: str
    # how the expert budget is sized (see planner.budget_plan): "live" the CLI/env count, capped per class by free
    # VRAM less the reserve (@80ebbc3 to #1082); "auto-488" the same, with #488's auto budget when none is given;
    # "planner" the total expert budget of later upstream (the 7/8 working-set cap, two layers of prefill
    # headroom, the auto budget); "planner-v41" that plan fitted once more to V4.1's runtime allowance (#1036)
    budget: str = "live"
    # non-routed weights VRAM cannot hold stay in mapped host memory, read over PCIe at every use (the weight
    # cache's fallback, cuda_model_range_ptr); else they must all fit in VRAM
    weight_overflow: bool = False
    # batched prefill reads every expert of each layer, not the chunk's union: the batch MoE kernels take the
    # layer's whole expert tensors through the weight cache, which streams them from the file in copy chunks
    # (the neutronstar GLM stack: glm_graph_routed_moe_batch_dispatch -> routed_moe_launch, which uses the
    # compact selected cache only when the layer's selected load prepared it, and no GLM batch path prepares
    # it; cuda_model_range_ptr -> cuda_model_range_ptr_from_fd, giannisanni/neutronstar @253cfb1 ds4.c
    # L29825, ds4_cuda.cu L13630-13660 and L1300-1390); the expert cache is neither read nor filled
    prefill_whole_layers: bool = False
    # how a miss's three parts reach the GPU: "per-part" each read into pinned staging, uploaded and synced in
    # turn (the ring restarts every call, ds4-engine.md §1.8); "pr605" #605's third and fourth commits: with no
    # O_DIRECT fd a plain cudaMemcpy from the mapped file (5930a3f, "default streamed expert uploads to plain
    # copy without O_DIRECT"), else the ring kept across the parts and one sync per expert (1c055bb, "pipeline
    # the streamed expert upload path"; both as described in nexus-cw/ds4 research/gb10/MEASUREMENTS.md)
    miss_copy: str = "per-part"

    @property
    def planner(self) -> bool:
        """The later builds' total budget planner sizes the cache (no live reserve)."""
        return self.budget.startswith("planner")


VARIANTS = {v.name: v for v in (
    Variant("pre-504", False, False, "memcpy", False, False, "antirez/ds4 @80ebbc3 (ds4-engine.md §1.2-§1.10)"),
    Variant("pr504", True, True, "memcpy", False, False, "PR #504 (seed; ds4-engine.md §1.13)"),
    Variant("pr605-cache", True, True, "gather", False, False,
            "PR #605's first commit (10ba298): the restored per-class cache, cache-reading prefill and its device "
            "gather-slots table (ds4-engine.md §1.14; the table sits with the restored cache in iCreil/ds4 "
            "@35f2513, whose streamed copy is still the per-part one the third commit replaced)"),
    Variant("pr605", True, True, "gather", False, False,
            "PR #605, all four commits: pr605-cache, then the per-load VRAM query skipped once the cache has "
            "settled (9167d12), the pipelined streamed upload (1c055bb) and plain pageable copies without "
            "O_DIRECT (5930a3f)", miss_copy="pr605"),
    Variant("pr1031", True, True, "none", False, False,
            "PR #1031: bounded LRU in contiguous slabs, kernels read remapped slots (no D2D copy), IQ2 prefill "
            "through the compact selected table (ds4-engine.md §1.14)"),
    Variant("pr1082", True, True, "none", True, False,
            "PR #1082 on #1031: hits first, an 8-worker pread pool, gate and up of every miss before the downs "
            "(ds4-engine.md §1.14)"),
    Variant("pr488", True, True, "memcpy", False, False,
            "PR #488 on #504's per-class caches: CUDA's auto budget, 80 % of the device's memory less the non-routed "
            "weights (at least one expert) when no budget is given (antirez/ds4#488)", "auto-488", True),
    Variant("main-0728", True, True, "none", False, False,
            "antirez/ds4 @54b36ed (2026-07-28): the total expert budget planner (ds4_engine_configure_streaming_"
            "cache_budget: the 7/8 working-set cap, two layers of prefill headroom, the Metal/ROCm auto budget), "
            "kernels reading the cache's slots, non-routed weights in a lazily filled weight cache with mapped "
            "host memory past it", "planner", True),
    Variant("main-v41", True, True, "none", False, False,
            "antirez/ds4 of #1036 (2026-09): main-0728's planner, its dynamic cache fitted once more so that static "
            "weights, staging, cache, graph and a 2 GiB runtime/I/O allowance fit the working set (V4.1)",
            "planner-v41", True),
    Variant("main-0814", False, False, "none", False, False,
            "antirez/ds4 @84cc882 (2026-08-14) on its Metal backend, the build of #810, read at upstream b0309611 "
            "(2026-08-05, the newest upstream in reach): main-0728's total expert budget planner (the same rules there, "
            "ds4.c L4567-L4720, L54440-L54625); one global "
            "(layer, expert) table evicting by route hotness, its slots wired as they fill; misses read by buffered "
            "preads of a 9-thread pool into the slot, hits read in place; the non-routed weights mapped file "
            "pages (sim/cache/hotness.py, sim/engines/ds4/metal.py)", "planner"),
    Variant("neutronstar-glm-slab", False, False, "memcpy", False, True,
            "what-if: the neutronstar GLM stack's MTP draft steps with upstream's pre-504 slab",
            prefill_whole_layers=True),
    Variant("neutronstar-glm", True, True, "memcpy", False, True,
            "giannisanni/neutronstar @db823235: PR #504 ported onto the fork's GLM CUDA stack; its batched prefill "
            "(working from @1d8a26c's IQ2 LUT fix) reads whole layers", prefill_whole_layers=True),
)}
# The builds whose Metal backend is modelled, and the only ones that run on a Metal profile: the CUDA and ROCm
# variants are other builds' GPU paths, and the Metal path of the older builds was not read.
METAL_VARIANTS = ("main-0814",)


# ------------------------------------------------------------------------------------------ the [engine] table

# Knobs that exist only in some variants: setting one on another variant is a mistake, not a no-op.
ONLY_IN: dict[str, tuple[str, ...]] = {
    "expert-profile": ("pr1031", "pr1082"),  # CUDA --expert-profile came with #1031 (§1.14)
    "DS4_EXPERT_PROFILE": ("pr1031", "pr1082"),
    "DS4_EXPERT_HOTLIST": ("pr1031", "pr1082"),
    "DS4_CUDA_HITS_FIRST": ("pr1082",),
    "DS4_CUDA_STREAMING_EXPERT_PREAD_POOL": ("pr1082",),
    "DS4_METAL_STREAMING_EXPERT_PREAD_THREADS": METAL_VARIANTS,
}
ENV_NAMES = (
    # ds4-engine.md §4, CUDA streaming @80ebbc3
    "DS4_CUDA_STREAMING_EXPERT_CACHE_N", "DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB",
    "DS4_CUDA_STREAMING_EXPERT_CACHE_VERBOSE", "DS4_CUDA_STREAMING_EXPERT_CACHE_PROFILE",
    "DS4_CUDA_ENABLE_STREAMING_EXPERT_HOTLIST", "DS4_CUDA_STREAMING_EXPERT_HOTLIST",
    "DS4_CUDA_DISABLE_STREAMING_SELECTED_SHARED_OVERLAP", "DS4_CUDA_DISABLE_STREAMING_PREFILL_BATCH_SELECTED_LOAD",
    "DS4_CUDA_STREAMING_PREFILL_BATCH_SELECTED_PROFILE", "DS4_CUDA_NO_DIRECT_IO", "DS4_CUDA_KEEP_MODEL_PAGES",
    "DS4_CUDA_MODEL_COPY_CHUNK_MB", "DS4_CUDA_WEIGHT_CACHE_VERBOSE",
    # the shared graph layer (named METAL, also read on CUDA)
    "DS4_METAL_STREAMING_DECODE_PREFILL_MAX", "DS4_METAL_DISABLE_STREAMING_DECODE_PREFILL",
    "DS4_METAL_DISABLE_STREAMING_COLD_DECODE_PREFILL", "DS4_METAL_PREFILL_CHUNK", "DS4_METAL_RESUME_PREFILL_MIN",
    "DS4_METAL_DISABLE_STREAMING_EXPERT_HOTLIST", "DS4_METAL_STREAMING_EXPERT_HOTLIST",
    "DS4_METAL_STREAMING_EXPERT_AUTO_PRELOAD_CAP",
    # later variants
    "DS4_EXPERT_PROFILE", "DS4_EXPERT_HOTLIST", "DS4_CUDA_HITS_FIRST", "DS4_CUDA_STREAMING_EXPERT_PREAD_POOL",
    # the Metal backend (ds4_metal.m)
    "DS4_METAL_STREAMING_EXPERT_PREAD_THREADS",
)
Env = env_table("Ds4Env", "ds4 environment variable", ENV_NAMES)
# Knobs whose effect the model does not simulate: a scenario that sets one is refused rather than run as if
# it were absent. The VERBOSE/PROFILE variables and --expert-profile only print or write files: accepted.
NOT_MODELLED = {
    "DS4_CUDA_DISABLE_STREAMING_PREFILL_BATCH_SELECTED_LOAD": "prefill without batched selected loads",
    "DS4_METAL_DISABLE_STREAMING_COLD_DECODE_PREFILL": "the cold decode-style prefill switch",
    "DS4_METAL_RESUME_PREFILL_MIN": "server resumes from a KV checkpoint",
}


def _check_cache_experts(value: object) -> str:
    """`--ssd-streaming-cache-experts N|NGB`, kept as the text ds4 parses (an integer is taken as N)."""
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    number = text[:-2] if isinstance(text, str) and text.endswith("GB") else text
    if not isinstance(number, str) or not digits(number):
        raise ValueError('must be N (experts) or "NGB" (GiB of experts), N a whole number')
    return text


class Flags(Strict):
    """ds4 CLI flags (ds4_help.c @80ebbc3, ds4-engine.md §4). None = the engine's default."""

    KEY_KIND: ClassVar[str] = "ds4 flag"
    ssd_streaming: bool = Field(True, alias="ssd-streaming")
    # N experts, or "NGB": N GiB of experts of the first routed layer. Default: 512 on CUDA.
    ssd_streaming_cache_experts: Annotated[str, PlainValidator(_check_cache_experts)] | None = \
        Field(None, alias="ssd-streaming-cache-experts")
    ssd_streaming_cold: bool = Field(False, alias="ssd-streaming-cold")
    ssd_streaming_preload_experts: Annotated[int, Field(ge=0)] | None = \
        Field(None, alias="ssd-streaming-preload-experts")  # default: auto, capped at 4096
    # Default: the whole prompt if <= 4096 tokens, else 4096 (8192 for PRO).
    prefill_chunk: Annotated[int, Field(ge=1)] | None = Field(None, alias="prefill-chunk")
    ctx: Annotated[int, Field(ge=2)] | None = None  # the session's context; default 32768
    # The MTP draft model. Upstream refuses it together with --ssd-streaming (ds4.c L25685 @80ebbc3); the
    # neutronstar GLM stack binds the draft layer (GLM-5.2's blk.78) from the main GGUF: pass its path.
    mtp: str | None = None
    expert_profile: str | None = Field(None, alias="expert-profile")


class Settings(Strict):
    KEY_KIND: ClassVar[str] = "ds4 engine key"
    name: Literal["ds4"]
    # pre-504 .. pr1082, pr488, main-0728, main-v41, main-0814 (Metal), neutronstar-*: see VARIANTS.
    variant: Literal[tuple(VARIANTS)]
    flags: Flags = Field(default_factory=Flags)
    env: Env = Field(default_factory=Env)


# ------------------------------------------------------------------------------------------ parsing, once


def env_set(env, name: str) -> bool:
    return getattr(env, name, None) not in (None, "0", "")


def env_count(where: str, env, name: str, minimum: int = 0) -> int | None:
    text = getattr(env, name, None)
    if text is None:
        return None
    if not digits(text.strip()) or int(text) < minimum:
        raise InputError(where, f"engine.env.{name}", text, f"must be a whole number >= {minimum}")
    return int(text)


def parse_cache_experts_arg(text: str, first_routed_layer_expert_bytes: int) -> int:
    """`--ssd-streaming-cache-experts N|NGB` as a number of experts (ds4_ssd.c, ds4.c L25638-25672, §1.3).

    N is a count; NGB is N GiB of experts of the FIRST routed layer: floor(N GiB / its expert bytes), so
    70GB of the mixed Flash file (6.75 MiB q2 experts at layer 0) is 10619. The clamp to 23424 is
    applied later, by requested_budget_experts. We accept only these two spellings (digits, optional
    "GB" suffix); the engine's own error wording for other text is not in the notes.
    """
    where = f"{CLI_CACHE_EXPERTS}"
    check_int(where, "first routed layer expert bytes", first_routed_layer_expert_bytes, 1)
    match = _CACHE_ARG.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise InputError(where, "value", text, "must be N (experts) or NGB (GiB of experts), N a whole number")
    amount = int(match.group(1))
    experts = amount * GIB // first_routed_layer_expert_bytes if match.group(2) else amount
    if experts < 1:
        raise InputError(where, "value", text, "must give at least one expert")
    return experts


def cache_budget_bytes(text: str | None) -> int | None:
    """`--ssd-streaming-cache-experts NGB` as the byte budget the later builds plan with (N GiB); None for a count
    or no flag (validated by the Flags model)."""
    match = None if text is None else _CACHE_ARG.fullmatch(text)
    return int(match.group(1)) * GIB if match is not None and match.group(2) else None


def requested_budget_experts(cli_experts: int | None = None, env_cache_experts: str | None = None) -> int:
    """requested_budget (L1454-1472): env DS4_CUDA_STREAMING_EXPERT_CACHE_N, else the CLI value, else 512;
    clamped to 23424. A non-integer env value is ignored here (our choice; the notes give no message)."""
    requested = DS4_CUDA_STREAM_EXPERT_DEFAULT_EXPERTS
    if cli_experts is not None:
        requested = check_int(CLI_CACHE_EXPERTS, "experts", cli_experts, 1)
    if env_cache_experts is not None and digits(env_cache_experts):
        requested = int(env_cache_experts)
    return min(requested, DS4_CUDA_STREAM_EXPERT_MAX_EXPERTS)


def vram_reserve_bytes(env_reserve_gib: str | None, total_vram_bytes: int) -> int:
    """DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB (§1.3): integer GiB only; anything else (unset, "0.5",
    "12GB", "-1") keeps the 16 GiB default silently. The result is clamped to at most total VRAM / 2."""
    check_int("ds4 VRAM", "total_vram_bytes", total_vram_bytes, 1)
    reserve_gib = DEFAULT_VRAM_RESERVE_GIB
    if env_reserve_gib is not None and digits(env_reserve_gib):
        reserve_gib = int(env_reserve_gib)
    return min(reserve_gib * GIB, int(total_vram_bytes * VRAM_RESERVE_MAX_FRACTION_OF_TOTAL))


def hotlist_preload_experts(budget_experts: int, preload_flag: int | None = None,
                            auto_cap_env: str | None = None) -> int:
    """How many hotlist experts a seeding pass loads (§1.9): --ssd-streaming-preload-experts N when given,
    else min(budget, auto cap), the auto cap being DS4_METAL_STREAMING_EXPERT_AUTO_PRELOAD_CAP (4096)."""
    where = "ds4 hotlist"
    check_int(where, "budget_experts", budget_experts)
    if preload_flag is not None:
        return check_int(where, "--ssd-streaming-preload-experts", preload_flag)
    cap = AUTO_PRELOAD_CAP_EXPERTS
    if auto_cap_env is not None:
        if not auto_cap_env.strip().isdigit():
            raise InputError(where, "DS4_METAL_STREAMING_EXPERT_AUTO_PRELOAD_CAP", auto_cap_env,
                             "must be a whole number of experts")
        cap = int(auto_cap_env)
    return min(budget_experts, cap)


def metal_pread_threads(env) -> int:
    """The Metal backend's pread pool size: DS4_METAL_STREAMING_EXPERT_PREAD_THREADS or 9, clamped to 1..18 (0 counts
    as 1, as in ds4_gpu_stream_expert_pread_thread_limit)."""
    text = getattr(env, "DS4_METAL_STREAMING_EXPERT_PREAD_THREADS", None)
    threads = METAL_PREAD_THREADS_DEFAULT if text is None else int(text)
    low, high = METAL_PREAD_THREADS_RANGE
    return min(max(threads, low), high)


def context_tokens(flags) -> int:
    return flags.ctx if flags.ctx is not None else DEFAULT_CTX_TOKENS


@dataclass(frozen=True)
class Knobs:
    """What ds4 makes of a scenario's [engine] table on this model and box (module docstring)."""

    variant: Variant
    metal: bool  # the Metal backend (a Metal profile)
    mtp: bool  # --mtp on a model whose file holds MTP layers
    budget_given: bool  # a budget on the command line or in the environment (a "visible" budget, §1.9)
    budget_experts: int  # the count asked for, clamped (requested_budget_experts)
    budget_bytes: int | None  # an NGB budget as bytes: what the planner builds plan with
    reserve_bytes: int
    ctx: int
    chunk_flag: int | None  # --prefill-chunk, else DS4_METAL_PREFILL_CHUNK
    chunk_default: int  # the whole prompt up to this, else chunks of it
    decode_path_max: int  # prompts up to this run the decode path token by token
    overlap: bool  # the selected-load worker beside the shared expert
    hits_first: bool
    pool_workers: int  # pread workers: #1082's pool, the ROCm readers, the Metal pool (0: the loader alone)
    rocm_readers: bool  # the planner builds' ROCm runtime reads every load through its pool
    buffered: bool  # misses through the page cache (buffered preads), not O_DIRECT
    keep_pages: bool
    copy_chunk_bytes: int
    pinned_staging_bytes: int  # the pinned host ring and the pool's staging (0 on Metal)
    hotlist_off: bool
    hotlist_visible: bool  # CUDA seeds only when the budget is "visible" (L1482-1492)
    hotlist_path: str | None  # a popularity list as a rank,layer,expert CSV
    preload_flag: int | None
    preload_cap_text: str | None
    ignored_env: tuple[str, ...] = ()  # notices for the set values ds4 fails to parse and drops without a word

    @property
    def chunk_cap(self) -> int:
        """The graph's prefill cap: the context buffers are sized for it."""
        return self.chunk_flag or self.chunk_default

    def chunk_for(self, prompt_tokens: int) -> int:
        return self.chunk_flag or (prompt_tokens if prompt_tokens <= self.chunk_default else self.chunk_default)

    def preload(self, budget_experts: int) -> int:
        return hotlist_preload_experts(budget_experts, self.preload_flag, self.preload_cap_text)

    @classmethod
    def of(cls, scenario, where: str) -> "Knobs":
        hw, layout, engine = scenario.hardware_profile, scenario.layout, scenario.engine
        flags, env = engine.flags, engine.env
        variant = VARIANTS[engine.variant]
        metal = hw.gpu.api == "metal"
        cli = None
        first = layout.layers[0]
        if flags.ssd_streaming_cache_experts is not None:
            cli = parse_cache_experts_arg(flags.ssd_streaming_cache_experts, first.expert_bytes)
        cache_n = getattr(env, "DS4_CUDA_STREAMING_EXPERT_CACHE_N", None)
        # the 64-token rule's types: Q4_K, and MXFP4 too in the Metal build (ds4.c @b0309611 L29861-L29870)
        wide = ("Q4_K", "MXFP4") if metal else ("Q4_K",)
        types = (first.gate_type, first.up_type, first.down_type)
        decode_path_max = DECODE_PATH_PREFILL_MAX_TOKENS_Q4 if types[0] in wide and len(set(types)) == 1 \
            else DECODE_PATH_PREFILL_MAX_TOKENS
        if env_set(env, "DS4_METAL_DISABLE_STREAMING_DECODE_PREFILL"):
            decode_path_max = 0
        elif (limit := env_count(where, env, "DS4_METAL_STREAMING_DECODE_PREFILL_MAX")) is not None:
            decode_path_max = limit
        pool_workers = PREAD_POOL_WORKERS if (variant.pread_pool and getattr(
            env, "DS4_CUDA_STREAMING_EXPERT_PREAD_POOL", None) != "0") else 0
        # the ROCm runtime of the planner builds reads every load, prompt and decode, through its own pool of
        # O_DIRECT readers, each with pinned staging and an upload stream (rocm/ds4_rocm_runtime.cuh @54b36ed)
        rocm_readers = hw.gpu.api == "hip" and variant.planner
        if rocm_readers:
            pool_workers = ROCM_READ_WORKERS
        copy_chunk = env_count(where, env, "DS4_CUDA_MODEL_COPY_CHUNK_MB") or DEFAULT_COPY_CHUNK_MIB
        copy_chunk = min(max(copy_chunk, COPY_CHUNK_MIB_RANGE[0]), COPY_CHUNK_MIB_RANGE[1]) * MIB
        # Metal preads straight into the cache's shared slots: no pinned ring, and its own pool
        staging = 0 if metal else (PINNED_STAGING_BUFFERS + pool_workers) * copy_chunk
        return cls(
            variant=variant, metal=metal, mtp=flags.mtp is not None and layout.n_mtp_layers > 0,
            budget_given=flags.ssd_streaming_cache_experts is not None or cache_n is not None,
            budget_experts=requested_budget_experts(cli, cache_n),
            budget_bytes=cache_budget_bytes(flags.ssd_streaming_cache_experts),
            reserve_bytes=vram_reserve_bytes(getattr(env, "DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB", None),
                                             hw.vram_bytes),
            ctx=context_tokens(flags),
            chunk_flag=flags.prefill_chunk or env_count(where, env, "DS4_METAL_PREFILL_CHUNK", minimum=1),
            chunk_default=DEFAULT_PREFILL_CHUNK_TOKENS_PRO if "pro" in layout.name else DEFAULT_PREFILL_CHUNK_TOKENS,
            decode_path_max=decode_path_max,
            overlap=not env_set(env, "DS4_CUDA_DISABLE_STREAMING_SELECTED_SHARED_OVERLAP"),
            hits_first=variant.pread_pool and getattr(env, "DS4_CUDA_HITS_FIRST", None) != "0",
            pool_workers=metal_pread_threads(env) if metal else pool_workers, rocm_readers=rocm_readers,
            buffered=env_set(env, "DS4_CUDA_NO_DIRECT_IO"), keep_pages=env_set(env, "DS4_CUDA_KEEP_MODEL_PAGES"),
            copy_chunk_bytes=copy_chunk, pinned_staging_bytes=staging,
            hotlist_off=flags.ssd_streaming_cold or env_set(env, "DS4_METAL_DISABLE_STREAMING_EXPERT_HOTLIST"),
            hotlist_visible=(flags.ssd_streaming_cache_experts is not None or cache_n is not None
                             or env_set(env, "DS4_CUDA_ENABLE_STREAMING_EXPERT_HOTLIST")
                             or env_set(env, "DS4_CUDA_STREAMING_EXPERT_HOTLIST")),
            hotlist_path=getattr(env, "DS4_METAL_STREAMING_EXPERT_HOTLIST", None) or None,
            preload_flag=flags.ssd_streaming_preload_experts,
            preload_cap_text=getattr(env, "DS4_METAL_STREAMING_EXPERT_AUTO_PRELOAD_CAP", None),
            ignored_env=_ignored_env(env))


def _ignored_env(env) -> tuple[str, ...]:
    """The cache count and the reserve are whole numbers to ds4, which keeps its default for anything else without a
    word: the run does the same and says so, since a typed value that changes nothing is easy to miss."""
    kept = {"DS4_CUDA_STREAMING_EXPERT_CACHE_N":  # the reference names no parse rule: read as the reserve's
            "keeps the --ssd-streaming-cache-experts value or 512 experts (expertsim reads it as the reserve is read)",
            "DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB":
            f"fails to parse it and keeps the {DEFAULT_VRAM_RESERVE_GIB} GiB default (ds4-engine.md §1.3)"}
    return tuple(f"expertsim: engine.env.{name} = {value!r} is not a whole number: ds4 {what}, printing nothing"
                 for name, what in kept.items()
                 if (value := getattr(env, name, None)) is not None and not digits(value))


# ------------------------------------------------------------------------------------------ refusals


def _variant_gate(where: str, section: str, names: set[str], engine) -> None:
    for name in sorted(names):
        allowed = ONLY_IN.get(name)
        if allowed is not None and engine.variant not in allowed:
            raise InputError(where, f"engine.{section}.{name}", written(getattr(engine, section), name),
                             f"read only by variant {' or '.join(allowed)}; this scenario's variant is "
                             f"{engine.variant}")


def check_flags(scenario, where: str) -> None:
    """The refusals of the [engine] table itself: variant gates, what is not modelled, values ds4 would not run."""
    layout, engine = scenario.layout, scenario.engine
    flags, env = engine.flags, engine.env
    _variant_gate(where, "flags", {Flags.model_fields[n].alias or n for n in flags.model_fields_set}, engine)
    _variant_gate(where, "env", set(env.model_fields_set), engine)
    for name in sorted(set(env.model_fields_set) & set(NOT_MODELLED)):
        raise InputError(where, f"engine.env.{name}", getattr(env, name),
                         f"not modelled: {NOT_MODELLED[name]}; remove it to simulate the default path")
    chunk_mib = env.DS4_CUDA_MODEL_COPY_CHUNK_MB
    if chunk_mib is not None:
        if not digits(chunk_mib):
            raise InputError(where, "engine.env.DS4_CUDA_MODEL_COPY_CHUNK_MB", chunk_mib, "must be a whole MiB count")
        low, high = COPY_CHUNK_MIB_RANGE
        largest_part = max(max(x.gate_bytes, x.up_bytes, x.down_bytes) for x in layout.layers)
        if min(max(int(chunk_mib), low), high) * MIB < largest_part:
            raise InputError(where, "engine.env.DS4_CUDA_MODEL_COPY_CHUNK_MB", chunk_mib,
                             f"not modelled: expert parts of up to {largest_part / MIB:.2f} MiB would span several "
                             "copy chunks; the model copies each part as one chunk")
    if not flags.ssd_streaming:
        raise InputError(where, "engine.flags.ssd-streaming", False,
                         "the simulator models ds4 with --ssd-streaming only (the expert cache exists only then)")


def check_budget(scenario, where: str) -> None:
    """The budget, the reserve and the context against this model, this box and this workload."""
    profile, layout, engine = scenario.hardware_profile, scenario.layout, scenario.engine
    flags, env = engine.flags, engine.env
    total = layout.n_routed_layers * layout.n_experts
    text = flags.ssd_streaming_cache_experts
    if text is not None:
        gib = text.endswith("GB")
        amount = int(text[:-2] if gib else text)
        # NGB counts experts of the first routed layer (ds4.c L25638-25672, ds4-engine.md §1.3)
        experts = amount * GIB // layout.layers[0].expert_bytes if gib else amount
        if experts < 1:
            raise InputError(where, KEY_BUDGET, text, "must give at least one expert")
        if experts > total:
            raise InputError(where, KEY_BUDGET, text,
                             f"{experts} experts is more than the model's {total} routed experts")
    cache_n = env.DS4_CUDA_STREAMING_EXPERT_CACHE_N
    if cache_n is not None and digits(cache_n) and int(cache_n) > total:
        raise InputError(where, "engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_N", cache_n,
                         f"more than the model's {total} routed experts")
    reserve = env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB
    # ds4 reads an integer GiB only (anything else keeps the 16 GiB default) and clamps it to VRAM / 2:
    # both are the engine's to reproduce. A reserve of the whole VRAM or more is no setting anyone runs.
    if reserve is not None and digits(reserve) and int(reserve) * GIB >= profile.vram_bytes:
        raise InputError(where, KEY_RESERVE, reserve,
                         f"a reserve >= the GPU's VRAM ({profile.vram_bytes / GIB:g} GiB on {profile.name})")
    ctx = context_tokens(flags)
    for i, request in enumerate(scenario.workload.requests):
        # ds4_session_sync (ds4.c): "prompt exceeds context" when prompt->len >= ctx_size, one token of
        # generation room being required (read at giannisanni/neutronstar @db823235, carrying upstream @80ebbc3)
        if request.prompt_tokens >= ctx:
            raise InputError(where, f"workload.requests[{i}].prompt_tokens", request.prompt_tokens,
                             f"ds4 refuses it: prompt exceeds context (--ctx {ctx}; the prompt must be shorter)")


def check_reserve_read(scenario, where: str) -> None:
    """The planner builds size against the working set: they never read the live reserve."""
    reserve_env = scenario.engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB
    variant = VARIANTS[scenario.engine.variant]
    if reserve_env is not None and variant.planner:
        raise InputError(where, KEY_RESERVE, reserve_env,
                         f"not read by variant {variant.name}: its planner sizes the cache against the working set")


def check_backend(scenario, where: str) -> None:
    """The GPU backend a build runs on the profile's GPU: Metal for the Metal variants, and only there; what the
    modelled Metal path does not cover is refused."""
    profile, layout, engine = scenario.hardware_profile, scenario.layout, scenario.engine
    metal = profile.gpu.api == "metal"
    if metal and engine.variant not in METAL_VARIANTS:
        raise InputError(where, KEY_VARIANT, engine.variant,
                         f"ds4 runs its Metal backend on {profile.name}; that backend is modelled for variant "
                         f"{' or '.join(METAL_VARIANTS)} only (the other variants are CUDA/ROCm paths)")
    if not metal:
        if engine.variant in METAL_VARIANTS:
            raise InputError(where, KEY_VARIANT, engine.variant,
                             f"modelled on its Metal backend only; {profile.name} runs {profile.gpu.api}")
        return
    cuda_env = sorted(name for name in engine.env.model_fields_set if name.startswith("DS4_CUDA_"))
    if cuda_env:
        raise InputError(where, f"engine.env.{cuda_env[0]}", getattr(engine.env, cuda_env[0]),
                         "read by ds4's CUDA backend only; the Metal backend always reads misses with buffered "
                         "preads and keeps the pages")
    sizes = {(x.gate_bytes, x.down_bytes) for x in layout.layers[: layout.n_routed_layers]}
    if len(sizes) > 1:
        raise InputError(where, "model", layout.name,
                         "not modelled: on Metal the expert cache keeps one size class and the other layers read "
                         "their experts through the mapped file (a mixed-quant file)")
    threads = engine.env.DS4_METAL_STREAMING_EXPERT_PREAD_THREADS
    if threads is not None and not digits(threads):
        raise InputError(where, "engine.env.DS4_METAL_STREAMING_EXPERT_PREAD_THREADS", threads,
                         "must be a whole number of threads")
