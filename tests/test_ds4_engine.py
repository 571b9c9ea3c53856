"""The ds4 engine model against PR #504's measurements (seeds/ds4-504-per-size-class-expert-caches.txt).

Measured: before #504 ~0.9 tok/s and the cache never warms; after it ~25 tok/s sustained decode at 97 %
hit rate (RTX PRO 6000 96 GB, Flash q2-q4 GGUF from the page cache, budget 9472, reserve 12 GiB).
Targets: each tok/s within +-35 %, per-class/slab decode ratio >= 10, hit rate 0.90-0.99.
A target the model does not meet yet is an xfail(strict) test that states the simulated figure: it turns
into a failure the day the model meets it, so the bands and docs/validation.md get updated.
"""

import json
from pathlib import Path

import pandas as pd
import pytest

from sim.engine.run import run_scenario, write_results
from sim.scenario import load_scenario

SCENARIOS = Path(__file__).resolve().parents[1] / "scenarios"
MEASURED_PER_CLASS_TOK_S = 25.0  # PR #504: "~25 t/s sustained decode"
MEASURED_SLAB_TOK_S = 0.9  # PR #504: "not finishing within 400s (~0.9 t/s)"
TOK_S_TOLERANCE = 0.35


@pytest.fixture(scope="module")
def per_class():
    return run_scenario(load_scenario(SCENARIOS / "ds4-504-per-class.toml"))


@pytest.fixture(scope="module")
def slab():
    return run_scenario(load_scenario(SCENARIOS / "ds4-504-slab.toml"))


def relative_error(simulated: float, measured: float) -> float:
    return (simulated - measured) / measured


def test_per_class_decode_tok_s_within_35_percent(per_class):
    error = relative_error(per_class.summary["decode_tok_s"], MEASURED_PER_CLASS_TOK_S)
    assert abs(error) <= TOK_S_TOLERANCE, f"simulated {per_class.summary['decode_tok_s']:.1f} tok/s, error {error:+.0%}"


def test_per_class_decode_hit_rate_in_band(per_class):
    assert 0.90 <= per_class.summary["decode_hit_rate"] <= 0.99  # measured 97 %


def test_slab_never_warms(slab):
    # "the cache never warms": every decode lookup misses, because every q2<->q4 transition releases it
    assert slab.summary["decode_hit_rate"] == 0.0
    # and the cap notice repeats at every transition (the "permanent cap-notice flood" of #503)
    assert len(slab.summary["engine_state"]["notices"]) >= slab.timings["decode_tokens"].sum()


@pytest.mark.xfail(strict=True, reason="simulated ~3.9 tok/s vs measured ~0.9 (+330 %): the model lacks the "
                   "cost that makes each slab rebuild take ~1 s; see docs/validation.md")
def test_slab_decode_tok_s_within_35_percent(slab):
    error = relative_error(slab.summary["decode_tok_s"], MEASURED_SLAB_TOK_S)
    assert abs(error) <= TOK_S_TOLERANCE, f"simulated {slab.summary['decode_tok_s']:.2f} tok/s, error {error:+.0%}"


@pytest.mark.xfail(strict=True, reason="simulated ratio ~7.9 (target >= 10) follows from the slab figure above")
def test_per_class_over_slab_decode_ratio_at_least_10(per_class, slab):
    assert per_class.summary["decode_tok_s"] / slab.summary["decode_tok_s"] >= 10


def test_q2_class_holds_every_q2_expert_and_q4_gets_the_leftover(per_class):
    caps = per_class.summary["engine_state"]["cache_slots_per_class"]
    assert caps[0] == 9472 == 37 * 256  # ds4-engine.md §1.12: the budget is exactly all q2 experts
    # §1.12 estimates ~285 q4 slots with a 3.375 GiB q4 prefill staging buffer, ~534 with decode-sized
    # staging; the simulated staging is the largest chunk union actually routed (below 256 experts)
    assert 285 <= caps[1] <= 534


def test_runs_are_deterministic(per_class):
    again = run_scenario(load_scenario(SCENARIOS / "ds4-504-per-class.toml"))
    assert again.summary == per_class.summary
    pd.testing.assert_frame_equal(again.steps, per_class.steps)


def test_results_are_written_with_provenance(per_class, tmp_path):
    files = write_results(per_class, tmp_path)
    summary = json.loads(Path(files["summary"]).read_text())
    for key in ("cache_slots", "cache_mib", "lent_slots", "prefill_buffer_mib", "file_blob_reads",
                "prefill_tok_s", "decode_tok_s", "decode_hit_rate", "ttft_s"):
        assert key in summary
    provenance = summary["provenance"]
    assert len(provenance["scenario_sha256"]) == 64 and len(provenance["trace_sha256"]) == 64
    assert provenance["expertsim"]
    steps = pd.read_parquet(files["steps"])
    copies = pd.read_parquet(files["copy_plan"])
    assert set(copies["kind"]) <= {"H2D", "D2D", "D2H"}
    # every decode hit is three D2D part copies in the plan
    decode_steps = steps.index[steps["phase"] == "decode"]
    d2d = copies[copies["step_id"].isin(decode_steps) & (copies["kind"] == "D2D")]["count"].sum()
    decode = steps.loc[decode_steps]
    assert d2d == 3 * (decode["hits"] + decode["inserts"] + decode["evictions"]).sum()


def test_belady_bound_is_above_the_simulated_decode_hit_rate(per_class, slab):
    s = per_class.summary
    assert s["decode_hit_rate"] <= s["belady_decode_hit_rate"] <= 1.0
    assert s["belady_gap"] == pytest.approx(s["belady_decode_hit_rate"] - s["decode_hit_rate"])
    assert slab.summary["belady_decode_hit_rate"] is None  # no fixed slot count to bound


def test_gpu_idle_time_is_what_compute_does_not_cover(per_class):
    compute = next(link for link in per_class.summary["links"] if link["link"] == "GPU compute")
    assert per_class.summary["gpu_idle_s"] == pytest.approx(per_class.summary["simulated_s"] - compute["busy_s"])


def test_unmodelled_variant_is_refused_not_approximated(tmp_path):
    from sim.errors import InputError

    text = (SCENARIOS / "ds4-504-per-class.toml").read_text().replace('variant = "pr504"', 'variant = "pr1082"')
    path = tmp_path / "scenarios" / "x.toml"
    path.parent.mkdir()
    path.write_text(text)
    (tmp_path / "scenarios" / "hardware").symlink_to(SCENARIOS / "hardware")
    with pytest.raises(InputError, match="pr1082"):
        run_scenario(load_scenario(path))
