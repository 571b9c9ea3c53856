"""Shared machinery of the engine models: FIFO links as busy-until timelines, and the step recorder.

A link (SSD, host memcpy, PCIe H2D/D2H, D2D copy engine, GPU compute stream) serves its work in order:
`start = max(ready, free_at)`, `free_at = start + cost`. An engine process books a layer step's work on
the links analytically (`hold` for a fixed time, `serial` for a host thread's chain of copies in bulk) and
then waits once (`yield env.timeout(...)`) for the step's end, so SimPy sees one event per layer step or
chunk rather than one per expert copy, while overlap between links (a copy stream beside compute) still
comes out right.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd


@dataclass
class Link:
    """One FIFO resource with fixed cost per operation + bytes / bandwidth."""

    name: str
    bytes_per_s: float
    op_latency_s: float = 0.0
    free_at: float = 0.0
    busy_s: float = 0.0
    bytes_moved: int = 0
    ops: int = 0

    def cost_s(self, n_bytes: float, n_ops: int = 1) -> float:
        return n_ops * self.op_latency_s + (n_bytes / self.bytes_per_s if self.bytes_per_s else 0.0)

    def charge(self, n_bytes: float, n_ops: int) -> float:
        """Account work done inside a serial chain (see `serial`); returns its cost in seconds."""
        cost = self.cost_s(n_bytes, n_ops)
        self.busy_s += cost
        self.bytes_moved += int(n_bytes)
        self.ops += n_ops
        return cost

    def hold(self, ready_s: float, seconds: float) -> float:
        """Occupy the link for a fixed time (compute, a synchronous call)."""
        start = max(ready_s, self.free_at)
        self.free_at = start + seconds
        self.busy_s += seconds
        return self.free_at

    def summary(self, elapsed_s: float) -> dict:
        return {"link": self.name, "busy_s": self.busy_s, "bytes": self.bytes_moved, "ops": self.ops,
                "utilisation": self.busy_s / elapsed_s if elapsed_s > 0 else 0.0}


def serial(ready_s: float, work: list[tuple[Link, float, int]]) -> float:
    """Work items done strictly one after another by one host thread (each waits for the previous):
    (link, bytes, ops) in bulk; every link ends busy until the chain's end. Returns the end time."""
    start = max([ready_s] + [link.free_at for link, _, _ in work])
    end = start + sum(link.charge(n_bytes, n_ops) for link, n_bytes, n_ops in work)
    for link, _, _ in work:
        link.free_at = end
    return end


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
        self.steps.append(tuple(row.get(c, 0) for c in STEP_COLUMNS))
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
