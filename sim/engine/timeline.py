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
    - "busy": busy time an engine adds to `busy_s` itself (Strata's compute stream, which may end later than its
      busy time because it waits for its inputs): placed to end where the engine next sets `free_at`.
    Bytes and ops an engine adds to `bytes_moved` / `ops` after a booking belong to the latest interval.
    So the intervals of a link never overlap and sum to its busy_s, bytes_moved and ops.
    """

    __slots__ = ("name", "bytes_per_s", "op_latency_s", "_free_at", "_busy_s", "_bytes", "_ops", "_pending_s",
                 "log")

    def __init__(self, name: str, bytes_per_s: float, op_latency_s: float = 0.0):
        self.name, self.bytes_per_s, self.op_latency_s = name, bytes_per_s, op_latency_s
        self._free_at = self._busy_s = self._pending_s = 0.0
        self._bytes = self._ops = 0
        self.log: list[tuple[float, float, int, int, str]] = []

    # free_at, busy_s, bytes_moved and ops are properties so that an engine that books work by assigning them
    # (strata.py) still leaves an exact interval log; the booking methods below bypass them.
    @property
    def free_at(self) -> float:
        return self._free_at

    @free_at.setter
    def free_at(self, value: float) -> None:
        if self._pending_s:
            self.log.append((value - self._pending_s, value, 0, 0, "busy"))
            self._pending_s = 0.0
        self._free_at = value

    @property
    def busy_s(self) -> float:
        return self._busy_s

    @busy_s.setter
    def busy_s(self, value: float) -> None:
        self._pending_s += value - self._busy_s
        self._busy_s = value

    @property
    def bytes_moved(self) -> int:
        return self._bytes

    @bytes_moved.setter
    def bytes_moved(self, value: int) -> None:
        self._attribute(value - self._bytes, 0)
        self._bytes = value

    @property
    def ops(self) -> int:
        return self._ops

    @ops.setter
    def ops(self, value: int) -> None:
        self._attribute(0, value - self._ops)
        self._ops = value

    def _attribute(self, n_bytes: int, n_ops: int) -> None:
        if not self.log:  # nothing booked yet: bytes without time, a zero-length interval
            self.log.append((self._free_at, self._free_at, 0, 0, "busy"))
        start, end, b, o, kind = self.log[-1]
        self.log[-1] = (start, end, b + n_bytes, o + n_ops, kind)

    def cost_s(self, n_bytes: float, n_ops: int = 1) -> float:
        return n_ops * self.op_latency_s + (n_bytes / self.bytes_per_s if self.bytes_per_s else 0.0)

    def charge(self, start_s: float, n_bytes: float, n_ops: int) -> float:
        """Account work done inside a serial chain from start_s (see `serial`); returns where it ends."""
        end = start_s + self.cost_s(n_bytes, n_ops)
        self._busy_s += end - start_s
        self._bytes += int(n_bytes)
        self._ops += n_ops
        self.log.append((start_s, end, int(n_bytes), n_ops, "serial"))
        return end

    def hold(self, ready_s: float, seconds: float) -> float:
        """Occupy the link for a fixed time (compute, a synchronous call)."""
        start = ready_s if ready_s > self._free_at else self._free_at
        self._free_at = start + seconds
        self._busy_s += seconds
        self.log.append((start, self._free_at, 0, 0, "hold"))
        return self._free_at

    def intervals(self) -> list[tuple[float, float, int, int, str]]:
        """The busy intervals in booking order; busy time added with no later `free_at` ends at free_at."""
        if self._pending_s:
            return [*self.log, (self._free_at - self._pending_s, self._free_at, 0, 0, "busy")]
        return list(self.log)

    def summary(self, elapsed_s: float) -> dict:
        return {"link": self.name, "busy_s": self.busy_s, "bytes": self.bytes_moved, "ops": self.ops,
                "utilisation": self.busy_s / elapsed_s if elapsed_s > 0 else 0.0}


def serial(ready_s: float, work: list[tuple[Link, float, int]]) -> float:
    """Work items done strictly one after another by one host thread (each waits for the previous):
    (link, bytes, ops) in bulk; every link ends busy until the chain's end. Returns the end time."""
    t = max([ready_s] + [link._free_at for link, _, _ in work])
    for link, n_bytes, n_ops in work:
        t = link.charge(t, n_bytes, n_ops)
    for link, _, _ in work:
        link._free_at = t
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
