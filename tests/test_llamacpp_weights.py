"""sim/engines/llamacpp/weights.py: the prompt figure derived for a file a hardware profile has no compute table for,
checked against the profiles' own hand derivations (written beside their tables, in their derivation strings), and
the loader and scenario init that use it."""

import re
from pathlib import Path

import pytest

from sim.engines import ENGINES
from sim.engines.llamacpp.weights import derived_compute
from sim.errors import InputError
from sim.hardware import load_hardware
from sim.model.presets import PRESETS
from sim.scenario import load_scenario
from tests.test_scenario_init import SHORT, expertsim, strict_json

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("hardware, table, model", [
    ("rtx-2080-10900x", "qwen3-30b-a3b", "qwen3-30b-a3b-q4_k_m"),  # "49.32 us x 62.5 / 302 = 10.21 us"
    ("rtx-3060-12gb", "glm-4.7-flash", "glm-4.7-flash"),  # "77.54 us x 64 / 302 = 16.43 us"
])
def test_the_derived_figure_is_the_profiles_own_hand_derivation(hardware, table, model):
    """Where a profile's table was derived by hand from its DeepSeek-V4-Flash figure by active parameters, the
    engine's derivation without that table gives the same figure: the hand one rounds V4-Flash's 302.3 M to 302 and
    the model's active parameters to whole millions, so they agree within half a percent."""
    profile = load_hardware(hardware)
    hand = profile.compute[table].prefill_us_per_token_layer
    assert re.search(r"x [\d.]+ / 302 = ", hand.derivation), hand.derivation  # the hand rule, not a measurement
    without = profile.model_copy(update={"compute": {k: v for k, v in profile.compute.items() if k != table}})
    derived = derived_compute(PRESETS[model], without).prefill_us_per_token_layer
    assert derived.value == pytest.approx(hand.value, rel=0.005)
    assert derived.record == profile.compute["deepseek-v4-flash"].prefill_us_per_token_layer.record
    assert derived.source.startswith("[E] derived by expertsim") and model in derived.source


def test_no_figure_is_derived_without_the_files_active_parameters_or_the_reference_table():
    profile = load_hardware("rtx-4090")
    assert derived_compute(PRESETS["deepseek-v2-lite-q4_k_m"], profile) is None  # its active parameters: not held
    bare = profile.model_copy(update={"compute": {}})
    assert derived_compute(PRESETS["qwen3-30b-a3b-q4_k_m"], bare) is None
    assert ENGINES["ds4"].derived_compute(PRESETS["qwen3-30b-a3b-q4_k_m"], profile) is None  # the spec's default


def _llamacpp_scenario(tmp_path, extra: str = "") -> Path:
    path = tmp_path / "q.toml"
    path.write_text(f'hardware = "rtx-4090"\nmodel = "qwen3-30b-a3b-q4_k_m"\n{extra}\n'
                    '[engine]\nname = "llama.cpp"\n[trace]\ngenerator = "qwen3-30b-a3b-q4_k_m"\nseed = 0\n'
                    '[[workload.requests]]\nprompt_tokens = 64\ndecode_tokens = 8\n')
    return path


def test_a_scenario_on_a_profile_without_the_models_table_runs_on_the_derived_figure(tmp_path):
    """rtx-4090.toml has no table for Qwen3-30B-A3B: its V4-Flash figure (12.02 us) x 62.5 M / 302.3 M. An
    uncertainty sample may set that figure like any other; a model_class the profile lacks is still refused."""
    path = _llamacpp_scenario(tmp_path)
    scenario = load_scenario(path)
    assert scenario.compute_key == "qwen3-30b-a3b-q4_k_m"
    assert scenario.compute.prefill_us_per_token_layer.value == pytest.approx(12.02 * 62.5 / (13e3 / 43))
    sampled = load_scenario(path, profile_values={"compute.qwen3-30b-a3b-q4_k_m.prefill_us_per_token_layer": 3.0})
    assert sampled.compute.prefill_us_per_token_layer.value == 3.0
    with pytest.raises(InputError, match="model_class = qwen3-30b-a3b: hardware profile rtx-4090 has no compute"):
        load_scenario(_llamacpp_scenario(tmp_path, 'model_class = "qwen3-30b-a3b"'))


def test_scenario_init_starts_llama_cpp_on_the_derived_figure_and_says_so(tmp_path):
    """Before, init refused llama.cpp for a file the profile had no table for (209 of 243 file x profile pairs) and
    the automatic choice fell back to a cache-only replay."""
    written = strict_json(expertsim("scenario", "init", "--model", "qwen3-30b-a3b-q4_k_m", "--hardware", "rtx-4090",
                                    *SHORT, "-o", "q.toml", "--json", cwd=tmp_path).stdout)
    assert written["engine"] == "llama.cpp" and "12.02 us x 62.5 M / 302.3 M" in written["compute_derived"]
    assert "Compute: [E] derived by expertsim" in (tmp_path / "q.toml").read_text()
    summary = strict_json(expertsim("run", "q.toml", "--json", cwd=tmp_path).stdout)
    assert summary["prefill_tok_s"] > 0 and summary["decode_tok_s"] > 0
