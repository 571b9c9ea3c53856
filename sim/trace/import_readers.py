"""The readers behind sim.trace.importers: a file's bytes into columns (Arrow arrays typed by field kind, null
where a key is absent or a cell empty) and the input line of each record.

Parsing goes through Arrow's C readers; only when they reject a file does a Python pass over its lines
run, to name the first bad line. Every defect is an InputError.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.json as pjson

from sim.errors import InputError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

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
