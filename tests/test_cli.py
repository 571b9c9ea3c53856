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


# --- usage errors, as click/typer report them, whichever copy of click typer carries -----------------

def _leaf_commands():
    """Every subcommand (path, click command) of the installed CLI, walked from the app itself so that a new
    command is covered the day it is added."""
    import typer

    from sim.cli import app

    found = []

    def visit(command, path):
        children = getattr(command, "commands", None)
        if children:
            for name, child in sorted(children.items()):
                visit(child, [*path, name])
        else:
            found.append((path, command))

    visit(typer.main.get_command(app), [])
    return found


LEAVES = _leaf_commands()


def _assert_usage_error(proc, needle):
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Usage: expertsim" in proc.stderr and needle in proc.stderr, proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("path", [p for p, _ in LEAVES], ids=" ".join)
def test_unknown_option_is_a_usage_error(path):
    _assert_usage_error(expertsim(*path, "--no-such-option", check=False), "No such option")


@pytest.mark.parametrize("path", [p for p, c in LEAVES if any(q.required for q in c.params)], ids=" ".join)
def test_missing_argument_is_a_usage_error(path):
    _assert_usage_error(expertsim(*path, check=False), "Missing")


def _typed_options():
    """(command path, its first int or float option), read from the commands' own signatures: the click
    parameter objects differ between typer releases, the annotations do not."""
    import inspect
    import typing

    import typer

    from sim.cli import app

    cases = []

    def visit(group, path):
        for info in group.registered_commands:
            hints = typing.get_type_hints(info.callback)
            for name, parameter in inspect.signature(info.callback).parameters.items():
                declared = getattr(parameter.default, "param_decls", None)
                kind = hints.get(name)
                if typing.get_origin(kind) is typing.Union:
                    kind = next(a for a in typing.get_args(kind) if a is not type(None))
                if isinstance(parameter.default, typer.models.OptionInfo) and kind in (int, float):
                    flag = next((d for d in declared or () if d.startswith("--")), "--" + name.replace("_", "-"))
                    cases.append(([*path, info.name or info.callback.__name__], flag))
                    break
        for sub in group.registered_groups:
            visit(sub.typer_instance, [*path, sub.name])

    visit(app, [])
    return cases


@pytest.mark.parametrize("path, option", _typed_options(), ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_wrong_type_is_a_usage_error(path, option):
    _assert_usage_error(expertsim(*path, option, "abc", check=False), "Invalid value")


def test_every_command_with_a_number_option_is_type_checked():
    # the wrong-type test above must reach the commands that take numbers, or it checks nothing
    assert {" ".join(p) for p, _ in _typed_options()} >= {"sweep", "bench", "trace gen", "calibrate", "plan"}


@pytest.mark.parametrize("args", [[], ["trace"]], ids=["expertsim", "expertsim trace"])
def test_a_group_without_a_command_shows_usage_and_exits_2(args):
    proc = expertsim(*args, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout
    assert "Usage: expertsim" in proc.stdout + proc.stderr


def test_version():
    from sim import __version__

    proc = expertsim("--version")
    assert proc.stdout.strip() == f"expertsim {__version__}" and proc.stderr == ""


def test_ctrl_c_exits_130_with_one_line():
    import signal
    import time

    # a bench long enough to be interrupted; SIGINT is what a terminal's Ctrl-C sends to the process
    env = {**os.environ, "COLUMNS": "120"}
    proc = subprocess.Popen([sys.executable, "-m", "sim", "bench", "--tokens", "20000"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    time.sleep(4)  # past start-up: the interrupt lands inside the benchmark's Python-level loop
    assert proc.poll() is None, "the benchmark ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and stderr.strip().splitlines() == ["expertsim: interrupted"]
