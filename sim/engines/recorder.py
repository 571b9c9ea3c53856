"""What an engine records of a run: one row per engine step and the copies of each step.

The step rows and copy rows are buffered in plain lists and turned into frames once at the end (SimPy's
monitoring advice: no per-event objects). The machine's busy intervals are its servers' own logs (sim/machine;
sim/results.py writes them as links.parquet).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

STEP_COLUMNS = (
    "request", "phase", "step", "layer", "start_s", "end_s", "tokens", "lookups", "hits", "inserts",
    "evictions", "direct_loads", "h2d_bytes", "d2d_bytes", "d2h_bytes", "file_read_bytes", "file_blob_reads",
    "lent_slots", "vram_used_bytes", "ram_used_bytes",
)

_EMPTY_STEP = dict.fromkeys(STEP_COLUMNS, 0)
# Each column's type: the phase a string, the simulated times seconds, every other figure a count (of tokens,
# experts, bytes, slots). An engine gives a count as an integer (tests/test_engine_contract.py checks every engine).
STEP_DTYPES = {name: object if name == "phase" else np.float64 if name.endswith("_s") else np.int64
               for name in STEP_COLUMNS}

COPY_COLUMNS = ("step_id", "kind", "count", "bytes_each", "src", "dst")


@dataclass
class Recorder:
    """Buffers per-step rows and copy-plan rows in plain lists; frames are built once at the end. Without
    `copy_plan` the copy rows are not kept: no figure of a run's summary reads them, only its copy_plan.parquet and
    `expertsim calibrate --replay` (a sweep point asks for the summary alone)."""

    steps: list = field(default_factory=list)
    copies: list = field(default_factory=list)
    copy_plan: bool = True

    def step(self, **row) -> int:
        """A step's row: the columns it names, 0 for the others (a name outside STEP_COLUMNS is an error)."""
        values = {**_EMPTY_STEP, **row}
        if len(values) != len(STEP_COLUMNS):
            raise ValueError(f"not step columns: {sorted(set(row) - set(STEP_COLUMNS))}")
        self.steps.append(tuple(values.values()))  # in STEP_COLUMNS order: the keys keep their first position
        return len(self.steps) - 1

    def copy(self, step_id: int, kind: str, count: int, bytes_each: int, src: str = "", dst: str = "") -> None:
        """Copies of one step: `count` copies of `bytes_each` bytes from src to dst (slab slot, staging...)."""
        if count and self.copy_plan:
            self.copies.append((step_id, kind, int(count), int(bytes_each), src, dst))

    def step_columns(self) -> dict[str, np.ndarray]:
        """The step rows as STEP_DTYPES columns: each converted to its declared type, not inferred value by value
        (from_records' inference, trying the phase strings as dates, was 6 % of a sweep point)."""
        table = np.array(self.steps, dtype=object).reshape(len(self.steps), len(STEP_COLUMNS))
        return {name: table[:, j].astype(STEP_DTYPES[name]) for j, name in enumerate(STEP_COLUMNS)}

    def step_frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.step_columns())

    def copy_frame(self) -> pd.DataFrame:
        return pd.DataFrame.from_records(self.copies, columns=list(COPY_COLUMNS))
