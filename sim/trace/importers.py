"""Import routing traces recorded by other tools into a `Trace` (docs/trace-format.md, "Importers").

Formats:
  vllm-jsonl  one JSON object per `FusedMoE.select_experts` call and token, as dumped by a patched vLLM
              (keys dataset, problem_id, layer, experts, gating_probs, and token_pos or token_idx).
  csv         request, position, phase, layer, e0..e{k-1}[, w0..w{k-1}] with a header line.
  jsonl       {"request", "position", "phase", "layer", "experts": [...], "weights": [...]} per line.

Parsing goes through Arrow's C readers; only when they reject a file does a Python pass over its lines
run, to name the first bad line. All checks on the parsed columns are vectorised and name the input line
of the first offending record. Every defect is an InputError.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.json as pjson

from sim.errors import InputError
from sim.trace.format import MISSING, PHASE_DECODE, PHASE_PREFILL, Trace, TraceHeader

FORMATS = ("auto", "vllm-jsonl", "csv", "jsonl")

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# A trace may hold at most this many (token, layer) cells per input record, or 2**22 cells in all,
# whichever is more: a corrupt position or layer number would otherwise ask for an absurd allocation.
MAX_CELLS_PER_RECORD = 64
MIN_CELL_ALLOWANCE = 1 << 22
PHASE_WORDS = ("prefill", "decode", "0", "1")  # index % 2 is the phase code

# Field kinds of the line formats: int (JSON integer), key (string or integer, compared as text),
# ids (list of integers), floats (list of finite numbers).
VLLM_FIELDS = {"dataset": "key", "problem_id": "key", "layer": "int", "token_pos": "int",
               "token_idx": "int", "experts": "ids", "gating_probs": "floats"}
JSONL_FIELDS = {"request": "int", "position": "int", "phase": "key", "layer": "int",
                "experts": "ids", "weights": "floats"}
_ARROW_TYPES = {"int": pa.int64(), "key": pa.string(), "ids": pa.list_(pa.int64()),
                "floats": pa.list_(pa.float64())}


class _Slow(Exception):
    """The fast (Arrow) reader could not take the file as it is; rerun the line-by-line reader."""


# ---------------------------------------------------------------------------------------------- entry


def import_trace(path: str | Path, fmt: str = "auto", *, n_experts: int | None = None,
                 model: str | None = None, top_k: int | None = None) -> Trace:
    """Read a routing trace in one of FORMATS; any defect in the input raises InputError."""
    where = str(path)
    if fmt not in FORMATS:
        raise InputError(where, "format", fmt, f"unknown format; expected one of {', '.join(FORMATS)}")
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise InputError(where, "path", where, "no such file") from None
    except OSError as exc:
        raise InputError(where, "path", where, f"cannot read: {exc.strerror or exc}") from None
    if not data or data.isspace():
        raise InputError(where, "file", f"{len(data)} bytes", "empty file: no records")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise InputError(where, "top_k", top_k, "must be a positive integer")
    n_experts, n_experts_note = _n_experts_from(where, n_experts, model)
    if fmt == "auto":
        fmt = _detect(where, data)
    ctx = _Ctx(where, fmt, model, n_experts, n_experts_note, top_k, hashlib.sha256(data).hexdigest())
    if fmt == "vllm-jsonl":
        cols, lines = _read_jsonl(where, data, VLLM_FIELDS)
        trace = _build_vllm(ctx, cols, lines)
    else:
        cols, lines = _read_jsonl(where, data, JSONL_FIELDS) if fmt == "jsonl" else _read_csv(where, data)
        trace = _build_generic(ctx, cols, lines)
    if model is not None:
        _check_shape(where, trace, model)
    return trace


def _check_shape(where: str, trace: Trace, model: str) -> None:
    """A trace said to be of `model` has its layers (routed, or routed + MTP) and its top-k: a trace of another
    model would be simulated with the wrong expert sizes."""
    from sim.model.presets import get_preset

    layout = get_preset(model)
    h = trace.header
    if h.n_layers not in (layout.n_routed_layers, len(layout.layers)):
        raise InputError(where, "n_layers", h.n_layers, f"model {model} has {layout.n_routed_layers} routed "
                                                        f"layers ({len(layout.layers)} with MTP)")
    if h.top_k != layout.top_k:
        raise InputError(where, "top_k", h.top_k, f"model {model} routes each token to {layout.top_k} experts")


class _Ctx:
    def __init__(self, where, fmt, model, n_experts, n_experts_note, top_k, sha):
        self.where, self.fmt, self.model = where, fmt, model
        self.n_experts, self.n_experts_note, self.top_k, self.sha = n_experts, n_experts_note, top_k, sha


def _n_experts_from(where: str, n_experts, model):
    """n_experts as given, else from the model preset, else None (infer from the ids)."""
    if n_experts is not None:
        if not isinstance(n_experts, int) or isinstance(n_experts, bool) or not 1 <= n_experts < int(MISSING):
            raise InputError(where, "n_experts", n_experts, f"must be an integer in 1..{int(MISSING) - 1}")
    if model is None:
        return n_experts, None
    from sim.model.presets import get_preset  # lazy: the model package imports heavier things

    try:
        preset = get_preset(model)
    except InputError:
        raise
    except (KeyError, ValueError, LookupError) as exc:
        raise InputError(where, "model", model, f"unknown model preset ({exc})") from None
    from_preset = int(preset.n_experts)
    if n_experts is not None and n_experts != from_preset:
        raise InputError(where, "n_experts", n_experts, f"model {model} has {from_preset} experts per layer")
    return from_preset, None if n_experts is not None else f"from model preset {model}"


def _detect(where: str, data: bytes) -> str:
    """Pick a format from the file name and its first non-blank line."""
    if where.lower().endswith(".csv"):
        return "csv"
    number, first = _first_line(data, b" \t\r\n")
    first = first.strip()
    if first.startswith(b"{"):
        try:
            obj = json.loads(first.decode("utf-8"))
        except (ValueError, RecursionError) as exc:
            raise InputError(f"{where}:{number}", "json", _clip(first), f"malformed JSON: {exc}") from None
        if isinstance(obj, dict):
            if "token_pos" in obj or "token_idx" in obj or "problem_id" in obj:
                return "vllm-jsonl"
            if "request" in obj or "position" in obj:
                return "jsonl"
        raise InputError(f"{where}:{number}", "keys", sorted(obj) if isinstance(obj, dict) else type(obj).__name__,
                         "cannot tell the format from the first record; pass fmt=vllm-jsonl or jsonl")
    if b"," in first and b"layer" in first:
        return "csv"
    raise InputError(where, "format", "auto", "cannot tell the format from the first line; pass fmt=...")


# ------------------------------------------------------------------------------------------- readers


def _line_scan(data: bytes, blank: bytes = b" \t\r\n") -> tuple[np.ndarray, bool]:
    """(1-based numbers of the lines holding anything but `blank` bytes, whether each of those lines
    starts with '{' and ends with '}' after blanks). Works on the newline positions only; the few lines
    that start or end with a blank byte are looked at one by one."""
    buf = np.frombuffer(data, np.uint8)
    newlines = np.flatnonzero(buf == 10)
    starts = np.concatenate(([0], newlines + 1))
    ends = np.concatenate((newlines, [len(buf)]))
    is_blank = np.zeros(256, dtype=bool)
    is_blank[list(blank)] = True
    nonempty = ends > starts
    first = np.full(len(starts), 32, dtype=np.uint8)
    last = first.copy()
    first[nonempty] = buf[starts[nonempty]]
    last[nonempty] = buf[ends[nonempty] - 1]
    content = nonempty & ~is_blank[first] & ~is_blank[last]
    for i in np.flatnonzero(nonempty & ~content):  # lines padded with blanks, or blank lines
        stripped = data[starts[i]:ends[i]].strip(blank)
        if stripped:
            content[i] = True
            first[i], last[i] = stripped[0], stripped[-1]
    objects = bool((first[content] == ord("{")).all() and (last[content] == ord("}")).all())
    return np.flatnonzero(content) + 1, objects


def _first_line(data: bytes, blank: bytes) -> tuple[int, bytes]:
    """(1-based number, bytes) of the first line holding anything but `blank` bytes."""
    solid = re.compile(b"[^" + re.escape(blank) + b"]").search(data)
    offset = solid.start() if solid else len(data)
    start = data.rfind(b"\n", 0, offset) + 1
    end = data.find(b"\n", offset)
    return data.count(b"\n", 0, offset) + 1, data[start:] if end < 0 else data[start:end]


def _clip(raw: bytes | str, n: int = 80):
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    return _one_line(text if len(text) <= n else text[: n - 3] + "...")


def _one_line(value):
    """A value safe to show in a one-line error (a string with a newline or control character is quoted)."""
    return repr(value) if isinstance(value, str) and not value.isprintable() else value


def _read_jsonl(where: str, data: bytes, fields: dict) -> tuple[dict, np.ndarray]:
    """Columns (Arrow arrays typed per `_ARROW_TYPES`, null where a key is absent) and each record's line."""
    # Arrow's JSON reader crashes the process (pyarrow 26: segfault) on a top-level `null` as the first
    # value, so anything that is not plainly one object per line goes to the line-by-line reader.
    lines, objects = _line_scan(data)
    try:
        if not objects:
            raise _Slow
        return _read_jsonl_fast(data, fields, len(lines)), lines
    except _Slow:
        return _read_jsonl_slow(where, data, fields)


def _read_jsonl_fast(data: bytes, fields: dict, n_lines: int) -> dict:
    schema = pa.schema([(name, _ARROW_TYPES[kind]) for name, kind in fields.items() if kind != "key"])
    options = pjson.ParseOptions(explicit_schema=schema, unexpected_field_behavior="infer")
    try:
        table = pjson.read_json(io.BytesIO(data), parse_options=options)
    except (pa.ArrowException, ValueError):
        raise _Slow from None
    if table.num_rows != n_lines:  # several objects on a line, or a line Arrow splits differently
        raise _Slow
    try:
        names = table.column_names
    except UnicodeDecodeError:  # a key that is not UTF-8
        raise _Slow from None
    cols = {}
    for name, kind in fields.items():
        if name not in names:
            cols[name] = pa.nulls(table.num_rows, _ARROW_TYPES[kind])
            continue
        col = table.column(name).combine_chunks()
        if kind == "key":
            if pa.types.is_null(col.type) or pa.types.is_int64(col.type):
                col = col.cast(pa.string())
            elif not pa.types.is_string(col.type):
                raise _Slow  # a float, bool, list or object: the slow reader names the line
            try:
                col.validate(full=True)  # Arrow's JSON reader passes invalid UTF-8 through
            except pa.ArrowInvalid:
                raise _Slow from None
        cols[name] = col
    return cols


def _no_duplicate_keys(pairs):
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key!r}")
        obj[key] = value
    return obj


def _no_constant(name):
    raise ValueError(f"{name} is not valid JSON")


def _check_value(kind: str, value):
    """The value converted for its column, or raise ValueError saying what is wrong."""
    if value is None:
        return None
    if kind == "int":
        if type(value) is not int:
            raise ValueError("must be an integer")
        if not INT64_MIN <= value <= INT64_MAX:
            raise ValueError("integer out of range")
        return value
    if kind == "key":
        if type(value) is str:
            return value
        if type(value) is int and INT64_MIN <= value <= INT64_MAX:
            return str(value)
        raise ValueError("must be a string or an integer")
    if not isinstance(value, list):
        raise ValueError("must be a list")
    if kind == "ids":
        for item in value:
            if type(item) is not int:
                raise ValueError("expert ids must be integers")
            if not INT64_MIN <= item <= INT64_MAX:
                raise ValueError("expert id out of range")
        return value
    out = []
    for item in value:
        if type(item) not in (int, float) or not math.isfinite(item):
            raise ValueError("weights must be finite numbers")
        out.append(float(item))
    return out


def _read_jsonl_slow(where: str, data: bytes, fields: dict) -> tuple[dict, np.ndarray]:
    values = {name: [] for name in fields}
    lines = []
    for number, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip(b" \t\r"):
            continue
        at = f"{where}:{number}"
        try:
            obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys,
                             parse_constant=_no_constant)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise InputError(at, "json", _clip(raw), f"malformed JSON (truncated line?): {exc}") from None
        if not isinstance(obj, dict):
            raise InputError(at, "json", _clip(raw), "each line must be one JSON object")
        for name, kind in fields.items():
            try:
                values[name].append(_check_value(kind, obj.get(name)))
            except ValueError as exc:
                raise InputError(at, name, _one_line(obj.get(name)), str(exc)) from None
        lines.append(number)
    cols = {name: pa.array(values[name], _ARROW_TYPES[kind]) for name, kind in fields.items()}
    return cols, np.asarray(lines, dtype=np.int64)


_CSV_COLUMN = re.compile(r"([ew])(0|[1-9][0-9]*)")
_CSV_INT = re.compile(r"\s*-?\d+\s*")


def _csv_header(where: str, data: bytes) -> tuple[int, list[str], int, bool]:
    """(line number, names, k, has_weights) of the CSV header line."""
    number, raw = _first_line(data, b"\r\n")
    try:
        names = next(csv.reader([raw.decode("utf-8").rstrip("\r")]))
    except (ValueError, csv.Error, StopIteration) as exc:
        raise InputError(f"{where}:{number}", "header", _clip(raw), f"unreadable CSV header: {exc}") from None
    at = f"{where}:{number}"
    if len(set(names)) != len(names):
        raise InputError(at, "header", names, "duplicated column name")
    for name in ("request", "position", "phase", "layer"):
        if name not in names:
            raise InputError(at, "header", names, f"missing column {name!r}")
    index = {"e": [], "w": []}
    for name in names:
        match = _CSV_COLUMN.fullmatch(name)
        if match:
            index[match.group(1)].append(int(match.group(2)))
    k = len(index["e"])
    if k == 0 or sorted(index["e"]) != list(range(k)):
        raise InputError(at, "header", names, "expert columns must be e0..e{k-1}")
    if index["w"] and sorted(index["w"]) != list(range(k)):
        raise InputError(at, "header", names, f"weight columns must be w0..w{k - 1} (as many as e columns)")
    return number, names, k, bool(index["w"])


def _read_csv(where: str, data: bytes) -> tuple[dict, np.ndarray]:
    header_line, names, k, has_weights = _csv_header(where, data)
    kinds = {"request": "int", "position": "int", "phase": "key", "layer": "int"}
    kinds.update({f"e{i}": "int" for i in range(k)})
    if has_weights:
        kinds.update({f"w{i}": "float" for i in range(k)})
    lines = _line_scan(data, blank=b"\r\n")[0]
    lines = lines[lines > header_line]
    try:
        table = _read_csv_fast(data, kinds, len(lines))
    except _Slow:
        table, lines = _read_csv_slow(where, data, names, kinds)
    return _csv_columns(where, table, lines, k, has_weights), lines


def _read_csv_fast(data: bytes, kinds: dict, n_rows: int) -> dict:
    types = {name: {"int": pa.int64(), "key": pa.string(), "float": pa.float64()}[kind]
             for name, kind in kinds.items()}
    try:
        table = pcsv.read_csv(io.BytesIO(data), convert_options=pcsv.ConvertOptions(
            column_types=types, include_columns=list(kinds), strings_can_be_null=False))
    except (pa.ArrowException, ValueError):
        raise _Slow from None
    if table.num_rows != n_rows:
        raise _Slow
    return {name: table.column(name).combine_chunks() for name in kinds}


def _read_csv_slow(where: str, data: bytes, names: list[str], kinds: dict) -> tuple[dict, np.ndarray]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        number = data[: exc.start].count(b"\n") + 1
        raise InputError(f"{where}:{number}", "encoding", _clip(data[exc.start:exc.start + 20]),
                         "not UTF-8") from None
    position = {name: names.index(name) for name in kinds}
    values = {name: [] for name in kinds}
    lines = []
    reader = csv.reader(io.StringIO(text, newline=""))
    header_seen = False
    while True:
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:
            raise InputError(f"{where}:{reader.line_num}", "csv", "", f"malformed CSV: {exc}") from None
        if not row:
            continue
        at = f"{where}:{reader.line_num}"
        if not header_seen:
            header_seen = True
            continue
        if len(row) != len(names):
            raise InputError(at, "fields", len(row), f"expected {len(names)} comma-separated fields")
        for name, kind in kinds.items():
            cell = row[position[name]]
            if kind == "key":
                values[name].append(cell)
            elif cell.strip() == "":
                values[name].append(None)
            elif kind == "int":
                if not _CSV_INT.fullmatch(cell) or not INT64_MIN <= int(cell) <= INT64_MAX:
                    raise InputError(at, name, _one_line(cell), "must be an integer")
                values[name].append(int(cell))
            else:
                try:
                    values[name].append(float(cell))
                except ValueError:
                    raise InputError(at, name, _one_line(cell), "must be a number") from None
        lines.append(reader.line_num)
    types = {"int": pa.int64(), "key": pa.string(), "float": pa.float64()}
    return ({name: pa.array(values[name], types[kind]) for name, kind in kinds.items()},
            np.asarray(lines, dtype=np.int64))


def _csv_columns(where: str, table: dict, lines: np.ndarray, k: int, has_weights: bool) -> dict:
    """Turn e0.. / w0.. into list columns like the JSONL reader's; an empty cell is an error."""

    def as_list(prefix, value_type):
        parts = [table[f"{prefix}{i}"] for i in range(k)]
        null = np.column_stack([part.is_null().to_numpy(zero_copy_only=False) for part in parts])
        if null.any():
            row, i = np.argwhere(null)[0]
            raise InputError(f"{where}:{int(lines[row])}", f"{prefix}{i}", "", "empty or null cell")
        flat = np.column_stack([part.fill_null(0).to_numpy(zero_copy_only=False) for part in parts])
        offsets = pa.array(np.arange(0, (len(lines) + 1) * k, k, dtype=np.int32))
        return pa.ListArray.from_arrays(offsets, pa.array(flat.reshape(-1), value_type))

    cols = {name: table[name] for name in ("request", "position", "phase", "layer")}
    cols["experts"] = as_list("e", pa.int64())
    cols["weights"] = as_list("w", pa.float64()) if has_weights else pa.nulls(len(lines), pa.list_(pa.float64()))
    return cols


# ---------------------------------------------------------------------------------- column checks


def _first(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if len(hits) else None


class _Cols:
    """Vectorised checks over parsed columns; errors name `file:line` of the first bad record."""

    def __init__(self, where: str, cols: dict, lines: np.ndarray):
        self.where, self.cols, self.lines = where, cols, lines
        self.n = len(lines)
        if self.n == 0:
            raise InputError(where, "file", "no records", "empty file: nothing but a header or blank lines")

    def fail(self, row: int, field: str, why: str, value=None):
        if value is None:
            value = self.cols[field][row].as_py() if field in self.cols else None
        raise InputError(f"{self.where}:{int(self.lines[row])}", field, _one_line(value), why)

    def present(self, name: str) -> np.ndarray:
        return self.cols[name].is_valid().to_numpy(zero_copy_only=False)

    def require(self, name: str) -> None:
        row = _first(~self.present(name))
        if row is not None:
            self.fail(row, name, "missing (absent key, null or empty cell)", value="absent")

    def ints(self, name: str, lo: int = 0, hi: int = INT32_MAX) -> np.ndarray:
        self.require(name)
        values = self.cols[name].to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        row = _first((values < lo) | (values > hi))
        if row is not None:
            self.fail(row, name, f"must be an integer in {lo}..{hi}")
        return values

    def keys(self, name: str) -> pa.Array:
        self.require(name)
        return self.cols[name]

    def matrix(self, name: str, width: int | None, what: str) -> tuple[np.ndarray, int]:
        """A list column as a [records, k] array; every list must have the same width (k)."""
        col = self.cols[name]
        lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
        k = int(lengths[0]) if width is None else width
        row = _first(lengths != k)
        if row is not None:
            why = f"expected {k} {what} (top_k={k}"
            why += ", as given)" if width is not None else ", the width of the first record)"
            self.fail(row, name, why)
        if k < 1:
            self.fail(0, name, f"needs at least one {what[:-1]}")
        flat = col.flatten()
        if flat.null_count:
            self.fail(_first(flat.is_null().to_numpy(zero_copy_only=False)) // k, name, f"null among the {what}")
        return flat.to_numpy(zero_copy_only=False).reshape(self.n, k), k


def _expert_ids(ctx: _Ctx, c: _Cols) -> tuple[np.ndarray, int, int, dict]:
    """(ids uint16 [records, k], k, n_experts, generator notes) after all id checks."""
    c.require("experts")
    ids, k = c.matrix("experts", ctx.top_k, "expert ids")
    notes = {}
    row = _first((ids < 0).any(axis=1))
    if row is not None:
        c.fail(row, "experts", "negative expert id")
    n_experts = ctx.n_experts
    if n_experts is None:
        top = int(ids.max())
        if top + 1 >= int(MISSING):
            c.fail(int(np.argmax(ids.max(axis=1))), "experts", f"expert id must be < {int(MISSING) - 1}")
        n_experts = top + 1
        notes["n_experts"] = "inferred from max id"
    else:
        row = _first((ids >= n_experts).any(axis=1))
        if row is not None:
            c.fail(row, "experts", f"expert id must be < n_experts={n_experts}")
        if ctx.n_experts_note:
            notes["n_experts"] = ctx.n_experts_note
    if k > n_experts:
        raise InputError(ctx.where, "top_k", k, f"exceeds n_experts={n_experts}")
    ordered = np.sort(ids, axis=1)
    row = _first((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))
    if row is not None:
        c.fail(row, "experts", "expert ids within a record must be distinct")
    return ids.astype(np.uint16), k, n_experts, notes


def _weights(c: _Cols, name: str, k: int) -> np.ndarray | None:
    present = c.present(name)
    if not present.any():
        return None
    row = _first(~present)
    if row is not None:
        c.fail(row, name, "missing here but present in other records", value="absent")
    weights, _ = c.matrix(name, k, "weights")
    with np.errstate(over="ignore"):
        weights = weights.astype(np.float32)
    row = _first(~np.isfinite(weights).all(axis=1))
    if row is not None:
        c.fail(row, name, "weights must be finite float32 numbers")
    return weights


def _check_duplicates(c: _Cols, cell: np.ndarray, field: str) -> None:
    order = np.argsort(cell, kind="stable")
    same = cell[order][1:] == cell[order][:-1]
    if same.any():
        later = order[1:][same]  # stable sort: the later record of each pair (in file order)
        row = int(later.min())
        first = int(order[:-1][same][np.argmin(later)])
        c.fail(row, field, f"duplicated (token, layer) record; first at line {int(c.lines[first])}")


def _trace(ctx: _Ctx, variant: str, n_layers: int, k: int, n_experts: int, notes: dict,
           request, position, phase, row_of, layer, ids, weights, extra: dict) -> Trace:
    n_rows = len(request)
    experts = np.full((n_rows, n_layers, k), MISSING, dtype=np.uint16)
    experts[row_of, layer] = ids
    full_weights = None
    if weights is not None:
        full_weights = np.zeros((n_rows, n_layers, k), dtype=np.float32)
        full_weights[row_of, layer] = weights
    generator = {"importer": ctx.fmt, "variant": variant, **notes, **extra}
    header = TraceHeader(model=ctx.model if ctx.model is not None else f"unknown ({ctx.fmt})",
                         n_layers=n_layers, n_experts=n_experts, top_k=k,
                         source=Path(ctx.where).name, source_sha256=ctx.sha, generator=generator)
    return Trace(header, request, position, phase, experts, full_weights).validate(ctx.where)


# ------------------------------------------------------------------------------------------ builders


def _build_vllm(ctx: _Ctx, cols: dict, lines: np.ndarray) -> Trace:
    c = _Cols(ctx.where, cols, lines)
    has_pos, has_idx = c.present("token_pos"), c.present("token_idx")
    raw = bool(has_pos[0])
    if not raw and not has_idx[0]:
        c.fail(0, "token_pos", "missing key: a record needs token_pos (raw file) or token_idx (decode-only)",
               value="absent")
    row = _first(has_idx if raw else has_pos)
    if row is not None:
        c.fail(row, "token_idx" if raw else "token_pos",
               f"mixes token_pos and token_idx records (line {int(lines[0])} set the kind)")
    pos_field = "token_pos" if raw else "token_idx"
    pos = c.ints(pos_field)
    layer = c.ints("layer")
    dataset, problem = c.keys("dataset"), c.keys("problem_id")
    ids, k, n_experts, notes = _expert_ids(ctx, c)
    weights = _weights(c, "gating_probs", k)
    joined = pc.binary_join_element_wise(dataset, problem, "\x1f")
    req = pc.dictionary_encode(joined).indices.to_numpy(zero_copy_only=False).astype(np.int64)
    first = np.unique(req, return_index=True)[1]  # codes follow first appearance
    names = [f"{dataset[int(i)].as_py()}/{problem[int(i)].as_py()}" for i in first]
    n_req = len(names)
    n_layers = int(layer.max()) + 1
    if raw:
        step, prefill_len, decode_len = _raw_steps(c, req, layer, pos, n_req, n_layers)
        first_pos = np.zeros(n_req, dtype=np.int64)
        lengths = prefill_len + decode_len
        variant = "prefill+decode"
    else:  # one row per token_idx from the request's smallest to its largest
        step = pos
        first_pos = np.full(n_req, np.iinfo(np.int64).max, dtype=np.int64)
        last = np.zeros(n_req, dtype=np.int64)
        np.minimum.at(first_pos, req, pos)
        np.maximum.at(last, req, pos)
        prefill_len = np.zeros(n_req, dtype=np.int64)
        lengths = last - first_pos + 1
        variant = "decode-only"
    _check_size(c, int(lengths.sum()), n_layers, layer, pos_field, step - first_pos[req])
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    row_of = offsets[req] + step - first_pos[req]
    request = np.repeat(np.arange(n_req, dtype=np.int64), lengths)
    position = np.arange(int(offsets[-1]), dtype=np.int64) - offsets[request] + first_pos[request]
    phase = np.where(position - first_pos[request] >= prefill_len[request], PHASE_DECODE, PHASE_PREFILL)
    _check_duplicates(c, row_of * n_layers + layer, pos_field)
    return _trace(ctx, variant, n_layers, k, n_experts, notes, request, position, phase,
                  row_of, layer, ids, weights, {"requests": names})


def _raw_steps(c: _Cols, req, layer, pos, n_req, n_layers):
    """Split a prefill+decode file. Per (request, layer), in file order, decode starts at the first record
    with token_pos 0 that is not the group's first record (the reset); every decode record has token_pos 0
    and the d-th one is decode step d. Returns each record's step (its row within the request: token_pos
    for prefill, prefill length + d for decode) and, per request, the prefill length P (max prefill
    token_pos + 1 over layers) and the number of decode steps (max d + 1 over layers)."""
    group = req * n_layers + layer
    order = np.argsort(group, kind="stable")
    g_sorted, p_sorted = group[order], pos[order]
    start = np.ones(len(order), dtype=bool)
    start[1:] = g_sorted[1:] != g_sorted[:-1]
    group_id = np.cumsum(start) - 1
    start_at = np.flatnonzero(start)

    def in_group_cumsum(flags):
        flags = flags.astype(np.int64)
        total = np.cumsum(flags)
        before = total[start_at] - flags[start_at]
        return total - before[group_id]

    decode_sorted = in_group_cumsum((p_sorted == 0) & ~start) > 0
    decode = np.empty_like(decode_sorted)
    decode[order] = decode_sorted
    row = _first(decode & (pos != 0))
    if row is not None:
        c.fail(row, "token_pos", "a decode record (after the reset to 0) must have token_pos 0")
    d = np.empty(len(order), dtype=np.int64)
    d[order] = in_group_cumsum(decode_sorted) - 1
    prefill_len = np.zeros(n_req, dtype=np.int64)
    np.maximum.at(prefill_len, req[~decode], pos[~decode] + 1)
    decode_len = np.zeros(n_req, dtype=np.int64)
    np.maximum.at(decode_len, req[decode], d[decode] + 1)
    step = np.where(decode, prefill_len[req] + d, pos)
    return step, prefill_len, decode_len


def _check_size(c: _Cols, n_rows: int, n_layers: int, layer: np.ndarray, pos_field: str,
                spread: np.ndarray) -> None:
    """Refuse a trace far sparser than its records: a corrupt position or layer would ask for gigabytes."""
    if n_rows * n_layers <= max(MAX_CELLS_PER_RECORD * c.n, MIN_CELL_ALLOWANCE) and n_rows <= INT32_MAX:
        return
    row, field = (int(np.argmax(layer)), "layer") if n_layers > 1024 else (int(np.argmax(spread)), pos_field)
    c.fail(row, field, f"implies a trace of {n_rows} tokens x {n_layers} layers for only {c.n} records "
                       "(corrupt number?)")


def _build_generic(ctx: _Ctx, cols: dict, lines: np.ndarray) -> Trace:
    """Rows are the distinct (request, position, phase) in order of first appearance in the file."""
    c = _Cols(ctx.where, cols, lines)
    request = c.ints("request")
    position = c.ints("position")
    phase_index = pc.index_in(pc.utf8_trim_whitespace(c.keys("phase")), value_set=pa.array(PHASE_WORDS))
    row = _first(phase_index.is_null().to_numpy(zero_copy_only=False))
    if row is not None:
        c.fail(row, "phase", "unknown phase: expected prefill, decode, 0 or 1")
    phase = phase_index.to_numpy(zero_copy_only=False).astype(np.int64) % 2
    layer = c.ints("layer")
    ids, k, n_experts, notes = _expert_ids(ctx, c)
    weights = _weights(c, "weights", k)
    n_layers = int(layer.max()) + 1
    key = (request << 32) | (position << 1) | phase
    uniques, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    rank = np.empty(len(uniques), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(uniques))
    row_of, first = rank[inverse.reshape(-1)], np.sort(first)
    _check_size(c, len(first), n_layers, layer, "layer", layer)
    _check_duplicates(c, row_of * n_layers + layer, "layer")
    return _trace(ctx, "rows in order of first appearance", n_layers, k, n_experts, notes,
                  request[first], position[first], phase[first], row_of, layer, ids, weights, {})
