"""Link lanes: each link's busy time per step, for the timeline figures (sim.explore.report.run_report) and the
Perfetto trace (sim.explore.report.perfetto).

Link lanes are the machine's busy intervals as its resources logged them (links.parquet, sim/machine/). A results
folder written before links.parquet existed has only each step's bytes, start and end, so there a link's busy time
(summary `links`) is apportioned over the steps: byte links by the step's share of the bytes they move (PCIe H2D
and host memcpy by h2d_bytes, D2D by d2d_bytes, D2H by d2h_bytes, file/SSD by file_read_bytes), the others (GPU
compute, host calls, stream syncs) by the step's share of the stepped time. Per lane the totals are exact; the
placement within the run is an estimate.
"""

from __future__ import annotations

import numpy as np
import pandas as pd


def _link_column(name: str) -> str | None:
    """The steps column whose bytes a link moves, or None for a time-only link."""
    low = name.lower()
    if "d2d" in low:
        return "d2d_bytes"
    if "d2h" in low:
        return "d2h_bytes"
    if "h2d" in low or "pcie" in low or "memcpy" in low:
        return "h2d_bytes"
    if "file" in low or "ssd" in low or "disk" in low:
        return "file_read_bytes"
    return None


def link_busy_per_step(steps: pd.DataFrame, summary: dict) -> dict[str, np.ndarray]:
    """Each busy link's busy time apportioned over the steps (seconds per step row); sums to its busy_s."""
    duration = (steps["end_s"] - steps["start_s"]).clip(lower=0).to_numpy(dtype=float)
    lanes: dict[str, np.ndarray] = {}
    for link in summary.get("links", []):
        busy = float(link.get("busy_s") or 0.0)
        if busy <= 0:
            continue
        column = _link_column(str(link["link"]))
        weight = steps[column].to_numpy(dtype=float) if column in steps.columns else duration
        if weight.sum() <= 0:
            weight = duration if duration.sum() > 0 else np.ones(len(steps))
        lanes[str(link["link"])] = busy * weight / weight.sum()
    return lanes


def link_busy_per_group(links: pd.DataFrame, groups: pd.DataFrame) -> dict[str, np.ndarray]:
    """Each link's booked busy time per step group, an interval counted in the group it starts in (the last
    group starting at or before it; the first group for anything earlier), so a lane sums to its busy time."""
    starts = groups["start_s"].to_numpy(float)
    lanes: dict[str, np.ndarray] = {}
    for name, lane in links.groupby("link", sort=False):
        duration = (lane["end_s"] - lane["start_s"]).to_numpy(float)
        if duration.sum() <= 0:
            continue
        at = np.clip(np.searchsorted(starts, lane["start_s"].to_numpy(float), side="right") - 1, 0, len(starts) - 1)
        lanes[str(name)] = np.bincount(at, weights=duration, minlength=len(starts))
    return lanes
