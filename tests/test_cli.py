"""The command line as a user meets it: JSON-only stdout, one-line errors with exit code 2, golden demo."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.cli.tables import format_cell

GOLDEN = Path(__file__).parent / "golden"


def expertsim(*args, check=True, cwd=None):
    env = {**os.environ, "COLUMNS": "120"}
    proc = subprocess.run([sys.executable, "-m", "sim", *map(str, args)], capture_output=True, text=True, env=env,
                          cwd=cwd)
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


@pytest.mark.parametrize("policy", ["lru", "lfu", "opt"])
def test_the_largest_slot_count_is_a_cache_that_holds_every_expert(small_trace, policy):
    """Issue 34: 2**31 - 1 slots (the most the kernels number) give what a cache of every expert gives (43 layers
    x 256 experts): its tables hold a slot per expert at most (tests/test_cache.py), so it runs."""
    def misses(slots):
        return json.loads(expertsim("cache", small_trace, "--policy", policy, "--scope", "global", "--slots",
                                    str(slots), "--json").stdout)["summary"]["misses"]
    assert misses(2**31 - 1) == misses(43 * 256)


def test_cache_mrc_json_agrees_with_replay(small_trace):
    curve = json.loads(expertsim("cache", small_trace, "--scope", "layer", "--mrc", "--json").stdout)["curve"]
    replayed = json.loads(expertsim("cache", small_trace, "--scope", "layer", "--slots-per-layer", "20",
                                    "--json").stdout)
    hits_at_20 = sum(h for c, s, h in zip(curve["class"], curve["slots"], curve["hits"]) if s == 20)
    assert hits_at_20 == replayed["summary"]["hits"]


@pytest.mark.parametrize("mrc", [False, True], ids=["replay", "mrc"])
def test_a_trace_of_no_known_model_counts_no_bytes(tmp_path, mrc):
    """Issue 34: a trace whose model is no preset was replayed with every expert as 1 byte (load_bytes 16, load_gib
    0.0000). Its byte columns are empty, the output says why, and --model gives the sizes."""
    fixture = Path(__file__).resolve().parents[1] / "traces" / "fixtures" / "generic.csv"
    trace = tmp_path / "g.parquet"
    expertsim("trace", "import", fixture, "-o", trace)
    capacity = ["--mrc"] if mrc else ["--slots-per-layer", "2"]
    data = json.loads(expertsim("cache", trace, *capacity, "--json").stdout)
    if mrc:
        assert data["curve"]["bytes"] and set(data["curve"]["bytes"]) == {None} == set(data["curve"]["miss_bytes"])
        assert sum(data["curve"]["hits"]) > 0  # the counts are still there
    else:
        assert data["summary"]["load_bytes"] is None and data["summary"]["load_gib"] is None
        assert data["summary"]["hits"] + data["summary"]["misses"] == data["summary"]["lookups"] == 18
        assert {row["load_bytes"] for row in data["per_layer"]} == {None}
    assert "unknown (csv)" in data["bytes"] and "--model" in data["bytes"]
    shown = expertsim("cache", trace, *capacity)
    assert "bytes not counted" in shown.stderr and "bytes not counted" not in shown.stdout


def test_trace_hotlist_ranks_pairs_by_their_uses(tmp_path):
    """`trace hotlist` writes ds4's rank,layer,expert format: every (layer, expert) the trace uses, most used first,
    ties in (layer, expert) order, ranks from 0 (ds4's own list, ../shared/data/ds4-hotlist). The expected order
    is counted here from the fixture's CSV lines."""
    import collections
    import csv

    fixture = Path(__file__).resolve().parents[1] / "traces" / "fixtures" / "generic.csv"
    trace = tmp_path / "g.parquet"
    expertsim("trace", "import", fixture, "-o", trace)
    uses = collections.Counter()
    for row in csv.DictReader(fixture.open()):
        for column in ("e0", "e1"):
            uses[(int(row["layer"]), int(row[column]))] += 1
    expected = sorted(uses, key=lambda pair: (-uses[pair], pair))
    written = json.loads(expertsim("trace", "hotlist", trace, "-o", tmp_path / "hot.csv", "--json").stdout)
    rows = list(csv.DictReader((tmp_path / "hot.csv").open()))
    assert [(int(r["layer"]), int(r["expert"])) for r in rows] == expected
    assert [int(r["rank"]) for r in rows] == list(range(len(expected))) and written["pairs"] == len(expected)
    again = expertsim("trace", "hotlist", trace, "-o", tmp_path / "hot.csv", check=False)
    assert again.returncode == 2 and "exists; add --force" in again.stderr


def test_trace_stats_json(small_trace):
    stats = json.loads(expertsim("trace", "stats", small_trace, "--json").stdout)
    assert len(stats["per_layer"]) == 43


@pytest.mark.parametrize("args, needle", [
    (["cache", "no-such-file.parquet", "--slots", "4"], "no-such-file.parquet"),
    (["trace", "gen", "--preset", "gpt-7", "--prompt-tokens", "8", "--decode-tokens", "8", "-o", "x.parquet"],
     "gpt-7"),
    (["trace", "import", "no-such.jsonl", "-o", "x.parquet"], "no-such.jsonl"),
    (["bench", "--quick", "--scenario", "no-such.toml"], "no-such.toml"),
    (["bench", "--quick", "--tokens", "0"], "--tokens"),  # issue 34: accepted before
    # a validation case where a scenario goes: "hardware = (missing)" before, a key the file has one level down
    (["run", "scenarios/validation/L10.toml", "--set", "engine.flags.threads=2"], "validate --case L10"),
    (["sweep", "scenarios/validation/L10.toml", "--grid", "engine.flags.threads=1,2", "-o", "sweep-out"],
     "validate --case L10"),
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
    # issue 34: a count past the kernels' slot ids was an OverflowError, or a table of that many slots
    (["--scope", "global", "--slots", "99999999999999999999"], "0 to 2,147,483,647"),
    (["--slots-per-layer", "999999999999"], "0 to 2,147,483,647"),
])
def test_bad_cache_settings_are_one_line_errors(small_trace, args, needle):
    proc = expertsim("cache", small_trace, *args, check=False)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(not hasattr(os, "mkfifo") or not Path("/dev/null").exists(), reason="needs a FIFO and /dev/null")
@pytest.mark.parametrize("kind, says", [("folder", "is a folder"), ("fifo", "is a FIFO"), ("device", "is a device")])
@pytest.mark.parametrize("command, what", [
    (["cache", "{path}", "--slots", "4"], "a trace file"),
    (["trace", "import", "{path}", "--format", "csv", "-o", "{tmp}/x.parquet"], "a csv trace file"),
    (["run", "{path}"], "a scenario file"),
], ids=["cache", "trace import", "run"])
def test_an_input_that_is_not_a_regular_file_says_what_it_is(tmp_path, kind, says, command, what):
    """Issue 34: /dev/null, a FIFO and a folder were all "no such file" (and a FIFO could block the read)."""
    path = {"folder": tmp_path / "a-folder", "fifo": tmp_path / "a-fifo", "device": Path("/dev/null")}[kind]
    if kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    proc = expertsim(*(a.format(path=path, tmp=tmp_path) for a in command), check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and what in lines[0] and str(path) in lines[0], proc.stderr


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


TYPERS_OWN_FLAGS = ("--help", "--install-completion", "--show-completion")  # typer adds these; not ours to label


def test_no_flag_of_ours_shows_a_value_type_in_its_help():
    """Issue 34: every flag's help showed "<bool>", as if it took a value (typer 0.29's rendering of a flag's type).
    The app's own help and every command's, in one process (click's test runner)."""
    from typer.testing import CliRunner

    from sim.cli import app

    runner = CliRunner()
    for path in [[], *[p for p, _ in LEAVES]]:
        shown = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"}).output
        labelled = [line for line in shown.splitlines()
                    if "<bool>" in line and not any(flag in line for flag in TYPERS_OWN_FLAGS)]
        assert not labelled, (path, labelled)
        assert "--help" in shown, (path, shown)  # the help was printed


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


@pytest.mark.parametrize("words, expected", [("expertsim hard", "hardware"), ("expertsim scenario i", "init"),
                                             ("expertsim report out --plotly", "--plotly-js")])
def test_shell_completion_completes_commands_and_options(words, expected):
    # what bash's completion function (expertsim --show-completion) asks the installed script
    script = Path(sys.executable).with_name("expertsim")
    env = {**os.environ, "_EXPERTSIM_COMPLETE": "complete_bash", "COMP_WORDS": words,
           "COMP_CWORD": str(len(words.split()) - 1)}
    proc = subprocess.run([str(script)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and expected in proc.stdout.split(), (proc.stdout, proc.stderr)


@pytest.mark.parametrize("signum, code", [(2, 130), (15, 143)], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_exits_130_with_one_line(signum, code):
    """Ctrl-C (SIGINT) exits 130 and SIGTERM 143 (issue 34: SIGTERM ended the process without a word), both with
    the one line."""
    import time

    # a bench long enough to be interrupted; SIGINT is what a terminal's Ctrl-C sends to the process
    env = {**os.environ, "COLUMNS": "120"}
    # -X faulthandler: a crash on the way out (a CI run's died of SIGSEGV) prints its stack into the assertion
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "sim", "bench", "--tokens", "20000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    time.sleep(4)  # past start-up: the interrupt lands inside the benchmark's Python-level loop
    assert proc.poll() is None, "the benchmark ended before it could be interrupted"
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stderr
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr and lines[-1] == "expertsim: interrupted"
    assert all(line.startswith("bench [") for line in lines[:-1])  # the progress lines before it


RUN_INTERRUPTED_DECODE_TOKENS = 20_000  # ds4's per-class run: a short routing, then seconds of simulation


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
@pytest.mark.parametrize("signum, code", [(2, 130), (15, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_run_interrupted_while_it_simulates_ends_with_one_line(signum, code):
    """Issue 34: Ctrl-C or SIGTERM in the engine's simulation (after the routing, which stops at its next block)
    ends the run with the one line and 130/143. The live line at the terminal says when the simulation starts;
    the signal comes 2 s later. How soon it ends is measured, not asserted (`expertsim bench`'s *_ctrl_c_* rows)."""
    from sim.explore.bench import interrupted_in_a_terminal

    _, exit_code, shown = interrupted_in_a_terminal(
        ["run", SCENARIO_DIR / "ds4-504-per-class.toml", "--set",
         f"workload.requests.0.decode_tokens={RUN_INTERRUPTED_DECODE_TOKENS}"], "simulating", signum)
    assert exit_code == code, shown[-500:]
    assert "Traceback" not in shown and "expertsim: interrupted" in shown, shown[-500:]


@pytest.mark.parametrize("dropped_in", ["finalizer", "ctypes callback"])
def test_ctrl_c_that_python_drops_is_delivered_again(dropped_in):
    """Python drops an exception raised in __del__ or in a ctypes callback; the CLI must deliver the interrupt
    after it. (CI runs' bench, compiling numba code on a cold cache, took a Ctrl-C inside llvmlite's __del__ and,
    another time, inside its object-cache callback, and ran on.)"""
    lands_in = {
        "finalizer": "class Freed:\n"
                     "    def __del__(self):\n"
                     "        land()\n"
                     "Freed()\n",
        "ctypes callback": "import ctypes\n"
                           "ctypes.CFUNCTYPE(None)(land)()\n",
    }[dropped_in]
    script = (
        "import os, signal, time\n"
        "from sim.cli.signals import CtrlC, Interrupted\n"
        "CtrlC()\n"
        "def land():\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    sum(range(100000))  # the handler runs here, where Python drops what it raises\n"
        "try:\n"
        + "".join("    " + line + "\n" for line in lands_in.splitlines()) +
        "    time.sleep(5)\n"
        "    print('lost')\n"
        "except Interrupted:\n"
        "    print('interrupted')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "interrupted", proc.stdout + proc.stderr
    assert "Exception ignored" not in proc.stderr


@pytest.mark.parametrize("terminal", ["fast", "slow"])
def test_a_failure_left_by_a_dropped_ctrl_c_is_reported_as_the_interrupt(terminal):
    """A Ctrl-C dropped inside a library's callback leaves the library's work cut short, and it may fail before the
    interrupt comes again (a CI run's bench: numba raised "no compiled object yet" after its object-cache callback
    was interrupted, and the command ended with a traceback and exit 1). The command ends as interrupted. With a
    slow terminal the redelivery comes while main reports the interrupt: raised there it would end the command
    with a traceback, and one that came after the handlers were put back would reach the interpreter's shutdown
    as a KeyboardInterrupt (a sweep's Ctrl-C test once ended in concurrent.futures' exit hook that way)."""
    slow_terminal = ("echo = cli.typer.echo\n"
                     "def slow_echo(*args, **kwargs):\n"
                     "    time.sleep(30 * cli.signals.REDELIVER_S)\n"
                     "    echo(*args, **kwargs)\n"
                     "cli.typer.echo = slow_echo\n")
    script = (
        "import ctypes, os, signal, time\n"
        "import sim.cli as cli\n"
        "def app(prog_name):\n"
        "    def land():\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "        sum(range(100000))\n"
        "    ctypes.CFUNCTYPE(None)(land)()\n"
        "    raise RuntimeError('left half done by the interrupt')\n"
        "cli.app = app\n"
        + (slow_terminal if terminal == "slow" else "") +
        "cli.main()\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines() == ["expertsim: interrupted"], proc.stderr


def test_a_failure_without_a_ctrl_c_is_not_reported_as_one():
    script = ("import sim.cli as cli\n"
              "def app(prog_name):\n"
              "    raise RuntimeError('a real failure')\n"
              "cli.app = app\n"
              "cli.main()\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "RuntimeError: a real failure" in proc.stderr


# --- strict JSON: what jq, a browser or any strict parser reads ------------------------------------

def _strict_loads(text: str):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def decode_only_trace(tmp_path_factory):
    """A trace with no prompt: every prefill rate is undefined (NaN inside, null in JSON)."""
    path = tmp_path_factory.mktemp("strict") / "decode-only.parquet"
    expertsim("trace", "gen", "--preset", "deepseek-v4-flash-q2-q4", "--prompt-tokens", 0, "--decode-tokens", 16,
              "-o", path, "--json")
    return path


SCENARIO_DIR = Path(__file__).resolve().parents[1] / "scenarios"
GENERIC_CSV = str(Path(__file__).resolve().parents[1] / "traces" / "fixtures" / "generic.csv")


@pytest.mark.parametrize("args", [
    ["demo"],
    ["cache", "{trace}", "--slots", "300", "--scope", "class"],
    ["cache", "{trace}", "--mrc"],
    ["trace", "stats", "{trace}"],
    ["run", str(SCENARIO_DIR / "ds4-504-per-class.toml"), "-o", "{tmp}/run", "--perfetto", "{tmp}/t.json"],
    ["run", str(SCENARIO_DIR / "replay-qwen3.8-lru.toml")],
    ["validate", "--case", "S6", "--workers", "1", "-o", "{tmp}/val"],
    ["sweep", str(SCENARIO_DIR / "ds4-504-per-class.toml"), "--grid", "workload.requests.0.decode_tokens=2,4",
     "--grid", "workload.requests.0.prompt_tokens=600", "--workers", "1", "-o", "{tmp}/sweep"],
    ["scenario", "init", "--model", "qwen3.8-flash-next-iq3s", "--hardware", "rtx-5090-48gb-windows",
     "-o", "{tmp}/s.toml"],
    ["hardware", "init", "rtx-pro-6000-96gb", "--set", "gpu.vram_gib=48", "-o", "{tmp}/hw.toml"],
    ["hardware", "show", "rtx-4090"],
    ["model", "show", "deepseek-v4-flash-q2-q4"],
], ids=lambda a: "-".join(a[:2]).replace("/", "_")[:40])
def test_every_json_output_parses_strictly(args, decode_only_trace, tmp_path):
    args = [a.format(trace=decode_only_trace, tmp=tmp_path) for a in args]
    payload = _strict_loads(expertsim(*args, "--json").stdout)
    assert payload
    for written in tmp_path.rglob("*.json"):  # the files a command writes are strict JSON too
        _strict_loads(written.read_text())


def test_an_undefined_rate_is_null_not_nan(decode_only_trace):
    payload = _strict_loads(expertsim("cache", decode_only_trace, "--slots", "300", "--scope", "class",
                                      "--json").stdout)
    prefill = [row for row in payload["per_phase"] if row["phase"] == "prefill"]
    assert prefill[0]["lookups"] == 0 and prefill[0]["hit_rate"] is None


# --- outputs are never replaced without --force ---------------------------------------------------

def test_outputs_are_not_overwritten_without_force(tmp_path, small_trace):
    gen = ["trace", "gen", "--preset", "mixtral-8x7b", "--prompt-tokens", 8, "--decode-tokens", 8, "-o",
           tmp_path / "t.parquet"]
    expertsim(*gen)
    before = (tmp_path / "t.parquet").read_bytes()
    again = expertsim(*gen, "--seed", 5, check=False)
    assert again.returncode == 2 and "--force" in again.stderr and "Traceback" not in again.stderr
    assert (tmp_path / "t.parquet").read_bytes() == before
    assert expertsim(*gen, "--seed", 5, "--force").returncode == 0
    assert (tmp_path / "t.parquet").read_bytes() != before
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "summary.json").write_text("a user's own file")
    scenario = SCENARIO_DIR / "ds4-504-per-class.toml"
    refused = expertsim("run", scenario, "-o", folder, check=False)
    assert refused.returncode == 2 and "not empty" in refused.stderr
    assert (folder / "summary.json").read_text() == "a user's own file"
    (tmp_path / "p.json").write_text("{}")
    refused = expertsim("run", scenario, "--perfetto", tmp_path / "p.json", check=False)
    assert refused.returncode == 2 and "--force" in refused.stderr
    (tmp_path / "r.html").write_text("mine")
    refused = expertsim("report", folder, "-o", tmp_path / "r.html", check=False)
    assert refused.returncode == 2 and (tmp_path / "r.html").read_text() == "mine"


# --- tables fit the terminal: numbers whole at any width, rows whole when piped --------------------

def _in_a_terminal(columns: int, *args, cwd=None, stderr_too=False) -> str:
    """stdout of the command attached to a pseudo-terminal `columns` wide, as a user at a shell sees it (and its
    stderr, with `stderr_too`, on a terminal that draws live lines: rich draws none on a "dumb" one)."""
    import pty

    controller, terminal = pty.openpty()
    env = {**os.environ, "COLUMNS": str(columns), "LINES": "50", "TERM": "xterm" if stderr_too else "dumb"}
    proc = subprocess.Popen([sys.executable, "-m", "sim", *map(str, args)], stdout=terminal,
                            stderr=terminal if stderr_too else subprocess.PIPE, env=env, cwd=cwd)
    os.close(terminal)
    shown = _read_until_closed(controller)
    assert proc.wait(timeout=60) == 0
    return shown


def _read_until_closed(controller: int) -> str:
    """Everything a pseudo-terminal's command writes until the command ends, the controller end closed after."""
    from sim.explore.bench import read_pty

    try:
        return read_pty(controller).decode(errors="replace")
    finally:
        os.close(controller)


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
@pytest.mark.parametrize("columns", [50, 80])
def test_a_narrow_terminal_never_cuts_a_number(columns):
    rows = json.loads(expertsim("demo", "--json").stdout)["rows"]
    shown = _in_a_terminal(columns, "demo")
    assert "…" not in shown
    for row in rows:
        assert f"{row['budget']:,}" in shown and format_cell(row["decode_hit"]) in shown  # the cell, whole


# Every command of the README that prints a table (calibrate aside: its tables need a GPU; they print through the
# same layout). {out} is a folder of the run's own, {trace} a small generated
# trace; both relative to the test's folder, where the commands run (a pytest path is longer than 80 columns).
README_TABLE_COMMANDS = {
    "demo": ["demo"],
    "trace gen": ["trace", "gen", "--preset", "deepseek-v4-flash-q2-q4", "--prompt-tokens", "64", "--decode-tokens",
                  "16", "--seed", "1", "-o", "{out}/g.parquet"],
    "trace import": ["trace", "import", GENERIC_CSV, "-o", "{out}/i.parquet"],
    "trace stats": ["trace", "stats", "t.parquet"],
    "cache": ["cache", "t.parquet", "--policy", "lru", "--scope", "class", "--slots", "9472"],
    "cache --mrc": ["cache", "t.parquet", "--scope", "layer", "--mrc"],
    "run": ["run", SCENARIO_DIR / "ds4-504-per-class.toml", "-o", "{out}/run"],
    "run replay": ["run", SCENARIO_DIR / "replay-qwen3.8-lru.toml"],
    "run --uncertainty": ["run", SCENARIO_DIR / "ds4-504-per-class.toml", "--uncertainty", "2", "--workers", "1"],
    "sweep": ["sweep", SCENARIO_DIR / "ds4-504-per-class.toml", "--grid",
              "engine.flags.ssd-streaming-cache-experts=2048,4096", "-o", "{out}/sweep"],
    "plan": ["plan", SCENARIO_DIR / "strata-658-borrow.toml", "--constraint", "vram_free_mib>=1536"],
    "hardware list": ["hardware", "list"],
    "hardware show": ["hardware", "show", "rtx-4090"],
    "hardware init": ["hardware", "init", "rtx-pro-6000-96gb", "--set", "gpu.vram_gib=48", "-o",
                      "{out}/hardware/what-if-48gb.toml"],
    "scenario init": ["scenario", "init", "--model", "deepseek-v4-flash-q2-q4", "--hardware", "rtx-4090", "-o",
                      "{out}/mine.toml"],
    "model list": ["model", "list"],
    "model show": ["model", "show", "deepseek-v4-flash-q2-q4"],
    "validate": ["validate", "--case", "D1"],
    # timings: its numbers differ from run to run, so only its words are compared (and its numbers are numbers)
    "bench": ["bench", "--quick", "--tokens", "2000", "--scenario", SCENARIO_DIR / "replay-qwen3.8-lru.toml"],
}
_BOX_DRAWING = re.compile(r"[\u2500-\u257f]+")
_STYLE = re.compile(r"\x1b\[[0-9;]*m")  # rich resets the style at a terminal, even a dumb one
_LEFT_OUT_NOTE = re.compile(r"\(\d+ more columns?: ([^;]*); --wide shows them\)")


def _words(text: str) -> set[str]:
    return set(_BOX_DRAWING.sub(" ", _LEFT_OUT_NOTE.sub(" ", " ".join(text.split()))).split())


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
@pytest.mark.parametrize("name", README_TABLE_COMMANDS)
def test_every_table_of_the_readme_fits_80_columns_and_keeps_every_word_whole(name, tmp_path):
    """Issue 34: at an 80-column terminal every line fits, and every word and number shown is one the piped
    output (one line per row, nothing cut) has whole: no path in 6-character pieces, no header split mid-word."""
    if "t.parquet" in README_TABLE_COMMANDS[name]:
        expertsim("trace", "gen", "--preset", "deepseek-v4-flash-q2-q4", "--prompt-tokens", 256, "--decode-tokens",
                  64, "--seed", 1, "-o", tmp_path / "t.parquet")

    def command(folder):
        (tmp_path / folder).mkdir()
        return [str(a).replace("{out}", folder) for a in README_TABLE_COMMANDS[name]]

    piped = expertsim(*command("piped"), cwd=tmp_path).stdout
    shown = _STYLE.sub("", _in_a_terminal(80, *command("terminal"), cwd=tmp_path).replace("\r\n", "\n"))
    too_wide = [line for line in shown.splitlines() if len(line) > 80]
    assert not too_wide, too_wide
    whole, words = _words(piped.replace("piped", "terminal")), _words(shown)
    # a word wider than the terminal (hardware init's calibration path, relative from a deep temporary folder to
    # the checkout) cannot stay whole at any layout: its pieces are not counted as cut words
    too_wide_words = [w for w in whole if len(w) > 76]
    words = {w for w in words if not any(w in long for long in too_wide_words)}
    if name == "bench":  # its timings differ from the piped run's: compared with each digit as "#" ("0.039" is
        # "#.###" either way; a number cut in two, "#,###," and "###", would not be a word of the piped output)
        whole, words = ({re.sub(r"\d", "#", w) for w in found} for found in (whole, words))
    assert words <= whole, sorted(words - whole)[:20]


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
@pytest.mark.parametrize("name", ["trace gen", "trace stats", "cache", "cache --mrc", "run", "validate"])
def test_a_long_command_shows_what_it_is_doing_at_a_terminal_and_nothing_in_json(name, tmp_path):
    """Issue 34: the commands that may run for more than a few seconds keep a live line on stderr (the stage, its
    time): at a terminal only, never with --json, and never on stdout."""
    expertsim("trace", "gen", "--preset", "deepseek-v4-flash-q2-q4", "--prompt-tokens", 256, "--decode-tokens", 64,
              "--seed", 1, "-o", tmp_path / "t.parquet")
    args = [str(a).replace("{out}", "out") for a in README_TABLE_COMMANDS[name]]
    (tmp_path / "out").mkdir()
    shown = _in_a_terminal(80, *args, cwd=tmp_path, stderr_too=True)
    assert f"expertsim {name.split(' --')[0]}" in shown, shown[-400:]
    quiet = _in_a_terminal(80, *args, "--json", *(["--force"] if "-o" in args else []), cwd=tmp_path,
                           stderr_too=True)
    assert "expertsim" not in quiet.split("{", 1)[0], quiet[:400]  # nothing before the JSON
    piped = expertsim(*args, *(["--force"] if "-o" in args else []), cwd=tmp_path)
    assert f"expertsim {name.split(' --')[0]}" not in piped.stderr + piped.stdout


def test_a_piped_table_keeps_each_row_on_one_line():
    rows = json.loads(expertsim("demo", "--json").stdout)["rows"]
    piped = subprocess.run([sys.executable, "-m", "sim", "demo"], capture_output=True, text=True,
                           env={**os.environ, "COLUMNS": "40"}).stdout
    assert "…" not in piped
    for row in rows:
        whole = [f"│ {row['cache']} ", f" {row['budget']:,} ", f" {row['prefill']} ",
                 f" {format_cell(row['decode_hit'])} "]
        assert any(all(cell in line for cell in whole) for line in piped.splitlines()), row


# --- run --set: any scenario setting, spelled as sweep's grid keys --------------------------------

def test_run_set_gives_what_the_edited_file_gives(tmp_path):
    import tomllib

    import tomli_w

    scenario = SCENARIO_DIR / "ds4-504-per-class.toml"
    key = "engine.flags.ssd-streaming-cache-experts"
    via_set = json.loads(expertsim("run", scenario, "--set", f"{key}=4096", "--json").stdout)
    data = tomllib.loads(scenario.read_text())
    data["engine"]["flags"]["ssd-streaming-cache-experts"] = "4096"  # ds4 reads its flags as text
    # In the test's own folder, never beside the original: another worker copying scenarios/ would meet a file
    # that vanishes mid-copy (CI at stop 39). The scenario names its hardware and model, no relative path.
    edited = tmp_path / "edited.toml"
    edited.write_text(tomli_w.dumps(data))
    via_file = json.loads(expertsim("run", edited, "--json").stdout)
    assert via_set["provenance"]["settings"] == {key: "4096"}
    assert via_set["provenance"]["scenario_sha256"] == via_file["provenance"]["scenario_sha256"]
    for metric in ("decode_tok_s", "cache_slots", "decode_hit_rate", "ttft_s"):
        assert via_set[metric] == via_file[metric], metric
    plain = json.loads(expertsim("run", scenario, "--json").stdout)
    assert plain["cache_slots"] != via_set["cache_slots"]


@pytest.mark.parametrize("setting, needle", [
    ("engine.flags.nope=1", "unknown ds4 flag"),
    ("engine.flags.ctx=1,2", "one value per key"),
    ("engine.flags.ctx", "--set"),
    ("engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB=nan", "finite"),  # issue 34: accepted before
])
def test_run_set_errors_are_one_line(setting, needle):
    proc = expertsim("run", SCENARIO_DIR / "ds4-504-per-class.toml", "--set", setting, check=False)
    assert proc.returncode == 2 and needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


# --- hardware list|show, model show -------------------------------------------------------------

def test_hardware_list_names_every_profile_of_the_repository():
    import tomllib

    rows = {r["name"]: r for r in _strict_loads(expertsim("hardware", "list", "--json").stdout)}
    for path in (SCENARIO_DIR / "hardware").glob("*.toml"):
        data = tomllib.loads(path.read_text())
        assert rows[path.stem]["ram_gib"] == data["host"]["ram_gib"]["value"]
        assert rows[path.stem]["memory"] == data.get("memory", "discrete")


def test_hardware_show_gives_each_figure_with_its_unit_and_source():
    import tomllib

    data = tomllib.loads((SCENARIO_DIR / "hardware" / "rtx-4090.toml").read_text())
    shown = _strict_loads(expertsim("hardware", "show", "rtx-4090", "--json").stdout)
    figures = {f["key"]: f for f in shown["figures"]}
    for key in ("gpu.vram_gib", "pcie.h2d_pinned_gbps", "host.memcpy_gbps"):
        table, leaf = key.split(".")
        assert figures[key]["value"] == data[table][leaf]["value"]
        assert figures[key]["unit"] == data[table][leaf]["unit"] and figures[key]["source"] == data[table][leaf]["source"]
    proc = expertsim("hardware", "show", "no-such-box", check=False)
    assert proc.returncode == 2 and "no-such-box" in proc.stderr and "Traceback" not in proc.stderr


def test_model_list_names_every_preset_with_its_geometry():
    """Issue 34: there was `model show` but no `model list`. Each preset once, its figures those `model show` gives."""
    from sim.model.presets import preset_names

    listed = _strict_loads(expertsim("model", "list", "--json").stdout)
    assert [row["name"] for row in listed] == preset_names()
    flash = next(row for row in listed if row["name"] == "deepseek-v4-flash-q2-q4")
    assert (flash["layers"], flash["experts"], flash["top_k"], flash["classes"]) == (43, 256, 6, 2)  # ds4-engine.md §2.3


def test_model_show_gives_the_size_classes_of_the_mixed_quant_flash():
    shown = _strict_loads(expertsim("model", "show", "deepseek-v4-flash-q2-q4", "--json").stdout)
    # ds4-engine.md §2.3: blocks 37-42 Q4_K, the rest IQ2_XXS gate/up + Q2_K down; 256 experts, top-6, 43 layers.
    # GGML block sizes (Q4_K 144 B per 256 weights; IQ2_XXS 66 B, Q2_K 84 B) over 3 x 4096 x 2048 weights:
    q4 = 3 * 4096 * 2048 // 256 * 144
    q2 = 2 * 4096 * 2048 // 256 * 66 + 4096 * 2048 // 256 * 84
    assert [(c["expert_bytes"], c["layers"], c["blocks"]) for c in shown["size_classes"]] == \
        [(q2, 37, "0-36"), (q4, 6, "37-42")]
    assert shown["experts_per_layer"] == 256 and shown["top_k"] == 6
    assert shown["total_expert_bytes"] == 256 * (37 * q2 + 6 * q4)


def test_bench_quick_shows_progress_and_leaves_the_long_rows_out():
    # one scenario given, so only it is timed (the seeds' rows are the same loop, without a file list)
    proc = expertsim("bench", "--quick", "--tokens", "2000", "--scenario", SCENARIO_DIR / "ds4-504-per-class.toml",
                     "--json")
    rows = {row["name"]: row for row in _strict_loads(proc.stdout)}
    assert "lru_replay_layer" in rows
    assert [n for n in rows if n.startswith("run_")] == ["run_ds4-504-per-class", "run_ds4-504-per-class_accesses",
                                                         "run_ds4-504-per-class_over_lru_replay"]
    assert rows["machine_probe"]["value"] > 0
    assert rows["run_ds4-504-per-class"]["value"] > 0 and rows["run_ds4-504-per-class"]["target"] is None
    assert not any(n.startswith(("sweep_", "routing_256k", "run_strata_256k")) for n in rows)
    assert [line.split(":")[0] for line in proc.stderr.strip().splitlines()] == ["bench [1/3]", "bench [2/3]",
                                                                                  "bench [3/3]"]


def _stderr_at_a_terminal(args, env: dict) -> str:
    """stderr of the command attached to a pseudo-terminal (stdout piped), as a user at a shell sees it."""
    import pty

    controller, terminal = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "sim", *map(str, args)], stdout=subprocess.PIPE, stderr=terminal,
                            env={**os.environ, **env})
    os.close(terminal)
    shown = _read_until_closed(controller)
    proc.communicate(timeout=120)
    assert proc.returncode == 0, shown
    return shown


def test_a_cold_kernel_cache_says_it_is_compiling_once_and_a_warm_one_says_nothing(tmp_path):
    """Issue 34: the first `expertsim demo` was silent for ~21 s while numba compiled. At a terminal, a run whose
    kernels are not cached says so once; the same run again (cached) does not; a pipe never gets the line."""
    from sim.cli.compiling import COMPILING_LINE

    env = {"NUMBA_CACHE_DIR": str(tmp_path / "numba-cache"), "COLUMNS": "120"}
    gen = ["trace", "gen", "--preset", "mixtral-8x7b", "--prompt-tokens", "8", "--decode-tokens", "8", "--force",
           "--json", "-o", tmp_path / "t.parquet"]
    assert _stderr_at_a_terminal(gen, env).count(COMPILING_LINE) == 1
    assert COMPILING_LINE not in _stderr_at_a_terminal(gen, env)
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "another-cold-cache")
    piped = subprocess.run([sys.executable, "-m", "sim", *map(str, gen)], capture_output=True, text=True,
                           env={**os.environ, **env})
    assert piped.returncode == 0 and COMPILING_LINE not in piped.stderr and json.loads(piped.stdout)["rows"] == 16


# What each command needs besides the option under test, so that the option's value is what is judged. A command
# with a number option and no entry here fails the fuzz test below: a new option is covered the day it is added.
SCENARIO_ARG = str(Path(__file__).resolve().parents[1] / "scenarios" / "ds4-504-per-class.toml")
NUMBER_OPTION_CONTEXT = {
    "sweep": ["sweep", SCENARIO_ARG, "--grid", "engine.flags.prefill-chunk=2048,4096", "-o", "{tmp}/sweep"],
    "plan": ["plan", SCENARIO_ARG],
    "validate": ["validate", "--case", "D1"],
    "scenario init": ["scenario", "init", "--model", "mixtral-8x7b", "--hardware", "rtx-4090", "-o", "{tmp}/i.toml"],
    "bench": ["bench", "--quick"],
    "calibrate": ["calibrate"],
    "run": ["run", SCENARIO_ARG, "--uncertainty", "1"],
    "trace import": ["trace", "import", GENERIC_CSV, "-o", "{tmp}/i.parquet"],
    "trace gen": ["trace", "gen", "--preset", "mixtral-8x7b", "--prompt-tokens", "4", "--decode-tokens", "4", "-o",
                  "{tmp}/g.parquet"],
    "trace record": ["trace", "record", "--model", "{tmp}", "-o", "{tmp}/r.parquet"],
    "trace locality": ["trace", "locality", "{tmp}/g.parquet"],
}
BAD_NUMBERS = st.one_of(st.sampled_from(["nan", "inf", "-inf", "1e30", "abc", "", "1.5e400"]),
                        st.integers(max_value=-1).map(str), st.integers(min_value=2**63, max_value=2**200).map(str))


def _all_number_options():
    """(command path, option) of every int or float option, from the commands' own signatures."""
    import inspect
    import typing

    import typer

    from sim.cli import app

    cases = []

    def visit(group, path):
        for info in group.registered_commands:
            hints = typing.get_type_hints(info.callback)
            for name, parameter in inspect.signature(info.callback).parameters.items():
                kind = hints.get(name)
                if typing.get_origin(kind) in (typing.Union, type(int | None)):
                    kind = next(a for a in typing.get_args(kind) if a is not type(None))
                if isinstance(parameter.default, typer.models.OptionInfo) and kind in (int, float):
                    declared = parameter.default.param_decls or ()
                    flag_name = next((d for d in declared if d.startswith("--")), "--" + name.replace("_", "-"))
                    cases.append((" ".join([*path, info.name or info.callback.__name__]), flag_name))
        for sub in group.registered_groups:
            visit(sub.typer_instance, [*path, sub.name])

    visit(app, [])
    return cases


NUMBER_OPTIONS = _all_number_options()


def test_every_number_option_is_in_the_fuzz_test():
    assert len(NUMBER_OPTIONS) >= 20 and {c for c, _ in NUMBER_OPTIONS} <= set(NUMBER_OPTION_CONTEXT)


@pytest.mark.parametrize("command, option", NUMBER_OPTIONS, ids=lambda v: v)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=BAD_NUMBERS)
def test_fuzz_a_number_option_refuses_what_is_not_in_its_range(tmp_path, command, option, value):
    """Issue 34: every number option of every command, given a value no setting has (negative, non-finite, huge,
    not a number), ends in one error naming it: a usage error (exit 2) or the one-line InputError; never a
    traceback (a huge --workers overflowed a C int) and never a run (validate took --seed -1)."""
    from typer.testing import CliRunner

    from sim.cli import app
    from sim.errors import InputError

    (tmp_path / "g.parquet").exists() or expertsim("trace", "gen", "--preset", "mixtral-8x7b", "--prompt-tokens", 4,
                                                   "--decode-tokens", 4, "-o", tmp_path / "g.parquet")
    args = [a.replace("{tmp}", str(tmp_path)) for a in NUMBER_OPTION_CONTEXT[command]]
    result = CliRunner().invoke(app, [*args, option, value, "--force"] if "-o" in args else [*args, option, value],
                                env={"COLUMNS": "120"})
    if isinstance(result.exception, InputError):
        return  # refused by our own checks: the CLI prints it as one line and exits 2
    assert result.exit_code == 2, (command, option, value, result.exit_code, result.output[-500:],
                                   repr(result.exception))
    assert option in result.output or option.lstrip("-") in result.output, result.output
