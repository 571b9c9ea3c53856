"""The checks behind sim.trace.importers: vectorised checks on the parsed columns, each error naming the input
line of the first offending record, and the Trace the checked records become."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sim.errors import InputError
from sim.trace.format import MISSING, Trace, TraceHeader
from sim.trace.import_readers import _one_line

INT32_MAX = 2**31 - 1
# A trace may hold at most this many (token, layer) cells per input record, or 2**22 cells in all,
# whichever is more: a corrupt position or layer number would otherwise ask for an absurd allocation.
MAX_CELLS_PER_RECORD = 64
MIN_CELL_ALLOWANCE = 1 << 22


class _Ctx:
    """What import_trace was asked for, and the file it read (its name and SHA-256): what the checks and the
    trace header need."""

    def __init__(self, where, fmt, model, n_experts, n_experts_note, top_k, sha):
        self.where, self.fmt, self.model = where, fmt, model
        self.n_experts, self.n_experts_note, self.top_k, self.sha = n_experts, n_experts_note, top_k, sha


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
    return Trace(header, request, position, phase, experts, full_weights).validate(ctx.where).require_routing(ctx.where)


def _check_layers(c: _Cols, layer: np.ndarray, n_layers: int) -> None:
    """Layer ids number a model's routed layers from 0, so every id up to the largest is recorded somewhere: a
    skipped id (a typo's layer=100000, or ids counted from the first dense layer) would add layers that hold no
    routing, each replayed as all-missing."""
    recorded = np.unique(layer)  # not a bincount: a corrupt id near 2**31 would ask for gigabytes
    if len(recorded) == n_layers:
        return
    first_absent = int(np.argmax(recorded != np.arange(len(recorded))))  # recorded[i] == i up to the first gap
    n_absent = n_layers - len(recorded)
    gap = f"{first_absent}" if n_absent == 1 else f"{n_absent:,} of them, first {first_absent}"
    c.fail(int(np.argmax(layer)), "layer", f"layer ids number the routed layers from 0, but ids below it are "
                                           f"never recorded ({gap}): each id 0..{n_layers - 1} needs a record")


def _check_size(c: _Cols, n_rows: int, n_layers: int, layer: np.ndarray, pos_field: str,
                spread: np.ndarray) -> None:
    """Refuse a trace far sparser than its records: a corrupt position or layer would ask for gigabytes."""
    if n_rows * n_layers <= max(MAX_CELLS_PER_RECORD * c.n, MIN_CELL_ALLOWANCE) and n_rows <= INT32_MAX:
        return
    row, field = (int(np.argmax(layer)), "layer") if n_layers > 1024 else (int(np.argmax(spread)), pos_field)
    c.fail(row, field, f"implies a trace of {n_rows} tokens x {n_layers} layers for only {c.n} records "
                       "(corrupt number?)")
