"""Calibration records (sim/engines/records.py): a figure fitted on one run is flagged in the summary's
out_of_domain whenever a run uses it outside its key (engine, model, hardware, context).

The seeds run with a short request: which records a run reads does not depend on the workload's length.
"""

from __future__ import annotations

import tomllib
from functools import lru_cache
from pathlib import Path

import pytest

from sim.engines.records import RECORDS, Domain, Record
from sim.simulate import run_scenario
from sim.scenario import load_scenario

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"
# Records each seed reads; the fitted figures of its engine and model.
SEED_RECORDS = {
    "ds4-504-per-class": {"ds4-flash-buffers-503", "strata-prefill-5090", "ds4-graph-encode-773"},
    "glm52-mtp-per-class": {"ds4-glm52-buffers-neutronstar", "strata-prefill-5090", "ds4-graph-encode-773"},
    "strata-658-borrow": {"strata-decode-layer-latency", "strata-prefill-5090", "strata-658-h2d", "strata-short-read"},
}
# Strata's runtime buffers: a record per platform, each fitted on boxes that no scenario runs on
STRATA_RUNTIME = {"rtx-5090-48gb-windows": "strata-runtime-windows-cuda", "rtx-4090": "strata-runtime-linux-cuda"}


@lru_cache(maxsize=None)
def short_run(name: str, hardware: str | None = None, flags: tuple = ()):
    data = tomllib.loads((SCENARIOS / f"{name}.toml").read_text())
    data["workload"]["requests"] = [{"prompt_tokens": 600, "decode_tokens": 4, "measured": True}]
    data["engine"].setdefault("flags", {}).update(dict(flags))
    if hardware:
        data["hardware"] = hardware
    return run_scenario(load_scenario(SCENARIOS / f"{name}.toml", data)).summary


def flagged(summary: dict) -> set[str]:
    """The record ids named in a summary's out_of_domain notes."""
    return {r.id for r in RECORDS for note in summary["out_of_domain"] if f"record {r.id}" in note}


def test_strata_seed_on_its_own_box_flags_only_the_figures_of_other_boxes():
    # the warm-up prompt (20 tokens) is read through the decode windows, whose ~16 ms/token comes from a comment
    # that names no box (record strata-short-read); Strata's runtime buffers were fitted on another Windows box's
    # log, its prompt compute on another 5090's, its decode layer latency on an RTX 3060's and 5080's: every run
    # that uses them is told so
    summary = short_run("strata-658-borrow")
    assert flagged(summary) == {"strata-short-read", "strata-runtime-windows-cuda", "strata-prefill-5090",
                                "strata-decode-layer-latency"}
    assert any("hardware rtx-5090-48gb-windows (fitted on not reported)" in n for n in summary["out_of_domain"])


@pytest.mark.parametrize("name", ["ds4-504-per-class", "glm52-mtp-per-class"])
def test_ds4_seeds_flag_the_figures_measured_elsewhere(name):
    # No ds4 prefill timing is published: the profile's ds4 prefill figure is derived from Strata's (#658); the
    # graph encode per token was measured on a GB10 (#773)
    summary = short_run(name)
    assert flagged(summary) == {"strata-prefill-5090", "ds4-graph-encode-773"}
    prefill = next(n for n in summary["out_of_domain"] if "strata-prefill-5090" in n)
    encode = next(n for n in summary["out_of_domain"] if "ds4-graph-encode-773" in n)
    assert "engine ds4 (fitted on strata)" in prefill and "(fitted on dgx-spark-gb10)" in encode


@pytest.mark.parametrize("name", ["ds4-504-per-class", "strata-658-borrow"])  # no other box has GLM-5.2 figures
def test_seeds_on_another_box_flag_every_record_they_read(name):
    summary = short_run(name, "rtx-4090")
    expected = SEED_RECORDS[name] - {"strata-658-h2d"}  # the 4090 profile's PCIe figures are not fitted
    if name.startswith("strata"):
        expected |= {STRATA_RUNTIME["rtx-4090"]}
    assert flagged(summary) == expected
    for note in summary["out_of_domain"]:
        assert "hardware rtx-4090 (fitted on " in note, note


def test_a_profile_figure_fitted_for_one_engine_is_flagged_for_another():
    # the 5090 box's 16 GB/s host -> device rate comes from Strata's runs (record strata-658-h2d): ds4 on that
    # box reads it too, and is told so
    summary = short_run("ds4-504-per-class", "rtx-5090-48gb-windows")
    assert "strata-658-h2d" in flagged(summary)
    note = next(n for n in summary["out_of_domain"] if "record strata-658-h2d" in n)
    assert note.startswith("pcie.h2d_pinned_gbps = 16 GB/s") and "engine ds4 (fitted on strata)" in note


def test_a_context_outside_the_key_is_flagged():
    summary = short_run("ds4-504-per-class", flags=(("ctx", 65536),))
    notes = [n for n in summary["out_of_domain"] if "record ds4-flash-buffers-503" in n]
    assert len(notes) == 1 and "context 65536 (fitted at 32768)" in notes[0]


def test_key_differences_name_each_part_that_differs():
    r = Record("x", "figure", 1.0, "GiB", "ds4", "deepseek-v4-flash", "box-a", 32768, "case", "how")
    assert r.key_differences("ds4", "deepseek-v4-flash-q2-q4", "box-a", 32768) == []  # the model is a prefix
    assert r.key_differences("ds4", "deepseek-v4-flash-q2", "box-a", None) == []  # no context: not compared
    assert r.key_differences("strata", "glm-5.2", "box-b", 4096) == [
        "engine strata (fitted on ds4)", "model glm-5.2 (fitted on deepseek-v4-flash)",
        "hardware box-b (fitted on box-a)", "context 4096 (fitted at 32768)"]


def test_domain_notes_each_use_once_in_record_order():
    domain = Domain("ds4", "glm-5.2", "rtx-4090", 4096)
    for _ in range(3):
        domain.use("ds4-glm52-buffers-neutronstar")
        domain.use("ds4-flash-buffers-503")
    notes = domain.out_of_domain()
    assert len(notes) == 2
    assert "record ds4-flash-buffers-503" in notes[0] and "record ds4-glm52-buffers-neutronstar" in notes[1]


@pytest.mark.parametrize("name", ["ds4-504-per-class", "strata-658-borrow"])
def test_records_read_names_the_engine_records_a_run_reads(name):
    # the engine's own list (what gives out-of-domain records their spread) against what a run on another box
    # flags, less the records that reach the run through hardware-profile figures
    from sim.engines import engine_of

    path = SCENARIOS / f"{name}.toml"
    on_4090 = load_scenario(path, {**tomllib.loads(path.read_text()), "hardware": "rtx-4090"})
    through_profile = {q.record for _, q in on_4090.hardware_profile.quantities() if getattr(q, "record", None)}
    read = set(engine_of(on_4090).records_read(on_4090))
    assert read == flagged(short_run(name, "rtx-4090")) - through_profile


def test_a_domain_value_stands_in_for_the_record():
    plain = Domain("strata", "qwen3.8-flash-next-iq3s", "rtx-4090", None)
    sampled = Domain("strata", "qwen3.8-flash-next-iq3s", "rtx-4090", None, {"strata-decode-layer-latency": 400.0})
    assert plain.use("strata-decode-layer-latency").value == 229.0
    assert sampled.use("strata-decode-layer-latency").value == 400.0
    assert plain.use("strata-short-read").value == sampled.use("strata-short-read").value == 16.0  # not sampled
    assert sampled.out_of_domain() == plain.out_of_domain()  # the note names the record's own figure


def test_metal_round_trip_is_437s_streaming_cost_over_its_resident_token():
    # antirez/ds4#437 (M4 Max 128 GiB, q2 Flash, cafc134; tkhr-sait/ds4 ssd-streaming-memo §2a, §6b): resident
    # 22.80 tok/s, streaming with every expert cached (b80) 19.37 and with 88 % of them (b64) 20.27. In the model's
    # terms the resident token is the 10.2 ms encode (record ds4-graph-encode-773) and the GPU's work in turn; a
    # streaming layer picked by its router adds the round trip and hides its shared expert behind the host. The
    # shared expert's share of a token's bytes, by hand: Q8_0 gate, up and down of 4,096 x 2,048 at 34 B per 32
    # weights, in each of 43 layers, against the 8.20 GiB of non-routed weights less the F16 embedding (129,280 x
    # 4,096 x 2 B) plus 6 routed experts of 7,077,888 B a layer
    shared = 3 * 4096 * 2048 * 34 // 32
    token_bytes = 8.20 * 2**30 - 129_280 * 4096 * 2 + 43 * 6 * 7_077_888
    resident_ms = 1000 / 22.80
    shared_ms = shared / token_bytes * (resident_ms - 10.2)  # one layer's, of the GPU's share of the token
    trips_us = [((1000 / rate - resident_ms) / 40 + shared_ms) * 1000 for rate in (20.27, 19.37)]
    r = next(r for r in RECORDS if r.id == "ds4-metal-round-trip-437")
    assert r.case is None and r.engine == "ds4" and r.unit == "us"
    assert r.spread == pytest.approx(trips_us, abs=0.1)
    assert r.value == pytest.approx(sum(trips_us) / 2, abs=0.1)
