"""Strata's [engine] table, its builds and its knobs, each parsed here once, as the engine parses it
(src/program/generate.cpp, strata-engine.md §3).

The table uses the engine's own flag and environment names; values are kept as typed (`Settings`) and `Knobs` is
what the engine makes of them: the reserve in bytes and whether it was given, the prompt chunk (a number, auto or
auto:N), the ring and lend overrides, the stager threads, the arena's pinning cap, the fused kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

from pydantic import Field, PlainValidator, model_validator

from sim.engines.strata.geometry import geometry_mismatch
from sim.errors import InputError
from sim.schema import Strict, count_or_keyword, digits, env_table, written
from sim.units import GIB, MIB

# fmt: off
STREAM_ALL_MIN_TOKENS_V0135 = 2048                 # STREAM_ALL_MIN in v0.1.35 (1024 from 0.1.39) (§3.2)
STREAM_ALL_MIN_TOKENS_V0139 = 1024                 # STREAM_ALL_MIN from 0.1.39 (§3.2)
MIN_KEEP_SLOTS = 128                               # non-lendable floor of the cache (§3.3)
KV_RESIDENT_MIN_CELLS = 20480                      # --kv-resident N: "minimum 20480" (Niko1221/Strata docs/FLAGS.md)
DEFAULT_MAX_CONTEXT_TOKENS = 4096                  # Options::max_context (generate.cpp; setup.py writes larger ones)
DEFAULT_KV = "fp16"                                # Options::kv ("setup" picks int8 above an 8K context)
FORK_VRAM_RESERVE_MIB = 1536                       # the #658 fork's reserve (§5.1, seed)
NO_BORROW_CHUNK_TOKENS = 2048                      # --no-prefill-borrow or no profile: owned 2048 (§3.3)
STAGER_THREADS_MIN, STAGER_THREADS_MAX = 2, 4   # max(2, min(4, hw / 4)), STRATA_STAGER_THREADS (§3.2)
# fmt: on

KEY_CACHE = "engine.flags.expert-cache"
KEY_RESERVE = "engine.flags.vram-reserve-mib"
KEY_PREFILL = "engine.flags.prefill"
KEY_OWN = "engine.env.STRATA_PREFILL_OWN_AUTO"
KEY_NO_BORROW = "engine.flags.no-prefill-borrow"
KEY_HEADROOM = "engine.env.STRATA_RESIDENT_HEADROOM_GIB"
KEY_CONV = "engine.flags.conversation-cache-mib"


# ------------------------------------------------------------------------------------------ builds
#
# What each Strata build does differently. The seeds are v0.1.35 and the #658 fork on it; the later builds
# change how the prompt path is priced and planned (strata-engine.md §0, §3.2, §3.3, §4.3).

@dataclass(frozen=True)
class Build:
    name: str
    stream_all_min_tokens: int
    source: str
    # what the build does that v0.1.35 does not (each off unless named)
    ring_bytes: bool = False  # 0.1.39b (#583): the ring is a byte budget, not a slot count
    grid_auto: bool = False  # 0.1.39b: --prefill auto bisects on a 256-token grid up to max(8192, min(auto:N, ctx))
    auto_n: bool = False  # #669: --prefill auto:N is parsed
    owned_pricing: bool = False  # 0.1.40: owned buffers priced per cudaMalloc (2 MiB pages)
    startup_plan: bool = False  # #765: the owned prompt path is booked before the cache is sized
    independent_buffers: bool = False  # the #658 fork: owned buffers when spare VRAM pays for them
    conversation_headroom: bool = False  # the #658 fork: the conversation budget inside the RAM headroom
    live_memory: bool = False  # the live-memory build: loans get RAM coverage from the resident budget
    loan_donors: bool = False  # live memory's loan coverage: a lent expert without a RAM copy takes a donor's slot
    grouped_gather: bool = False  # 0.1.38 (#372): the unfused walk waits and records once per MMQ group, native packs


_V0139 = dict(auto_n=True, grouped_gather=True)  # 0.1.38's grouped gather, 0.1.39's auto:N
_V0139B = dict(_V0139, ring_bytes=True, grid_auto=True)
_V0140 = dict(_V0139B, owned_pricing=True, startup_plan=True)
BUILDS = {b.name: b for b in (
    Build("v0.1.35", 2048, "Niko1221/Strata d9ab8435 (strata-engine.md §3)"),
    Build("fork-658", 2048, "spideytznn/Strata on v0.1.35: proposal #658 (seed)",
          independent_buffers=True, conversation_headroom=True),
    Build("v0.1.39", STREAM_ALL_MIN_TOKENS_V0139,
          "0.1.39: #669 --prefill auto:N (the chunk list up to 32768, entries above 8192 only when asked for), "
          "STREAM_ALL_MIN 1024; the ring still 384 pinned / 96; 0.1.38's grouped prompt gather (#372)", **_V0139),
    Build("v0.1.39b", STREAM_ALL_MIN_TOKENS_V0139,
          "0.1.39b: #583 ring byte budget and 256-token chunk bisection, #669 --prefill auto:N, STREAM_ALL_MIN 1024",
          **_V0139B),
    Build("v0.1.40", STREAM_ALL_MIN_TOKENS_V0139,
          "0.1.40: bytes_needed_owned (2 MiB pages), #765 plan_startup_vram, on 0.1.39b", **_V0140),
    Build("v0.1.40-live-guarded", STREAM_ALL_MIN_TOKENS_V0139,
          "the live-memory build's guarded borrowing (docs/LIVE_MEMORY.md, PR #726 before 'Refreshing current loan "
          "coverage'), priced as 0.1.40: lent GPU experts get RAM copies from the resident budget at startup; a lent "
          "expert without one (an adaptive swap moved a file-tier expert into a covered slot) falls back to the file",
          **_V0140, live_memory=True),
    Build("v0.1.40-live", STREAM_ALL_MIN_TOKENS_V0139,
          "the live-memory build on 0.1.40 (docs/LIVE_MEMORY.md): lent GPU experts get RAM copies that share the "
          "resident budget; a lent expert without one takes a same-layer RAM slot's place (a donor: a GPU-backed "
          "duplicate first, else the coldest RAM-only expert) before the loan, else falls back to the file",
          **_V0140, live_memory=True, loan_donors=True),
)}


# ------------------------------------------------------------------------------------------ the [engine] table

ONLY_IN: dict[str, tuple[str, ...]] = {
    "STRATA_PREFILL_OWN_AUTO": ("fork-658",),  # spideytznn/Strata: independent prefill buffers (#658)
}
ENV_NAMES = (
    "STRATA_PREFILL_OWN_AUTO",  # fork-658: "0" turns the independent-buffer choice off (default on)
    "STRATA_RESIDENT_HEADROOM_GIB",  # RAM headroom of the resident modes (default 4 GiB, 8 otherwise)
    "STRATA_PREFILL_RING", "STRATA_PREFILL_LEND_PCT", "STRATA_STAGER_THREADS", "STRATA_ARENA_PIN_GIB",
    "STRATA_PF_FUSED",  # "1": the fused int8 expert kernels (CUDA), whose prompt ring is 1,024 slots (capped at 512)
)
Env = env_table("StrataEnv", "strata environment variable", ENV_NAMES)
# How the engine parses each value (strata-engine.md §3): the kind and the least value it accepts. Checked when
# the scenario loads, so a bad value is named with its file, not found in the middle of a run.
ENV_VALUES: dict[str, tuple[type, float]] = {
    "STRATA_PREFILL_OWN_AUTO": (int, 0), "STRATA_RESIDENT_HEADROOM_GIB": (float, 0),
    "STRATA_PREFILL_RING": (int, 0), "STRATA_PREFILL_LEND_PCT": (int, 0), "STRATA_STAGER_THREADS": (int, 1),
    "STRATA_ARENA_PIN_GIB": (float, 0), "STRATA_PF_FUSED": (int, 0),
}


def _check_env_value(where: str, name: str, text: str) -> None:
    kind, least = ENV_VALUES[name]
    try:
        value = kind(text)
    except ValueError:
        raise InputError(where, f"engine.env.{name}", text,
                         "must be an integer" if kind is int else "must be a number") from None
    if not value >= least:  # also refuses nan
        raise InputError(where, f"engine.env.{name}", text, f"must be >= {least:g}")


def _check_expert_cache(value: object) -> str | int:
    return count_or_keyword(value, '"auto" or a number of experts', lambda v: v == "auto")


def _check_prefill(value: object) -> str | int:
    return count_or_keyword(value, '"auto", "auto:N" or a chunk size in tokens',
                            lambda v: v == "auto" or (v.startswith("auto:") and digits(v[5:]) and int(v[5:]) >= 1))


class Flags(Strict):
    """Strata CLI flags (src/program/generate.cpp, strata-engine.md §3). Defaults are the engine's."""

    KEY_KIND: ClassVar[str] = "strata flag"
    # "auto", or N: a byte budget of N x the largest expert blob, filled with sized slots (§2.3).
    expert_cache: Annotated[str | int, PlainValidator(_check_expert_cache)] = Field("auto", alias="expert-cache")
    vram_reserve_mib: Annotated[int, Field(ge=0)] = Field(700, alias="vram-reserve-mib")
    prefill: Annotated[str | int, PlainValidator(_check_prefill)] = "auto"  # "auto" | "auto:N" | C
    no_prefill_borrow: bool = Field(False, alias="no-prefill-borrow")
    # A profile ranking (layer, expert) pairs; "@trace" ranks them by the scenario trace's own counts.
    expert_profile: Annotated[str, Field(min_length=1)] | None = Field(None, alias="expert-profile")
    # RAM mode: arena (default), resident-experts, or resident-budget-gib G (§3.5); --mmap-experts alone serves
    # every expert the GPU lacks from the mapped model files (no RAM copy: the page cache), as the ROCm container
    # does ("ROCm: large pinned allocations fail even with free RAM", docker/entrypoint-hip.sh)
    mmap_experts: bool = Field(False, alias="mmap-experts")
    resident_experts: bool = Field(False, alias="resident-experts")
    resident_budget_gib: Annotated[float, Field(gt=0)] | None = Field(None, alias="resident-budget-gib")
    max_context: Annotated[int, Field(ge=256)] = Field(DEFAULT_MAX_CONTEXT_TOKENS, alias="max-context")
    kv: Literal["fp16", "int8", "k8v4", "q4_0"] = DEFAULT_KV  # the K/V cache's type
    # N cells of each QSA layer's K/V in VRAM, the rest in pinned host RAM (KV streaming); unset: all in VRAM
    kv_resident: Annotated[int, Field(ge=1)] | None = Field(None, alias="kv-resident")
    # The vision encoder: none, on the CPU, or on the GPU (it starts before the engine, so its VRAM is taken
    # when the cache is sized)
    vision: Literal["none", "cpu", "gpu"] = "none"
    conversation_cache_mib: Annotated[int, Field(ge=0)] = Field(0, alias="conversation-cache-mib")  # 0 = off
    conversation_cache_slots: Annotated[int, Field(ge=1)] = Field(4, alias="conversation-cache-slots")
    conversation_cache_min_free_mib: Annotated[int, Field(ge=0)] = Field(2560, alias="conversation-cache-min-free-mib")
    prompt_cache: Annotated[int, Field(ge=0)] = Field(6, alias="prompt-cache")  # in-session checkpoints
    prompt_cache_every: Annotated[int, Field(ge=1)] = Field(16384, alias="prompt-cache-every")
    adapt_every: Annotated[int, Field(ge=0)] = Field(4, alias="adapt-every")  # 0: no adaptive tier
    # --pcie-frac: the share of a window's missed experts the GPU reads over PCIe; unset: the startup probe's rule
    pcie_frac: Annotated[float, Field(ge=0, le=1)] | None = Field(None, alias="pcie-frac")
    adapt_swaps: Annotated[int, Field(ge=0)] = Field(96, alias="adapt-swaps")
    short_read: Annotated[int, Field(ge=0)] = Field(64, alias="short-read")
    # --live-prefill-min-retained N (0..128, live memory): the slots a prompt loan may leave unlent under pressure
    live_prefill_min_retained: Annotated[int, Field(ge=0, le=128)] = Field(128, alias="live-prefill-min-retained")
    # --spec: MTP draft tokens per verify window; with prompt lookup (on by default) the window widens by 2, to at
    # most 8 (o.spec = min(spec + 2, 8))
    spec: Annotated[int, Field(ge=0, le=8)] = 4

    @property
    def ram_mode(self) -> str:
        if self.resident_budget_gib is not None:
            return "resident-budget"
        if self.resident_experts:
            return "resident-experts"
        return "mmap" if self.mmap_experts else "arena"

    @property
    def kv_resident_cells(self) -> int | None:
        """--kv-resident N as the engine applies it: at least 20480 cells (FLAGS.md)."""
        return None if self.kv_resident is None else max(self.kv_resident, KV_RESIDENT_MIN_CELLS)


class Drafts(Strict):
    """How the MTP draft fares on the workload's text: the tokens a verify window runs and the tokens it emits (the
    accepted drafts + 1), on average. Not engine flags: they depend on the text and the draft model. Defaults:
    "2.4-3.2 tokens per pass on average" (Strata docs/DETAILS.md @ 0173fc46, the middle) and a window of 3 tokens
    (2.85 on a 2 x RTX 4090 decode timing log, indexed copy 71542003190; --spec-min-p 0.5 grows a window only while
    the draft is confident)."""

    KEY_KIND: ClassVar[str] = "strata draft key"
    window_tokens: Annotated[float, Field(ge=1, le=8)] = 3.0
    tokens_per_window: Annotated[float, Field(ge=1, le=8)] = 2.8

    @model_validator(mode="after")
    def _accepted_within_window(self) -> "Drafts":
        if self.tokens_per_window > self.window_tokens:
            raise ValueError(f"tokens_per_window {self.tokens_per_window} > window_tokens {self.window_tokens}: a "
                             "window emits at most the tokens it verified")
        return self


class Settings(Strict):
    KEY_KIND: ClassVar[str] = "strata engine key"
    name: Literal["strata"]
    variant: Literal[tuple(BUILDS)]
    flags: Flags = Field(default_factory=Flags)
    env: Env = Field(default_factory=Env)
    drafts: Drafts = Field(default_factory=Drafts)


# ------------------------------------------------------------------------------------------ parsing, once


def env_int(where: str, text: str | None, minimum: int = 0) -> int | None:
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        raise InputError(where, "value", text, "must be an integer") from None
    if value < minimum:
        raise InputError(where, "value", text, f"must be >= {minimum}")
    return value


@dataclass(frozen=True)
class Knobs:
    """What Strata makes of a scenario's [engine] table on this box (module docstring)."""

    build: Build
    reserve_bytes: int  # --vram-reserve-mib
    reserve_mib: int
    reserve_given: bool  # set on the command line (#496 adapts only the default)
    explicit_chunk: int | None  # --prefill C
    auto_cap: int | None  # --prefill auto:N
    ring_override: int | None  # STRATA_PREFILL_RING
    lend_pct: int | None  # STRATA_PREFILL_LEND_PCT
    stager_threads: int  # STRATA_STAGER_THREADS, else max(2, min(4, hardware threads / 4))
    arena_pin_cap_bytes: float | None  # STRATA_ARENA_PIN_GIB = N > 0 (0 or unset: no cap)
    fused: bool  # STRATA_PF_FUSED = 1 on CUDA: the fused int8 experts
    own_auto: bool  # the fork's independent buffers, unless STRATA_PREFILL_OWN_AUTO = 0
    headroom_text: str | None  # STRATA_RESIDENT_HEADROOM_GIB, as ram.resident_headroom_bytes parses it

    @classmethod
    def of(cls, scenario) -> "Knobs":
        hw, engine = scenario.hardware_profile, scenario.engine
        flags, env = engine.flags, engine.env
        prefill = flags.prefill
        threads = env_int("STRATA_STAGER_THREADS", env.STRATA_STAGER_THREADS, 1)
        cap = None
        if env.STRATA_ARENA_PIN_GIB is not None:
            try:
                cap = float(env.STRATA_ARENA_PIN_GIB) * GIB
            except ValueError:
                raise InputError("STRATA_ARENA_PIN_GIB", "value", env.STRATA_ARENA_PIN_GIB,
                                 "must be a number of GiB") from None
        return cls(
            build=BUILDS[engine.variant], reserve_bytes=flags.vram_reserve_mib * MIB,
            reserve_mib=flags.vram_reserve_mib, reserve_given="vram_reserve_mib" in flags.model_fields_set,
            explicit_chunk=prefill if isinstance(prefill, int) else None,
            auto_cap=int(prefill[5:]) if isinstance(prefill, str) and prefill.startswith("auto:") else None,
            ring_override=env_int("STRATA_PREFILL_RING", env.STRATA_PREFILL_RING),
            lend_pct=env_int("STRATA_PREFILL_LEND_PCT", env.STRATA_PREFILL_LEND_PCT),
            stager_threads=threads if threads is not None else
            max(STAGER_THREADS_MIN, min(STAGER_THREADS_MAX, int(hw.host.hardware_threads.value) // 4)),
            arena_pin_cap_bytes=cap if cap is not None and cap > 0 else None,
            fused=env.STRATA_PF_FUSED == "1" and hw.gpu.api == "cuda",
            own_auto=env.STRATA_PREFILL_OWN_AUTO != "0", headroom_text=env.STRATA_RESIDENT_HEADROOM_GIB)


# ------------------------------------------------------------------------------------------ refusals


def check_settings(scenario, where: str) -> None:
    """Strata's refusals of the [engine] table on this model, box and workload: what the engine would refuse, and
    what the model does not simulate."""
    profile, layout, engine = scenario.hardware_profile, scenario.layout, scenario.engine
    flags, env = engine.flags, engine.env
    build = BUILDS[engine.variant]
    for name in sorted(set(env.model_fields_set)):
        if written(env, name) is not None:
            _check_env_value(where, name, written(env, name))
        allowed = ONLY_IN.get(name)
        if allowed is not None and engine.variant not in allowed:
            raise InputError(where, f"engine.env.{name}", written(env, name),
                             f"read only by variant {' or '.join(allowed)}; this scenario's variant is "
                             f"{engine.variant}")
    mismatch = geometry_mismatch(layout)
    if mismatch is not None:
        field, allowed = mismatch
        raise InputError(where, "model", scenario.model,
                         f"Strata runs only Qwen3.8-Flash-Next geometry ({field} {' or '.join(map(str, allowed))}"
                         f"); {layout.name} has {field} {getattr(layout, field)}")
    if flags.resident_experts and flags.resident_budget_gib is not None:
        raise InputError(where, "engine.flags.resident-budget-gib", flags.resident_budget_gib,
                         "choose one RAM mode: resident-experts or resident-budget-gib")
    if isinstance(flags.prefill, str) and flags.prefill.startswith("auto:") and not build.auto_n:
        raise InputError(where, "engine.flags.prefill", flags.prefill,
                         f"{engine.variant} does not parse auto:N (upstream #669 came with 0.1.39): use auto, a "
                         "chunk, or variant v0.1.39b or later")
    if flags.live_prefill_min_retained != MIN_KEEP_SLOTS and not build.live_memory:
        raise InputError(where, "engine.flags.live-prefill-min-retained", flags.live_prefill_min_retained,
                         f"a live-memory option (docs/PRESSURE_PREFILL_FLOOR.md); variant {engine.variant} has no "
                         "live memory")
    if build.live_memory and (flags.resident_budget_gib is None or flags.expert_profile is None):
        raise InputError(where, "engine.variant", engine.variant,
                         "live memory needs --resident-budget-gib and an --expert-profile (docs/LIVE_MEMORY.md)")
    total = layout.n_routed_layers * layout.n_experts
    if isinstance(flags.expert_cache, int) and flags.expert_cache > total:
        raise InputError(where, "engine.flags.expert-cache", flags.expert_cache,
                         f"more than the model's {total} routed experts")
    if flags.vram_reserve_mib * MIB >= profile.vram_bytes:
        raise InputError(where, KEY_RESERVE, flags.vram_reserve_mib,
                         f"a reserve >= the GPU's VRAM ({profile.vram_bytes // MIB} MiB on {profile.name})")
    for i, request in enumerate(scenario.workload.requests):
        # "prompt + max_new exceeds max-context" (Qwen35Runtime::generate, Niko1221/Strata indexed copy id
        # 71027611532: the dense path's check; the MoE server's own check was not in the copies read)
        if request.prompt_tokens + request.decode_tokens > flags.max_context:
            raise InputError(where, f"workload.requests[{i}].prompt_tokens", request.prompt_tokens,
                             f"Strata refuses a request beyond --max-context {flags.max_context}: "
                             f"{request.prompt_tokens} prompt + {request.decode_tokens} output tokens")
