"""TOML files as validated data: the plumbing every scenario, profile and record file shares.

`read_toml` parses a file (every failure one InputError naming the file); `validate` checks the data against a
pydantic model whose tables derive from `Strict` (unknown keys, silent type coercions and NaN are errors) and
turns the first pydantic error into one line naming the dotted key path the user wrote (`engine.flags.ctx`),
the value and why. `Quantity` is one sourced number, `{ value, unit, source = "[S|M|H|E] ..." }`: the source
starts with the provenance tag of reference/hardware-and-gguf.md ([S] spec, [M] public measurement, [H] this
project's measurement, [E] estimate; combinations such as [E from M]).
"""

from __future__ import annotations

import hashlib
import tomllib
import types
import typing
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo, create_model, \
    field_validator

from sim.errors import InputError, require_regular_file

# "[S] ...", "[M] ...", "[H] ...", "[E] ...", also "[E from M]", "[M/H]", "[E from S/H]".
_TAGS = "SMHE"

class Strict(BaseModel):
    """Base of every scenario/profile table: unknown keys and silent type coercions are errors."""

    # protected_namespaces=(): a scenario key may start with "model_" (model_class); pydantic < 2.10 warns on
    # such fields at import, which would break the one-line error promise on stderr.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False,
                              populate_by_name=False, protected_namespaces=())
    # How an unknown key of this table is called in errors ("ds4 flag", "key", ...).
    KEY_KIND: ClassVar[str] = "key"


def safe_path(where: str, field: str, text: object) -> None:
    """Refuse path text the OS cannot take (a NUL byte) before any Path call sees it."""
    if not isinstance(text, str) or not text or "\x00" in text:
        raise InputError(where, field, text, "must be a non-empty path without NUL characters")


def read_bytes(path: Path, where: str) -> bytes:
    require_regular_file(path, where, "a TOML file")
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise InputError(where, "path", str(path), "no such file") from None
    except (OSError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or type(exc).__name__
        raise InputError(where, "path", str(path), f"cannot read: {why}") from None


def parse_toml(raw: bytes, where: str) -> dict:
    """Parse TOML bytes; every failure is an InputError naming `where`."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(where, "encoding", f"byte {exc.start}", "a TOML file must be UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(where, "toml", " ".join(str(exc).split()), "not valid TOML") from None
    except RecursionError:
        raise InputError(where, "toml", "nesting", "too deeply nested") from None


def read_toml(path: Path, where: str | None = None) -> dict:
    """Parse a TOML file; every failure is an InputError naming the file."""
    where = where or str(path)
    return parse_toml(read_bytes(path, where), where)


def display_path(path: Path) -> str:
    """`path` relative to the working folder when it lies below it (what users type), else absolute."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def unwrap(annotation: Any) -> Any:
    """Strip Annotated[...] and Optional[...] down to the one type that matters for walking a loc."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
            if len(args) == 1:
                annotation = args[0]
            elif models and len(models) == len(args):
                return tuple(models)  # a tagged union of tables
            else:
                return annotation
        else:
            return annotation


def _field_by_key(model: type[BaseModel], key: str):
    for name, info in model.model_fields.items():
        if (info.alias or name) == key:
            return info
    return None


def _walk(root: type[BaseModel], loc: tuple) -> Any:
    """The annotation found at `loc` (a pydantic error location) below `root`, or None."""
    current: Any = root
    for part in loc:
        current = unwrap(current)
        if isinstance(current, tuple):  # tagged union: the loc names the tag
            current = next((m for m in current if _tag_of(m) == part), None)
            if current is None:
                return None
            continue
        origin = typing.get_origin(current)
        if isinstance(current, type) and issubclass(current, BaseModel):
            info = _field_by_key(current, str(part))
            if info is None:
                return None
            current = info.annotation
        elif origin in (list, tuple) and isinstance(part, int):
            current = typing.get_args(current)[0]
        elif origin is dict and isinstance(part, str):
            current = typing.get_args(current)[1]
        else:
            return None
    return unwrap(current)


def _tag_of(model: type[BaseModel]) -> str | None:
    info = model.model_fields.get("name")
    if info is not None and typing.get_origin(info.annotation) is Literal:
        return typing.get_args(info.annotation)[0]
    return None


def _dotted(loc: tuple, root: type[BaseModel]) -> str:
    """A pydantic loc as the TOML key path users wrote: a.b-c[2].d (the tags of tagged unions dropped)."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(_walk(root, loc[:i]), tuple):
            continue  # the tag pydantic puts into the loc of a tagged union
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(file)"


def known_keys(model: type[BaseModel]) -> list[str]:
    return [info.alias or name for name, info in model.model_fields.items()]


def _why(err: dict, root: type[BaseModel]) -> tuple[str, object]:
    """One short reason for one pydantic error, and the value to show."""
    kind, ctx, loc, value = err["type"], err.get("ctx") or {}, err["loc"], err.get("input")
    original = value
    if kind not in ("extra_forbidden", "model_type", "model_attributes_type", "dict_type", "union_tag_invalid",
                    "union_tag_not_found") and isinstance(value, (dict, list)):
        if isinstance(value, dict) and {"value", "unit"} <= value.keys():  # a sourced number: its figure
            value = f"{value['value']!r} {value['unit']}"
        else:
            value = "{...}" if isinstance(value, dict) else f"[{len(value)} item{'' if len(value) == 1 else 's'}]"
    target = _walk(root, loc)
    if kind == "extra_forbidden":
        parent = _walk(root, loc[:-1])
        if isinstance(parent, type) and issubclass(parent, BaseModel):
            return f"unknown {parent.KEY_KIND if issubclass(parent, Strict) else 'key'}; known: " \
                   f"{', '.join(known_keys(parent))}", value
        return "unknown key", value
    if kind == "missing":
        return "required", "(missing)"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        if isinstance(target, type) and issubclass(target, Quantity):
            unit = typing.get_args(target.model_fields["unit"].annotation)[0]
            return (f"a number needs its source: write {{ value = {value!r}, unit = \"{unit}\", "
                    f"source = \"[S|M|H|E] ...\" }}"), value
        return "must be a table", value
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        tags = ", ".join(repr(_tag_of(m)) for m in (target if isinstance(target, tuple) else ()))
        shown = value.get("name", "(missing)") if isinstance(value, dict) else value
        return f"must be one of {tags}", shown
    simple = {
        "greater_than_equal": lambda: f"must be >= {ctx.get('ge')}",
        "greater_than": lambda: f"must be > {ctx.get('gt')}",
        "less_than_equal": lambda: f"must be <= {ctx.get('le')}",
        "less_than": lambda: f"must be < {ctx.get('lt')}",
        "int_type": lambda: "must be an integer",
        "float_type": lambda: "must be a number",
        "finite_number": lambda: "must be a finite number",
        "string_type": lambda: "must be a string",
        "bool_type": lambda: "must be true or false",
        "list_type": lambda: "must be an array",
        "literal_error": lambda: f"must be {ctx.get('expected')}",
        "too_short": lambda: f"needs at least {ctx.get('min_length')} item(s)",
        "string_too_short": lambda: "must not be empty",
        "string_pattern_mismatch": lambda: ("must start with a provenance tag, [S] spec, [M] public measurement, "
                                            "[H] this project's measurement or [E] estimate (also e.g. "
                                            "[E from M]), then a space and the note"
                                            if loc and loc[-1] == "source" else f"must match {ctx.get('pattern')}"),
        "value_error": lambda: str(ctx.get("error", err["msg"])),
    }
    if kind in simple:
        why = simple[kind]()
        if kind.endswith("_type") and original is not None:
            why += f", not {_toml_type(original)}"
            value = repr(original) if isinstance(original, str) else value
        return why, value
    return " ".join(err["msg"].split()), value


def _toml_type(value: object) -> str:
    for kind, name in ((bool, "a boolean"), (int, "an integer"), (float, "a float"), (str, "a string"),
                       (dict, "a table"), (list, "an array")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def input_error(where: str, exc: ValidationError, root: type[BaseModel]) -> InputError:
    """The first pydantic error of `exc` as a one-line InputError: file, dotted key path, value, why."""
    err = exc.errors(include_url=False)[0]
    why, value = _why(err, root)
    path = _dotted(err["loc"], root)
    if err["type"] in ("union_tag_invalid", "union_tag_not_found"):
        path += ".name"
    return InputError(where, path, value, why)


INT64_LIMIT = 2**63  # TOML's integers are 64-bit (toml.io, v1.0.0: "Integers"); Python's reader takes any size


def _first_huge_integer(node, path: str = "") -> tuple[str, int] | None:
    """The first integer of a file's data outside 64 bits, with its key path (a.b[2].c), else None."""
    if isinstance(node, dict):
        items = ((f"{path}.{k}" if path else str(k), v) for k, v in node.items())
    elif isinstance(node, list):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(node))
    else:
        huge = isinstance(node, int) and not isinstance(node, bool) and not -INT64_LIMIT <= node < INT64_LIMIT
        return (path or "(file)", node) if huge else None
    for key, value in items:
        found = _first_huge_integer(value, key)
        if found:
            return found
    return None


def validate(where: str, model: type[BaseModel], data: object):
    """`data` (a TOML file's, or a scenario with --set values) as `model`, or the first defect as one InputError.
    Every integer must fit 64 bits, the rule of TOML itself: one check here for every file and every --set (a
    max-context of 2**70 was taken)."""
    huge = _first_huge_integer(data)
    if huge is not None:
        raise InputError(where, huge[0], huge[1], "outside a 64-bit integer (-2**63 .. 2**63 - 1)")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise input_error(where, exc, model) from None
    except RecursionError:
        raise InputError(where, "(file)", "nesting", "too deeply nested") from None


def is_file(path: Path) -> bool:
    """Path.is_file() that says False instead of raising for names the OS refuses (too long, say)."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


# ------------------------------------------------------------------------------------------ quantities

_SOURCE_PATTERN = rf"^\[[{_TAGS}](/[{_TAGS}])*( from [{_TAGS}](/[{_TAGS}])*)?\] \S.*"


class Quantity(Strict):
    """One sourced number. Subclasses fix the unit and the admissible range (see `quantity`)."""

    value: float
    unit: str
    source: str = Field(pattern=_SOURCE_PATTERN, min_length=8)
    calibrated: bool = False
    derivation: str | None = Field(default=None, min_length=1, validate_default=True)
    # The calibration record (sim/engines/records.py) this figure was fitted on, or derived from: a run that
    # uses it outside the record's key (engine, model, hardware, context) lists it under out_of_domain.
    record: str | None = Field(default=None, min_length=1)
    # The figure's plausible range [LOW, HIGH] (same unit) and why: `run --uncertainty` samples it. Estimates
    # without one take their field's rule (sim/explore/uncertainty.py RULES).
    range: list[float] | None = Field(default=None, min_length=2, max_length=2)
    range_source: str | None = Field(default=None, min_length=8)

    @field_validator("derivation", mode="after")
    @classmethod
    def _calibrated_needs_derivation(cls, derivation: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("calibrated") and not derivation:
            raise ValueError("calibrated = true needs a derivation saying how the figure was obtained")
        return derivation

    @field_validator("value", mode="after")
    @classmethod
    def _as_float(cls, value: float) -> float:
        return float(value)  # 96 and 96.0 must hash alike

    @field_validator("range", mode="after")
    @classmethod
    def _around_the_value(cls, rng: list[float] | None, info: ValidationInfo) -> list[float] | None:
        value = info.data.get("value")
        if rng is not None and value is not None and not rng[0] <= value <= rng[1]:
            raise ValueError(f"range = [LOW, HIGH] must hold the value {value:g}")
        return rng


def _whole(value: float) -> float:
    if not float(value).is_integer():
        raise ValueError(f"must be a whole number, got {value:g}")
    return value


@lru_cache(maxsize=None)
def quantity(unit: str, *, gt: float | None = None, ge: float | None = None, le: float | None = None,
             whole: bool = False, extra: tuple = ()) -> type[Quantity]:
    """A Quantity subclass whose unit must be `unit` and whose value obeys gt/ge/le (and is a whole number where
    `whole`: a count)."""
    checks = (Field(gt=gt, ge=ge, le=le),) + ((AfterValidator(_whole),) if whole else ())
    fields: dict[str, Any] = {
        "value": (Annotated[float, *checks], ...),
        "unit": (Literal[unit], ...),
    }
    for name, annotation in extra:
        fields[name] = (annotation, ...)
    safe = "".join(c if c.isalnum() else "_" for c in unit)
    return create_model(f"Quantity_{safe}", __base__=Quantity, **fields)


# ------------------------------------------------------------------------------------------ engine knobs


def _env_text(value: object) -> object:
    """Environment variables are strings; an integer is taken as its decimal text, anything else refused
    (a float's text would not be what the user typed, and the engines parse the raw text)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, (float, bool)):
        raise ValueError(f'write environment values as strings, e.g. "{value}"')
    return value


EnvValue = Annotated[str, BeforeValidator(_env_text)]


def kind_of(value: object) -> str:
    names = {bool: "a boolean", float: "a float", dict: "a table", list: "an array"}
    return names.get(type(value), type(value).__name__)


def digits(text: str) -> bool:
    return text.isascii() and text.isdigit()


def check_int(where: str, field: str, value: object, minimum: int = 0) -> int:
    """An engine rule's integer argument (numpy integers too), or a one-line InputError."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise InputError(where, field, value, f"must be an integer >= {minimum}")
    return int(value)


def count_or_keyword(value: object, expected: str, is_keyword) -> str | int:
    """A positive whole number (int or digits) or one of an engine's keywords, else a ValueError."""
    if not isinstance(value, (str, int)) or isinstance(value, bool):
        raise ValueError(f"must be {expected}, not {kind_of(value)}")
    if isinstance(value, str) and digits(value):
        value = int(value)
    if isinstance(value, int):
        if value < 1:
            raise ValueError("must be >= 1")
        return value
    if is_keyword(value):
        return value
    raise ValueError(f"must be {expected}")


def env_table(name: str, kind: str, names: tuple[str, ...]) -> type[Strict]:
    """A Strict table of optional string environment variables (an engine's [engine.env])."""
    model = create_model(name, __base__=Strict, **{n: (EnvValue | None, None) for n in names})
    model.KEY_KIND = kind
    return model


def written(table: BaseModel, key: str) -> Any:
    """The value of a key as the user wrote it (by its TOML alias)."""
    return table.model_dump(by_alias=True).get(key)


def field_comments(model: type) -> dict[str, str]:
    """The comments the source puts on each field of a pydantic model, by field name: the comment lines right
    above the field and the comment at the end of its line(s). The one place the schema's prose lives: the
    schema reference (docs/tools/docgen) and `scenario init`'s comments (sim/scaffold/scenario.py) both read it. A
    model made at run time (create_model: the engines' environment tables) has no source, hence none."""
    import ast
    import inspect
    import io
    import textwrap
    import tokenize

    try:
        source = textwrap.dedent(inspect.getsource(model))
    except (OSError, TypeError):
        return {}
    comments = {token.start[0]: token.string.lstrip("#").strip()
                for token in tokenize.generate_tokens(io.StringIO(source).readline) if token.type == tokenize.COMMENT}
    lines = source.splitlines()
    found = {}
    for node in ast.parse(source).body[0].body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        above, line = [], node.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        trailing = [comments[i] for i in range(node.lineno, node.end_lineno + 1) if i in comments]
        if above or trailing:
            found[node.target.id] = " ".join(above + trailing)
    return found
