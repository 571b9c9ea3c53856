"""What a run records: one row per engine step, the copies of each step, and the machine's busy intervals.

The step rows and copy rows are buffered in plain lists and turned into frames once at the end (SimPy's
monitoring advice: no per-event objects). The busy intervals come from the machine's servers
(sim/machine): one row per job, per server (`link_frame`, links.parquet).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd


LINK_COLUMNS = ("link", "start_s", "end_s", "bytes", "ops", "kind")


def link_frame(links) -> pd.DataFrame:
    """One row per busy interval of each server (LINK_COLUMNS), in the given order: links.parquet. Built column
    by column per server: a row tuple per interval held a million-token prompt's intervals twice over."""
    parts = [pd.DataFrame({"link": link.name, **dict(zip(LINK_COLUMNS[1:], zip(*intervals)))})
             for link in links if (intervals := link.intervals())]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=list(LINK_COLUMNS))


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


def safe_rate(numerator: float, seconds: float) -> float:
    return float(numerator / seconds) if seconds > 0 else float("nan")


def hit_rate(frame: pd.DataFrame) -> float:
    lookups = frame["lookups"].sum()
    return float(frame["hits"].sum() / lookups) if lookups else float("nan")
