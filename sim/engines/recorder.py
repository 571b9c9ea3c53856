"""What an engine records of a run: one row per engine step and the copies of each step.

The step rows and copy rows are buffered in plain lists and turned into frames once at the end (SimPy's
monitoring advice: no per-event objects). The machine's busy intervals are its servers' own logs (sim/machine;
sim/results.py writes them as links.parquet).
"""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

COPY_COLUMNS = ("step_id", "kind", "count", "bytes_each", "src", "dst")
COPY_COUNTS = ("step_id", "count", "bytes_each")  # the integer columns; the others name a link and its ends


@dataclass
class Recorder:
    """Buffers per-step rows and copy-plan rows in plain lists; frames are built once at the end. Without
    `copy_plan` the copy rows are not kept: no figure of a run's summary reads them, only its copy_plan.parquet and
    `expertsim calibrate --replay` (a sweep point asks for the summary alone)."""

    steps: list = field(default_factory=list)
    # the copy rows as COPY_COLUMNS columns: a full ds4 run records ~40K, and a tuple each set off the garbage
    # collector's full scans (sim/machine/servers.py IntervalLog says why that costs)
    copies: tuple = field(default_factory=lambda: tuple([] for _ in COPY_COLUMNS))
    copy_plan: bool = True
    # the rows recorded before, as blocks of COPY_COLUMNS arrays: `copies_of`'s, and `copies`' rows up to them (a
    # slab's decode records ~70K copy rows, in blocks of steps done at once: arrays, not Python objects, until the
    # frame is built)
    copy_blocks: list = field(default_factory=list)

    # The step columns are this signature's parameters (STEP_COLUMNS below): an engine names the columns it sets
    # and the rest are 0; a name that is not a column is Python's TypeError. Keyword binding builds the row: a
    # ds4 layer step's row costs 1.2 us this way against 2.1 us as a merge of dicts (timeit, 2026-12-06).
    def step(self, *, request=0, phase=0, step=0, layer=0, start_s=0, end_s=0, tokens=0, lookups=0, hits=0,
             inserts=0, evictions=0, direct_loads=0, h2d_bytes=0, d2d_bytes=0, d2h_bytes=0, file_read_bytes=0,
             file_blob_reads=0, lent_slots=0, vram_used_bytes=0, ram_used_bytes=0) -> int:
        """A step's row: the columns it names, 0 for the others. Returns its step id."""
        self.steps.append((request, phase, step, layer, start_s, end_s, tokens, lookups, hits, inserts, evictions,
                           direct_loads, h2d_bytes, d2d_bytes, d2h_bytes, file_read_bytes, file_blob_reads,
                           lent_slots, vram_used_bytes, ram_used_bytes))
        return len(self.steps) - 1

    def steps_of(self, n: int, **columns) -> range:
        """n step rows at once (a chain of steps, sim/machine/chains.py): each column named a list of n values or
        one value for every row, 0 for the others, as `step`. Returns their step ids."""
        values = [columns.pop(name, 0) for name in STEP_COLUMNS]
        if columns:
            raise TypeError(f"not step columns: {sorted(columns)}")
        first = len(self.steps)
        self.steps.extend(zip(*(v if isinstance(v, list) else itertools.repeat(v, n) for v in values)))
        return range(first, first + n)

    def copy(self, step_id: int, kind: str, count: int, bytes_each: int, src: str = "", dst: str = "") -> None:
        """Copies of one step: `count` copies of `bytes_each` bytes from src to dst (slab slot, staging...)."""
        if count and self.copy_plan:
            ids, kinds, counts, sizes, sources, destinations = self.copies
            ids.append(step_id)
            kinds.append(kind)
            counts.append(int(count))
            sizes.append(int(bytes_each))
            sources.append(src)
            destinations.append(dst)

    def copies_of(self, step_ids: np.ndarray, kinds: np.ndarray, counts: np.ndarray, sizes: np.ndarray,
                  sources: np.ndarray, destinations: np.ndarray) -> None:
        """Copy rows given as COPY_COLUMNS arrays (int64 counts, object names), each count above 0: `copy`'s rows
        for steps done at once."""
        if self.copy_plan:
            self._seal_copies()
            self.copy_blocks.append((step_ids, kinds, counts, sizes, sources, destinations))

    def _seal_copies(self) -> None:
        """The rows of `copies` as a block, in their place among the blocks."""
        if self.copies[0]:
            self.copy_blocks.append(tuple(np.array(values, np.int64 if name in COPY_COUNTS else object)
                                          for name, values in zip(COPY_COLUMNS, self.copies)))
            for values in self.copies:
                values.clear()

    def step_columns(self) -> dict[str, np.ndarray]:
        """The step rows as STEP_DTYPES columns: each converted to its declared type, not inferred value by value
        (from_records' inference, trying the phase strings as dates, was 6 % of a sweep point)."""
        table = np.array(self.steps, dtype=object).reshape(len(self.steps), len(STEP_COLUMNS))
        return {name: table[:, j].astype(STEP_DTYPES[name]) for j, name in enumerate(STEP_COLUMNS)}

    def step_frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.step_columns())

    def copy_frame(self) -> pd.DataFrame:
        """The copy rows as columns: the counts int64 arrays, the names strings as pandas infers them from lists
        (from_records inferred every column, value by value)."""
        self._seal_copies()
        if not self.copy_blocks:  # no rows: untyped columns, as from_records made them
            return pd.DataFrame(columns=list(COPY_COLUMNS))
        columns = [np.concatenate(blocks) for blocks in zip(*self.copy_blocks)]
        return pd.DataFrame({name: values if name in COPY_COUNTS else values.tolist()
                             for name, values in zip(COPY_COLUMNS, columns)})


STEP_COLUMNS = tuple(inspect.signature(Recorder.step).parameters)[1:]
# Each column's type: the phase a string, the simulated times seconds, every other figure a count (of tokens,
# experts, bytes, slots). An engine gives a count as an integer (tests/test_engine_contract.py checks every engine).
STEP_DTYPES = {name: object if name == "phase" else np.float64 if name.endswith("_s") else np.int64
               for name in STEP_COLUMNS}
