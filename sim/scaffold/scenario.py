"""A commented starting scenario for a model on a machine.

    expertsim scenario init --model deepseek-v4-flash-q2-q4 --hardware rtx-4090 -o mine.toml

A scenario starts from the engine's own defaults, and each line says what it is (the schema's comment on the
field where it has one, the same text docs/reference/scenario-schema.md shows), and whether it keeps the engine's
default or changes it. The engine follows from the model: the first registered engine that runs it (Engine.runs:
Strata for the one geometry its kernels are built for, ds4 for its model families), else the untimed cache-only
replay of the routing. `--set KEY=VALUE` is `run --set`: the same keys and typing rules, through
sim.explore.sweep.parse_settings.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel

from sim.engines import ENGINES
from sim.engines.base import refused_tensor
from sim.errors import InputError
from sim.scaffold.toml_text import comment_block, commented, dotted, toml_key, toml_value
from sim.scaffold.writing import hardware_from, reference, write_checked
from sim.schema import field_comments, is_file

ENGINE_CHOICES = ("auto", *ENGINES)
COMMENT_COLUMN_MAX = 40  # a longer `key = value` takes its comment two spaces after it


@lru_cache(maxsize=None)
def field_notes(model: type[BaseModel]) -> dict[str, str]:
    """The schema's comment on each field of `model` (sim.schema.field_comments), by the key's TOML spelling."""
    return {(model.model_fields[name].alias or name): text for name, text in field_comments(model).items()
            if name in model.model_fields}


def _file_from(ref: str, base: Path) -> Path | None:
    path = Path(ref) if Path(ref).is_absolute() else base / ref
    return path if is_file(path) else None


def compute_for(engine, layout, profile, model_class: str | None) -> tuple[str | None, object]:
    """(key, derived): the [compute] table a scenario of this engine would use (model_class, else the profile's own
    for the model, else the engine's derived one under the model's name; None: none) and, where it is the engine's,
    its figures (scenario.engine_compute; else None)."""
    from sim.scenario import engine_compute

    if model_class:
        return model_class, None
    derived = engine_compute(engine, profile, layout, None)
    return (layout.name, derived) if derived is not None else (profile.compute_key(layout.name), None)


def choose_engine(engine: str, layout, profile, model_class: str | None) -> tuple[str, str]:
    """(engine, why) for --engine: as given, or for auto the first timed engine that runs the model (Engine.runs),
    else the untimed one, a replay of its routing."""
    if engine not in ENGINE_CHOICES:
        raise InputError("scenario init", "--engine", engine, f"must be one of: {', '.join(ENGINE_CHOICES)}")
    if engine != "auto":
        return engine, f"--engine {engine}"
    timed = [e for e in ENGINES.values() if e.timed]
    not_here = []  # engines that run the model, but not on this box
    for candidate in timed:
        compute_key, _ = compute_for(candidate, layout, profile, model_class)
        why = candidate.runs(layout, compute_key)
        if why is None or refused_tensor(candidate, layout, candidate.default_variant(layout, compute_key)) is not None:
            continue
        if (no_backend := candidate.refuses_hardware(profile)) is not None:
            not_here.append(f"{candidate.name} runs it, but not on {profile.name}: {no_backend}")
            continue
        return candidate.name, why
    fallback = next(e for e in ENGINES.values() if not e.timed)
    scopes = "; ".join(not_here or [e.scope() for e in timed])
    here = " here" if not_here else ""
    return fallback.name, f"no timed engine runs {layout.name}{here} ({scopes}), so {fallback.runs(layout, None)}"


def generator_for(layout) -> str | None:
    """The generator preset of the model, else the first (by name) that generates its shape; None if none does."""
    from sim.trace.generator_model import generator_shape
    from sim.trace.generator_spec import GENERATOR_PRESETS

    shape = (layout.n_routed_layers, layout.n_experts, layout.top_k)
    names = ([layout.name] if layout.name in GENERATOR_PRESETS else []) + sorted(GENERATOR_PRESETS)
    return next((name for name in names if generator_shape(name) == shape), None)


class _Notes:
    """What each line of a scenario says: by key path (array indices dropped), what it is and its default."""

    def __init__(self, engine: str):
        self.engine = engine  # whose defaults the engine keys keep (Engine.label): "ds4", "Strata", "expertsim cache"
        self.owner = f"{engine}'s"
        self.what: dict[tuple, str] = {}
        self.engine_default: dict[tuple, object] = {}  # engine keys and their defaults (None: unset)
        self.tables: dict[tuple, str] = {}
        self.unset: dict[tuple, list[tuple[str, str]]] = {}  # per table: keys left unset, and what they are
        self.others: dict[tuple, str] = {}  # per table: the undocumented keys, at their defaults, in one line
        self.started: set[tuple] = set()  # keys the engine's starting settings write (Engine.starting_settings)

    def line(self, path: tuple, changed: set[tuple]) -> str:
        what = self.what.get(path, "")
        if path in self.engine_default:
            default = self.engine_default[path]
            shown = "unset" if default is None else toml_value(default)
            status = f"[set here; {self.owner} default: {shown}]" if path in changed | self.started else \
                f"[{self.owner} default]"
        else:
            status = "[set here]" if path in changed else ""
        return " ".join(filter(None, [what, status])) or "set here"


def _engine_notes(notes: _Notes, engine, variant: str | None, flags_model, env_model, starting: dict) -> dict:
    """The engine's flags a starting scenario writes (documented ones with a default, and `starting`: the engine's
    starting settings, key -> (value, why)), and the notes of every key."""
    flags_path, env_path = ("engine", "flags"), ("engine", "env")
    knob_names = {knob.key: knob.title for knob in engine.knobs}
    written, unset, others = {}, [], []
    for name, info in flags_model.model_fields.items():
        key = info.alias or name
        if key in engine.only_in and variant not in engine.only_in[key]:
            continue  # read by other variants only: setting it here would be refused
        if info.is_required() or key in starting:
            continue  # no default, or one the engine starts from elsewhere: the caller writes it
        dotted_key = f"engine.flags.{key}"
        what = "; ".join(filter(None, [knob_names.get(dotted_key), engine.notes.get(dotted_key),
                                       field_notes(flags_model).get(key)]))
        default = info.get_default(call_default_factory=True)
        notes.engine_default[flags_path + (key,)] = default
        notes.what[flags_path + (key,)] = what
        if not what:
            others.append(f"{key} = {toml_value(default)}" if default is not None else f"{key} unset")
        elif default is None:
            unset.append((key, what))
        else:
            written[key] = default
    notes.unset[flags_path] = unset
    if others:
        notes.others[flags_path] = (f"Also, at {notes.owner} defaults: {', '.join(others)}; every key: "
                                    "docs/reference/scenario-schema.md")
    if env_model is not None:
        env_unset = []
        for name in env_model.model_fields:
            key = f"engine.env.{name}"
            if name in engine.only_in and variant not in engine.only_in[name]:
                continue
            notes.engine_default[env_path + (name,)] = None
            if key in knob_names:
                what = "; ".join(filter(None, [knob_names[key], engine.notes.get(key)]))
                notes.what[env_path + (name,)] = what
                env_unset.append((name, what))
        notes.unset[env_path] = env_unset
        notes.others[env_path] = f"Every name {notes.engine} reads: docs/reference/scenario-schema.md"
    return written


def _render_scenario(header: list[str], data: dict, notes: _Notes, changed: set[tuple]) -> str:
    out = [*header, ""]

    def is_tables(value) -> bool:
        return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)

    def emit(path: tuple, table: dict, opener: str | None) -> None:
        if opener is not None:
            note = notes.tables.get(path)
            out.extend(commented(opener, note, len(opener) + 2) if note else [opener])
        items = [(k, v) for k, v in table.items() if not isinstance(v, dict) and not is_tables(v)]
        codes = [f"{toml_key(k)} = {toml_value(v)}" for k, v in items]
        column = min(max((len(c) for c in codes), default=0) + 2, COMMENT_COLUMN_MAX)
        for (key, _), code in zip(items, codes):
            out.extend(commented(code, notes.line(path + (key,), changed), column))
        for key, what in notes.unset.get(path, []):
            if key not in table:
                out.extend(comment_block(f"{toml_key(key)}, unset ({notes.owner} default): {what}"))
        if path in notes.others:
            out.extend(comment_block(notes.others[path]))
        for key, value in table.items():
            if isinstance(value, dict):
                out.append("")
                emit(path + (key,), value, f"[{dotted(path + (key,))}]")
            elif is_tables(value):
                for item in value:
                    out.append("")
                    emit(path + (key,), item, f"[[{dotted(path + (key,))}]]")

    emit((), data, None)
    return "\n".join(out) + "\n"


def _parts(key: str) -> tuple:
    from sim.explore.runner import split_key

    return tuple(p for p in split_key(key) if not isinstance(p, int))


def write_scenario(output: str | Path, model: str, hardware: str, prompt_tokens: int, decode_tokens: int,
                   engine: str = "auto", variant: str | None = None, settings: Sequence[str] = ()) -> dict:
    """Write a commented starting scenario to `output` (refusing nothing about an existing file: the caller
    claims it); what was written. Paths typed on the command line (a .gguf, a profile) are relative to the
    working folder and are rebased into the scenario's; paths inside --set values are scenario values,
    relative to the scenario file as in the file itself."""
    from sim.explore.sweep import parse_settings
    from sim.hardware import load_hardware_file, resolve_hardware
    from sim.model.gguf_reader import layout_from_gguf
    from sim.model.presets import PRESETS, get_preset
    from sim.scenario import Request, TraceSource, Workload, load_scenario

    output = Path(output)
    folder = output.parent
    if model in PRESETS:
        layout, model_ref = PRESETS[model], model
    elif model.endswith(".gguf") or Path(model).is_file():
        if not is_file(Path(model)):
            raise InputError("--model", "model", model, "no such file")
        layout, model_ref = layout_from_gguf(model), reference(model, Path(model), folder, _file_from)
    else:
        layout = get_preset(model)  # the unknown name's one-line error, listing the presets
    hardware_path = resolve_hardware(hardware, Path.cwd(), "--hardware", "hardware")
    profile = load_hardware_file(hardware_path.resolve())
    hardware_ref = reference(hardware, hardware_path, folder, hardware_from(folder))
    typed_class = next((spec.partition("=")[2].strip() for spec in settings
                        if spec.partition("=")[0].strip() == "model_class"), None)
    typed_engine = engine
    engine, why = choose_engine(engine, layout, profile, typed_class)
    spec = ENGINES[engine]
    compute_key, derived_figures = compute_for(spec, layout, profile, typed_class)
    if not spec.variants and variant is not None:
        raise InputError("scenario init", "--variant", variant, f"{spec.description} has no variants")
    typed_variant, variant = variant, variant or spec.default_variant(layout, compute_key)

    notes = _Notes(spec.label)
    notes.what[("hardware",)] = "the machine: a profile name (expertsim hardware list) or a .toml path"
    notes.what[("model",)] = "a model preset (expertsim model show NAME) or a path to a .gguf file"
    notes.what[("engine", "name")] = (f"the engine: {', '.join(e for e in ENGINES if ENGINES[e].timed)}, or "
                                      f"{', '.join(e for e in ENGINES if not ENGINES[e].timed)} (one cache, hit rates, "
                                      "no timing)")
    engine_table: dict = {"name": engine}
    fields = spec.Settings.model_fields
    if spec.variants:
        source = spec.variants.get(variant)
        chosen = "--variant" if typed_variant is not None else "the newest build for this model"
        notes.what[("engine", "variant")] = f"{source.source} [{chosen}]" if source else chosen
        engine_table["variant"] = variant
    notes.tables[("engine", "flags")] = spec.flags_note or f"{notes.owner} command-line flags, without the leading --"
    starting = spec.starting_settings(layout, profile,
                                      frozenset(setting.partition("=")[0].strip() for setting in settings))
    flags = _engine_notes(notes, spec, variant, fields["flags"].annotation,
                          fields["env"].annotation if "env" in fields else None, starting)
    for key, (value, what) in starting.items():
        flags[key] = value
        notes.what[("engine", "flags", key)] = what
        notes.started.add(("engine", "flags", key))
    engine_table["flags"] = flags
    if "env" in fields:
        notes.tables[("engine", "env")] = f"{notes.owner} environment variables, as strings"
        engine_table["env"] = {}
    generator = generator_for(layout)
    trace: dict = {} if generator is None else {"generator": generator, "seed": 0}
    trace_notes = field_notes(TraceSource)
    if generator is not None:
        notes.what[("trace", "generator")] = (
            f"{trace_notes['generator']}: {layout.name}'s own" if generator == layout.name else
            f"{trace_notes['generator']} with {layout.name}'s shape ({layout.n_routed_layers} layers x "
            f"{layout.n_experts} experts, top-{layout.top_k})")
    notes.what[("trace", "seed")] = "the generator's seed: same seed, same routing"
    notes.what[("trace", "path")] = trace_notes["path"]
    notes.tables[("trace",)] = ("the routing" if generator is not None else
                                f"a trace file is needed: no generator preset makes {layout.name}'s routing")
    notes.what.update({("workload", key): text for key, text in field_notes(Workload).items()})
    notes.what.update({("workload", "requests", key): text for key, text in field_notes(Request).items()})
    notes.what[("workload", "requests", "label")] = "free text, shown in reports"
    notes.what[("workload", "requests", "decode_tokens")] = "tokens of answer generated after the prompt"
    request = {"label": f"a {prompt_tokens:,}-token prompt, then {decode_tokens:,} tokens of answer",
               "prompt_tokens": prompt_tokens, "decode_tokens": decode_tokens}
    data = {"hardware": hardware_ref, "model": model_ref, "engine": engine_table, "trace": trace,
            "workload": {"page-cache": "warm", "requests": [request]}}

    command = ["expertsim", "scenario", "init", "--model", model, "--hardware", hardware]
    command += ["--engine", typed_engine] if typed_engine != "auto" else []
    command += ["--variant", variant] if typed_variant is not None else []
    command += ["--prompt-tokens", str(prompt_tokens), "--decode-tokens", str(decode_tokens)]
    command += [a for spec in settings for a in ("--set", spec)] + ["-o", str(output)]
    title = (f"{notes.engine} {variant} serving {layout.name} on {profile.name}" if spec.timed
             else f"{spec.description} of {layout.name}'s routing, its cache sized for {profile.name}")

    derived = None  # the engine's derived prompt figure where the profile has no table for the model
    if spec.timed and derived_figures is not None:
        figure = derived_figures.prefill_us_per_token_layer
        derived = f"{figure.source}: {figure.derivation}"

    def header(warning: str | None) -> list[str]:
        covers = (f"Covers: a starting point to edit, written by `{shlex.join(command)}`. Engine {engine}: {why}. "
                  + (f"Compute: {derived}. " if derived else "")
                  + "Each line keeps the engine's default unless its comment says it is set here; every key is in "
                  "docs/reference/scenario-schema.md.")
        lines = [*comment_block(f"Scenario: {title}: one {prompt_tokens:,}-token prompt, then {decode_tokens:,} "
                                 "tokens of answer."),
                 *comment_block(covers)]
        return lines + (comment_block(f"Note: {warning}") if warning else [])

    def draft(temporary: Path):
        temporary.write_text(_render_scenario(header(None), data, notes, set()), encoding="utf-8")
        full, overrides = parse_settings(temporary, list(settings)) if settings else (data, {})
        if "trace.path" in overrides and "trace.generator" not in overrides:
            full["trace"] = {"path": full["trace"]["path"],
                             **({"seed": full["trace"]["seed"]} if "trace.seed" in overrides else {})}
        if not full.get("trace"):
            raise InputError(str(temporary), "trace", layout.name,
                             f"no generator preset makes routing of {layout.n_routed_layers} layers x "
                             f"{layout.n_experts} experts, top-{layout.top_k}: give a trace recorded for this model, "
                             "--set trace.path=FILE.parquet (relative to the scenario)")
        changed = {_parts(key) for key in overrides}
        temporary.write_text(_render_scenario(header(None), full, notes, changed), encoding="utf-8")
        scenario = load_scenario(temporary)
        room = {}  # a default changed so that the engine has an expert cache on this card: key -> (value, why)
        try:
            plan = spec.plan_memory(scenario)
            ways_out = spec.room_for_a_cache(scenario, plan) if plan.knob not in overrides else ()
            ways_out = [way for way in ways_out if way[0] not in overrides]
            for key, value, reason in ways_out:  # start from settings that work; say which defaults changed and why
                *tables, leaf = _parts(key)
                node = full
                for part in tables:
                    node = node.setdefault(part, {})
                node[leaf] = value
                notes.what[_parts(key)] = reason
                notes.started.add(_parts(key))
                room[key] = (value, reason)
            if ways_out:
                temporary.write_text(_render_scenario(header(None), full, notes, changed), encoding="utf-8")
                scenario = load_scenario(temporary)
                plan = spec.plan_memory(scenario)
            warning = plan.why_no_cache and f"{plan.why_no_cache} (change it with --set {plan.knob})"
        except InputError as exc:  # the engine would refuse to start on this box
            warning = exc.why
            temporary.write_text(_render_scenario(header(warning), full, notes, changed), encoding="utf-8")
        return scenario, overrides, warning, room

    scenario, overrides, warning, room = write_checked(output, draft)
    return {"path": str(output), "engine": engine, "engine_choice": why, "variant": variant, "model": model_ref,
            "hardware": hardware_ref, "trace": scenario.trace.model_dump(exclude_unset=True),
            "workload": {"prompt_tokens": prompt_tokens, "decode_tokens": decode_tokens}, "settings": overrides,
            "room_for_a_cache": {key: {"value": value, "why": reason} for key, (value, reason) in room.items()},
            "compute_derived": derived, "warning": warning}
