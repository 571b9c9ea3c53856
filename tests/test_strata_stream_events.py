"""The prompt walk's cross-stream events (sim/engines/strata/prompt_stream.stream_events) and what WDDM makes of
them (sim/machine, WDDM_STREAM_EVENT_S): the rules are Niko1221/Strata's src/prefill/prefill.cpp (@ 0165063d,
before the grouped gather; @ 2249c244, with it and the fused walk)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest
import simpy

import sim.machine
from sim.engines.strata.prompt_stream import stream_events
from sim.hardware import load_hardware
from sim.results import link_frame
from sim.scenario import load_scenario
from sim.simulate import run_scenario

SCENARIO = Path(__file__).resolve().parents[1] / "scenarios" / "strata-658-own.toml"


def _layer():
    """40 experts; no token routes to experts 5 and 6; 0-9 and 30-39 are streamed (the rest resident)."""
    routed = np.ones(40, dtype=bool)
    routed[[5, 6]] = False
    streamed = np.zeros(40, dtype=bool)
    streamed[:10] = streamed[30:] = True
    return streamed, routed


def test_unfused_walk_waits_and_records_per_expert():
    # a wait on the copy and a record of the ring entry per routed expert; an entry no token routes to: a record
    streamed, routed = _layer()
    events = stream_events(streamed, routed, fused=False, grouped=False, ring=96)
    assert events.tolist() == [2, 2, 2, 2, 2, 1, 1, 2, 2, 2] + [2] * 10


def test_grouped_gather_waits_and_records_per_mmq_group():
    # routed experts in id order, 16 to an MMQ group: ids 0-4 and 7-17 (group 0), 18-33 (group 1), 34-39 (group 2).
    # A group's one wait and one record sit at its last streamed expert: 9, 33 and 39; experts 5 and 6 are skipped
    # ring entries (a record each)
    streamed, routed = _layer()
    events = stream_events(streamed, routed, fused=False, grouped=True, ring=96)
    expected = np.zeros(20, dtype=int)
    expected[[5, 6]] = 1
    expected[[9, 13, 19]] = 2  # positions of experts 9, 33 and 39 among the streamed ones
    assert events.tolist() == expected.tolist()
    assert events.sum() == 2 * 3 + 2


def test_fused_walk_waits_per_batch_and_records_per_expert():
    # a ring of 12: batches of at most 4 streamed experts, one wait at each batch's last (and the layer's last)
    streamed, routed = _layer()
    events = stream_events(streamed, routed, fused=True, grouped=False, ring=12)
    assert events.tolist() == [1, 1, 1, 2] * 5
    assert stream_events(streamed, routed, fused=True, grouped=False, ring=13).sum() == 20 + 5


@pytest.mark.parametrize(("profile", "seconds"), [("rtx-5090-48gb-windows", 30e-6), ("rtx-4090", 0.0)])
def test_only_wddm_stalls_the_stream_per_event(profile, seconds):
    machine = sim.machine.Machine(simpy.Environment(), load_hardware(profile), np.zeros(1))
    assert machine.stream_events_s(3) == pytest.approx(seconds)


def _prompt(monkeypatch, event_s: float):
    monkeypatch.setattr(sim.machine, "WDDM_STREAM_EVENT_S", event_s)
    data = tomllib.loads(SCENARIO.read_text())
    data["workload"]["requests"] = [{"prompt_tokens": 8192, "decode_tokens": 2, "measured": True}]
    return run_scenario(load_scenario(SCENARIO, data))


def test_every_event_of_the_walk_idles_the_compute_stream(monkeypatch):
    # the #658 fork on v0.1.35 (Windows, unfused, no grouped gather): each streamed expert a step streams costs a
    # wait and a record if a token routes to it, a record if not, so a layer's events are its streamed experts
    # plus its routed ones that missed the cache, counted from the steps the run records
    bubbled, plain = _prompt(monkeypatch, 10e-6), _prompt(monkeypatch, 0.0)
    steps = bubbled.steps[(bubbled.steps["phase"] == "prefill") & (bubbled.steps["layer"] >= 0)]
    events = int((steps["direct_loads"] + steps["lookups"] - steps["hits"]).sum())
    assert events > 10_000

    def compute_busy(result):
        links = link_frame(result.links)
        gpu = links[links["link"] == "GPU compute stream"]
        return (gpu["end_s"] - gpu["start_s"]).sum()

    assert compute_busy(bubbled) - compute_busy(plain) == pytest.approx(events * 10e-6, rel=1e-6)
    state = bubbled.summary["engine_state"]
    assert state["prompt_stream_events"] == events
    assert state["prompt_event_stall_s"] == pytest.approx(events * 10e-6)
    assert bubbled.summary["prefill_tok_s"] < plain.summary["prefill_tok_s"]
