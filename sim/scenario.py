"""Scenarios as data: one TOML file = hardware + model + engine settings + workload + trace source.

    hardware = "rtx-pro-6000-96gb"          # scenarios/hardware/NAME.toml, or a path to a profile
    model = "deepseek-v4-flash-q2-q4"        # a preset (sim.model.preset_names()) or a path to a .gguf
    [engine]                                 # name = one of the registered engines (sim/engines), variant
    [engine.flags]                           # the engine's own CLI flags, without the leading "--"
    [engine.env]                             # the engine's own environment variables, as strings
    [trace]                                  # generator = PRESET (+ seed) or path = "traces/x.parquet"
    [[workload.requests]]                    # prompt_tokens, decode_tokens, conversation, think_time_s

The [engine] table is the named engine's own (its Settings: the engine's names and defaults, so a command line
can be copied in) and its refusals are the engine's (Engine.validate): this module knows no engine. Values an
engine accepts and then handles in its own way are accepted here too and kept raw; settings no run of it could
have are errors. An untimed engine (the cache-only replay) reads no compute figures and no calibration file.

Every error is one line naming the file and the dotted key path (sim.errors.InputError).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, field_validator

from sim.engines import ENGINES, settings_union
from sim.engines.base import refused_tensor
from sim.errors import InputError, require_regular_file
from sim.hardware import Compute, HardwareProfile, load_hardware_file, resolve_hardware, with_values
from sim.model.layout import ModelLayout
from sim.schema import Strict, is_file, read_toml, safe_path, validate

SCHEMA = "expertsim.scenario/1"
# A request's tokens are numbered in a trace's int32 positions (sim.trace.format): a longer request has no row to
# be (scenario init took a 1e20-token prompt without a word).
MAX_REQUEST_TOKENS = 2**31 - 1


# ------------------------------------------------------------------------------------------ scenario


class Request(Strict):
    KEY_KIND: ClassVar[str] = "request key"
    label: str | None = None
    # The whole prompt the request sends. A later turn of a conversation repeats the earlier turns (their
    # prompt and output) and adds its own tokens, so its prompt_tokens >= that context.
    prompt_tokens: Annotated[int, Field(ge=1, le=MAX_REQUEST_TOKENS)]
    decode_tokens: Annotated[int, Field(ge=0, le=MAX_REQUEST_TOKENS)]
    conversation: Annotated[str, Field(min_length=1)] | None = None  # None: a conversation of its own
    # idle time before the request arrives; at most a day: a longer pause is a new session, not a turn of one
    think_time_s: Annotated[float, Field(ge=0, le=86_400)] = 0.0
    measured: bool = False  # the request a validation figure refers to


class Workload(Strict):
    requests: list[Request] = Field(min_length=1)
    # The page cache when the run starts: "warm", the model files were read before (a previous run, the
    # model load) and it holds what fits of them; "cold", it holds nothing of them.
    page_cache: Literal["warm", "cold"] = Field("warm", alias="page-cache")

    @field_validator("requests", mode="after")
    @classmethod
    def _one_measured(cls, requests: list[Request]) -> list[Request]:
        """The summary's headline describes one request: a second `measured = true` was taken and the headline
        silently described the last."""
        measured = [i for i, request in enumerate(requests) if request.measured]
        if len(measured) > 1:
            raise ValueError(f"requests {', '.join(map(str, measured))} each set measured = true: the summary "
                             "describes one request; keep it on one")
        return requests


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
    engine: settings_union()
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
        """The settings as an engine user would type them (set keys only): its environment, then its flags (a list
        is written as a command line takes it, a,b,c)."""
        env = self.engine.env.model_dump(exclude_none=True) if "env" in type(self.engine).model_fields else {}
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
    from sim.model.gguf_reader import layout_from_gguf

    return layout_from_gguf(path)


def _normal(name: str) -> str:
    return name.lower().replace(" ", "-").replace("_", "-")


def engine_compute(engine, profile: HardwareProfile, layout: ModelLayout, model_class: str | None):
    """The engine's derived compute figures for the model (Engine.derived_compute, a sim.hardware.Compute) where the
    profile has no table of its own and the scenario names no model_class; None where the profile's own (or none)
    apply."""
    if model_class is not None or (profile.compute_key(layout.name) or profile.compute_key(_normal(layout.name))):
        return None
    return engine.derived_compute(layout, profile)


def with_engine_compute(engine, profile: HardwareProfile, layout: ModelLayout,
                        model_class: str | None) -> HardwareProfile:
    """The profile with the engine's derived compute figures (engine_compute) under the model's name, where there are
    any; else the profile as it is."""
    derived = engine_compute(engine, profile, layout, model_class)
    if derived is None:
        return profile
    return profile.model_copy(update={"compute": {**profile.compute, layout.name: derived}})


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


def _check_trace(s: Scenario, layout: ModelLayout, base: Path, where: str) -> tuple[Path | None, str | None]:
    t = s.trace
    if (t.generator is None) == (t.path is None):
        raise InputError(where, "trace", sorted(t.model_fields_set) or "{}",
                         "give exactly one of generator = PRESET or path = FILE")
    want = (layout.n_experts, layout.top_k)
    if t.generator is not None:
        from sim.trace.generate import generator_preset_names
        from sim.trace.generator_spec import GENERATOR_PRESETS
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


def _refuse_a_case(raw: dict, where: str) -> None:
    """A validation case (scenarios/validation/: id, [scenario], [[arms]], [[measured]]) given where a scenario is
    read: say what runs it, rather than list the scenario keys its [scenario] table holds one level down."""
    if "arms" in raw and "measured" in raw:
        case = raw.get("id", Path(where).stem)
        raise InputError(where, "id", case, f"a validation case, not a scenario: `expertsim validate --case {case}` "
                                            "runs its arms against its measurements; its [scenario] table (or the "
                                            "file its base names) is the scenario its arms change")


def load_scenario(path: str | Path, data: dict | None = None, profile_values: dict | None = None) -> Scenario:
    """Read, validate and resolve a scenario file; any defect is a one-line InputError.

    With `data`, that parsed TOML stands in for the file's (a sweep point): the same checks, relative
    paths resolved against the file's folder, errors naming the file. With `profile_values` (dotted profile keys
    -> values, an uncertainty sample) the hardware profile's figures are those (sim.hardware.with_values)."""
    where = str(path)
    safe_path(where, "path", where)
    file = Path(path)
    require_regular_file(file, where, "a scenario file")
    base = file.resolve().parent
    raw = read_toml(file, where) if data is None else data
    _refuse_a_case(raw, where)
    scenario: Scenario = validate(where, Scenario, raw)
    hw_path = resolve_hardware(scenario.hardware, base, where)
    profile = load_hardware_file(hw_path.resolve())
    layout = _resolve_model(scenario.model, base, where)
    engine = ENGINES[scenario.engine.name]
    refused = refused_tensor(engine, layout, getattr(scenario.engine, "variant", None))
    if refused is not None:  # the file itself, before anything the engine would do with it
        raise InputError(where, "model", scenario.model, refused)
    if engine.timed:  # before an uncertainty sample's values, which may set a derived figure too
        profile = with_engine_compute(engine, profile, layout, scenario.model_class)
    if profile_values:
        profile = with_values(profile, profile_values)
    # an untimed engine needs no compute figures for the model
    compute_key = _resolve_compute(scenario, profile, layout, where) if engine.timed else None
    scenario._path = file.resolve()
    scenario._hardware_profile = profile
    scenario._layout = layout
    scenario._compute_key = compute_key
    if (no_backend := engine.refuses_hardware(profile)) is not None:
        raise InputError(where, "hardware", profile.name, no_backend)
    engine.validate(scenario, where)
    if engine.timed and profile.calibration_path is not None:  # the GPU calibration file, checked whole first
        from sim.calibrate.fileformat import load as load_calibration

        load_calibration(profile.calibration_path, f"{profile.path or profile.name}: calibration")
    trace_path, trace_sha = _check_trace(scenario, layout, base, where)
    _check_workload(scenario, where)
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
        from sim.trace.generator_spec import GENERATOR_PRESETS

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


__all__ = ["Request", "Scenario", "TraceSource", "Workload", "canonical",
           "load_scenario", "scenario_hash"]
