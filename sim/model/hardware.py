"""Hardware profiles: the machine a scenario runs on, every number with its source.

A profile is one TOML file in scenarios/hardware/. Each quantity is a table

    h2d_pinned_gbps = { value = 56.3, unit = "GB/s", source = "[M] nvbandwidth, tinygrad/open-gpu-kernel-modules#29" }

and a bare number is refused: the schema has no place for a figure without provenance. The source starts
with the tag of reference/hardware-and-gguf.md: [S] vendor spec, [M] public measurement, [H] measured by
this project, [E] estimate (combinations such as "[E from M]" are allowed). A figure that is fitted, or
meant to be fitted, against end-to-end measurements says `calibrated = true` and carries its `derivation`.

Units are part of the field name (`_gbps`, `_us`, `_gib`, `_kib`) and the table's `unit` must repeat it,
so a value typed in the wrong unit is caught where it is written. GB/s = 1e9 B/s; GiB, MiB, KiB are binary.
D2D copy rates are *bytes copied* per second: benchmarks that report device-local copies count read +
write, so a reported figure is halved (hardware-and-gguf.md §1.1).
"""

from __future__ import annotations

import hashlib
import tomllib
import types
import typing
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo, create_model, \
    field_validator

from sim.errors import InputError

GIB = 1 << 30
MIB = 1 << 20
KIB = 1 << 10
# "[S] ...", "[M] ...", "[H] ...", "[E] ...", also "[E from M]", "[M/H]", "[E from S/H]".
_TAGS = "SMHE"
REPO_SCENARIOS = Path(__file__).resolve().parents[2] / "scenarios"


# ------------------------------------------------------------------------------- shared TOML plumbing


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
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise InputError(where, "path", str(path), "no such file") from None
    except (OSError, ValueError) as exc:
        raise InputError(where, "path", str(path), f"unreadable: {type(exc).__name__}") from None


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


def _unwrap(annotation: Any) -> Any:
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
        current = _unwrap(current)
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
    return _unwrap(current)


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


def validate(where: str, model: type[BaseModel], data: object):
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise input_error(where, exc, model) from None
    except RecursionError:
        raise InputError(where, "(file)", "nesting", "too deeply nested") from None


# ------------------------------------------------------------------------------------------ quantities

_SOURCE_PATTERN = rf"^\[[{_TAGS}](/[{_TAGS}])*( from [{_TAGS}](/[{_TAGS}])*)?\] \S.*"


class Quantity(Strict):
    """One sourced number. Subclasses fix the unit and the admissible range (see `quantity`)."""

    value: float
    unit: str
    source: str = Field(pattern=_SOURCE_PATTERN, min_length=8)
    calibrated: bool = False
    derivation: str | None = Field(default=None, min_length=1, validate_default=True)

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


@lru_cache(maxsize=None)
def quantity(unit: str, *, gt: float | None = None, ge: float | None = None, extra: tuple = ()) -> type[Quantity]:
    """A Quantity subclass whose unit must be `unit` and whose value obeys gt/ge."""
    fields: dict[str, Any] = {
        "value": (Annotated[float, Field(gt=gt, ge=ge)], ...),
        "unit": (Literal[unit], ...),
    }
    for name, annotation in extra:
        fields[name] = (annotation, ...)
    safe = "".join(c if c.isalnum() else "_" for c in unit)
    return create_model(f"Quantity_{safe}", __base__=Quantity, **fields)


GBps = quantity("GB/s", gt=0)
Micros = quantity("us", ge=0)
MicrosPerGiB = quantity("us/GiB", ge=0)
GiBs = quantity("GiB", gt=0)
KiBs = quantity("KiB", gt=0)
# One point of the SSD table: the read bandwidth reached at `queue_depth` requests in flight.
SsdPoint = quantity("GB/s", gt=0, extra=(("queue_depth", Annotated[int, Field(ge=1)]),))


# ------------------------------------------------------------------------------------------- profile


class Gpu(Strict):
    model: str = Field(min_length=1)
    vram_gib: GiBs
    dram_bandwidth_gbps: GBps  # spec DRAM bandwidth: what decode compute scales with


class Host(Strict):
    cpu: str = Field(min_length=1)
    ram_gib: GiBs
    # Single-thread copy from the page cache into pinned staging (a buffered pread): the RAM side of a miss.
    memcpy_gbps: GBps


class Pcie(Strict):
    link: str = Field(min_length=1)  # e.g. "PCIe 5.0 x16": description only
    h2d_pinned_gbps: GBps
    d2h_pinned_gbps: GBps
    h2d_pageable_gbps: GBps
    d2h_pageable_gbps: GBps
    # t(copy) = copy_fixed_latency_us + bytes / rate (hardware-and-gguf.md §0 rule 2)
    copy_fixed_latency_us: Micros
    # Measured effective rate of an engine's stager path (pageable blobs memcpy'd into pinned buffers, then
    # DMA'd), where one is known for this box; otherwise engines derive it from the figures above.
    stager_stream_gbps: GBps | None = None


class Ssd(Strict):
    model: str = Field(min_length=1)
    read_request_kib: KiBs  # the request size the bandwidth table was measured or estimated at
    read_gbps_by_queue_depth: list[SsdPoint] = Field(min_length=1)
    request_latency_us: Micros  # one small (4 KiB) read at queue depth 1
    max_request_kib: KiBs  # larger reads are split into requests of at most this size

    @field_validator("read_gbps_by_queue_depth", mode="after")
    @classmethod
    def _increasing(cls, points: list) -> list:
        depths = [p.queue_depth for p in points]
        if depths != sorted(set(depths)):
            raise ValueError(f"queue depths must strictly increase, got {depths}")
        return points


class D2d(Strict):
    copy_gbps: GBps  # bytes copied per second (a read+write benchmark figure halved)


class Latency(Strict):
    memcpy_call_us: Micros  # host time of one small synchronous cudaMemcpy (enqueue + completion)
    device_sync_us: Micros  # cudaDeviceSynchronize / cudaStreamSynchronize after the work is done
    kernel_launch_us: Micros
    cuda_malloc_us: Micros
    cuda_malloc_us_per_gib: MicrosPerGiB
    cuda_free_us: Micros
    cuda_free_us_per_gib: MicrosPerGiB


class Compute(Strict):
    """GPU time per token and per routed layer for one model class (attention, shared and routed experts
    already resident on the GPU; transfers are simulated separately)."""

    decode_us_per_token_layer: Micros
    prefill_us_per_token_layer: Micros


class HardwareProfile(Strict):
    name: str = Field(min_length=1)
    description: str = Field(min_length=1)
    os: Literal["linux", "windows"]  # windows means WDDM: slower and jittery RAM<->GPU transfers
    calibration: str | None = None  # path, relative to this file, of a calibration record (format: later)
    gpu: Gpu
    host: Host
    pcie: Pcie
    ssd: Ssd
    d2d: D2d
    latency: Latency
    # Keyed by model class: a key matches every model whose name starts with it (longest key wins).
    compute: dict[str, Compute] = Field(min_length=1)

    _path: Path | None = PrivateAttr(default=None)
    _calibration_path: Path | None = PrivateAttr(default=None)
    _calibration_sha256: str | None = PrivateAttr(default=None)

    @property
    def path(self) -> Path | None:
        return self._path

    @property
    def calibration_path(self) -> Path | None:
        return self._calibration_path

    @property
    def calibration_sha256(self) -> str | None:
        return self._calibration_sha256

    @property
    def wddm(self) -> bool:
        return self.os == "windows"

    @property
    def vram_bytes(self) -> int:
        return int(round(self.gpu.vram_gib.value * GIB))

    @property
    def ram_bytes(self) -> int:
        return int(round(self.host.ram_gib.value * GIB))

    def ssd_read_gbps(self, queue_depth: float) -> float:
        """Read bandwidth at `queue_depth`, linear between table points and flat beyond them."""
        points = [(p.queue_depth, p.value) for p in self.ssd.read_gbps_by_queue_depth]
        if queue_depth <= points[0][0]:
            return points[0][1]
        for (q0, b0), (q1, b1) in zip(points, points[1:]):
            if queue_depth <= q1:
                return b0 + (b1 - b0) * (queue_depth - q0) / (q1 - q0)
        return points[-1][1]

    def compute_key(self, model_name: str) -> str | None:
        matches = [key for key in self.compute if model_name.startswith(key)]
        return max(matches, key=len) if matches else None

    def compute_for(self, model_name: str) -> Compute | None:
        key = self.compute_key(model_name)
        return None if key is None else self.compute[key]

    def quantities(self) -> list[tuple[str, Quantity]]:
        """Every number of the profile with its dotted key path."""
        found: list[tuple[str, Quantity]] = []

        def visit(obj: object, path: str) -> None:
            if isinstance(obj, Quantity):
                found.append((path, obj))
            elif isinstance(obj, BaseModel):
                for name in type(obj).model_fields:
                    visit(getattr(obj, name), f"{path}.{name}" if path else name)
            elif isinstance(obj, dict):
                for key, item in obj.items():
                    visit(item, f"{path}.{key}")
            elif isinstance(obj, list):
                for i, item in enumerate(obj):
                    visit(item, f"{path}[{i}]")

        visit(self, "")
        return found

    def canonical(self) -> dict:
        """JSON-able content for hashing: the validated numbers, sources and the calibration's hash."""
        return {"profile": self.model_dump(mode="json"), "calibration_sha256": self.calibration_sha256}


def _is_bare_name(ref: str) -> bool:
    return "/" not in ref and "\\" not in ref and not ref.endswith(".toml")


def hardware_search_dirs(start: Path) -> list[Path]:
    """Folders a bare profile name is looked up in: `hardware/` and `scenarios/hardware/` in `start` and
    every folder above it, then the repository's own scenarios/hardware/."""
    dirs: list[Path] = []
    for folder in (start, *start.parents):
        dirs += [folder / "hardware", folder / "scenarios" / "hardware"]
    dirs.append(REPO_SCENARIOS / "hardware")
    return list(dict.fromkeys(dirs))


def is_file(path: Path) -> bool:
    """Path.is_file() that says False instead of raising for names the OS refuses (too long, say)."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def resolve_hardware(ref: str, base: Path, where: str, field: str = "hardware") -> Path:
    safe_path(where, field, ref)
    if _is_bare_name(ref):
        for folder in hardware_search_dirs(base):
            candidate = folder / f"{ref}.toml"
            if is_file(candidate):
                return candidate
        raise InputError(where, field, ref, f"no hardware profile {ref}.toml in scenarios/hardware/ next to or "
                                            f"above {base} (or give a path to a .toml file)")
    path = Path(ref)
    path = path if path.is_absolute() else base / path
    if not is_file(path):
        raise InputError(where, field, ref, f"no such file ({path})")
    return path


def load_hardware(ref: str | Path, *, base: str | Path | None = None) -> HardwareProfile:
    """A profile by bare name (scenarios/hardware/NAME.toml, looked up from `base` or the working folder
    upward, then in this repository) or by path (relative to `base`, or absolute)."""
    base_dir = Path(base) if base is not None else Path.cwd()
    path = resolve_hardware(str(ref), base_dir, str(ref), "hardware")
    return load_hardware_file(path.resolve())


def load_hardware_file(path: Path) -> HardwareProfile:
    """The profile in the file `path`. Parsing is cached by content; each call returns its own copy, and the
    calibration file (if any) is hashed afresh."""
    where = display_path(path)
    profile = _parse_profile(where, read_bytes(path, where)).model_copy()
    profile._path = path
    if profile.calibration is not None:
        safe_path(where, "calibration", profile.calibration)
        cal = Path(profile.calibration)
        cal = cal if cal.is_absolute() else path.parent / cal
        if not is_file(cal):
            raise InputError(where, "calibration", profile.calibration, f"no such file ({cal})")
        from sim.calibrate.fileformat import load as load_calibration

        load_calibration(cal, f"{where}: calibration")  # another schema version is an error here, not later
        profile._calibration_path = cal.resolve()
        profile._calibration_sha256 = sha256_file(cal)
    return profile


@lru_cache(maxsize=64)
def _parse_profile(where: str, raw: bytes) -> HardwareProfile:
    data = parse_toml(raw, where)
    if "name" not in data:
        data = {"name": Path(where).stem, **data}
    profile = validate(where, HardwareProfile, data)
    if "" in profile.compute:
        raise InputError(where, "compute", "", "a model class key must not be empty")
    return profile


__all__ = [
    "Compute", "GIB", "HardwareProfile", "KIB", "MIB", "Quantity", "input_error", "is_file", "load_hardware",
    "load_hardware_file", "quantity", "read_toml", "resolve_hardware", "validate",
]