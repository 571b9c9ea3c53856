"""A what-if copy of a hardware profile.

    expertsim hardware init rtx-pro-6000-96gb --set gpu.vram_gib=48 -o hardware/what-if-48gb.toml

A profile copy keeps the base file's text and comments and changes only the lines of the fields set; each
changed figure's source says it is a what-if of the user's, and a relative calibration path is rebased so that
the copy reads the same file from where it is written.
"""

from __future__ import annotations

import copy
import math
import re
import shlex
import tomllib
import typing
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel

from sim.errors import InputError
from sim.scaffold.toml_text import comment_block, dotted, toml_key, toml_value
from sim.scaffold.writing import hardware_from, reference, write_checked
from sim.schema import Quantity, display_path, unwrap

# A TOML key at the start of a line: bare or quoted parts joined by dots.
_KEY_PART = r'(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|\'[^\']*\')'
_LINE_KEY = re.compile(rf"^\s*({_KEY_PART}(?:\s*\.\s*{_KEY_PART})*)\s*=")
_TABLE_HEADER = re.compile(rf"^\s*(\[\[?)\s*({_KEY_PART}(?:\s*\.\s*{_KEY_PART})*)\s*\]\]?\s*(#.*)?$")


def _key_path(key_text: str) -> tuple[str, ...]:
    """The parts of a TOML key (`compute."qwen3.8-flash-next".decode_us_per_token_layer`)."""
    node = tomllib.loads(f"{key_text} = 0")
    path = []
    while isinstance(node, dict):
        (name, node), = node.items()
        path.append(name)
    return tuple(path)


def profile_fields(data: dict) -> dict[tuple[str, ...], object]:
    """Every field `hardware init --set` can change in a profile holding `data`, by key path: its quantities
    (a Quantity model) and plain values (their annotation). Optional tables count where the profile has them;
    compute classes are the profile's own. The SSD's table of points is an array: edited by hand."""
    from sim.hardware import HardwareProfile

    fields: dict[tuple[str, ...], object] = {}

    def walk(model: type[BaseModel], prefix: tuple[str, ...], node: dict) -> None:
        for name, info in model.model_fields.items():
            kind, path = unwrap(info.annotation), prefix + (name,)
            if isinstance(kind, type) and (issubclass(kind, Quantity) or _is_sourced_choice(kind)):
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


def _is_sourced_choice(kind: type) -> bool:
    """A table of a value and its source without a unit (host.simd): set as one field, its value a word."""
    return issubclass(kind, BaseModel) and set(kind.model_fields) == {"value", "source"}


def _what_if_source(path: tuple[str, ...], value_text: str, was: str) -> str:
    """The source a --set field's copy carries: the user's what-if, and what the base profile had."""
    return f"[E] what-if set by the user (expertsim hardware init --set {dotted(path)}={value_text.strip()}); {was}"


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
        if isinstance(value, float) and not math.isfinite(value):
            raise InputError("hardware init", dotted(path), value_text.strip(), "must be a finite number")
        if isinstance(kind, type) and issubclass(kind, Quantity):
            unit = typing.get_args(kind.model_fields["unit"].annotation)[0]
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise InputError("hardware init", dotted(path), value_text.strip(), f"must be a number in {unit}")
            old = _get(data, path)
            was = f"{profile.name} has {old['value']:g} {unit}" if isinstance(old, dict) else f"not in {profile.name}"
            value = {"value": value, "unit": unit, "source": _what_if_source(path, value_text, was)}
            shown[dotted(path)] = f"{toml_value(value['value'])} {unit}"
        elif isinstance(kind, type) and _is_sourced_choice(kind):
            allowed = typing.get_args(kind.model_fields["value"].annotation)
            if value_text.strip() not in allowed:
                raise InputError("hardware init", dotted(path), value_text.strip(),
                                 f"must be one of {', '.join(allowed)}")
            old = _get(data, path)
            was = f"{profile.name} has {old['value']}" if isinstance(old, dict) else f"not in {profile.name}"
            value = {"value": value_text.strip(), "source": _what_if_source(path, value_text, was)}
            shown[dotted(path)] = value["value"]
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
        changes[("calibration",)] = reference(calibration, start / calibration, output.parent,
                                               lambda ref, folder: None)
    expected = copy.deepcopy(data)
    for path, value in changes.items():
        text = _set_line(text, path, value)
        _put(expected, path, value)
    command = ["expertsim", "hardware", "init", base, *(a for spec in settings for a in ("--set", spec)),
               *(["--name", name] if name else []), "-o", str(output)]
    header = comment_block(f"What-if: {changes[('name',)]}, a copy of {display_path(base_path)} written by "
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

    write_checked(output, make)
    written = load_hardware_file(output.resolve())
    stem = output.stem
    found = hardware_from(Path.cwd())(stem, Path.cwd())
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
