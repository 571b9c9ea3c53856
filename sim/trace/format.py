"""The routing trace: which experts each token picked, per MoE layer, in execution order.

In memory a trace is a handful of numpy arrays (see `Trace`); on disk it is one Parquet file with one row
per token step and the header in the schema metadata (docs/trace-format.md). Loading never iterates over
rows in Python: the expert column is a fixed-size list that maps straight onto a numpy array.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
from numba import njit
import pyarrow as pa
import pyarrow.parquet as pq

from sim.errors import InputError, require_regular_file

FORMAT_VERSION = 1
METADATA_KEY = b"expertsim.trace"
SHA256_KEY = b"expertsim.trace.sha256"  # Trace.sha256() of the content, checked on read
PHASE_PREFILL = 0
PHASE_DECODE = 1
PHASE_NAMES = ("prefill", "decode")
# An expert id no model uses (ids are < 65,535 experts per layer): marks a (token, layer) cell the
# source did not record. A cell is either complete or all MISSING.
MISSING = np.uint16(0xFFFF)


def distinct_experts(rows: np.ndarray, n_experts: int) -> np.ndarray:
    """The distinct expert ids of routing cells (any shape), ascending, MISSING left out: np.unique's answer by a
    mask over the ids instead of a sort (a 5,120-token prompt chunk's layer, 30K cells: ~1 ms sorted)."""
    seen = np.zeros(n_experts + 1, np.bool_)
    seen[np.minimum(rows, n_experts)] = True  # MISSING marks the spare last flag
    return np.flatnonzero(seen[:n_experts]).astype(rows.dtype)


@dataclass(frozen=True)
class TraceHeader:
    model: str
    n_layers: int
    n_experts: int
    top_k: int
    source: str
    source_sha256: str
    generator: dict = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)


VALIDATE_BLOCK_ROWS = 16_384  # rows a validation check looks at at once (Trace.validate)
WRITE_ROW_GROUP_ROWS = 16_384  # rows of a Parquet row group (write_trace): ~16 MB of a 48-layer top-10 trace


def routing_digest(header: TraceHeader, request: np.ndarray, position: np.ndarray, phase: np.ndarray):
    """The start of a trace's content hash (Trace.sha256): its header and row index columns; the expert ids follow,
    in row order (whole, or block by block as a generator writes them: the same digest)."""
    digest = hashlib.sha256()
    digest.update(header.to_json().encode())
    for arr in (request, position, phase):
        digest.update(np.ascontiguousarray(arr))
    return digest


@dataclass
class Trace:
    """Rows are token steps in execution order; `experts[row, layer]` holds that step's top-k ids.

    request, position: int32 per row (position counts tokens within the request, prompt first).
    phase: uint8 per row, PHASE_PREFILL or PHASE_DECODE.
    experts: uint16 [rows, n_layers, top_k]; MISSING where the cell was not recorded.
    weights: float32 of the same shape (gate weights), or None when the source had none.
    """

    header: TraceHeader
    request: np.ndarray
    position: np.ndarray
    phase: np.ndarray
    experts: np.ndarray
    weights: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.request = np.ascontiguousarray(self.request, dtype=np.int32)
        self.position = np.ascontiguousarray(self.position, dtype=np.int32)
        self.phase = np.ascontiguousarray(self.phase, dtype=np.uint8)
        self.experts = np.ascontiguousarray(self.experts, dtype=np.uint16)
        if self.weights is not None:
            self.weights = np.ascontiguousarray(self.weights, dtype=np.float32)

    @property
    def n_rows(self) -> int:
        return int(self.experts.shape[0])

    @property
    def n_lookups(self) -> int:
        """Expert lookups a replay makes: recorded cells × top_k."""
        return int((~self.missing_cells()).sum()) * self.header.top_k

    def missing_cells(self) -> np.ndarray:
        """bool [rows, n_layers]: True where the (token, layer) cell was not recorded."""
        return self.experts[:, :, 0] == MISSING

    def validate(self, where: str = "trace") -> "Trace":
        """Check shapes, ids and phases; raise InputError naming the first bad field."""
        h = self.header
        rows = self.n_rows
        if self.experts.ndim != 3 or self.experts.shape[1:] != (h.n_layers, h.top_k):
            raise InputError(where, "experts.shape", tuple(self.experts.shape),
                             f"expected (rows, n_layers={h.n_layers}, top_k={h.top_k})")
        for name in ("request", "position", "phase"):
            arr = getattr(self, name)
            if arr.shape != (rows,):
                raise InputError(where, name + ".shape", tuple(arr.shape), f"expected ({rows},)")
        if self.weights is not None and self.weights.shape != self.experts.shape:
            raise InputError(where, "weights.shape", tuple(self.weights.shape), "must match experts")
        if h.n_experts < 1 or h.n_experts >= int(MISSING):
            raise InputError(where, "n_experts", h.n_experts, f"must be in 1..{int(MISSING) - 1}")
        if h.top_k < 1 or h.top_k > h.n_experts:
            raise InputError(where, "top_k", h.top_k, f"must be in 1..n_experts={h.n_experts}")
        for name in ("request", "position"):
            arr = getattr(self, name)
            if rows and int(arr.min()) < 0:
                raise InputError(where, name, int(arr.min()), "must be >= 0")
        if rows and int(self.phase.max()) > PHASE_DECODE:
            raise InputError(where, "phase", int(self.phase.max()), "must be 0 (prefill) or 1 (decode)")
        # each check runs over blocks of rows, in row order (the first bad cell is the whole trace's first): its
        # temporaries stay a few MB for a million-token trace instead of several times the routing's size
        blocks = range(0, rows, VALIDATE_BLOCK_ROWS)
        if self.weights is not None:
            for first in blocks:
                weights = self.weights[first: first + VALIDATE_BLOCK_ROWS]
                wrong = ~(np.isfinite(weights) & (weights >= 0))
                if wrong.any():
                    r, layer, k = np.argwhere(wrong)[0]
                    raise InputError(where, f"weights[row {first + r}, layer {layer}]", float(weights[r, layer, k]),
                                     "a router weight is a finite number >= 0")
        for first in blocks:
            missing = self.experts[first: first + VALIDATE_BLOCK_ROWS] == MISSING
            partial = missing.any(axis=2) & ~missing.all(axis=2)
            if partial.any():
                r, layer = np.argwhere(partial)[0]
                raise InputError(where, f"experts[row {first + r}, layer {layer}]",
                                 self.experts[first + r, layer].tolist(),
                                 "a cell is either fully recorded or fully missing")
        for first in blocks:
            experts = self.experts[first: first + VALIDATE_BLOCK_ROWS]
            bad = (experts != MISSING) & (experts >= h.n_experts)
            if bad.any():
                r, layer, k = np.argwhere(bad)[0]
                raise InputError(where, f"experts[row {first + r}, layer {layer}]", int(experts[r, layer, k]),
                                 f"expert id must be < n_experts={h.n_experts}")
        self._check_token_order(where)
        cell = _first_repeated_pick(self.experts.reshape(-1, h.top_k), MISSING)
        if cell >= 0:  # one expert picked twice by one token would count as two lookups, one of them a free hit
            r, layer = divmod(int(cell), h.n_layers)
            raise InputError(where, f"experts[row {r}, layer {layer}]", self.experts[r, layer].tolist(),
                             "a token picks each expert of a layer at most once")
        return self

    def _check_token_order(self, where: str) -> None:
        """Each (request, position) is one token, and a request's prompt comes before its answer: the workload
        cuts a request into its prefill rows and its decode steps, so a repeated position would be replayed twice
        and a prefill row after a decode row would be replayed as part of a prompt already answered. The importers
        build traces that hold both; a Parquet file written by hand or by another tool may not."""
        if not self.n_rows:
            return
        token = (self.request.astype(np.int64) << 32) | self.position.astype(np.int64)
        order = np.argsort(token, kind="stable")
        repeated = token[order][1:] == token[order][:-1]
        if repeated.any():
            later = order[1:][repeated]  # stable sort: of two rows of one token, the later one in row order
            row = int(later.min())
            first = int(order[:-1][repeated][np.argmin(later)])
            raise InputError(where, f"position[row {row}]", int(self.position[row]),
                             f"request {int(self.request[row])} already has a token at this position (row {first}):"
                             " each (request, position) is one token")
        requests, request_of_row = np.unique(self.request, return_inverse=True)
        rows = np.arange(self.n_rows)
        first_decode = np.full(len(requests), self.n_rows)
        decode = self.phase == PHASE_DECODE
        np.minimum.at(first_decode, request_of_row[decode], rows[decode])
        late_prefill = ~decode & (rows > first_decode[request_of_row])
        if late_prefill.any():
            row = int(np.argmax(late_prefill))
            raise InputError(where, f"phase[row {row}]", PHASE_NAMES[PHASE_PREFILL],
                             f"request {int(self.request[row])} has a decode row before it (row "
                             f"{int(first_decode[request_of_row[row]])}): a request's prompt comes before its answer")

    def require_routing(self, where: str) -> "Trace":
        """A trace read from a user's file must hold routing to replay: at least one token, not every cell missing
        (read_trace and the importers both ask; an empty trace in memory, a selection of no rows, is fine)."""
        if not self.n_rows:
            raise InputError(where, "rows", 0, "a trace holds at least one token")
        if self.missing_cells().all():
            raise InputError(where, "experts", f"{self.n_rows} rows", "every (token, layer) cell is missing: "
                                                                       "nothing to replay")
        return self

    def sha256(self) -> str:
        """Content hash of the routing (not of a file's bytes): stable across Parquet writers.

        Computed once per Trace: a trace's arrays are treated as immutable once built."""
        return self._sha256

    @cached_property
    def _sha256(self) -> str:
        digest = routing_digest(self.header, self.request, self.position, self.phase)
        digest.update(np.ascontiguousarray(self.experts))  # the buffer itself: no copy of a long prompt
        if self.weights is not None:
            digest.update(np.ascontiguousarray(self.weights))
        return digest.hexdigest()

    def nbytes(self) -> int:
        arrays = [self.request, self.position, self.phase, self.experts]
        if self.weights is not None:
            arrays.append(self.weights)
        return int(sum(a.nbytes for a in arrays))

    def rows(self, mask: np.ndarray) -> "Trace":
        """A trace of the rows where mask is True (same header)."""
        return Trace(self.header, self.request[mask], self.position[mask], self.phase[mask],
                     self.experts[mask], None if self.weights is None else self.weights[mask])


def write_trace(trace: Trace, path: str | Path) -> None:
    """Write a trace as Parquet (zstd); the header goes into the schema metadata."""
    trace.validate(str(path))
    h = trace.header
    width = h.n_layers * h.top_k
    columns = {
        "request": pa.array(trace.request),
        "position": pa.array(trace.position),
        "phase": pa.array(trace.phase),
        "experts": pa.FixedSizeListArray.from_arrays(pa.array(trace.experts.reshape(-1)), width),
    }
    if trace.weights is not None:
        columns["weights"] = pa.FixedSizeListArray.from_arrays(pa.array(trace.weights.reshape(-1)), width)
    table = pa.table(columns)
    meta = {METADATA_KEY: h.to_json().encode(), SHA256_KEY: trace.sha256().encode()}
    table = table.replace_schema_metadata(meta)
    # Row groups of WRITE_ROW_GROUP_ROWS rows: Arrow's writer holds one group's encoding and compression buffers at
    # a time; one group of a million-token trace took about 5x the routing's bytes (issue 34's `trace gen` peak)
    pq.write_table(table, str(path), compression="zstd", row_group_size=WRITE_ROW_GROUP_ROWS)


@njit(cache=True)
def _first_repeated_pick(cells: np.ndarray, missing: np.uint16) -> int:
    """Index of the first (token, layer) cell naming one expert twice, or -1. A loop in numba: numpy would sort
    the whole array (0.9 s for a 65K-token, 48-layer trace) to compare neighbours; top-k is small."""
    for c in range(cells.shape[0]):
        for i in range(1, cells.shape[1]):
            if cells[c, i] == missing:
                continue
            for j in range(i):
                if cells[c, i] == cells[c, j]:
                    return c
    return -1


def _header_from(path: str, meta: dict | None) -> TraceHeader:
    if not meta or METADATA_KEY not in meta:
        raise InputError(path, "schema metadata", "absent", "not an expertsim trace (no expertsim.trace header)")
    try:
        raw = json.loads(meta[METADATA_KEY])
        header = TraceHeader(**raw)
    except (ValueError, TypeError, RecursionError) as exc:
        why = " ".join(str(exc).split())  # one line
        raise InputError(path, "expertsim.trace header", meta[METADATA_KEY][:80], f"unreadable: {why}") from None
    if header.format_version != FORMAT_VERSION:
        raise InputError(path, "format_version", header.format_version, f"this expertsim reads {FORMAT_VERSION}")
    for name in ("n_layers", "n_experts", "top_k"):
        value = getattr(header, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InputError(path, name, value, "must be a positive integer")
    return header


def _list_column(path: str, table: pa.Table, name: str, width: int, dtype) -> np.ndarray:
    """A fixed-size list column as a [rows, width] array (read_trace passes one row group at a time)."""
    col = table.column(name).combine_chunks()
    if not pa.types.is_fixed_size_list(col.type) or col.type.list_size != width:
        raise InputError(path, name, str(col.type), f"expected fixed_size_list of n_layers*top_k = {width}")
    if col.type.value_type != pa.from_numpy_dtype(np.dtype(dtype)):
        raise InputError(path, name, str(col.type.value_type), f"expected {np.dtype(dtype).name} values")
    values = col.flatten()
    if col.null_count or values.null_count:
        raise InputError(path, name, f"{col.null_count + values.null_count} nulls",
                         "mark missing cells with 65535, not null")
    return values.to_numpy(zero_copy_only=False).astype(dtype, copy=False).reshape(len(col), width)


def _int_column(path: str, table: pa.Table, name: str, dtype) -> np.ndarray:
    """An integer column without nulls whose values fit `dtype` (no silent wrap-around or NaN casts)."""
    col = table.column(name)
    if not pa.types.is_integer(col.type):
        raise InputError(path, name, str(col.type), f"expected an integer column ({np.dtype(dtype).name})")
    if col.null_count:
        raise InputError(path, name, f"{col.null_count} nulls", "must not be null")
    values = col.to_numpy()
    info = np.iinfo(dtype)
    if len(values) and (int(values.min()) < info.min or int(values.max()) > info.max):
        bad = int(values.min()) if int(values.min()) < info.min else int(values.max())
        raise InputError(path, name, bad, f"out of range for {np.dtype(dtype).name}")
    return values.astype(dtype, copy=False)


def _unreadable(where: str, exc: Exception) -> InputError:
    why = " ".join(str(exc).split())  # Arrow messages can span lines; an InputError is one line
    return InputError(where, "parquet", type(exc).__name__, f"not a readable Parquet file: {why}")


def read_trace(path: str | Path) -> Trace:
    """Read a trace written by `write_trace`; any defect raises InputError naming the file and field. The file is
    read a row group at a time into the trace's arrays: a million-token trace takes its own size once, not the
    Arrow table's and then the arrays' (issue 34's `trace stats` and `cache --mrc` peaks)."""
    where = str(path)
    require_regular_file(where, where, "a trace file")  # pyarrow would read a folder as a dataset of its files
    try:
        file = pq.ParquetFile(where)
        schema = file.schema_arrow
    except FileNotFoundError:
        raise InputError(where, "path", where, "no such file") from None
    except UnicodeDecodeError:  # Arrow decodes the column names as it builds the schema
        raise InputError(where, "columns", "?", "a column name is not UTF-8") from None
    except (pa.ArrowException, OSError) as exc:
        raise _unreadable(where, exc) from None
    metadata = schema.metadata
    header = _header_from(where, metadata)
    try:
        names = schema.names
    except UnicodeDecodeError:
        raise InputError(where, "columns", "?", "a column name is not UTF-8") from None
    if len(set(names)) != len(names):
        raise InputError(where, "columns", names, "duplicated column name")
    for name in ("request", "position", "phase", "experts"):
        if name not in names:
            raise InputError(where, "columns", names, f"missing column {name!r}")
    width = header.n_layers * header.top_k
    n_rows = file.metadata.num_rows
    cell = (header.n_layers, header.top_k)
    columns = {"request": (np.int32, ()), "position": (np.int32, ()), "phase": (np.uint8, ()),
               "experts": (np.uint16, cell), **({"weights": (np.float32, cell)} if "weights" in names else {})}
    arrays = {name: np.empty((n_rows, *shape), dtype) for name, (dtype, shape) in columns.items()}
    row = 0
    for group in range(file.num_row_groups):
        try:
            table = file.read_row_group(group)
        except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:
            raise _unreadable(where, exc) from None
        rows = table.num_rows
        if row + rows > n_rows:
            raise InputError(where, "row groups", f"more than {n_rows} rows", "the footer's row count is wrong")
        for name, (dtype, shape) in columns.items():
            part = (_list_column(where, table, name, width, dtype) if shape else
                    _int_column(where, table, name, dtype))
            arrays[name][row: row + rows] = part.reshape(rows, *shape)
        row += rows
        del table  # its Arrow buffers go before the next group is read
    if row != n_rows:
        raise InputError(where, "row groups", f"{row} rows", f"the footer says {n_rows}")
    trace = Trace(header, arrays["request"], arrays["position"], arrays["phase"], arrays["experts"],
                  arrays.get("weights"))
    trace.validate(where).require_routing(where)
    stored = metadata.get(SHA256_KEY)
    if stored is not None and stored.decode("ascii", "replace") != trace.sha256():
        raise InputError(where, "expertsim.trace.sha256", stored.decode("ascii", "replace"),
                         "content hash does not match the data (file altered or corrupt)")
    return trace
