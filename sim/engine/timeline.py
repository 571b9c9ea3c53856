"""Shared machinery of the engine models: FIFO links as busy-until timelines, and the step recorder.

A link (SSD, host memcpy, PCIe H2D/D2H, D2D copy engine, GPU compute stream) serves its work in order:
`start = max(ready, free_at)`, `free_at = start + cost`. An engine process books a layer step's work on
the links analytically (`hold` for a fixed time, `serial` for a host thread's chain of copies in bulk) and
then waits once (`yield env.timeout(...)`) for the step's end, so SimPy sees one event per layer step or
chunk rather than one per expert copy, while overlap between links (a copy stream beside compute) still
comes out right. Each link also logs one busy interval per booking (`Link.intervals`, links.parquet).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd


LINK_COLUMNS = ("link", "start_s", "end_s", "bytes", "ops", "kind")


class Link:
    """One FIFO resource with fixed cost per operation + bytes / bandwidth, and a log of its busy intervals.

    Each booking appends one interval (start_s, end_s, bytes, ops, kind), never one per expert:
    - "hold": `hold` occupies the link for a fixed time from max(ready, free_at);
    - "serial": the link's share of a `serial` chain, placed in chain order from the chain's start (the chain's
      real per-part interleaving of links is not kept, only each link's total inside the chain);
    - "busy": `book`, work that cannot end before its inputs arrive (Strata's compute stream): its busy time is
      placed to end where the link becomes free.
    `block_until` makes the link wait without being busy. So the intervals of a link never overlap and sum to its
    busy_s, bytes_moved and ops.
    """

    __slots__ = ("name", "bytes_per_s", "op_latency_s", "free_at", "busy_s", "bytes_moved", "ops", "log")

    def __init__(self, name: str, bytes_per_s: float, op_latency_s: float = 0.0):
        self.name, self.bytes_per_s, self.op_latency_s = name, bytes_per_s, op_latency_s
        self.free_at = self.busy_s = 0.0
        self.bytes_moved = self.ops = 0
        self.log: list[tuple[float, float, int, int, str]] = []

    def _book(self, end_s: float, busy_s: float, n_bytes: float, n_ops: int, kind: str) -> None:
        """busy_s of work ending at end_s (after any wait for inputs), with its bytes and operations."""
        self.busy_s += busy_s
        self.bytes_moved += int(n_bytes)
        self.ops += n_ops
        self.log.append((end_s - busy_s, end_s, int(n_bytes), n_ops, kind))

    def cost_s(self, n_bytes: float, n_ops: int = 1) -> float:
        return n_ops * self.op_latency_s + (n_bytes / self.bytes_per_s if self.bytes_per_s else 0.0)

    def charge(self, start_s: float, n_bytes: float, n_ops: int) -> float:
        """Account work done inside a serial chain from start_s (see `serial`); returns where it ends."""
        end = start_s + self.cost_s(n_bytes, n_ops)
        self._book(end, end - start_s, n_bytes, n_ops, "serial")
        return end

    def hold(self, ready_s: float, seconds: float, n_bytes: float = 0, n_ops: int = 0) -> float:
        """Occupy the link for a fixed time (compute, a synchronous call, a copy timed by its caller)."""
        start = ready_s if ready_s > self.free_at else self.free_at
        self.free_at = start + seconds
        self._book(self.free_at, seconds, n_bytes, n_ops, "hold")
        return self.free_at

    def book(self, ready_s: float, seconds: float, inputs_ready_s: float = 0.0) -> tuple[float, float]:
        """`seconds` of work from max(ready, free_at) that cannot end before inputs_ready_s; returns (start, end)."""
        start = max(ready_s, self.free_at)
        self.free_at = max(start + seconds, inputs_ready_s)
        self._book(self.free_at, seconds, 0, 0, "busy")
        return start, self.free_at

    def block_until(self, t_s: float) -> None:
        """The link waits (not busy) until t_s: a stream held back by a copy it depends on."""
        self.free_at = max(self.free_at, t_s)

    def intervals(self) -> list[tuple[float, float, int, int, str]]:
        """The busy intervals in booking order."""
        return list(self.log)

    def summary(self, elapsed_s: float) -> dict:
        return {"link": self.name, "busy_s": self.busy_s, "bytes": self.bytes_moved, "ops": self.ops,
                "utilisation": self.busy_s / elapsed_s if elapsed_s > 0 else 0.0}


def serial(ready_s: float, work: list[tuple[Link, float, int]]) -> float:
    """Work items done strictly one after another by one host thread (each waits for the previous):
    (link, bytes, ops) in bulk; every link ends busy until the chain's end. Returns the end time."""
    t = max([ready_s] + [link.free_at for link, _, _ in work])
    for link, n_bytes, n_ops in work:
        t = link.charge(t, n_bytes, n_ops)
    for link, _, _ in work:
        link.free_at = t
    return t


def link_frame(links) -> pd.DataFrame:
    """One row per busy interval of each link (LINK_COLUMNS), links in the given order: links.parquet."""
    rows = [(link.name, *interval) for link in links for interval in link.intervals()]
    return pd.DataFrame.from_records(rows, columns=list(LINK_COLUMNS))


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
