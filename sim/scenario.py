"""Scenarios as data: one TOML file = hardware + model + engine settings + workload + trace source.

    hardware = "rtx-pro-6000-96gb"          # scenarios/hardware/NAME.toml, or a path to a profile
    model = "deepseek-v4-flash-q2-q4"        # a preset (sim.model.preset_names()) or a path to a .gguf
    [engine]                                 # name = "ds4" | "strata", variant = which code; or "replay"
    [engine.flags]                           # the engine's own CLI flags, without the leading "--"
    [engine.env]                             # the engine's own environment variables, as strings
    [trace]                                  # generator = PRESET (+ seed) or path = "traces/x.parquet"
    [[workload.requests]]                    # prompt_tokens, decode_tokens, conversation, think_time_s

Engine settings use the engines' names and defaults (reference/ds4-engine.md §4, strata-engine.md §3),
so a command line can be copied in. Values the real engine accepts and then handles in its own way are
accepted here too and kept raw (ds4 parses DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB as an integer, so
"0.5" silently keeps the 16 GiB default, and clamps the reserve to VRAM / 2): the engine model reproduces
that. Settings no engine run could have are errors: a reserve >= the GPU's VRAM, a chunk of 0, a budget
larger than the model's routed experts, a trace recorded for another model shape, --mtp with streaming on
upstream ds4 (only the neutronstar GLM stack runs the draft layer while streaming).

`name = "replay"` is no engine: the workload's routing replayed through one `expertsim cache` cache, its
[engine.flags] that command's options (policy, scope, slots, prefill-mode, profile); no timing, so the
hardware profile is not used and the model needs no compute figures.

Every error is one line naming the file and the dotted key path (sim.errors.InputError).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, PlainValidator, PrivateAttr, create_model

from sim.errors import InputError
from sim.model.hardware import GIB, MIB, Compute, HardwareProfile, Strict, is_file, load_hardware_file, read_toml, \
    resolve_hardware, safe_path, validate
from sim.model.layout import ModelLayout

SCHEMA = "expertsim.scenario/1"


# ------------------------------------------------------------------------------------------- values


def _env_text(value: object) -> object:
    """Environment variables are strings; an integer is taken as its decimal text, anything else refused
    (a float's text would not be what the user typed, and the engines parse the raw text)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, (float, bool)):
        raise ValueError(f'write environment values as strings, e.g. "{value}"')
    return value


EnvValue = Annotated[str, BeforeValidator(_env_text)]


def _kind(value: object) -> str:
    names = {bool: "a boolean", float: "a float", dict: "a table", list: "an array"}
    return names.get(type(value), type(value).__name__)


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _check_cache_experts(value: object) -> str:
    """`--ssd-streaming-cache-experts N|NGB`, kept as the text ds4 parses (an integer is taken as N)."""
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    number = text[:-2] if isinstance(text, str) and text.endswith("GB") else text
    if not isinstance(number, str) or not _digits(number):
        raise ValueError('must be N (experts) or "NGB" (GiB of experts), N a whole number')
    return text


def _count_or_keyword(value: object, expected: str, is_keyword) -> str | int:
    """A positive whole number (int or digits) or one of an engine's keywords, else a ValueError."""
    if not isinstance(value, (str, int)) or isinstance(value, bool):
        raise ValueError(f"must be {expected}, not {_kind(value)}")
    if isinstance(value, str) and _digits(value):
        value = int(value)
    if isinstance(value, int):
        if value < 1:
            raise ValueError("must be >= 1")
        return value
    if is_keyword(value):
        return value
    raise ValueError(f"must be {expected}")


def _check_expert_cache(value: object) -> str | int:
    return _count_or_keyword(value, '"auto" or a number of experts', lambda v: v == "auto")


def _check_prefill(value: object) -> str | int:
    return _count_or_keyword(value, '"auto", "auto:N" or a chunk size in tokens',
                             lambda v: v == "auto" or (v.startswith("auto:") and _digits(v[5:]) and int(v[5:]) >= 1))


def _env_model(name: str, kind: str, names: tuple[str, ...]) -> type[Strict]:
    model = create_model(name, __base__=Strict, **{n: (EnvValue | None, None) for n in names})
    model.KEY_KIND = kind
    return model


# ---------------------------------------------------------------------------------------------- ds4

# Knobs that exist only in some variants: setting one on another variant is a mistake, not a no-op.
DS4_VARIANTS = ("pre-504", "pr504", "pr1082", "neutronstar-glm-slab", "neutronstar-glm")
# Variants that run the in-file MTP draft layer (--mtp) together with --ssd-streaming; upstream ds4 refuses
# the pair (ds4.c L25685 @80ebbc3).
DS4_MTP_STREAMING_VARIANTS = ("neutronstar-glm-slab", "neutronstar-glm")
DS4_ONLY_IN: dict[str, tuple[str, ...]] = {
    "expert-profile": ("pr1082",),  # CUDA --expert-profile came with #1031 (ds4-engine.md §1.14)
    "DS4_EXPERT_PROFILE": ("pr1082",),
    "DS4_EXPERT_HOTLIST": ("pr1082",),
    "DS4_CUDA_HITS_FIRST": ("pr1082",),  # #1082
    "DS4_CUDA_STREAMING_EXPERT_PREAD_POOL": ("pr1082",),
}
DS4_ENV_NAMES = (
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
)
Ds4Env = _env_model("Ds4Env", "ds4 environment variable", DS4_ENV_NAMES)
# Knobs whose effect the ds4 model does not simulate: a scenario that sets one is refused rather than run
# as if it were absent. The VERBOSE/PROFILE variables only print, so they are accepted.
DS4_NOT_MODELLED = {
    "DS4_CUDA_DISABLE_STREAMING_SELECTED_SHARED_OVERLAP": "the decode path without the selected/shared overlap",
    "DS4_CUDA_DISABLE_STREAMING_PREFILL_BATCH_SELECTED_LOAD": "prefill without batched selected loads",
    "DS4_METAL_DISABLE_STREAMING_COLD_DECODE_PREFILL": "the cold decode-style prefill switch",
    "DS4_METAL_RESUME_PREFILL_MIN": "server resumes from a KV checkpoint",
}
DS4_COPY_CHUNK_MIB_RANGE = (16, 4096)  # DS4_CUDA_MODEL_COPY_CHUNK_MB clamp (ds4-engine.md §1.2, L218-222)


class Ds4Flags(Strict):
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
    ctx: Annotated[int, Field(ge=1)] | None = None
    # The MTP draft model. Upstream refuses it together with --ssd-streaming (ds4.c L25685 @80ebbc3); the
    # neutronstar GLM stack binds the draft layer (GLM-5.2's blk.78) from the main GGUF: pass its path.
    mtp: str | None = None
    expert_profile: str | None = Field(None, alias="expert-profile")


class Ds4Engine(Strict):
    KEY_KIND: ClassVar[str] = "ds4 engine key"
    name: Literal["ds4"]
    # pre-504: one slab keyed on the last expert size, release_all before every prefill batch (@80ebbc3).
    # pr504: per-size-class caches, prefill reads the cache and appends without evicting (PR #504).
    # pr1082: pr504 plus hits-first and the pread pool (#1082; DS4_CUDA_HITS_FIRST, ..._PREAD_POOL).
    # neutronstar-glm: giannisanni/neutronstar @db823235fd15a4287916377e1f108a7319160c40 (2026-07-06), PR
    #   #504 ported onto the fork's GLM CUDA stack: per-size-class caches (the Q2_K MTP draft layer blk.78
    #   "can be cached alongside the IQ2_XXS layers"), prefill reads the cache; the MTP draft layer runs
    #   with --ssd-streaming (--mtp, the main GGUF's path). Its other extras (io_uring fetch, host LFU
    #   cache, backfill, prefetch) are not modelled: misses use upstream's QD1 streamed copy.
    # neutronstar-glm-slab: a what-if twin of neutronstar-glm with upstream's pre-504 slab (one cache keyed
    #   on the last expert size, release_all before prefill batches) under the same MTP draft steps: what
    #   ds4 #595 reports, "1/76 routed layers off the slab size class". Not the fork's pre-port code, which
    #   sent blk.78 around the cache ("falling back to model views", db823235's commit message).
    variant: Literal["pre-504", "pr504", "pr1082", "neutronstar-glm-slab", "neutronstar-glm"]
    flags: Ds4Flags = Field(default_factory=Ds4Flags)
    env: Ds4Env = Field(default_factory=Ds4Env)


# ------------------------------------------------------------------------------------------- Strata

STRATA_ONLY_IN: dict[str, tuple[str, ...]] = {
    "STRATA_PREFILL_OWN_AUTO": ("fork-658",),  # spideytznn/Strata: independent prefill buffers (#658)
}
STRATA_ENV_NAMES = (
    "STRATA_PREFILL_OWN_AUTO",  # fork-658: "0" turns the independent-buffer choice off (default on)
    "STRATA_RESIDENT_HEADROOM_GIB",  # RAM headroom of the resident modes (default 4 GiB, 8 otherwise)
    "STRATA_PREFILL_RING", "STRATA_PREFILL_LEND_PCT", "STRATA_STAGER_THREADS", "STRATA_ARENA_PIN_GIB",
)
StrataEnv = _env_model("StrataEnv", "strata environment variable", STRATA_ENV_NAMES)


class StrataFlags(Strict):
    """Strata CLI flags (src/program/generate.cpp, strata-engine.md §3). Defaults are the engine's."""

    KEY_KIND: ClassVar[str] = "strata flag"
    # "auto", or N: a byte budget of N x the largest expert blob, filled with sized slots (§2.3).
    expert_cache: Annotated[str | int, PlainValidator(_check_expert_cache)] = Field("auto", alias="expert-cache")
    vram_reserve_mib: Annotated[int, Field(ge=0)] = Field(700, alias="vram-reserve-mib")
    prefill: Annotated[str | int, PlainValidator(_check_prefill)] = "auto"  # "auto" | "auto:N" | C
    no_prefill_borrow: bool = Field(False, alias="no-prefill-borrow")
    # A profile ranking (layer, expert) pairs; "@trace" ranks them by the scenario trace's own counts.
    expert_profile: Annotated[str, Field(min_length=1)] | None = Field(None, alias="expert-profile")
    # RAM mode: arena (default), resident-experts, or resident-budget-gib G (§3.5).
    resident_experts: bool = Field(False, alias="resident-experts")
    resident_budget_gib: Annotated[float, Field(gt=0)] | None = Field(None, alias="resident-budget-gib")
    conversation_cache_mib: Annotated[int, Field(ge=0)] = Field(0, alias="conversation-cache-mib")  # 0 = off
    conversation_cache_slots: Annotated[int, Field(ge=1)] = Field(4, alias="conversation-cache-slots")
    conversation_cache_min_free_mib: Annotated[int, Field(ge=0)] = Field(2560, alias="conversation-cache-min-free-mib")
    prompt_cache: Annotated[int, Field(ge=0)] = Field(6, alias="prompt-cache")  # in-session checkpoints
    prompt_cache_every: Annotated[int, Field(ge=1)] = Field(16384, alias="prompt-cache-every")
    adapt_every: Annotated[int, Field(ge=1)] = Field(4, alias="adapt-every")
    adapt_swaps: Annotated[int, Field(ge=0)] = Field(96, alias="adapt-swaps")
    short_read: Annotated[int, Field(ge=0)] = Field(64, alias="short-read")

    @property
    def ram_mode(self) -> str:
        if self.resident_budget_gib is not None:
            return "resident-budget"
        return "resident-experts" if self.resident_experts else "arena"


class StrataEngine(Strict):
    KEY_KIND: ClassVar[str] = "strata engine key"
    name: Literal["strata"]
    # v0.1.35: upstream Niko1221/Strata d9ab8435. fork-658: spideytznn/Strata on v0.1.35 (independent
    # prefill buffers when spare VRAM allows; conversation budget added to the resident RAM headroom).
    variant: Literal["v0.1.35", "fork-658"]
    flags: StrataFlags = Field(default_factory=StrataFlags)
    env: StrataEnv = Field(default_factory=StrataEnv)


# ------------------------------------------------------------------------------------------- replay


def _check_slots(value: object) -> int | list[int]:
    """One slot count for every pool, or an array of one per pool (whole numbers >= 0)."""
    def count(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if count(value) or (isinstance(value, list) and value and all(count(v) for v in value)):
        return value
    raise ValueError("must be a slot count >= 0 for every pool, or an array of one count per pool")


class ReplayFlags(Strict):
    """The `expertsim cache` options a cache-only replay runs with (sim/cache/replay.py, docs/cache.md).
    The literals are replay.POLICIES, SCOPES and PREFILL_MODES (tests/test_cache_only.py checks they agree):
    importing the cache module here would load numba for every scenario."""

    KEY_KIND: ClassVar[str] = "replay flag"
    policy: Literal["lru", "lfu", "opt", "static", "ds4-slab"] = "lru"
    # Pools: one per layer, per size class, or one; ds4-slab is always one slab with a capacity per class.
    scope: Literal["layer", "class", "global"] = "layer"
    slots: Annotated[int | list[int], PlainValidator(_check_slots)]
    prefill_mode: Literal["evict", "append"] = Field("evict", alias="prefill-mode")
    # The static policy's ranking: a rank,layer,expert CSV relative to the scenario; unset = the workload's own
    # access counts (an oracle profile, as `expertsim cache` does without --profile).
    profile: Annotated[str, Field(min_length=1)] | None = None


class ReplayEngine(Strict):
    """No engine: the workload's routing replayed through one cache, counts only, no timing."""

    KEY_KIND: ClassVar[str] = "replay engine key"
    name: Literal["replay"]
    flags: ReplayFlags


# ------------------------------------------------------------------------------------------ scenario


class Request(Strict):
    KEY_KIND: ClassVar[str] = "request key"
    label: str | None = None
    # The whole prompt the request sends. A later turn of a conversation repeats the earlier turns (their
    # prompt and output) and adds its own tokens, so its prompt_tokens >= that context.
    prompt_tokens: Annotated[int, Field(ge=1)]
    decode_tokens: Annotated[int, Field(ge=0)]
    conversation: Annotated[str, Field(min_length=1)] | None = None  # None: a conversation of its own
    think_time_s: Annotated[float, Field(ge=0)] = 0.0  # idle time before the request arrives
    measured: bool = False  # the request a validation figure refers to


class Workload(Strict):
    requests: list[Request] = Field(min_length=1)


class TraceSource(Strict):
    KEY_KIND: ClassVar[str] = "trace key"
    generator: str | None = None  # a sim.trace generator preset
    path: str | None = None  # an expertsim trace (.parquet), relative to the scenario file
    seed: Annotated[int, Field(ge=0, lt=2**63)] = 0


class Scenario(Strict):
    description: str | None = None
    hardware: Annotated[str, Field(min_length=1)]
    model: Annotated[str, Field(min_length=1)]
    # The key of the hardware profile's [compute] table to use; default: the one the model name starts with.
    model_class: Annotated[str, Field(min_length=1)] | None = None
    engine: Annotated[Ds4Engine | StrataEngine | ReplayEngine, Field(discriminator="name")]
    trace: TraceSource
    workload: Workload

    _path: Path | None = PrivateAttr(default=None)
    _hardware_profile: HardwareProfile | None = PrivateAttr(default=None)
    _layout: ModelLayout | None = PrivateAttr(default=None)
    _compute_key: str | None = PrivateAttr(default=None)
    _trace_path: Path | None = PrivateAttr(default=None)
    _trace_sha256: str | None = PrivateAttr(default=None)

    @property
    def path(self) -> Path | None:
        return self._path

    @property
    def hardware_profile(self) -> HardwareProfile:
        return self._hardware_profile

    @property
    def layout(self) -> ModelLayout:
        return self._layout

    @property
    def compute_key(self) -> str:
        return self._compute_key

    @property
    def compute(self) -> Compute:
        return self._hardware_profile.compute[self._compute_key]

    @property
    def trace_path(self) -> Path | None:
        return self._trace_path

    @property
    def trace_sha256(self) -> str | None:
        return self._trace_sha256

    @property
    def measured(self) -> list[int]:
        return [i for i, r in enumerate(self.workload.requests) if r.measured]

    def command_line(self) -> str:
        """The settings as an engine user would type them (set keys only); a replay's as `expertsim cache`
        options (it has no environment; a list of slots is written as the CLI takes it, a,b,c)."""
        env = {} if isinstance(self.engine, ReplayEngine) else self.engine.env.model_dump(exclude_none=True)
        flags = self.engine.flags.model_dump(by_alias=True, exclude_unset=True)
        flags = {k: ",".join(map(str, v)) if isinstance(v, list) else v for k, v in flags.items()}
        args = [f"--{k}" if v is True else f"--{k} {v}" for k, v in flags.items() if v not in (False, None)]
        return " ".join([*(f"{k}={v}" for k, v in env.items()), self.engine.name, *args])


# ------------------------------------------------------------------------------------------ loading


def _resolve_model(value: str, base: Path, where: str) -> ModelLayout:
    from sim.model.presets import PRESETS, preset_names

    if value in PRESETS:
        return PRESETS[value]
    if not (value.endswith(".gguf") or "/" in value or "\\" in value):
        raise InputError(where, "model", value, f"unknown model preset; valid: {', '.join(preset_names())} "
                                                "(or a path to a .gguf file)")
    safe_path(where, "model", value)
    path = Path(value) if Path(value).is_absolute() else base / value
    if not is_file(path):
        raise InputError(where, "model", value, f"no such file ({path})")
    return ModelLayout.from_gguf(path)


def _normal(name: str) -> str:
    return name.lower().replace(" ", "-").replace("_", "-")


def _resolve_compute(s: Scenario, profile: HardwareProfile, layout: ModelLayout, where: str) -> str:
    keys = ", ".join(profile.compute) or "none"
    if s.model_class is not None:
        if s.model_class not in profile.compute:
            raise InputError(where, "model_class", s.model_class,
                             f"hardware profile {profile.name} has no compute figures for it; it has: {keys}")
        return s.model_class
    key = profile.compute_key(layout.name) or profile.compute_key(_normal(layout.name))
    if key is None:
        raise InputError(where, "model", s.model, f"hardware profile {profile.name} has no compute figures for "
                                                  f"model {layout.name!r}; set model_class to one of: {keys}")
    return key


def _variant_gate(where: str, section: str, names: set[str], only_in: dict[str, tuple[str, ...]], engine) -> None:
    for name in sorted(names):
        allowed = only_in.get(name)
        if allowed is not None and engine.variant not in allowed:
            raise InputError(where, f"engine.{section}.{name}", _written(engine, section, name),
                             f"read only by variant {' or '.join(allowed)}; this scenario's variant is "
                             f"{engine.variant}")


def _written(engine, section: str, key: str) -> Any:
    return getattr(engine, section).model_dump(by_alias=True).get(key)


def _routed_experts(layout: ModelLayout) -> int:
    return layout.n_routed_layers * layout.n_experts


def _check_ds4(s: Scenario, profile: HardwareProfile, layout: ModelLayout, where: str) -> None:
    engine: Ds4Engine = s.engine
    flags, env = engine.flags, engine.env
    _variant_gate(where, "flags", {Ds4Flags.model_fields[n].alias or n for n in flags.model_fields_set},
                  DS4_ONLY_IN, engine)
    _variant_gate(where, "env", set(env.model_fields_set), DS4_ONLY_IN, engine)
    for name in sorted(set(env.model_fields_set) & set(DS4_NOT_MODELLED)):
        raise InputError(where, f"engine.env.{name}", getattr(env, name),
                         f"not modelled: {DS4_NOT_MODELLED[name]}; remove it to simulate the default path")
    chunk_mib = env.DS4_CUDA_MODEL_COPY_CHUNK_MB
    if chunk_mib is not None:
        if not _digits(chunk_mib):
            raise InputError(where, "engine.env.DS4_CUDA_MODEL_COPY_CHUNK_MB", chunk_mib, "must be a whole MiB count")
        low, high = DS4_COPY_CHUNK_MIB_RANGE
        largest_part = max(max(x.gate_bytes, x.up_bytes, x.down_bytes) for x in layout.layers)
        if min(max(int(chunk_mib), low), high) * MIB < largest_part:
            raise InputError(where, "engine.env.DS4_CUDA_MODEL_COPY_CHUNK_MB", chunk_mib,
                             f"not modelled: expert parts of up to {largest_part / MIB:.2f} MiB would span several "
                             "copy chunks; the model copies each part as one chunk")
    if not flags.ssd_streaming:
        raise InputError(where, "engine.flags.ssd-streaming", False,
                         "the simulator models ds4 with --ssd-streaming only (the expert cache exists only then)")
    if flags.mtp is not None and engine.variant not in DS4_MTP_STREAMING_VARIANTS:
        raise InputError(where, "engine.flags.mtp", flags.mtp,
                         "ds4 rejects --mtp together with --ssd-streaming (ds4.c L25685 @80ebbc3)")
    if flags.mtp is not None and layout.n_mtp_layers == 0:
        raise InputError(where, "engine.flags.mtp", flags.mtp,
                         f"model {layout.name} has no MTP layer in its file; variant {engine.variant} runs the "
                         "draft layer bound from the main GGUF (a separate MTP GGUF is not modelled)")
    total = _routed_experts(layout)
    text = flags.ssd_streaming_cache_experts
    if text is not None:
        gib = text.endswith("GB")
        amount = int(text[:-2] if gib else text)
        # NGB counts experts of the first routed layer (ds4.c L25638-25672, ds4-engine.md §1.3)
        experts = amount * GIB // layout.layers[0].expert_bytes if gib else amount
        if experts < 1:
            raise InputError(where, "engine.flags.ssd-streaming-cache-experts", text, "must give at least one expert")
        if experts > total:
            raise InputError(where, "engine.flags.ssd-streaming-cache-experts", text,
                             f"{experts} experts is more than the model's {total} routed experts")
    cache_n = env.DS4_CUDA_STREAMING_EXPERT_CACHE_N
    if cache_n is not None and _digits(cache_n) and int(cache_n) > total:
        raise InputError(where, "engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_N", cache_n,
                         f"more than the model's {total} routed experts")
    reserve = env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB
    # ds4 reads an integer GiB only (anything else keeps the 16 GiB default) and clamps it to VRAM / 2:
    # both are the engine's to reproduce. A reserve of the whole VRAM or more is no setting anyone runs.
    if reserve is not None and _digits(reserve) and int(reserve) * GIB >= profile.vram_bytes:
        raise InputError(where, "engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB", reserve,
                         f"a reserve >= the GPU's VRAM ({profile.gpu.vram_gib.value:g} GiB on {profile.name})")


# Strata's kernels are built for one geometry (compile-time constants checked against the model,
# strata-engine.md §2.1, §4.1): Qwen3.8-Flash-Next, 512 experts (256 in the Coder prune), top-10, n_embd 2560.
STRATA_GEOMETRY = {"hidden": (2560,), "top_k": (10,), "n_experts": (512, 256)}


def _check_strata(s: Scenario, profile: HardwareProfile, layout: ModelLayout, where: str) -> None:
    engine: StrataEngine = s.engine
    flags, env = engine.flags, engine.env
    _variant_gate(where, "env", set(env.model_fields_set), STRATA_ONLY_IN, engine)
    for field, allowed in STRATA_GEOMETRY.items():
        if getattr(layout, field) not in allowed:
            raise InputError(where, "model", s.model,
                             f"Strata runs only Qwen3.8-Flash-Next geometry ({field} {' or '.join(map(str, allowed))}"
                             f"); {layout.name} has {field} {getattr(layout, field)}")
    if flags.resident_experts and flags.resident_budget_gib is not None:
        raise InputError(where, "engine.flags.resident-budget-gib", flags.resident_budget_gib,
                         "choose one RAM mode: resident-experts or resident-budget-gib")
    total = _routed_experts(layout)
    if isinstance(flags.expert_cache, int) and flags.expert_cache > total:
        raise InputError(where, "engine.flags.expert-cache", flags.expert_cache,
                         f"more than the model's {total} routed experts")
    if flags.vram_reserve_mib * MIB >= profile.vram_bytes:
        raise InputError(where, "engine.flags.vram-reserve-mib", flags.vram_reserve_mib,
                         f"a reserve >= the GPU's VRAM ({profile.vram_bytes // MIB} MiB on {profile.name})")


def _check_replay(s: Scenario, layout: ModelLayout, base: Path, where: str) -> None:
    from sim.cache.replay import Geometry, capacity_pools

    flags: ReplayFlags = s.engine.flags
    if flags.policy == "opt" and flags.prefill_mode != "evict":
        raise InputError(where, "engine.flags.prefill-mode", flags.prefill_mode,
                         "opt is the bound of an evicting cache: use evict")
    if flags.profile is not None:
        if flags.policy != "static":
            raise InputError(where, "engine.flags.profile", flags.profile,
                             f"read only by policy static; this scenario's policy is {flags.policy}")
        safe_path(where, "engine.flags.profile", flags.profile)
        path = Path(flags.profile) if Path(flags.profile).is_absolute() else base / flags.profile
        if not is_file(path):
            raise InputError(where, "engine.flags.profile", flags.profile, f"no such file ({path})")
    # A replay routes the model's routed layers (no MTP draft steps).
    geometry = Geometry.of_layout(layout, layout.n_routed_layers)
    scope, pool_keys = capacity_pools(geometry, flags.policy, flags.scope)
    slots = flags.slots if isinstance(flags.slots, list) else [flags.slots] * len(pool_keys)
    if len(slots) != len(pool_keys):
        pools = "size class" if flags.policy == "ds4-slab" or scope == "class" else scope
        raise InputError(where, "engine.flags.slots", flags.slots,
                         f"{len(slots)} counts; policy {flags.policy}, scope {scope} on {layout.name} takes one "
                         f"count, or one per {pools} ({len(pool_keys)})")
    for pool, (count, keys) in enumerate(zip(slots, pool_keys)):
        if count > keys:  # the kernels allocate every slot: a count beyond the pool's experts is no cache at all
            raise InputError(where, "engine.flags.slots", flags.slots,
                             f"{count} slots in pool {pool}, which has only {keys} experts")


def _check_trace(s: Scenario, layout: ModelLayout, base: Path, where: str) -> tuple[Path | None, str | None]:
    t = s.trace
    if (t.generator is None) == (t.path is None):
        raise InputError(where, "trace", sorted(t.model_fields_set) or "{}",
                         "give exactly one of generator = PRESET or path = FILE")
    want = (layout.n_experts, layout.top_k)
    if t.generator is not None:
        from sim.trace.generate import GENERATOR_PRESETS, generator_preset_names
        from sim.model.presets import get_preset

        if t.generator not in GENERATOR_PRESETS:
            raise InputError(where, "trace.generator", t.generator,
                             f"unknown generator preset; valid: {', '.join(generator_preset_names())}")
        gen = get_preset(GENERATOR_PRESETS[t.generator]["model"])
        got = (gen.n_routed_layers, gen.n_experts, gen.top_k)
        if got != (layout.n_routed_layers, *want):
            raise InputError(where, "trace.generator", t.generator,
                             f"generates {got[0]} layers x {got[1]} experts, top-{got[2]}; model {layout.name} has "
                             f"{layout.n_routed_layers} x {layout.n_experts}, top-{layout.top_k}")
        return None, None
    if "seed" in t.model_fields_set:
        raise InputError(where, "trace.seed", t.seed, "a seed applies to generator traces only")
    safe_path(where, "trace.path", t.path)
    path = Path(t.path) if Path(t.path).is_absolute() else base / t.path
    if not is_file(path):
        raise InputError(where, "trace.path", t.path, f"no such file ({path})")
    from sim.trace.format import read_trace

    trace = read_trace(path)
    h = trace.header
    layers_ok = h.n_layers in (layout.n_routed_layers, len(layout.layers))
    if not layers_ok or (h.n_experts, h.top_k) != want:
        raise InputError(where, "trace.path", t.path,
                         f"trace has {h.n_layers} layers x {h.n_experts} experts, top-{h.top_k}; model {layout.name} "
                         f"has {layout.n_routed_layers} x {layout.n_experts}, top-{layout.top_k}")
    return path.resolve(), trace.sha256()


def _check_workload(s: Scenario, where: str) -> None:
    context: dict[str, int] = {}
    for i, r in enumerate(s.workload.requests):
        if r.conversation is None:
            continue
        before = context.get(r.conversation, 0)
        if r.prompt_tokens < before:
            raise InputError(where, f"workload.requests[{i}].prompt_tokens", r.prompt_tokens,
                             f"a turn of conversation {r.conversation!r} repeats its earlier turns: "
                             f"needs >= {before} tokens (earlier prompt + output)")
        context[r.conversation] = r.prompt_tokens + r.decode_tokens


def load_scenario(path: str | Path, data: dict | None = None) -> Scenario:
    """Read, validate and resolve a scenario file; any defect is a one-line InputError.

    With `data`, that parsed TOML stands in for the file's (a sweep point): the same checks, relative
    paths resolved against the file's folder, errors naming the file."""
    where = str(path)
    safe_path(where, "path", where)
    file = Path(path)
    if not is_file(file):
        raise InputError(where, "path", where, "no such file")
    base = file.resolve().parent
    scenario: Scenario = validate(where, Scenario, read_toml(file, where) if data is None else data)
    hw_path = resolve_hardware(scenario.hardware, base, where)
    profile = load_hardware_file(hw_path.resolve())
    layout = _resolve_model(scenario.model, base, where)
    replay = isinstance(scenario.engine, ReplayEngine)
    # a cache-only replay has no timing, so it needs no compute figures for the model
    compute_key = None if replay else _resolve_compute(scenario, profile, layout, where)
    if replay:
        _check_replay(scenario, layout, base, where)
    else:
        (_check_ds4 if scenario.engine.name == "ds4" else _check_strata)(scenario, profile, layout, where)
    trace_path, trace_sha = _check_trace(scenario, layout, base, where)
    _check_workload(scenario, where)
    scenario._path = file.resolve()
    scenario._hardware_profile = profile
    scenario._layout = layout
    scenario._compute_key = compute_key
    scenario._trace_path = trace_path
    scenario._trace_sha256 = trace_sha
    return scenario


# ------------------------------------------------------------------------------------------- hashing


def canonical(scenario: Scenario) -> dict:
    """What a result depends on, as JSON-able data: the validated settings plus the *content* of the
    hardware profile, the model layout and the trace (not their names or paths)."""
    if scenario.hardware_profile is None:
        raise ValueError("only a scenario returned by load_scenario() can be hashed")
    settings = scenario.model_dump(mode="json", by_alias=True, exclude={"description", "hardware", "model", "trace"})
    layout = scenario.layout.to_dict()
    layout.pop("source", None)  # provenance text (a GGUF path), not content
    trace: dict[str, Any]
    if scenario.trace.generator is not None:
        from sim.trace.generate import GENERATOR_PRESETS

        trace = {"generator": scenario.trace.generator, "seed": scenario.trace.seed,
                 "preset": GENERATOR_PRESETS[scenario.trace.generator]}
    else:
        trace = {"sha256": scenario.trace_sha256}
    return {"schema": SCHEMA, "settings": settings, "hardware": scenario.hardware_profile.canonical(),
            "model": layout, "trace": trace}


def scenario_hash(scenario: Scenario) -> str:
    """sha256 of the canonical JSON (sorted keys, no whitespace) of `canonical(scenario)`."""
    text = json.dumps(canonical(scenario), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


__all__ = ["Ds4Engine", "Ds4Flags", "ReplayEngine", "ReplayFlags", "Request", "Scenario", "StrataEngine",
           "StrataFlags", "TraceSource", "Workload",
           "canonical", "load_scenario", "scenario_hash"]
