"""The command line as a user meets it: JSON-only stdout, one-line errors with exit code 2, golden demo."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).parent / "golden"


def expertsim(*args, check=True):
    env = {**os.environ, "COLUMNS": "120"}
    proc = subprocess.run([sys.executable, "-m", "sim", *map(str, args)], capture_output=True, text=True, env=env)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "flash.parquet"
    proc = expertsim("trace", "gen", "--preset", "deepseek-v4-flash-q2-q4", "--prompt-tokens", 64,
                     "--decode-tokens", 32, "--seed", 3, "-o", path, "--json")
    written = json.loads(proc.stdout)
    assert written["rows"] == 96 and written["n_layers"] == 43 and written["top_k"] == 6
    return path


def test_demo_matches_golden_output():
    result = json.loads(expertsim("demo", "--json").stdout)
    golden = json.loads((GOLDEN / "demo.json").read_text())
    assert result == golden


def test_demo_table_is_readable():
    text = expertsim("demo").stdout
    assert "one slab (pre-#504)" in text and "OPT bound" in text


def test_cache_json_has_tables_and_counts_add_up(small_trace):
    data = json.loads(expertsim("cache", small_trace, "--policy", "lru", "--scope", "class", "--slots", "300",
                                "--json").stdout)
    s = data["summary"]
    assert s["lookups"] == 96 * 43 * 6
    assert s["hits"] + s["misses"] == s["lookups"]
    assert sum(row["lookups"] for row in data["per_layer"]) == s["lookups"]
    assert [row["phase"] for row in data["per_phase"]] == ["prefill", "decode"]
    assert len(data["per_class"]) == 2  # q2 and q4 experts


def test_cache_mrc_json_agrees_with_replay(small_trace):
    curve = json.loads(expertsim("cache", small_trace, "--scope", "layer", "--mrc", "--json").stdout)["curve"]
    replayed = json.loads(expertsim("cache", small_trace, "--scope", "layer", "--slots-per-layer", "20",
                                    "--json").stdout)
    hits_at_20 = sum(h for c, s, h in zip(curve["class"], curve["slots"], curve["hits"]) if s == 20)
    assert hits_at_20 == replayed["summary"]["hits"]


def test_trace_stats_json(small_trace):
    stats = json.loads(expertsim("trace", "stats", small_trace, "--json").stdout)
    assert len(stats["per_layer"]) == 43


@pytest.mark.parametrize("args, needle", [
    (["cache", "no-such-file.parquet", "--slots", "4"], "no-such-file.parquet"),
    (["trace", "gen", "--preset", "gpt-7", "--prompt-tokens", "8", "--decode-tokens", "8", "-o", "x.parquet"],
     "gpt-7"),
    (["trace", "import", "no-such.jsonl", "-o", "x.parquet"], "no-such.jsonl"),
])
def test_bad_input_is_one_line_exit_2(args, needle):
    proc = expertsim(*args, check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("args, needle", [
    (["--policy", "fifo", "--slots", "4"], "policy"),
    (["--slots", "4,x"], "--slots"),
    (["--slots-per-layer", "4", "--scope", "global"], "--slots-per-layer"),
    (["--slots", "4", "--model", "mixtral-8x7b"], "n_experts"),
    (["--policy", "lfu", "--mrc"], "--mrc"),
])
def test_bad_cache_settings_are_one_line_errors(small_trace, args, needle):
    proc = expertsim("cache", small_trace, *args, check=False)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_not_a_trace_file_is_an_error(tmp_path):
    bogus = tmp_path / "bogus.parquet"
    bogus.write_bytes(b"PAR1 this is not parquet")
    proc = expertsim("cache", bogus, "--slots", "4", check=False)
    assert proc.returncode == 2 and str(bogus) in proc.stderr


def test_console_script_and_module_entry_points_agree():
    via_module = expertsim("--help").stdout
    assert "trace" in via_module and "cache" in via_module and "bench" in via_module


def test_run_json_has_the_headline_keys(tmp_path):
    data = json.loads(expertsim("run", Path(__file__).resolve().parents[1] / "scenarios" / "ds4-504-per-class.toml",
                                "--json", "-o", tmp_path / "out").stdout)
    for key in ("cache_slots", "cache_mib", "lent_slots", "prefill_buffer_mib", "file_blob_reads",
                "prefill_tok_s", "decode_tok_s", "decode_hit_rate", "ttft_s"):
        assert key in data
    assert (tmp_path / "out" / "copy_plan.parquet").is_file()


def test_run_bad_scenario_is_one_line_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('hardware = "rtx-4090"\nmodel = "no-such-model"\n')
    proc = expertsim("run", bad, check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and str(bad) in proc.stderr
