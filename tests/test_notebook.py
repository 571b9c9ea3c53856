"""The notebook API (sim.run): the same run as `expertsim run`, as tables; docs/notebook.md runs as a golden."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import sim
from sim.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "scenarios" / "ds4-504-per-class.toml"
SETTINGS = {"engine.flags.ssd-streaming-cache-experts": 4096, "workload.requests.0.prompt_tokens": 600,
            "workload.requests.0.decode_tokens": 8}


@pytest.fixture(scope="module")
def run():
    return sim.run(SCENARIO, SETTINGS)


def test_a_notebook_run_is_the_command_lines_run(run, tmp_path):
    command = [sys.executable, "-m", "sim", "run", str(SCENARIO), "--json",
               *(a for k, v in SETTINGS.items() for a in ("--set", f"{k}={v}"))]
    printed = json.loads(subprocess.run(command, capture_output=True, text=True, check=True, cwd=tmp_path).stdout)
    for metric, value in zip(run.summary["metric"], run.summary["value"]):
        assert printed[metric] == pytest.approx(value), metric
    assert printed["provenance"]["scenario_sha256"] == run.record["provenance"]["scenario_sha256"]
    assert run.record["provenance"]["settings"] == printed["provenance"]["settings"]


def test_tables_and_what_the_engine_said(run):
    assert len(run.steps) == run.steps["lookups"].notna().sum() > 0
    assert {"request", "phase", "layer", "hits", "lookups"} <= set(run.steps.columns)
    assert (run.links["end_s"] >= run.links["start_s"]).all()
    # a 4096-expert budget on the 96 GB card is capped by the 12 GiB reserve: the engine says so
    assert any("capped from 4096" in n for n in run.notices)
    page = run._repr_html_()
    assert "capped from 4096" in page and "tok/s" in page and page.count("<tr>") == len(run.summary)


def test_save_writes_the_command_lines_files_and_keeps_a_users_folder(run, tmp_path):
    written = run.save(tmp_path / "out")
    assert {Path(p).name for p in written.values()} >= {"summary.json", "steps.parquet", "links.parquet"}
    with pytest.raises(InputError, match="is not empty; add force=True"):  # issue 34: it said --force
        run.save(tmp_path / "out")
    run.save(tmp_path / "out", force=True)


def test_a_bad_setting_is_the_one_line_error_the_command_prints():
    with pytest.raises(InputError) as info:
        sim.run(SCENARIO, {"engine.flags.no-such-flag": 1})
    assert "\n" not in str(info.value) and "no-such-flag" in str(info.value)
