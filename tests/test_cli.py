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
    (["bench", "--quick", "--scenario", "no-such.toml"], "no-such.toml"),
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


@pytest.mark.parametrize("words, expected", [("expertsim hard", "hardware"), ("expertsim scenario i", "init"),
                                             ("expertsim report out --plotly", "--plotly-js")])
def test_shell_completion_completes_commands_and_options(words, expected):
    # what bash's completion function (expertsim --show-completion) asks the installed script
    script = Path(sys.executable).with_name("expertsim")
    env = {**os.environ, "_EXPERTSIM_COMPLETE": "complete_bash", "COMP_WORDS": words,
           "COMP_CWORD": str(len(words.split()) - 1)}
    proc = subprocess.run([str(script)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and expected in proc.stdout.split(), (proc.stdout, proc.stderr)


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
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr and lines[-1] == "expertsim: interrupted"
    assert all(line.startswith("bench [") for line in lines[:-1])  # the progress lines before it


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

def _in_a_terminal(columns: int, *args) -> str:
    """stdout of the command attached to a pseudo-terminal `columns` wide, as a user at a shell sees it."""
    import pty

    controller, terminal = pty.openpty()
    env = {**os.environ, "COLUMNS": str(columns), "LINES": "50", "TERM": "dumb"}
    proc = subprocess.Popen([sys.executable, "-m", "sim", *map(str, args)], stdout=terminal, stderr=subprocess.PIPE,
                            env=env)
    os.close(terminal)
    chunks = []
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # the terminal closed: the command ended
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(controller)
    assert proc.wait(timeout=60) == 0
    return b"".join(chunks).decode()


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
@pytest.mark.parametrize("columns", [50, 80])
def test_a_narrow_terminal_never_cuts_a_number(columns):
    rows = json.loads(expertsim("demo", "--json").stdout)["rows"]
    shown = _in_a_terminal(columns, "demo")
    assert "…" not in shown
    for row in rows:
        assert f"{row['budget']:,}" in shown and f"{row['decode_hit']:.4f}" in shown


def test_a_piped_table_keeps_each_row_on_one_line():
    rows = json.loads(expertsim("demo", "--json").stdout)["rows"]
    piped = subprocess.run([sys.executable, "-m", "sim", "demo"], capture_output=True, text=True,
                           env={**os.environ, "COLUMNS": "40"}).stdout
    assert "…" not in piped
    for row in rows:
        whole = [f"│ {row['cache']} ", f" {row['budget']:,} ", f" {row['prefill']} ", f" {row['decode_hit']:.4f} "]
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
    edited = SCENARIO_DIR / f"_edited-{os.getpid()}.toml"  # beside the original: relative paths resolve alike
    try:
        edited.write_text(tomli_w.dumps(data))
        via_file = json.loads(expertsim("run", edited, "--json").stdout)
    finally:
        edited.unlink()
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
    assert [n for n in rows if n.startswith("run_")] == ["run_ds4-504-per-class", "run_ds4-504-per-class_accesses"]
    assert rows["run_ds4-504-per-class"]["value"] > 0 and rows["run_ds4-504-per-class"]["target"] is None
    assert not any(n.startswith(("sweep_", "routing_256k", "run_strata_256k")) for n in rows)
    assert [line.split(":")[0] for line in proc.stderr.strip().splitlines()] == ["bench [1/2]", "bench [2/2]"]
