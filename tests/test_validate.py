"""Validation cases (sim/explore/validate.py, scenarios/validation/): the schema, the comparison policy, the roles,
and a regression check against the last recorded run (docs/figures/validation-cases.json)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sim.engines.records import RECORDS
from sim.errors import InputError
from sim.explore.validate import (CASES_DIR, EFFECT_FLOOR, EFFECT_SHARE, TOLERANCE, Measured, band_reason, compare,
                                  judge_effect, load_case, load_cases)

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "docs" / "figures" / "validation-cases.json"
GOOD = '''id = "x"
title = "a test case"
source = "a test"
base = "{base}"

[[arms]]
name = "a"

[[arms]]
name = "b"
set = {{ "engine.flags.prefill-chunk" = 512 }}

[[measured]]
metric = "decode_tok_s"
kind = "ratio"
arms = ["a", "b"]
value = 1.0
source = "a test figure"
'''


def _write(tmp_path, text, name="x.toml") -> Path:
    path = tmp_path / name
    path.write_text(text.format(base=ROOT / "scenarios" / "ds4-504-per-class.toml"))
    return path


def test_a_good_case_loads(tmp_path):
    case = load_case(_write(tmp_path, GOOD))
    assert [a.name for a in case.arms] == ["a", "b"] and case.role == "prediction"


@pytest.mark.parametrize("old, new, key, why", [
    ('metric = "decode_tok_s"', 'metric = "tok_s"', "measured[0].metric", "decode_tok_s"),
    ('arms = ["a", "b"]', 'arms = ["a"]', "measured[0]", "ratio names two arms"),
    ('arms = ["a", "b"]', 'arms = ["a", "c"]', "(top level)", "unknown arms ['c']"),
    ("value = 1.0", "range = [2.0, 1.0]", "measured[0]", "LOW <= HIGH"),
    ("value = 1.0", "value = 1.0\nrange = [1.0, 2.0]", "measured[0]", "one of them"),
    ('name = "b"', 'name = "a"', "arms", "unique"),
    ('id = "x"', 'id = "y"', "id", "the file's name"),
    ('kind = "ratio"\narms = ["a", "b"]', 'kind = "percent"\narms = ["a"]', "measured[0]", "a hit rate"),
])
def test_a_bad_case_is_one_line_naming_the_file_and_key(tmp_path, old, new, key, why):
    path = _write(tmp_path, GOOD.replace(old, new, 1))
    with pytest.raises(InputError) as info:
        load_case(path)
    text = str(info.value)
    assert text.startswith(str(path)) and "\n" not in text and why in text, text
    assert key in text or key == "(top level)", text


def test_a_case_not_expressible_has_no_arms(tmp_path):
    path = _write(tmp_path, 'id = "x"\ntitle = "a test case"\nsource = "a test"\nnot_expressible = "no model"\n')
    assert load_case(path).not_expressible == "no model"
    with pytest.raises(InputError, match="no scenario, arms or measured"):
        load_case(_write(tmp_path, GOOD.replace('source = "a test"\n', 'source = "a test"\nnot_expressible = "x"\n', 1)))


def _measured(**kw) -> Measured:
    base = {"metric": "decode_tok_s", "kind": "ratio", "arms": ["a", "b"], "value": 2.0, "source": "a test figure"}
    return Measured.model_validate({**base, **kw})


def _rows(a, b, metric="decode_tok_s"):
    return {"a": {metric: a, "error": None}, "b": {metric: b, "error": None}}


def test_compare_known_answers():
    r = compare(_measured(), _rows(3.0, 1.0))  # effect +200 % against +100 %: 100 points off, a third is 33
    assert r["predicted"] == 3.0 and r["predicted_effect"] == pytest.approx(2.0)
    assert r["error"] == pytest.approx(1.0) and r["tolerance"] == pytest.approx(1 / 3) and r["within"] is False
    r = compare(_measured(value=None, range=[2.5, 3.5]), _rows(3.0, 1.0))  # inside the range: no error
    assert r["error"] == 0.0 and r["within"] is True
    r = compare(_measured(value=None, range=[1.0, 1.8]), _rows(2.06, 1.0))  # +106 % against at most +80 %: 26
    assert r["error"] == pytest.approx(0.26) and r["within"] is True     # points off, a third of 80 is 26.7 ...
    r = compare(_measured(value=None, range=[1.0, 1.8]), _rows(2.07, 1.0))
    assert r["within"] is False and r["sign_agrees"] is None             # ... 27 is out (the range spans 0)
    r = compare(_measured(metric="decode_hit_rate", kind="percent", arms=["a"], value=97.0),
                _rows(0.90, None, "decode_hit_rate"))  # 90 % against 97 %: -7 points, within 10
    assert r["predicted"] == pytest.approx(90.0) and r["error"] == pytest.approx(-7.0) and r["within"] is True
    r = compare(_measured(kind="absolute", arms=["a"], value=10.0), _rows(12.6, None))
    assert r["error"] == pytest.approx(0.26) and r["within"] is False
    failed = compare(_measured(), {"a": {"decode_tok_s": None, "error": "it broke"}, "b": {"decode_tok_s": 1.0,
                                                                                        "error": None}})
    assert failed["predicted"] is None and failed["within"] is None and failed["failed"] == "it broke"


def test_band_reason_known_answers():
    row = {"in_band": False, "band_p10": 5.0, "band_median": 5.0, "band_p90": 5.0, "within": True, "note": None}
    assert band_reason(row).startswith("no estimated input moves it")  # a band of zero width
    row.update(band_p10=4.0, band_p90=6.0)
    assert band_reason(row).startswith("within tolerance")
    row.update(within=False)
    assert band_reason(row) == "outside tolerance: a mechanism or setting the model lacks"
    row.update(note="the Metal path's host work is not modelled")
    assert band_reason(row) == "outside tolerance: the Metal path's host work is not modelled"
    assert band_reason({**row, "in_band": True}) is None and band_reason({**row, "in_band": None}) is None


def test_tolerances_are_the_issues():
    assert TOLERANCE == {"percent": 10.0, "absolute": 0.25}
    assert (EFFECT_FLOOR, EFFECT_SHARE) == (0.05, 1 / 3)


@pytest.mark.parametrize("predicted, measured, within, sign", [
    (1.00, 1.10, False, False),   # "no effect" against +10 %: 10 points off, the allowance is 5
    (1.06, 1.10, True, True),     # +6 % against +10 %: 4 points off
    (0.99, 1.04, True, None),     # an effect under 5 %: its sign is not judged, 5 points allowed
    (0.99, 1.06, False, False),   # -1 % against +6 %: 7 points off and of the wrong sign
    (1.01, 1.06, True, True),
    (0.80, 0.70, True, True),     # -20 % against -30 %: a third of 30 is 10 points
    (0.79, 0.70, True, True),
    (0.81, 0.70, False, True),    # 11 points off
    (1.02, 0.90, False, False),   # +2 % against -10 %: wrong sign
    (1.60, 1.30, False, True),    # +60 % against +30 %: 30 points off, 10 allowed
])
def test_effect_rule_known_answers(predicted, measured, within, sign):
    r = judge_effect(predicted, measured, measured)
    assert r["within"] is within and r["sign_agrees"] is sign


def test_effect_rule_for_a_range_counts_from_the_nearer_end():
    # S5's ring 48 against the default ring: 231.1-234.3 over 170.6-173.4 tok/s = 1.333-1.373
    low, high = 231.1 / 173.4, 234.3 / 170.6
    assert judge_effect(1.35, low, high)["error"] == 0.0
    r = judge_effect(1.50, low, high)   # 12.7 points above the high end's +37.3 %, whose third is 12.4
    assert r["error"] == pytest.approx(1.50 - high) and r["within"] is False
    assert judge_effect(1.49, low, high)["within"] is True


def test_roles_are_derived_from_the_records_and_at_most_a_third_calibrate():
    cases = load_cases()
    named = {r.case for r in RECORDS if r.case is not None}  # records fitted on other runs name no case
    for _, case in cases:
        assert case.role == ("calibration" if case.id in named else "prediction")
    assert named <= {case.id for _, case in cases}  # every record's case is a case
    assert sum(case.role == "calibration" for _, case in cases) <= len(cases) / 3


def test_every_case_of_the_reference_list_is_a_file():
    listed = {f"S{i}" for i in range(1, 13)} | {f"D{i}" for i in range(1, 13)}
    assert listed <= {p.stem for p in CASES_DIR.glob("*.toml")}


def test_the_recorded_bands_are_of_the_current_predictions():
    # docs/reference/validation-bands.json is one recorded `validate --uncertainty` run (minutes): its central
    # predictions must be the recorded exhibit's (itself checked current by tests/test_docs.py), else re-record it;
    # every prediction figure outside its band carries a reason
    bands = json.loads((ROOT / "docs" / "reference" / "validation-bands.json").read_text())["record"]["rows"]
    exhibit = {(r["case"], r["metric"], r["arms"]): r["predicted"] for r in json.loads(RECORDED.read_text())["data"]["rows"]}
    recorded = {(r["case"], r["metric"], r["arms"]): r["predicted"] for r in bands}
    assert recorded.keys() == exhibit.keys()
    for key, predicted in exhibit.items():
        assert recorded[key] == (None if predicted is None else pytest.approx(predicted, rel=1e-4)), key  # 5 digits
    for r in bands:
        if r["role"] == "prediction" and r.get("in_band") is False:
            assert r["band_reason"], (r["case"], r["metric"], r["arms"])


def test_cli_validate_json_for_one_case():
    proc = subprocess.run([sys.executable, "-m", "sim", "validate", "--case", "seed-504-glm52", "--json",
                           "--workers", "1"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    [row] = record["rows"]
    assert row["case"] == "seed-504-glm52" and row["role"] == "calibration" and row["within"] is True
    assert record["totals"]["cases"] == 1


def test_cli_validate_unknown_case_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "sim", "validate", "--case", "Z99"], capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--case: case = Z99: no such case" in proc.stderr


def test_the_gpu_replay_is_reported_per_machine_with_its_own_and_anothers_calibration(tmp_path):
    """Known answer on a four-replay record: machine X's replay with its own calibration (5 %, 12 % at the host
    state it ran in) and with Y's (20 %, 3 % with the anchors); Y's twice with its own (11 % and 11.02 %): X meets
    the goal, Y does not."""
    from sim.explore.validate import replay_by_machine, replay_table

    def row(machine, calibration, error, adjusted=None, anchored=None):
        return {"machine": f"{machine} (a test H200)", "calibration": calibration, "way": "ce_sync",
                "timing": "settled", "median_error": error, "host_adjusted_median_error": adjusted,
                "anchor_adjusted_median_error": anchored}

    spread = tmp_path / "spread.json"
    spread.write_text(json.dumps({"rows": [row("X", "x.json (machine X, fresh)", 0.05, 0.12),
                                           row("X", "y.json (machine Y)", 0.20, anchored=0.03),
                                           row("Y", "y.json (machine Y)", 0.11),
                                           row("Y", "y.json (machine Y)", 0.1102)]}))
    by_machine = {r["machine"]: r for r in replay_by_machine(spread)}
    assert by_machine["X"]["own"] == [0.05] and by_machine["X"]["other"] == [0.20]
    assert by_machine["X"]["host_adjusted"] == [0.12] and by_machine["X"]["own_within_goal"] is True
    assert by_machine["X"]["anchor_adjusted"] == [0.03] and by_machine["Y"]["anchor_adjusted"] == []
    assert by_machine["Y"]["own"] == [0.11, 0.1102] and by_machine["Y"]["own_within_goal"] is False
    shown = {r["machine"]: r for r in replay_table(list(by_machine.values()))}
    assert shown["X"]["own calibration"] == "5.0 %" and shown["Y"]["own <= 10%"] == "no"
    assert shown["X"]["with the anchors"] == "3.0 %" and shown["Y"]["own calibration"] == "11.0 % (2 replays)"


def test_validate_reports_the_recorded_gpu_replays_of_every_machine():
    from sim.explore.validate import REPLAY_SPREAD_FILE, replay_by_machine

    recorded = json.loads(REPLAY_SPREAD_FILE.read_text())["rows"]
    machines = {r["machine"].split(" (")[0] for r in recorded}
    assert {r["machine"] for r in replay_by_machine()} == machines


def test_effect_drivers_name_the_input_that_moves_the_effect():
    # a ratio whose numerator follows input "a.x" and not "b.y" (a known answer): the effect's drivers name a.x
    # alone, with rho +1, and the effect keeps its sign in every sample
    from sim.explore.validate import _band

    rng = np.random.default_rng(1)
    xs, ys = rng.permutation(np.linspace(1.0, 2.0, 12)), rng.permutation(np.linspace(0.0, 1.0, 12))
    def sample(x, y, figure):
        return ({"a.x": x, "b.y": y}, {"error": None, "decode_tok_s": figure})
    samples = {"a": [sample(x, y, 10 * (1 + x)) for x, y in zip(xs, ys)],
               "b": [sample(x, y, 10.0) for x, y in zip(xs, ys)]}
    out = _band(_measured(value=2.5), samples)
    assert [d["input"] for d in out["effect_drivers"]] == ["a.x"]
    assert out["effect_drivers"][0]["rho"] == pytest.approx(1.0) and out["effect_sign_stable"] is True
    assert out["band_p10"] < 2.5 < out["band_p90"] and out["in_band"] is True
    flipping = {"a": [sample(x, y, 10 * (x - 0.5)) for x, y in zip(xs, ys)], "b": samples["b"]}
    assert _band(_measured(value=2.5), flipping)["effect_sign_stable"] is False  # effects from -50 % to +50 %
