"""What an engine records of a run: one row per engine step and the copies of each step.

The step rows and copy rows are buffered in plain lists and turned into frames once at the end (SimPy's
monitoring advice: no per-event objects). The machine's busy intervals are its servers' own logs (sim/machine;
sim/results.py writes them as links.parquet).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

STEP_COLUMNS = (
    "request", "phase", "step", "layer", "start_s", "end_s", "tokens", "lookups", "hits", "inserts",
    "evictions", "direct_loads", "h2d_bytes", "d2d_bytes", "d2h_bytes", "file_read_bytes", "file_blob_reads",
    "lent_slots", "vram_used_bytes", "ram_used_bytes",
)

COPY_COLUMNS = ("step_id", "kind", "count", "bytes_each", "src", "dst")


@dataclass
class Recorder:
    """Buffers per-step rows and copy-plan rows in plain lists; frames are built once at the end."""

    steps: list = field(default_factory=list)
    copies: list = field(default_factory=list)

    def step(self, **row) -> int:
        get = row.get
        self.steps.append(tuple([get(c, 0) for c in STEP_COLUMNS]))
        return len(self.steps) - 1

    def copy(self, step_id: int, kind: str, count: int, bytes_each: int, src: str = "", dst: str = "") -> None:
        """Copies of one step: `count` copies of `bytes_each` bytes from src to dst (slab slot, staging...)."""
        if count:
            self.copies.append((step_id, kind, int(count), int(bytes_each), src, dst))

    def step_frame(self) -> pd.DataFrame:
        return pd.DataFrame.from_records(self.steps, columns=list(STEP_COLUMNS))

    def copy_frame(self) -> pd.DataFrame:
        return pd.DataFrame.from_records(self.copies, columns=list(COPY_COLUMNS))
