"""Links' busy intervals (sim/engine/timeline.py): a hand-driven example with known intervals, and on whole runs of
both engines (links.parquet against summary.json) intervals that never overlap and sum to each link's totals."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from sim.engine.run import run_scenario, write_results
from sim.engine.timeline import Link, link_frame, serial
from sim.scenario import load_scenario


def test_hand_driven_link_intervals():
    a = Link("a", 100.0, 0.5)  # 100 bytes/s, 0.5 s per op
    b = Link("b", 0.0, 0.25)  # time per op only
    assert a.hold(1.0, 2.0) == 3.0
    assert a.hold(2.0, 1.0) == 4.0  # ready at 2 s but a is busy until 3 s
    # a chain from max(ready 0, a free at 4, b free at 0) = 4: a's share 1 op + 100 B = 1.5 s, then b's 2 ops
    assert serial(0.0, [(a, 100, 1), (b, 0, 2)]) == 6.0
    assert a.free_at == b.free_at == 6.0
    c = Link("c", 0.0)
    # 2 s of work from 0 whose inputs arrive at 10 (Strata's compute stream): busy 8-10, free at 10
    assert c.book(0.0, 2.0, inputs_ready_s=10.0) == (0.0, 10.0)
    assert c.hold(10.0, 0.0, n_bytes=5, n_ops=1) == 10.0  # bytes and ops with no time: a zero-length interval
    c.block_until(12.0)  # waiting, not busy: no interval
    assert a.intervals() == [(1.0, 3.0, 0, 0, "hold"), (3.0, 4.0, 0, 0, "hold"), (4.0, 5.5, 100, 1, "serial")]
    assert b.intervals() == [(5.5, 6.0, 0, 2, "serial")]
    assert c.intervals() == [(8.0, 10.0, 0, 0, "busy"), (10.0, 10.0, 5, 1, "hold")]
    assert (a.busy_s, a.bytes_moved, a.ops) == (4.5, 100, 1) and (c.busy_s, c.bytes_moved, c.ops) == (2.0, 5, 1)
    frame = link_frame([a, b, c])
    assert list(frame.columns) == ["link", "start_s", "end_s", "bytes", "ops", "kind"]
    assert frame["link"].tolist() == ["a"] * 3 + ["b"] + ["c"] * 2
    # work that needs no wait starts where the link is free (after the block) and ends its own time later
    assert c.book(11.0, 1.0) == (12.0, 13.0)
    assert c.intervals()[-1] == (12.0, 13.0, 0, 0, "busy")


@pytest.mark.parametrize("scenario", ["scenarios/ds4-504-per-class.toml", "scenarios/strata-658-borrow.toml"])
def test_run_intervals_match_summary(scenario, tmp_path):
    files = write_results(run_scenario(load_scenario(scenario)), tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    intervals = pd.read_parquet(files["links"])
    assert set(intervals["link"]) <= {link["link"] for link in summary["links"]}
    for link in summary["links"]:
        mine = intervals[intervals["link"] == link["link"]].sort_values(["start_s", "end_s"], kind="stable")
        assert (mine["end_s"] >= mine["start_s"]).all()
        assert (mine["start_s"].to_numpy()[1:] >= mine["end_s"].to_numpy()[:-1] - 1e-12).all()  # no overlap
        assert (mine["end_s"] - mine["start_s"]).sum() == pytest.approx(link["busy_s"], rel=1e-9, abs=1e-12)
        assert mine["bytes"].sum() == link["bytes"] and mine["ops"].sum() == link["ops"]
