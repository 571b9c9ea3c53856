"""Starting files: a commented scenario for a model on a machine, and a what-if copy of a hardware profile.

    expertsim scenario init --model deepseek-v4-flash-q2-q4 --hardware rtx-4090 -o mine.toml
    expertsim hardware init rtx-pro-6000-96gb --set gpu.vram_gib=48 -o hardware/what-if-48gb.toml

A scenario starts from the engine's own defaults, and each line says what it is (the schema's comment on the
field where it has one, the same text docs/reference/scenario-schema.md shows), and whether it keeps the engine's
default or changes it. The engine follows from the model: the first registered engine that runs it (Engine.runs:
Strata for the one geometry its kernels are built for, ds4 for its model families), else the untimed cache-only
replay of the routing. `--set KEY=VALUE` is
`run --set`: the same keys and typing rules, through sim.explore.sweep.parse_settings.

A profile copy keeps the base file's text and comments and changes only the lines of the fields set; each
changed figure's source says it is a what-if of the user's, and a relative calibration path is rebased so that
the copy reads the same file from where it is written.

Nothing is written that does not load: each file is written beside its target under a temporary name, loaded
from there (so relative paths resolve as they will), and only then renamed into place.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shlex
import textwrap
import tomllib
import typing
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel

from sim.engines import ENGINES
from sim.errors import InputError
from sim.schema import Quantity, display_path, field_comments, is_file, unwrap

ENGINE_CHOICES = ("auto", *ENGINES)
LINE_WIDTH = 118  # the repository's scenario files wrap at ~120 columns
COMMENT_COLUMN_MAX = 40  # a longer `key = value` takes its comment two spaces after it

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
# A TOML key at the start of a line: bare or quoted parts joined by dots.
_KEY_PART = r'(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|\'[^\']*\')'
_LINE_KEY = re.compile(rf"^\s*({_KEY_PART}(?:\s*\.\s*{_KEY_PART})*)\s*=")
_TABLE_HEADER = re.compile(rf"^\s*(\[\[?)\s*({_KEY_PART}(?:\s*\.\s*{_KEY_PART})*)\s*\]\]?\s*(#.*)?$")


# ------------------------------------------------------------------------------------------- TOML text


def toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key, ensure_ascii=False)


def dotted(path: Sequence[str]) -> str:
    return ".".join(toml_key(p) for p in path)


def toml_value(value) -> str:
    """One TOML value on one line (a JSON string is a TOML basic string)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"TOML files here hold finite numbers only, not {value}")
        return repr(value)
    if isinstance(value, str):  # JSON's escapes are TOML's, but for DEL, which TOML wants escaped
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + " }" if value else "{}"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def _key_path(key_text: str) -> tuple[str, ...]:
    """The parts of a TOML key (`compute."qwen3.8-flash-next".decode_us_per_token_layer`)."""
    node = tomllib.loads(f"{key_text} = 0")
    path = []
    while isinstance(node, dict):
        (name, node), = node.items()
        path.append(name)
    return tuple(path)


def _wrap(text: str, width: int) -> list[str]:
    """Lines of at most `width` characters, breaking at spaces only (paths and key names stay whole)."""
    return textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False)


def _commented(code: str, note: str, column: int) -> list[str]:
    """`code` with `note` as its end-of-line comment, wrapped onto comment lines at the same column."""
    lead = code.ljust(column) if len(code) < column else code + "  "
    pieces = _wrap(note, max(LINE_WIDTH - len(lead) - 4, 40)) or [""]
    return [f"{lead}# {pieces[0]}", *(f"{' ' * len(lead)}#   {p}" for p in pieces[1:])]


def _comment_block(text: str) -> list[str]:
    """A header comment: the first line as it is, the rest indented under it."""
    lines = _wrap(text, LINE_WIDTH - 4)
    return [f"# {lines[0]}", *(f"#   {line}" for line in lines[1:])]


# ------------------------------------------------------------------------------------------- schema notes


@lru_cache(maxsize=None)
def field_notes(model: type[BaseModel]) -> dict[str, str]:
    """The schema's comment on each field of `model` (sim.schema.field_comments), by the key's TOML spelling."""
    return {(model.model_fields[name].alias or name): text for name, text in field_comments(model).items()
            if name in model.model_fields}


# ------------------------------------------------------------------------------------------- writing


def _named_as(exc: InputError, temporary: Path, target: Path) -> InputError:
    """An error raised while loading the temporary file, naming the target the user asked for."""
    where = exc.where
    for shown in sorted({str(temporary), display_path(temporary.resolve()), str(temporary.resolve())}, key=len,
                        reverse=True):  # the longest spelling first: the others are parts of it
        where = where.replace(shown, str(target))
    return InputError(where, exc.field, exc.value, exc.why)


def _write_checked(target: Path, make: Callable[[Path], object]):
    """`make(temporary)` writes the file under a temporary name beside `target` and loads it from there; only
    then is it renamed to `target`. What `make` returns; its errors name `target`."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(str(target), "output", str(target), f"cannot create its folder: {exc.strerror}") from None
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        result = make(temporary)
        os.replace(temporary, target)
    except InputError as exc:
        raise _named_as(exc, temporary, target) from None
    except OSError as exc:
        raise InputError(str(target), "output", str(target), f"cannot write: {exc.strerror}") from None
    finally:
        temporary.unlink(missing_ok=True)
    return result


def _reference(typed: str, found: Path, folder: Path, resolve: Callable[[str, Path], Path | None]) -> str:
    """How a file in `folder` names `found` (given as `typed` from the working folder): as typed when that
    resolves to the same file from `folder`, else a path relative to `folder`, else an absolute one."""
    if (again := resolve(typed, folder)) is not None and again.resolve() == found.resolve():
        return typed
    here, there = os.path.abspath(folder), os.path.abspath(found)
    if os.path.commonpath([here, there]) == os.path.splitdrive(here)[0] + os.sep:
        return str(found.resolve())  # no folder in common: a relative path would only break sooner
    relative = os.path.relpath(there, here)
    return relative if (folder / relative).resolve() == found.resolve() else str(found.resolve())


def _hardware_from(folder: Path) -> Callable[[str, Path], Path | None]:
    from sim.hardware import resolve_hardware

    def resolve(ref: str, base: Path) -> Path | None:
        try:
            return resolve_hardware(ref, base, "hardware")
        except InputError:
            return None
    return resolve


def _file_from(ref: str, base: Path) -> Path | None:
    path = Path(ref) if Path(ref).is_absolute() else base / ref
    return path if is_file(path) else None


# ------------------------------------------------------------------------------------------- scenario


def choose_engine(engine: str, layout, compute_key: str | None) -> tuple[str, str]:
    """(engine, why) for --engine: as given, or for auto the first timed engine that runs the model (Engine.runs),
    else the untimed one, a replay of its routing."""
    if engine not in ENGINE_CHOICES:
        raise InputError("scenario init", "--engine", engine, f"must be one of: {', '.join(ENGINE_CHOICES)}")
    if engine != "auto":
        return engine, f"--engine {engine}"
    timed = [e for e in ENGINES.values() if e.timed]
    for candidate in timed:
        why = candidate.runs(layout, compute_key)
        if why is not None:
            return candidate.name, why
    fallback = next(e for e in ENGINES.values() if not e.timed)
    scopes = "; ".join(e.scope() for e in timed)
    return fallback.name, f"no timed engine runs {layout.name} ({scopes}), so {fallback.runs(layout, compute_key)}"


def generator_for(layout) -> str | None:
    """The generator preset of the model, else the first (by name) that generates its shape; None if none does."""
    from sim.model.presets import get_preset
    from sim.trace.generator_spec import GENERATOR_PRESETS

    shape = (layout.n_routed_layers, layout.n_experts, layout.top_k)

    def generates(name: str) -> bool:
        gen = get_preset(GENERATOR_PRESETS[name]["model"])
        return (gen.n_routed_layers, gen.n_experts, gen.top_k) == shape

    names = ([layout.name] if layout.name in GENERATOR_PRESETS else []) + sorted(GENERATOR_PRESETS)
    return next((name for name in names if generates(name)), None)


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

    def line(self, path: tuple, changed: set[tuple]) -> str:
        what = self.what.get(path, "")
        if path in self.engine_default:
            default = self.engine_default[path]
            shown = "unset" if default is None else toml_value(default)
            status = f"[set here; {self.owner} default: {shown}]" if path in changed else f"[{self.owner} default]"
        else:
            status = "[set here]" if path in changed else ""
        return " ".join(filter(None, [what, status])) or "set here"


def _engine_notes(notes: _Notes, engine, variant: str | None, flags_model, env_model) -> dict:
    """The engine's flags a starting scenario writes (documented ones with a default), and the notes of every key."""
    flags_path, env_path = ("engine", "flags"), ("engine", "env")
    knob_names = {knob.key: knob.title for knob in engine.knobs}
    written, unset, others = {}, [], []
    for name, info in flags_model.model_fields.items():
        key = info.alias or name
        if key in engine.only_in and variant not in engine.only_in[key]:
            continue  # read by other variants only: setting it here would be refused
        if info.is_required():
            continue  # no default: the caller writes it (Engine.starting_settings)
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
            out.extend(_commented(opener, note, len(opener) + 2) if note else [opener])
        items = [(k, v) for k, v in table.items() if not isinstance(v, dict) and not is_tables(v)]
        codes = [f"{toml_key(k)} = {toml_value(v)}" for k, v in items]
        column = min(max((len(c) for c in codes), default=0) + 2, COMMENT_COLUMN_MAX)
        for (key, _), code in zip(items, codes):
            out.extend(_commented(code, notes.line(path + (key,), changed), column))
        for key, what in notes.unset.get(path, []):
            if key not in table:
                out.extend(_comment_block(f"{toml_key(key)}, unset ({notes.owner} default): {what}"))
        if path in notes.others:
            out.extend(_comment_block(notes.others[path]))
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
        layout, model_ref = layout_from_gguf(model), _reference(model, Path(model), folder, _file_from)
    else:
        layout = get_preset(model)  # the unknown name's one-line error, listing the presets
    hardware_path = resolve_hardware(hardware, Path.cwd(), "--hardware", "hardware")
    profile = load_hardware_file(hardware_path.resolve())
    hardware_ref = _reference(hardware, hardware_path, folder, _hardware_from(folder))
    typed_class = next((spec.partition("=")[2].strip() for spec in settings
                        if spec.partition("=")[0].strip() == "model_class"), None)
    compute_key = typed_class or profile.compute_key(layout.name)
    typed_engine = engine
    engine, why = choose_engine(engine, layout, compute_key)
    spec = ENGINES[engine]
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
    flags = _engine_notes(notes, spec, variant, fields["flags"].annotation,
                          fields["env"].annotation if "env" in fields else None)
    for key, (value, what) in spec.starting_settings(layout, profile).items():
        flags[key] = value
        notes.what[("engine", "flags", key)] = what
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

    def header(warning: str | None) -> list[str]:
        covers = (f"Covers: a starting point to edit, written by `{shlex.join(command)}`. Engine {engine}: {why}. "
                  "Each line keeps the engine's default unless its comment says it is set here; every key is in "
                  "docs/reference/scenario-schema.md.")
        lines = [*_comment_block(f"Scenario: {title}: one {prompt_tokens:,}-token prompt, then {decode_tokens:,} "
                                 "tokens of answer."),
                 *_comment_block(covers)]
        return lines + (_comment_block(f"Note: {warning}") if warning else [])

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
        try:
            plan = spec.plan_memory(scenario)
            warning = plan.why_no_cache and f"{plan.why_no_cache} (change it with --set {plan.knob})"
        except InputError as exc:  # the engine would refuse to start on this box
            warning = exc.why
            temporary.write_text(_render_scenario(header(warning), full, notes, changed), encoding="utf-8")
        return scenario, overrides, warning

    scenario, overrides, warning = _write_checked(output, draft)
    return {"path": str(output), "engine": engine, "engine_choice": why, "variant": variant, "model": model_ref,
            "hardware": hardware_ref, "trace": scenario.trace.model_dump(exclude_unset=True),
            "workload": {"prompt_tokens": prompt_tokens, "decode_tokens": decode_tokens}, "settings": overrides,
            "warning": warning}


# ------------------------------------------------------------------------------------------- hardware profile


def profile_fields(data: dict) -> dict[tuple[str, ...], object]:
    """Every field `hardware init --set` can change in a profile holding `data`, by key path: its quantities
    (a Quantity model) and plain values (their annotation). Optional tables count where the profile has them;
    compute classes are the profile's own. The SSD's table of points is an array: edited by hand."""
    from sim.hardware import HardwareProfile

    fields: dict[tuple[str, ...], object] = {}

    def walk(model: type[BaseModel], prefix: tuple[str, ...], node: dict) -> None:
        for name, info in model.model_fields.items():
            kind, path = unwrap(info.annotation), prefix + (name,)
            if isinstance(kind, type) and issubclass(kind, Quantity):
                fields[path] = kind
            elif isinstance(kind, type) and issubclass(kind, BaseModel):
                if name in node or info.is_required():
                    walk(kind, path, node.get(name) or {})
            elif typing.get_origin(kind) is dict:
                for key, table in (node.get(name) or {}).items():
                    walk(typing.get_args(kind)[1], path + (key,), table)
            elif typing.get_origin(kind) is not list:
                fields[path] = kind

    walk(HardwareProfile, (), data)
    return fields


def _field_path(text: str, fields: dict, spec: str) -> tuple[str, ...]:
    """FIELD of --set FIELD=VALUE: a dotted path, or a name only one table of the profile has."""
    try:
        path = _key_path(text)
    except tomllib.TOMLDecodeError:
        raise InputError("hardware init", "--set", spec, 'FIELD must be a key such as gpu.vram_gib (quote a part '
                                                         'that holds a dot: compute."qwen3.8-flash-next".…)') from None
    if path in fields:
        return path
    matches = [p for p in fields if len(path) == 1 and p[-1] == path[0]]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise InputError("hardware init", "--set", text, f"ambiguous: {', '.join(dotted(p) for p in matches)}")
    raise InputError("hardware init", "--set", text, f"unknown profile field; known: {', '.join(map(dotted, fields))}")


def _set_line(text: str, path: tuple[str, ...], value) -> str:
    """`text` with the one-line assignment of `path` replaced by `value`, or added to its table (a new table at
    the end); comments and every other line kept. A layout this cannot edit fails the caller's round trip."""
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    table, table_end, first_header = (), {}, len(lines)
    for i, line in enumerate(lines):
        header = _TABLE_HEADER.match(line)
        if header:
            first_header = min(first_header, i)
            table = _key_path(header[2]) if header[1] == "[" else None  # an array of tables: not edited
            table_end.setdefault(table, i + 1)
            continue
        key = _LINE_KEY.match(line)
        if key is None or table is None:
            continue
        table_end[table] = i + 1
        if table + _key_path(key[1]) == path:
            lines[i] = f"{key[1].strip()} = {toml_value(value)}\n"
            return "".join(lines)
    entry = f"{toml_key(path[-1])} = {toml_value(value)}\n"
    parent = path[:-1]
    if parent in table_end:
        lines.insert(table_end[parent], entry)
    elif not parent:
        lines.insert(first_header, entry)
    else:
        lines += ["\n", f"[{dotted(parent)}]\n", entry]
    return "".join(lines)


def _typed(text: str, kind) -> object:
    """VALUE of --set FIELD=VALUE: a TOML value (48, 1.5, true, "x"), else the text; a string field keeps the
    text as typed."""
    literal_strings = typing.get_origin(kind) is typing.Literal and all(isinstance(a, str)
                                                                   for a in typing.get_args(kind))
    if kind is str or literal_strings:
        return text
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def write_hardware(base: str, output: str | Path, settings: Sequence[str] = (), name: str | None = None) -> dict:
    """Write a copy of profile `base` to `output` with the fields of `settings` (FIELD=VALUE) changed; what was
    written. The copy is named `name`, by default the file's stem (the name a scenario looks it up by)."""
    from sim.hardware import load_hardware_file, profile_summary, resolve_hardware
    from sim.schema import read_toml

    output = Path(output)
    base_path = resolve_hardware(base, Path.cwd(), "hardware init", "BASE")
    profile = load_hardware_file(base_path.resolve())
    text, data = base_path.read_text(encoding="utf-8"), read_toml(base_path)
    fields = profile_fields(data)
    changes: dict[tuple[str, ...], object] = {}  # key path -> the new value, as the file will hold it
    shown: dict[str, object] = {}  # what the user set, by dotted key: the provenance of the copy
    for spec in settings:
        key_text, eq, value_text = spec.partition("=")
        if not eq or not key_text.strip():
            raise InputError("hardware init", "--set", spec, "write FIELD=VALUE, e.g. gpu.vram_gib=48")
        path = _field_path(key_text.strip(), fields, spec)
        if path in changes:
            raise InputError("hardware init", "--set", dotted(path), "given twice")
        kind, value = fields[path], _typed(value_text.strip(), fields[path])
        if isinstance(kind, type) and issubclass(kind, Quantity):
            unit = typing.get_args(kind.model_fields["unit"].annotation)[0]
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise InputError("hardware init", dotted(path), value_text.strip(), f"must be a number in {unit}")
            old = _get(data, path)
            was = f"{profile.name} has {old['value']:g} {unit}" if isinstance(old, dict) else f"not in {profile.name}"
            value = {"value": value, "unit": unit, "source": f"[E] what-if set by the user (expertsim hardware init "
                                                             f"--set {dotted(path)}={value_text.strip()}); {was}"}
            shown[dotted(path)] = f"{toml_value(value['value'])} {unit}"
        else:
            shown[dotted(path)] = value
        changes[path] = value
    if name is not None and ("name",) in changes:
        raise InputError("hardware init", "--name", name, "given twice (also --set name=...)")
    changes.setdefault(("name",), name or output.stem)
    if ("description",) not in changes:
        what_if = ", ".join(f"{k} = {v}" for k, v in shown.items() if k != "name") or "no figure changed"
        changes[("description",)] = f"{data['description']} (what-if: {what_if}; expertsim hardware init from " \
                                    f"{profile.name})"
    calibration = changes.get(("calibration",), data.get("calibration"))
    if isinstance(calibration, str) and not Path(calibration).is_absolute():
        # the base's path is relative to the base file; a --set one to the working folder, where it was typed
        start = Path.cwd() if ("calibration",) in changes else base_path.parent
        changes[("calibration",)] = _reference(calibration, start / calibration, output.parent,
                                               lambda ref, folder: None)
    expected = copy.deepcopy(data)
    for path, value in changes.items():
        text = _set_line(text, path, value)
        _put(expected, path, value)
    command = ["expertsim", "hardware", "init", base, *(a for spec in settings for a in ("--set", spec)),
               *(["--name", name] if name else []), "-o", str(output)]
    header = _comment_block(f"What-if: {changes[('name',)]}, a copy of {display_path(base_path)} written by "
                            f"`{shlex.join(command)}`. The figures not set there, and the comments below, are the "
                            "base profile's.")
    text = "\n".join(header) + "\n\n" + text
    if tomllib.loads(text) != expected:
        raise InputError(str(base_path), "layout", ", ".join(shown) or "name",
                         "cannot change these keys in place (each must be one `key = value` line of its table): "
                         "copy the file and edit it by hand")

    def make(temporary: Path):
        temporary.write_text(text, encoding="utf-8")
        return load_hardware_file(temporary.resolve())

    _write_checked(output, make)
    written = load_hardware_file(output.resolve())
    stem = output.stem
    found = _hardware_from(Path.cwd())(stem, Path.cwd())
    named_by = stem if found is not None and found.resolve() == output.resolve() else str(output)
    return {"path": str(output), "name": written.name, "base": profile.name, "base_path": display_path(base_path),
            "changed": shown, "calibration": written.calibration, "scenario_names_it": named_by,
            "profile": {k: v for k, v in profile_summary(written).items() if k != "path"}}


def _get(data: dict, path: tuple[str, ...]):
    for part in path:
        data = data.get(part) if isinstance(data, dict) else None
    return data


def _put(data: dict, path: tuple[str, ...], value) -> None:
    for part in path[:-1]:
        data = data.setdefault(part, {})
    data[path[-1]] = value
