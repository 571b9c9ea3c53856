"""Uncertainty (sim/explore/uncertainty.py): which inputs are uncertain, the Latin hypercube, setting figures,
and a propagation whose direction is known."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.errors import InputError
from sim.explore.runner import make_point
from sim.explore.uncertainty import Input, latin_hypercube, propagate, quantiles, rule_for, uncertain_inputs
from sim.hardware import with_values
from sim.hardware import load_hardware
from sim.schema import read_toml
from sim.scenario import load_scenario, scenario_hash

ROOT = Path(__file__).resolve().parents[1]
PER_CLASS = ROOT / "scenarios" / "ds4-504-per-class.toml"


def test_only_estimates_are_uncertain():
    scenario = load_scenario(PER_CLASS)
    found = {i.path for i in uncertain_inputs(scenario)}
    profile = scenario.hardware_profile
    by_path = dict(profile.quantities())
    assert "host.memcpy_gbps" in found and "pcie.h2d_pinned_gbps" in found  # [E] figures
    assert "d2d.copy_gbps" not in found and "gpu.dram_bandwidth_gbps" not in found  # [M] and [S]
    assert not any(p.startswith("compute.qwen3.8") for p in found)  # another model class's table: not read
    assert "ssd.read_gbps_by_queue_depth[*]" in found  # the SSD table as one factor
    for path in found - {"ssd.read_gbps_by_queue_depth[*]"}:
        assert by_path[path].source.startswith("[E"), path


def test_every_estimate_a_run_reads_has_a_range_rule():
    for path in sorted((ROOT / "scenarios" / "hardware").glob("*.toml")):
        for key, q in load_hardware(path).quantities():
            if q.source.startswith("[E") and not key.startswith("ssd.read_gbps"):
                generic = ".".join(["compute", "*", key.split(".")[-1]]) if key.startswith("compute.") else key
                assert rule_for(key) or rule_for(generic) or q.range, f"{path.name}: {key} has no range"


def test_an_explicit_range_wins_and_must_hold_the_value(tmp_path):
    box = tmp_path / "box.toml"
    text = (ROOT / "scenarios" / "hardware" / "rtx-4090.toml").read_text()
    old = next(line for line in text.splitlines() if line.startswith("memcpy_gbps"))
    ranged = old[:-2] + ', range = [10.0, 20.0], range_source = "a stated test range" }'
    box.write_text(text.replace(old, ranged))
    assert load_hardware(box).host.memcpy_gbps.range == [10.0, 20.0]
    box.write_text(text.replace(old, old[:-2] + ', range = [15.0, 20.0] }'))
    with pytest.raises(InputError, match="must hold the value 14.5"):
        load_hardware(box)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 40), k=st.integers(1, 6), seed=st.integers(0, 2**31))
def test_latin_hypercube_puts_one_sample_in_each_stratum(n, k, seed):
    inputs = [Input(f"x{j}", 1.0, float(j), float(j) + 2.0, "test") for j in range(k)]
    values = latin_hypercube(inputs, n, seed)
    assert values.shape == (n, k)
    for j in range(k):
        strata = np.floor((values[:, j] - j) / 2.0 * n).astype(int)
        assert sorted(strata.tolist()) == list(range(n))  # each stratum exactly once
    assert np.array_equal(values, latin_hypercube(inputs, n, seed))  # a seed gives the same samples


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 40), seed=st.integers(0, 2**31))
def test_a_sampled_cpu_never_has_more_cores_than_threads(n, seed):
    """Issue 34: a profile refuses more cores than threads; a generic box's two CPU estimates, each drawn over half
    to twice its value, must still give CPUs that exist, and the sample's profile must load."""
    profile = load_hardware("rtx-4090")  # 16 threads, 8 cores, both estimates
    inputs = [Input("host.hardware_threads", 16, 8, 32, "test"), Input("host.physical_cores", 8, 4, 16, "test")]
    values = latin_hypercube(inputs, n, seed)
    assert (values[:, 1] <= values[:, 0]).all()
    worst = values[np.argmin(values[:, 0] - values[:, 1])]
    with_values(profile, {"host.hardware_threads": worst[0], "host.physical_cores": worst[1]})


def test_with_values_changes_only_the_named_figures():
    profile = load_hardware("rtx-pro-6000-96gb")
    changed = with_values(profile, {"host.memcpy_gbps": 9.0, "ssd.read_gbps_by_queue_depth[*]": 0.5})
    assert changed.host.memcpy_gbps.value == 9.0 and changed.host.memcpy_gbps.source == profile.host.memcpy_gbps.source
    assert [q.value for q in changed.ssd.read_gbps_by_queue_depth] == \
        [q.value * 0.5 for q in profile.ssd.read_gbps_by_queue_depth]
    assert changed.pcie == profile.pcie and changed.path == profile.path


def test_quantiles_known_answer():
    q = quantiles([1.0, 2.0, 3.0, 4.0, 5.0, None])
    assert (q["p10"], q["median"], q["p90"], q["n"]) == (pytest.approx(1.4), 3.0, pytest.approx(4.6), 5)
    assert quantiles([None])["n"] == 0


def test_a_slower_page_cache_copy_slows_a_page_cache_run(tmp_path):
    # the seed's misses come from the page cache at host.memcpy_gbps: its low end must give the slower decode,
    # and the band must hold both ends' direction
    data = read_toml(PER_CLASS)
    data["workload"]["requests"][0].update(prompt_tokens=600, decode_tokens=16)
    scenario = load_scenario(PER_CLASS, data)
    point = make_point(PER_CLASS, data, {}, scenario_hash(scenario))
    result = propagate(point, scenario, 4, metrics=("decode_tok_s",), executor="inline")
    row = next(r for r in result["sensitivity"] if r["input"] == "host.memcpy_gbps")
    assert row["decode_tok_s@low"] < row["decode_tok_s@high"]
    band = result["bands"]["decode_tok_s"]
    assert band["n"] == 4 and band["p10"] <= band["median"] <= band["p90"]
    assert result["failed_samples"] == 0


def test_cli_run_uncertainty_json(tmp_path):
    data = read_toml(PER_CLASS)
    text = PER_CLASS.read_text().replace("prompt_tokens = 5000", "prompt_tokens = 600") \
                                .replace("decode_tokens = 270", "decode_tokens = 8") \
                                .replace('hardware = "rtx-pro-6000-96gb"',
                                         f'hardware = "{ROOT / "scenarios" / "hardware" / "rtx-pro-6000-96gb.toml"}"')
    del data
    path = tmp_path / "short.toml"
    path.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "sim", "run", str(path), "--uncertainty", "2", "--workers", "1",
                           "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    u = json.loads(proc.stdout)["uncertainty"]
    assert u["n"] == 2 and u["bands"]["decode_tok_s"]["n"] == 2 and u["sensitivity"]


def test_with_values_reaches_a_compute_table_whose_key_has_dots():
    profile = load_hardware("rtx-5090-48gb-windows")
    changed = with_values(profile, {"compute.qwen3.8-flash-next.prefill_us_per_token_layer": 4.5})
    assert changed.compute["qwen3.8-flash-next"].prefill_us_per_token_layer.value == 4.5
    assert changed.compute["deepseek-v4-flash"] == profile.compute["deepseek-v4-flash"]


def test_a_record_read_outside_its_key_varies_over_its_spread():
    # Strata's decode layer latency was fitted on other cards' logs (223-400 us over the cards behind it): on the
    # #658 box it is an input, and a longer latency per layer must give a slower decode. The runtime buffers of
    # that box's platform were fitted on one run: no spread, not an input.
    path = ROOT / "scenarios" / "strata-658-borrow.toml"
    data = read_toml(path)
    data["workload"]["requests"] = [{"prompt_tokens": 600, "decode_tokens": 8, "measured": True}]
    scenario = load_scenario(path, data)
    inputs = {i.path: i for i in uncertain_inputs(scenario)}
    latency = inputs["record.strata-decode-layer-latency"]
    assert (latency.value, latency.low, latency.high) == (229.0, 223.0, 400.0)
    assert not any(p.startswith("record.strata-runtime") for p in inputs)
    point = make_point(path, data, {}, scenario_hash(scenario))
    result = propagate(point, scenario, 2, metrics=("decode_tok_s",), executor="inline")
    row = next(r for r in result["sensitivity"] if r["input"] == "record.strata-decode-layer-latency")
    assert row["decode_tok_s@high"] < row["decode_tok_s@low"]
