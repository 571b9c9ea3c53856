"""The engine spec: what the rest of expertsim may ask of an engine, and nothing else.

An engine is a package under sim/engines/ whose `__init__` defines one `Engine` subclass; sim/engines/__init__.py
registers an instance of it (one line). Everything outside sim/engines/ reaches an engine through this spec, by
the `name` in the scenario's [engine] table, and never names one:

    scenario.py   Settings (its [engine] table in the scenario's union), validate (refusals at load),
                  unloadable_type (a file's tensor types the build does not load)
    simulate.py   timed, process(...) -> EngineProcess, context_tokens
    workload.py   reads_prompt_in_chunks (a long prompt's routing kept on disk)
    explore, cli  search_space / knobs (plan's grid and labels, report axis names), default_objective,
                  plan_memory (what plan prunes before running), records_read (uncertainty), one_pass (runner),
                  headline / extra_metrics / summary_tables (the tables a run and a sweep print)
    scaffold      runs / default_variant (scenario init's choice), variants, notes, starting_settings

An engine's process is built per run on the machine (sim/machine) and serves the scenario's requests as SimPy
processes; its `state()` is an `EngineState`, whose declared fields every summary reads. An untimed engine (the
cache-only replay) has no machine and no clock: its process only counts, and its state carries its figures.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Protocol, runtime_checkable

from pydantic import BaseModel


class Variant(Protocol):
    """A build of an engine: one word (its key in `Engine.variants`) and where its behaviour was read."""

    name: str
    source: str


@dataclass(frozen=True)
class Knob:
    """A setting a user turns: its dotted scenario key (sweep's --grid spelling), a short name and unit (plan's
    lines, report axes, scenario init's notes) and words for some of its values ("one slab (pre-504)")."""

    key: str
    name: str
    unit: str = ""
    labels: Mapping[Any, str] = field(default_factory=dict)

    @property
    def title(self) -> str:
        """The name with its unit: "VRAM reserve (MiB)"."""
        return f"{self.name} ({self.unit})" if self.unit else self.name

    def label(self, value) -> str:
        """Words for one value: the knob's own, else `last-key-part=value`."""
        for known, text in self.labels.items():
            if type(known) is type(value) and known == value:
                return text
        return f"{self.key.rsplit('.', 1)[-1]}={value}"


class SearchAxis(NamedTuple):
    """One knob of plan's default search with its candidate values (the scenario's own first): primary axes are
    searched as a full grid, the others one at a time from the best primary candidate."""

    knob: Knob
    values: list
    primary: bool


def setting(data: dict, key: str):
    """The value at a dotted key of scenario TOML data (None when absent): a search space's starting point."""
    node = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def candidates(own, *others) -> list:
    """A knob's candidate values: the scenario's own (when set) first, then the others it does not hold yet
    (by type and value: "16" and 16 are different settings)."""
    out = [] if own is None else [own]
    for v in others:
        if v is not None and not any(type(v) is type(u) and v == u for u in out):
            out.append(v)
    return out


class Allocation(NamedTuple):
    pool: str  # "vram" or "ram" (one pool on unified memory: sim.machine.Memory)
    name: str
    bytes: int


@dataclass(frozen=True)
class MemoryPlan:
    """What an engine holds before its expert cache, from the scenario alone (no routing, no clock): the
    allocations its startup makes in order, what its sizing rule sees free, and why no expert cache can exist
    (None when one can) with the knob that would make room. Startup allocates these; plan prunes and scenario init
    warns on `why_no_cache`; validate refuses what cannot start."""

    allocations: tuple[Allocation, ...]
    free_at_sizing_bytes: int  # VRAM free when the cache is sized, as the engine's own rule computes it
    why_no_cache: str | None = None
    knob: str | None = None  # the setting that makes room (a reserve), named with why_no_cache
    notices: tuple[str, ...] = ()

    def held(self, pool: str) -> int:
        return sum(a.bytes for a in self.allocations if a.pool == pool)


@dataclass(frozen=True)
class EngineState:
    """What a run reports of its engine. The declared fields are the summary's headline; `detail` is the engine's
    own account (summary.json's engine_state, in the engine's order; where it repeats a declared field the two
    agree); an untimed engine's `figures` are its summary's headline and `provenance` the files it read."""

    cache_slots: int | None
    planned_cache_slots: int | None
    cache_mib: float | None
    lent_slots: int | None
    prefill_buffer_mib: float | None
    notices: tuple[str, ...] = ()
    detail: dict = field(default_factory=dict)
    figures: dict = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)


class Bounds(NamedTuple):
    """Bounds of the measured request: the most decode hits any cache of the run's sizes could get (None: the
    engine's cache has no such bound)."""

    belady_decode_hit_rate: float | None


@runtime_checkable
class EngineProcess(Protocol):
    """A run's engine, built per run: what it reports."""

    def state(self) -> EngineState: ...


@runtime_checkable
class TimedProcess(EngineProcess, Protocol):
    """A timed engine's process: SimPy processes on the machine serving the workload (`timings` gets one row per
    request), and the Belady bound of a request."""

    def serve(self, env, timings: list) -> Generator: ...

    def bounds(self, request: int) -> Bounds: ...


def refused_tensor(engine: "Engine", layout, variant: str | None) -> str | None:
    """Why the build refuses the layout's file at load (Engine.unloadable_type of its first such expert tensor), None
    when it loads every one."""
    from sim.model.quant import quant_type

    for layer in layout.layers:
        for part in ("gate", "up", "down"):
            why = engine.unloadable_type(variant, f"blk.{layer.block}.ffn_{part}_exps.weight",
                                         quant_type(getattr(layer, f"{part}_type")))
            if why is not None:
                return why
    return None


class Engine(ABC):
    """One engine family: its settings, refusals, memory plan, search space and process (module docstring)."""

    name: ClassVar[str]  # the [engine] table's `name`
    label: ClassVar[str]  # how texts name it ("Strata"): whose defaults a scenario keeps
    description: ClassVar[str]  # one phrase: "ds4's SSD-streaming expert cache"
    Settings: ClassVar[type[BaseModel]]  # its [engine] table; a `name` Literal tag, raw text kept where read
    variants: ClassVar[Mapping[str, Variant]]  # builds by their one word ({} for an engine without builds)
    timed: ClassVar[bool] = True  # False: no machine, no clock (counts only)
    # True: the process reads a request's prompt rows a chunk at a time through len, slices and np.asarray, so a long
    # prompt's routing may be kept in a temporary file (sim.trace.rowfile.FileRows) instead of memory
    reads_prompt_in_chunks: ClassVar[bool] = False
    default_objective: ClassVar[str]  # the summary metric plan maximises by default
    knobs: ClassVar[tuple[Knob, ...]]  # every knob search_space names
    headline: ClassVar[tuple[str, ...] | None] = None  # summary keys shown first (None: the run's headline)
    extra_metrics: ClassVar[tuple[str, ...]] = ()  # metrics a sweep row carries beyond the run's headline
    summary_tables: ClassVar[tuple[str, ...]] = ("links",)  # summary keys `run` prints as tables
    context_key: ClassVar[str | None] = None  # the dotted key of the context the engine allocates for, if any
    flags_note: ClassVar[str | None] = None  # its [engine.flags] table (None: the engine's command-line flags)
    notes: ClassVar[Mapping[str, str]] = {}  # scenario init's words on keys the schema does not comment (dotted)
    only_in: ClassVar[Mapping[str, tuple[str, ...]]] = {}  # flag or env names read by some variants only
    not_modelled: ClassVar[Mapping[str, str]] = {}  # env names refused: what their effect is, which is not modelled

    @abstractmethod
    def validate(self, scenario, where: str) -> None:
        """Refusals when the scenario loads, each one InputError: what the engine refuses, what is not modelled."""

    @abstractmethod
    def plan_memory(self, scenario, domain=None) -> MemoryPlan:
        """Memory before the expert cache (pure; `domain` collects the calibration records it reads)."""

    @abstractmethod
    def search_space(self, data: dict) -> list[SearchAxis]:
        """plan's default search for a scenario's TOML data."""

    @abstractmethod
    def process(self, scenario, routing, recorder, machine, domain) -> EngineProcess:
        """The engine of one run (machine None for an untimed engine)."""

    def context_tokens(self, settings) -> int | None:
        """The context the settings configure (the calibration records' `context` key); None: none."""
        return None

    def records_read(self, scenario) -> tuple[str, ...]:
        """The calibration records (sim/engines/records.py) a run of the scenario reads."""
        return ()

    def runs(self, layout, compute_key: str | None) -> str | None:
        """Why this engine runs the model (scenario init's automatic choice), None when it does not."""
        return None

    def refuses_hardware(self, profile) -> str | None:
        """Why the engine cannot run on this box at all (a GPU API it has no backend for, a memory it is not
        modelled on), None when it can: the loader's refusal and scenario init's automatic choice both ask."""
        return None

    def derived_compute(self, layout, profile):
        """Compute figures (a sim.hardware.Compute) for a model the hardware profile has no [compute] table for,
        derived from the profile's other figures; None (the default): the engine runs only the models the profile
        has figures for, and such a scenario is refused naming model_class."""
        return None

    def scope(self) -> str:
        """What the engine runs, in a few words (scenario init's text when no engine runs a model)."""
        return self.description

    def default_variant(self, layout, compute_key: str | None) -> str | None:
        """The build a starting scenario takes for this model (None: the engine has no variants)."""
        return None

    def unloadable_type(self, variant: str | None, tensor: str, qt) -> str | None:
        """Why this build refuses the file when it loads a tensor of type qt (a sim.model.quant QuantType), None when
        it loads it: by default a fork's own types (QuantType.fork) are refused."""
        if qt.fork is None:
            return None
        return f"{tensor} is {qt.name} (type {qt.ggml_id}), {qt.fork}'s own type: {self.label} does not load it"

    def owned_buffers(self, settings: dict) -> bool:
        """Whether these knob settings give the prompt path buffers of its own (plan says what pays for them)."""
        return False

    def starting_settings(self, layout, profile, typed: frozenset[str] = frozenset()) -> dict[str, tuple[Any, str]]:
        """[engine.flags] a starting scenario sets (no default, or a default this box cannot run): key -> (value,
        why); typed: the dotted keys the user sets, which such a choice leaves to them."""
        return {}

    def room_for_a_cache(self, scenario, plan: MemoryPlan) -> tuple[tuple[str, Any, str], ...]:
        """scenario init's way out where the engine's defaults leave no expert cache on the card (plan.why_no_cache):
        the settings that give one and let the engine start with it, each as (dotted key, value, why), plan.knob's
        first; none when the engine has no way out."""
        return ()

    def one_pass(self, table: dict) -> str | None:
        """A knob whose values this engine computes in one pass for the settings of this [engine] table (valid
        TOML data: an evicting LRU's slots from one miss-ratio curve), else None."""
        return None

    def one_pass_figures(self, scenario, values: list) -> list[dict]:
        """The scenario's figures at each value of its one-pass knob."""
        raise NotImplementedError(f"{self.name} computes no knob in one pass")

    def knob(self, key: str) -> Knob | None:
        return next((k for k in self.knobs if k.key == key), None)


MEMBERS = ("name", "label", "description", "Settings", "variants", "timed", "default_objective", "knobs",
           "validate", "plan_memory", "search_space", "process")
_TYPES = {"name": str, "label": str, "description": str, "timed": bool, "default_objective": str, "knobs": tuple,
          "variants": Mapping}


def spec_problems(engine) -> list[str]:
    """What keeps `engine` from meeting the spec: each missing or mistyped member, by name (empty: it meets it)."""
    problems = []
    cls = type(engine)
    for member in MEMBERS:
        value = getattr(engine, member, None)
        if value is None or getattr(value, "__isabstractmethod__", False):  # absent, or the spec's own stub
            problems.append(f"{cls.__name__} lacks {member}")
        elif member in _TYPES and not isinstance(value, _TYPES[member]):
            problems.append(f"{cls.__name__}.{member} must be a {_TYPES[member].__name__}, not {type(value).__name__}")
        elif member == "Settings" and not (inspect.isclass(value) and issubclass(value, BaseModel)):
            problems.append(f"{cls.__name__}.Settings must be a pydantic model")
    if problems:
        return problems
    tag = engine.Settings.model_fields.get("name")
    if tag is None or getattr(tag.annotation, "__args__", None) != (engine.name,):
        problems.append(f"{cls.__name__}.Settings.name must be Literal[{engine.name!r}] (the [engine] table's tag)")
    variant = engine.Settings.model_fields.get("variant")
    words = tuple(engine.variants)
    if words and (variant is None or tuple(getattr(variant.annotation, "__args__", ())) != words):
        problems.append(f"{cls.__name__}.Settings.variant must be Literal of the variants' words {words}")
    for word, build in engine.variants.items():
        if getattr(build, "name", None) != word or not isinstance(getattr(build, "source", None), str):
            problems.append(f"{cls.__name__}.variants[{word!r}] needs name {word!r} and a source")
    for knob in engine.knobs:
        if not isinstance(knob, Knob):
            problems.append(f"{cls.__name__}.knobs holds {knob!r}, not a Knob")
    return problems


__all__ = ["Allocation", "Bounds", "Engine", "EngineProcess", "EngineState", "Knob", "MEMBERS", "MemoryPlan",
           "SearchAxis", "TimedProcess", "Variant", "candidates", "refused_tensor", "setting", "spec_problems"]
