"""expertsim plan: constraint parsing, the seeds' conclusions, the CLI (small candidate sets, < 60 s)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sim.errors import InputError
from sim.explore.plan import NoFeasiblePlan, make_plan, parse_constraint, parse_objective

OWN = "engine.env.STRATA_PREFILL_OWN_AUTO=0,1"


def test_constraint_parsing():
    c = parse_constraint("decode_tok_s>=20")
    assert (c.key, c.op, c.bound) == ("decode_tok_s", ">=", 20.0)
    assert c.ok({"decode_tok_s": 20.0}) and not c.ok({"decode_tok_s": 19.9})
    c = parse_constraint(" file_blob_reads <= 0 ")
    assert c.ok({"file_blob_reads": 0.0}) and not c.ok({"file_blob_reads": 1.0})
    assert parse_constraint("vram_free_mib>2048").op == ">"
    assert parse_objective("-ttft_s") == ("ttft_s", -1)
    assert parse_objective("prefill_tok_s") == ("prefill_tok_s", 1)


@pytest.mark.parametrize("text, named", [("foo>=1", "foo"), ("decode_tok_s>>1", ">1"), ("decode_tok_s", "OP"),
                                         ("decode_tok_s>=fast", "fast"), ("", "METRIC")])
def test_bad_constraints(text, named):
    with pytest.raises(InputError) as err:
        parse_constraint(text)
    assert named in str(err.value) and "\n" not in str(err.value)


def test_bad_objective():
    with pytest.raises(InputError, match="unknown metric 'nope'"):
        parse_objective("-nope")


def test_ds4_slab_recommends_per_class_caches():
    plan = make_plan("scenarios/ds4-504-slab.toml", grids=["engine.variant=pre-504,pr504"])
    assert plan.objective == "decode_tok_s"
    assert plan.best.settings["engine.variant"] == "pr504"
    line = plan.explanations[0]
    assert "per-class caches" in line and "one slab" in line and "tok/s decode" in line
    assert plan.best.metrics["decode_tok_s"] > 5 * min(c.metrics["decode_tok_s"] for c in plan.candidates)


def test_strata_capped_cache_recommends_own_buffers():
    plan = make_plan("scenarios/strata-658-borrow.toml", grids=[OWN], constraints=["vram_free_mib>=2048"])
    assert plan.objective == "prefill_tok_s"
    assert plan.best.settings["engine.env.STRATA_PREFILL_OWN_AUTO"] == "1"
    m = plan.best.metrics
    assert m["file_blob_reads"] == 0 and m["lent_slots"] == 0 and m["vram_free_mib"] >= 2048
    line = plan.explanations[0]
    assert "own buffers" in line and "file-blob reads" in line and "spare VRAM pays" in line


def test_strata_auto_cache_own_vs_borrow_makes_no_difference():
    plan = make_plan("scenarios/strata-658-auto-borrow.toml", grids=[OWN])
    rates = [c.metrics["prefill_tok_s"] for c in plan.candidates]
    assert max(rates) / min(rates) - 1 < 0.03
    assert plan.best.settings["engine.env.STRATA_PREFILL_OWN_AUTO"] == "0"  # ties keep the scenario's own
    assert "no prefill_tok_s difference within 3 %" in plan.explanations[0]


def test_default_plan_explains_every_knob_against_a_run_alternative():
    # the default search ends with every knob's other values tried around the best, so no choice stands alone;
    # and on the #658 scenario it reaches the seed's conclusion without being told which knob to look at
    plan = make_plan("scenarios/strata-658-borrow.toml")
    assert len(plan.explanations) == len(plan.knobs)
    assert not [line for line in plan.explanations if "no alternative was run" in line]
    assert plan.best.settings["engine.env.STRATA_PREFILL_OWN_AUTO"] == "1"
    best = plan.best.metrics["prefill_tok_s"]
    for knob in plan.knobs:  # the best is at least as good as each one-knob neighbour that ran, or within 3 % of
        for c in plan.candidates:  # one that changes more of the scenario's settings (docs/plan.md: no difference)
            if c.ran and c.feasible and all(c.settings.get(k) == plan.best.settings.get(k)
                                            for k in plan.knobs if k != knob):
                theirs = c.metrics["prefill_tok_s"]
                assert theirs <= best * (1 + 1e-9) or (theirs - best <= 0.03 * theirs and c.changed > plan.best.changed)


def test_a_gain_within_3_percent_keeps_the_scenarios_own_setting(tmp_path):
    """gpt-oss-120b under llama.cpp on a 16 GB card (`scenario init`'s scenario): turning op offload off gained
    1.9 % decode (27.3 vs 26.8 tok/s) and cost 5 % of prefill, and plan recommended it while its own explanation
    called the decode gain no difference. Within 3 % the scenario's own setting stays (docs/plan.md)."""
    path = tmp_path / "gpt.toml"
    hardware = Path(__file__).resolve().parents[1] / "scenarios" / "hardware" / "rtx-4060ti-16gb.toml"
    path.write_text(f'hardware = "{hardware}"\nmodel = "gpt-oss-120b"\n'
                    '[engine]\nname = "llama.cpp"\nvariant = "mainline"\n'
                    '[engine.flags]\nubatch-size = 512\nno-op-offload = false\n'
                    '[trace]\ngenerator = "gpt-oss-120b"\nseed = 0\n'
                    '[[workload.requests]]\nprompt_tokens = 2048\ndecode_tokens = 256\nmeasured = true\n')
    plan = make_plan(path, objective="decode_tok_s")
    ran = [c for c in plan.candidates if c.ran and c.feasible]
    top = max(c.metrics["decode_tok_s"] for c in ran)
    assert plan.best.changed == min(c.changed for c in ran if c.metrics["decode_tok_s"] >= 0.97 * top)
    assert "engine.flags.no-op-offload" not in plan.as_dict()["changes"]


def test_impossible_constraint_lists_the_closest():
    with pytest.raises(NoFeasiblePlan) as err:
        make_plan("scenarios/strata-658-borrow.toml", grids=[OWN], constraints=["prefill_tok_s>=100000"])
    assert err.value.plan.closest and "closest" in str(err.value) and "prefill_tok_s>=100000" in str(err.value)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "sim", "plan", *args], capture_output=True, text=True, timeout=120)


def test_cli_json_and_exit_codes():
    r = _cli("scenarios/strata-658-borrow.toml", "--grid", OWN, "--constraint", "file_blob_reads<=0", "--json")
    assert r.returncode == 0, r.stderr
    payload = json.loads(r.stdout)
    assert payload["recommended"]["engine.env.STRATA_PREFILL_OWN_AUTO"] == "1"
    assert payload["changes"] == {"engine.env.STRATA_PREFILL_OWN_AUTO": "1"} and payload["explanations"]
    r = _cli("scenarios/strata-658-borrow.toml", "--grid", OWN, "--constraint", "decode_tok_s>=100000", "--json")
    assert r.returncode == 1
    payload = json.loads(r.stdout)
    assert payload["feasible"] is False and payload["closest"] and "closest" in payload["error"]
    r = _cli("scenarios/strata-658-borrow.toml", "--constraint", "bogus>=1")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "bogus" in r.stderr


def test_a_candidate_past_the_cards_vram_is_never_recommended(tmp_path):
    """A 12 GB card (rtx-4070-12gb-wsl2.toml), Strata without an expert profile, so its prompt path owns 2048-token
    buffers (strata-engine.md §3.3): an explicit cache of 5,400 x 2.54 MiB leaves no room for them. Before, that run
    went on past the card (a notice said so) and plan recommended it, at '-510 MiB VRAM free'."""
    from tests.test_strata_engine import scenario_file

    path = scenario_file(tmp_path, "no-profile", variant="v0.1.40", hardware="rtx-4070-12gb-wsl2",
                         requests=((300, 8),), flags={"expert-cache": "auto", "expert-profile": None,
                                                     "vram-reserve-mib": 700, "max-context": 4096, "kv": "fp16"})
    plan = make_plan(str(path), grids=["engine.flags.expert-cache=auto,5400"])
    refused = [c for c in plan.candidates if c.settings["engine.flags.expert-cache"] == 5400]
    assert refused and all(not c.ran and "owned prompt buffers" in c.error for c in refused)
    assert plan.best is not None and plan.best.metrics["vram_free_mib"] >= 0


def test_a_candidate_without_the_objective_is_never_tied_with_the_best():
    """A feasible candidate whose row lacks the objective scores -inf; it is no 'no difference' tie of a finite
    best, however few settings it changes (the 3 % rule compares figures, and a missing one is none)."""
    from sim.explore.plan import Candidate, _pick

    best = Candidate({"k": 2}, changed=1, metrics={"decode_tok_s": 30.0})
    missing = Candidate({"k": 1}, changed=0, metrics={"decode_tok_s": None})
    close = Candidate({"k": 3}, changed=0, metrics={"decode_tok_s": 29.5})  # within 3 %, fewer changes
    assert _pick([best, missing], "decode_tok_s", 1) is best
    assert _pick([best, missing, close], "decode_tok_s", 1) is close
