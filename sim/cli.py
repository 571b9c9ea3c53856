"""The `expertsim` command: parses arguments, calls the library, prints tables or JSON. Nothing else.

Every verb that prints a table takes --json and then prints only JSON on stdout. Bad input ends with one
line on stderr naming the file, field and value, and exit code 2.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from enum import Enum
from typing import Optional

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from sim.engines import ENGINES
from sim.errors import InputError
from sim.outputs import claim_file, claim_folder, dumps
from sim.units import GIB

ENGINE_NAMES = tuple(ENGINES)
DEFAULT_OBJECTIVES = ", ".join(f"{e.default_objective} for {e.label}" for e in ENGINES.values() if e.timed)

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Simulate MoE expert caches (SSD, RAM, GPU) of local LLM inference engines.")
trace_app = typer.Typer(no_args_is_help=True, help="Routing traces: import, generate, record, measure.")
app.add_typer(trace_app, name="trace")
hardware_app = typer.Typer(no_args_is_help=True, help="Hardware profiles: list them, show one's figures and sources, "
                                                        "copy one with figures changed.")
app.add_typer(hardware_app, name="hardware")
model_app = typer.Typer(no_args_is_help=True, help="Model layouts: a preset's or a GGUF file's experts and classes.")
app.add_typer(model_app, name="model")
scenario_app = typer.Typer(no_args_is_help=True, help="Scenarios: write a commented starting scenario.")
app.add_typer(scenario_app, name="scenario")

_NUMBER = re.compile(r"[-+]?[\d,]*\.?\d+(e[-+]?\d+)?")
PIPED_WIDTH = 10_000  # columns of a table written to a pipe or file: never cut, one line per row for grep and awk
EXIT_BAD_INPUT = 2
EXIT_POINTS_FAILED = 1  # a sweep that ran but where points failed: not bad input (2), not success
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a process ended by Ctrl-C
REDELIVER_S = 0.01  # a Ctrl-C that Python dropped is sent again this much later (see _CtrlC)
REDELIVERY_TAKEN_S = 1.0  # restore waits at most this long for a redelivery already sent to reach the handler


class Interrupted(BaseException):
    """Ctrl-C, raised by our SIGINT handler. Not a KeyboardInterrupt: click and typer turn that into exit 1
    ("Aborted!") or a silent exit 130 depending on their version, and commands need to say what was saved."""


class _CtrlC:
    """Ctrl-C raises Interrupted while installed. Python prints and drops an exception that escapes a finalizer or
    a ctypes callback ("Exception ignored in ..."), and llvmlite runs both while numba compiles (its objects'
    __del__, its object-cache notify callback): a Ctrl-C landing in one would be lost and the command would run
    on. Python hands every such exception to sys.unraisablehook, so an Interrupted that reaches it is delivered
    again once that code has returned, and `dropped` remembers it: the code it cut short may fail before then
    (numba, its object never stored, raises "no compiled object yet"), and that failure is the interrupt's.
    A redelivery that comes once the interrupt is being acted on (an Interrupted is being handled, or `closing`)
    is taken and ignored: raised there it would end the command with a traceback, and after `restore` it would
    reach the interpreter's shutdown as a KeyboardInterrupt."""

    def __init__(self) -> None:
        self.dropped = False
        self.closing = False
        self._redelivery: threading.Timer | None = None
        self._on_its_way = threading.Event()  # a redelivery sent and not yet taken by the handler
        self._previous_handler = signal.signal(signal.SIGINT, self._interrupt)
        self._previous_hook = sys.unraisablehook
        sys.unraisablehook = self._redeliver

    def _interrupt(self, signum, frame):
        self._on_its_way.clear()
        if self.closing or isinstance(sys.exception(), Interrupted):
            return
        raise Interrupted()

    def _send_again(self) -> None:
        self._on_its_way.set()
        os.kill(os.getpid(), signal.SIGINT)

    def _redeliver(self, unraisable) -> None:
        if not isinstance(unraisable.exc_value, Interrupted):
            self._previous_hook(unraisable)
            return
        self.dropped = True
        self._redelivery = threading.Timer(REDELIVER_S, self._send_again)
        self._redelivery.start()

    def restore(self) -> None:
        """The previous handler and hook back, after any redelivery: one not yet sent is not sent, one sent is
        taken here."""
        self.closing = True
        if self._redelivery is not None:
            self._redelivery.cancel()
            self._redelivery.join()
        deadline = time.monotonic() + REDELIVERY_TAKEN_S
        while self._on_its_way.is_set() and time.monotonic() < deadline:
            time.sleep(REDELIVER_S)  # Python runs the handler in this thread, between two sleeps
        signal.signal(signal.SIGINT, self._previous_handler)
        sys.unraisablehook = self._previous_hook


def _version(value: bool) -> None:
    if value:
        from sim.version import __version__

        typer.echo(f"expertsim {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                          help="print the version and exit")) -> None:
    """Simulate MoE expert caches (SSD, RAM, GPU) of local LLM inference engines."""


def _force():
    return typer.Option(False, "--force", help="replace output files that already exist")


def _print_json(payload) -> None:
    sys.stdout.write(dumps(payload, indent=2) + "\n")


def _print(*renderables) -> None:
    """Print to stdout as it is now (a test runner or a notebook may have replaced it): at the terminal's width
    with cells folded where they must, and when piped at a width that never cuts a row."""
    console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else PIPED_WIDTH)
    console.print(*renderables)


def _table(title: str, rows: list[dict], columns: list[str] | None = None) -> Table:
    columns = columns or (list(rows[0]) if rows else [])
    cells = [[_fmt(row.get(c)) for c in columns] for row in rows]
    table = Table(title=title, title_justify="left")
    for i, c in enumerate(columns):
        numbers = [r[i] for r in cells if _NUMBER.fullmatch(r[i])]
        # a narrow terminal folds text inside its cell ("fold", not "…") and never splits a number: a number
        # column is at least as wide as its widest number
        filled = [r[i] for r in cells if r[i]]
        table.add_column(c, overflow="fold", min_width=max(map(len, numbers), default=None),
                         justify="right" if filled and len(numbers) == len(filled) else "left")
    for r in cells:
        table.add_row(*r)
    return table


def _fmt(value) -> str:
    if isinstance(value, (float, np.floating)):
        if np.isnan(value):
            return "-"
        return f"{value:.4f}" if abs(value) < 10 else f"{value:,.1f}"
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return f"{int(value):,}"
    return "" if value is None else str(value)


def _gib(n_bytes) -> float:
    return float(n_bytes) / GIB


def _write_trace(trace, output: Path) -> None:
    from sim.trace.format import write_trace

    try:
        write_trace(trace, output)
    except OSError as exc:
        raise InputError(str(output), "output", str(output), f"cannot write: {exc.strerror}") from None


def _trace_summary(trace, output: Path) -> dict:
    h = trace.header
    return {"output": str(output), "model": h.model, "rows": trace.n_rows, "n_layers": h.n_layers,
            "n_experts": h.n_experts, "top_k": h.top_k, "lookups": trace.n_lookups,
            "missing_cells": int(trace.missing_cells().sum()), "sha256": trace.sha256()}


def _report_written(summary: dict, as_json: bool) -> None:
    if as_json:
        _print_json(summary)
    else:
        _print(_table("trace written", [{"key": k, "value": v} for k, v in summary.items()], ["key", "value"]))


# --- trace ----------------------------------------------------------------------------------------


@trace_app.command("import")
def trace_import(
    file: Path = typer.Argument(..., help="vLLM select_experts JSONL, or a generic CSV/JSONL"),
    output: Path = typer.Option(..., "-o", "--output", help="Parquet trace to write"),
    fmt: str = typer.Option("auto", "--format", help="auto | vllm-jsonl | csv | jsonl"),
    n_experts: Optional[int] = typer.Option(None, help="experts per layer (default: from --model, else max id + 1)"),
    model: Optional[str] = typer.Option(None, help="model preset name the trace belongs to"),
    force: bool = _force(),
    as_json: bool = typer.Option(False, "--json", help="print JSON only"),
):
    """Convert a routing log into an expertsim trace."""
    from sim.trace.importers import import_trace

    claim_file(output, force, "--output")
    trace = import_trace(file, fmt, n_experts=n_experts, model=model)
    _write_trace(trace, output)
    _report_written(_trace_summary(trace, output), as_json)


@trace_app.command("gen")
def trace_gen(
    preset: str = typer.Option(..., help="generator preset (a model preset name)"),
    prompt_tokens: int = typer.Option(..., help="prompt (prefill) tokens per request"),
    decode_tokens: int = typer.Option(..., help="decoded tokens per request"),
    seed: int = typer.Option(0, help="random seed: same seed, same trace"),
    requests: int = typer.Option(1, help="independent requests"),
    output: Path = typer.Option(..., "-o", "--output", help="Parquet trace to write"),
    reuse_decode: Optional[float] = typer.Option(None, "--reuse-decode", help="your measured adjacent-token "
                                                 "reuse in decode (share of a token's experts the previous token "
                                                 "picked too) in place of the preset's"),
    reuse_prefill: Optional[float] = typer.Option(None, "--reuse-prefill", help="the same in prefill"),
    entropy: Optional[float] = typer.Option(None, "--entropy", help="normalized popularity entropy of the middle "
                                            "layers (1 = uniform), for presets with a generic popularity"),
    force: bool = _force(),
    as_json: bool = typer.Option(False, "--json", help="print JSON only"),
):
    """Generate a synthetic trace that reproduces measured routing statistics (the preset's, or yours)."""
    from sim.trace.generate import generate_trace

    claim_file(output, force, "--output")
    statistics = {k: v for k, v in (("reuse_decode", reuse_decode), ("reuse_prefill", reuse_prefill),
                                    ("entropy", entropy)) if v is not None}
    trace = generate_trace(preset, prompt_tokens, decode_tokens, seed, requests, statistics or None)
    _write_trace(trace, output)
    _report_written(_trace_summary(trace, output), as_json)


@trace_app.command("record")
def trace_record(
    model: Path = typer.Option(..., help="local Hugging Face MoE model directory"),
    output: Path = typer.Option(..., "-o", "--output", help="Parquet trace to write"),
    prompt: Optional[str] = typer.Option(None, help="prompt text (needs the model's tokenizer)"),
    prompt_tokens: Optional[int] = typer.Option(None, help="random prompt of this many token ids"),
    decode_tokens: int = typer.Option(16, help="greedy decode steps"),
    seed: int = typer.Option(0),
    requests: int = typer.Option(1),
    force: bool = _force(),
    as_json: bool = typer.Option(False, "--json", help="print JSON only"),
):
    """Record router top-k per layer from a transformers MoE model (needs expertsim[record])."""
    from sim.trace.record import record_trace

    claim_file(output, force, "--output")
    trace = record_trace(model, prompt=prompt, prompt_tokens=prompt_tokens, decode_tokens=decode_tokens,
                         seed=seed, requests=requests)
    _write_trace(trace, output)
    _report_written(_trace_summary(trace, output), as_json)


@trace_app.command("stats")
def trace_stats_cmd(
    trace_path: Path = typer.Argument(..., metavar="TRACE"),
    as_json: bool = typer.Option(False, "--json", help="print JSON only"),
):
    """Routing statistics: reuse per layer, entropy, skew, prefill unions, co-activation."""
    from sim.trace.format import read_trace
    from sim.trace.stats import trace_stats

    stats = trace_stats(read_trace(trace_path))
    if as_json:
        _print_json(stats)
        return
    _print(_table(f"{trace_path}", [{"statistic": k, "value": v} for k, v in stats["summary"].items()],
                     ["statistic", "value"]))
    _print(_table("per layer", stats["per_layer"]))
    _print(_table("prefill union vs chunk length", stats["prefill_union"]))
    for part, values in (stats.get("coactivation") or {}).items():
        rows = [{"statistic": k, "value": v} for k, v in values.items() if not isinstance(v, (list, dict))]
        _print(_table(f"co-activation ({part.replace('_', ' ')})", rows, ["statistic", "value"]))


# --- hardware and model --------------------------------------------------------------------------


@hardware_app.command("list")
def hardware_list(as_json: bool = typer.Option(False, "--json", help="print JSON only")):
    """Every hardware profile a scenario can name from here (./hardware, ./scenarios/hardware, upward, then
    expertsim's own)."""
    from sim.hardware import find_profiles, load_hardware_file, profile_summary

    rows = []
    for path in find_profiles(Path.cwd()):
        try:
            rows.append(profile_summary(load_hardware_file(path.resolve())))
        except InputError as exc:  # one broken profile of the user's does not hide the others
            rows.append({"name": path.stem, "path": str(path), "error": str(exc)})
    if as_json:
        _print_json(rows)
        return
    _print(_table("hardware profiles (vram_gib: none for unified memory; ssd_gbps at the deepest queue)", rows,
                  ["name", "os", "memory", "vram_gib", "ram_gib", "ssd_gbps", "h2d_pinned_gbps", "calibrated", "path",
                   *(["error"] if any("error" in r for r in rows) else [])]))


@hardware_app.command("show")
def hardware_show(profile: str = typer.Argument(..., metavar="PROFILE", help="a profile name or a .toml path"),
                  as_json: bool = typer.Option(False, "--json", help="print JSON only")):
    """One profile's figures, each with its unit and source (and its range where it is an estimate)."""
    from sim.hardware import load_hardware, profile_figures, profile_summary

    loaded = load_hardware(profile)
    summary, figures = profile_summary(loaded), profile_figures(loaded)
    if as_json:
        _print_json({"summary": summary, "figures": figures})
        return
    _print(_table(f"{summary['name']} ({summary['path']})", figures, ["key", "value", "unit", "source", "range"]))


@hardware_app.command("init")
def hardware_init(
    base: str = typer.Argument(..., metavar="BASE", help="the profile to copy: a name or a .toml path"),
    output: Path = typer.Option(..., "-o", "--output", help="profile TOML to write (e.g. hardware/NAME.toml: a "
                                                            "scenario beside hardware/ names it NAME)"),
    settings: list[str] = typer.Option([], "--set", metavar="FIELD=VALUE",
                                       help="change one field, e.g. gpu.vram_gib=48 (or vram_gib=48 where one table "
                                            "has it); its source then says it is your what-if; repeat for more"),
    name: Optional[str] = typer.Option(None, "--name", help="the copy's name (default: the output file's name)"),
    force: bool = _force(),
    as_json: bool = typer.Option(False, "--json", help="print JSON only"),
):
    """A copy of a hardware profile with fields changed, its comments kept and its calibration path rebased."""
    from sim.scaffold import write_hardware

    claim_file(output, force, "--output")
    written = write_hardware(base, output, settings, name)
    if as_json:
        _print_json(written)
        return
    rows = [{"key": k, "value": written[k]} for k in ("path", "name", "base", "calibration", "scenario_names_it")]
    rows[3:3] = [{"key": "--set", "value": f"{k} = {v}"} for k, v in written["changed"].items()]
    _print(_table(f"hardware profile written: {written['path']}", rows, ["key", "value"]))


@model_app.command("show")
def model_show(model: str = typer.Argument(..., metavar="MODEL", help="a model preset name or a .gguf file"),
               as_json: bool = typer.Option(False, "--json", help="print JSON only")):
    """A model's routed-expert layout: layers, experts, top-k, and per size class the bytes of one expert."""
    layout = _layout_for(model, "")
    described = layout.describe()
    if as_json:
        _print_json(described)
        return
    _print(_table(f"{described['name']}: {described['source']}",
                  [{"key": k, "value": v} for k, v in described.items() if k not in ("size_classes", "source", "name")],
                  ["key", "value"]))
    _print(_table("size classes (one cache per class in ds4 since PR #504)", described["size_classes"]))


@scenario_app.command("init")
def scenario_init(
    model: str = typer.Option(..., "--model", help="a model preset or a .gguf file"),
    hardware: str = typer.Option(..., "--hardware", help="a hardware profile name or a .toml path"),
    engine: str = typer.Option("auto", "--engine", help=f"auto | {' | '.join(ENGINE_NAMES)} (auto: the engine that "
                                                        "runs the model, else a cache-only replay)"),
    variant: Optional[str] = typer.Option(None, "--variant", help="the engine build (default: its newest for the "
                                                                  "model)"),
    # a starting workload, our choice: one chat-sized request, simulated in seconds
    prompt_tokens: int = typer.Option(2048, "--prompt-tokens", min=1, help="the request's prompt tokens"),
    decode_tokens: int = typer.Option(256, "--decode-tokens", min=0, help="the request's tokens of answer"),
    settings: list[str] = typer.Option([], "--set", metavar="KEY=VALUE",
                                       help="set one scenario key, as run --set does (e.g. "
                                            "engine.flags.prefill-chunk=4096); repeat for more"),
    output: Path = typer.Option(..., "-o", "--output", help="scenario TOML to write"),
    force: bool = _force(),
    as_json: bool = typer.Option(False, "--json", help="print JSON only"),
):
    """Write a commented starting scenario for a model on a machine: the engine's defaults, each line explained."""
    from sim.scaffold import write_scenario

    claim_file(output, force, "--output")
    written = write_scenario(output, model, hardware, prompt_tokens, decode_tokens, engine, variant, settings)
    if as_json:
        _print_json(written)
        return
    trace = written["trace"]
    rows = [{"key": "path", "value": written["path"]},
            {"key": "engine", "value": f"{written['engine']} ({written['engine_choice']})"},
            *([{"key": "variant", "value": written["variant"]}] if written["variant"] else []),
            {"key": "model", "value": written["model"]}, {"key": "hardware", "value": written["hardware"]},
            {"key": "trace", "value": trace.get("path") or f"generator {trace['generator']}, seed {trace['seed']}"},
            {"key": "workload", "value": f"{prompt_tokens:,} prompt tokens, {decode_tokens:,} tokens of answer"},
            *({"key": "--set", "value": f"{k} = {v}"} for k, v in written["settings"].items()),
            {"key": "next", "value": f"expertsim run {written['path']} -o OUT"}]
    _print(_table(f"scenario written: {written['path']}", rows, ["key", "value"]))
    if written["warning"]:
        _print(f"warning: {written['warning']}")


# --- cache ----------------------------------------------------------------------------------------


def _layout_for(model: Optional[str], trace_model: str):
    """--model as a preset name or a .gguf path; else the trace's own model if it is a preset."""
    from sim.model.presets import get_preset, preset_names

    if model is None:
        return get_preset(trace_model) if trace_model in preset_names() else None
    if model.endswith(".gguf") or Path(model).is_file():
        from sim.model.gguf_reader import layout_from_gguf

        return layout_from_gguf(model)
    return get_preset(model)


@app.command()
def cache(
    trace_path: Path = typer.Argument(..., metavar="TRACE"),
    policy: str = typer.Option("lru", help="lru | lfu | opt | static | ds4-slab"),
    scope: str = typer.Option("layer", help="layer | class | global (one pool per layer, per size class, or one)"),
    slots_per_layer: Optional[str] = typer.Option(None, help="slots per layer: N, or one per layer a,b,c"),
    slots: Optional[str] = typer.Option(None, help="slots of the pool (global) or per class (N or a,b,c)"),
    prefill_mode: str = typer.Option("evict", help="evict | append (hit, fill free slots, else load direct)"),
    model: Optional[str] = typer.Option(None, help="model preset or .gguf giving expert sizes and classes"),
    profile: Optional[Path] = typer.Option(None, help="ranked rank,layer,expert CSV for --policy static"),
    mrc: bool = typer.Option(False, "--mrc", help="print the exact LRU miss-ratio curve (one pass)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON only"),
):
    """Replay a trace through an expert cache: hit rate, misses, direct loads and bytes."""
    from sim.cache.replay import Geometry, capacity_pools, lru_mrc, mrc_exact, parse_slots, read_profile, replay
    from sim.trace.format import read_trace

    trace = read_trace(trace_path)
    geometry = Geometry.of(trace, _layout_for(model, trace.header.model), str(trace_path))
    if mrc:
        if not mrc_exact(policy, prefill_mode):
            raise InputError("cache", "--mrc", f"{policy}/{prefill_mode}",
                             "the one-pass curve is exact for an evicting LRU only")
        _print_mrc(lru_mrc(trace, geometry, scope), trace, as_json)
        return
    scope, pool_keys = capacity_pools(geometry, policy, scope)
    if (slots_per_layer is None) == (slots is None):
        raise InputError("cache", "--slots-per-layer/--slots", "both" if slots else "neither",
                         "give exactly one capacity")
    if slots_per_layer is not None:
        if scope != "layer":
            raise InputError("cache", "--slots-per-layer", slots_per_layer, f"needs --scope layer, not {scope}")
        capacity = parse_slots(slots_per_layer, geometry.n_layers, "--slots-per-layer")
    else:
        capacity = parse_slots(slots, len(pool_keys), "--slots")
    ranking = read_profile(profile, geometry) if profile is not None else None
    result = replay(trace, geometry, policy, scope, capacity, prefill_mode, ranking)
    summary = result.summary()
    summary["load_gib"] = _gib(summary["load_bytes"])
    tables = {"per_phase": result.per_phase(), "per_class": result.per_class(), "per_layer": result.per_layer()}
    if as_json:
        _print_json({"summary": summary, **{k: v.to_dict(orient="records") for k, v in tables.items()}})
        return
    shown = {k: v for k, v in summary.items() if k not in ("trace_sha256",)}
    _print(_table(f"{trace_path}: {policy}, scope {scope}",
                     [{"key": k, "value": v} for k, v in shown.items()], ["key", "value"]))
    for name, frame in tables.items():
        _print(_table(name.replace("_", " "), frame.to_dict(orient="records")))


def _print_mrc(curve, trace, as_json: bool) -> None:
    frame = curve.curve()
    if as_json:
        _print_json({"scope": curve.scope, "trace_sha256": trace.sha256(),
                     "curve": {c: frame[c].tolist() for c in frame.columns}})
        return
    rows = []
    for c, part in frame.groupby("class"):
        # every capacity is in the JSON; the table shows a log-spaced sample
        picks = np.unique(np.geomspace(1, len(part) - 1, 16).astype(int)) if len(part) > 2 else np.arange(len(part))
        rows += part.iloc[picks].to_dict(orient="records")
    _print(_table(f"LRU miss-ratio curve, scope {curve.scope} (per class; bytes = slots x expert bytes)", rows))


# --- run -----------------------------------------------------------------------------------------

@app.command()
def run(
    scenario_path: Path = typer.Argument(..., metavar="SCENARIO", help="scenario TOML"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="folder for summary, steps and copy plan"),
    as_json: bool = typer.Option(False, "--json", help="print the summary as JSON only"),
    perfetto: Optional[Path] = typer.Option(None, "--perfetto", metavar="FILE",
                                            help="write the run's timeline as a Chrome/Perfetto trace (JSON)"),
    uncertainty: int = typer.Option(0, "--uncertainty", min=0, metavar="N",
                                    help="also run N Latin-hypercube samples of the profile's estimated inputs: "
                                         "p10/median/p90 of each metric and which input moves it most"),
    seed: int = typer.Option(0, "--seed", help="the samples' seed"),
    workers: Optional[int] = typer.Option(None, help="worker processes for --uncertainty (default: the CPU count)"),
    settings: list[str] = typer.Option([], "--set", metavar="KEY=VALUE",
                                       help="change one scenario setting for this run (a dotted key as in sweep's "
                                            "--grid, e.g. engine.flags.prefill-chunk=4096); repeat for more"),
    force: bool = _force(),
):
    """Simulate an engine serving a scenario's workload: tok/s, TTFT, hit rates, lent slots, file reads."""
    from sim.results import write_results
    from sim.simulate import run_scenario
    from sim.explore.sweep import parse_settings
    from sim.scenario import load_scenario

    if output is not None:
        claim_folder(output, force, "--output")
    if perfetto is not None:
        claim_file(perfetto, force, "--perfetto")
    data, overrides = parse_settings(scenario_path, settings) if settings else (None, {})
    scenario = load_scenario(scenario_path, data)
    engine = ENGINES[scenario.engine.name]
    if perfetto is not None and not engine.timed:
        raise InputError(str(scenario_path), "--perfetto", str(perfetto), f"{engine.description} has no timeline")
    if uncertainty and not engine.timed:
        raise InputError(str(scenario_path), "--uncertainty", uncertainty, f"{engine.description} reads no hardware")
    result = run_scenario(scenario)
    if overrides:
        result.summary["provenance"]["settings"] = overrides  # the scenario hash covers them too
    if uncertainty:
        result.summary["uncertainty"] = _uncertainty(scenario_path, scenario, uncertainty, seed, workers, data)
    if output is not None:
        result.summary["files"] = write_results(result, output)
    if perfetto is not None:
        from sim.results import link_frame
        from sim.explore.report import write_perfetto

        write_perfetto(result.steps, result.summary, perfetto, link_frame(result.links))
        result.summary["perfetto"] = str(perfetto)
    if as_json:
        _print_json(result.summary)
        return
    s = result.summary
    from sim.explore.runner import METRICS

    title = (f"{s['engine']} {s['variant']} on {s['hardware']}, {s['model']}" if engine.timed else
             f"{s['provenance']['command_line']}, {s['model']} (cache only)")
    _print(_table(f"{scenario_path}: {title}", [{"key": k, "value": s[k]} for k in engine.headline or METRICS if k in s],
                  ["key", "value"]))
    for table in engine.summary_tables:
        _print(_table(table.replace("_", " "), s[table]))
    for notice in s["engine_state"].get("notices", []):
        _print(f"engine: {notice}")
    for warning in s.get("out_of_domain", []):
        _print(f"out of domain: {warning}")
    if "uncertainty" in s:
        from sim.explore.uncertainty import rank_sensitivity

        u = s["uncertainty"]
        _print(_table(f"under uncertainty: {u['n']} samples of {len(u['inputs'])} estimated inputs "
                         f"({u['failed_samples']} failed)",
                         [{"key": k, **{q: b[q] for q in ("p10", "median", "p90")}} for k, b in u["bands"].items()
                          if b["n"] and k in s], ["key", "p10", "median", "p90"]))
        metric = "decode_tok_s" if s.get("decode_tok_s") else "prefill_tok_s"
        top = rank_sensitivity(u["sensitivity"], metric)[:8]
        _print(_table(f"what moves {metric} most: each input alone at the ends of its range",
                         [{"input": r["input"], "range": f"{_fmt(r['low'])}-{_fmt(r['high'])}",
                           "at low": r[f"{metric}@low"], "at high": r[f"{metric}@high"]} for r in top],
                         ["input", "range", "at low", "at high"]))


def _uncertainty(scenario_path: Path, scenario, n: int, seed: int, workers: Optional[int], data: dict | None) -> dict:
    from sim.explore.runner import make_point
    from sim.explore.uncertainty import propagate
    from sim.scenario import scenario_hash
    from sim.schema import read_toml

    data = data if data is not None else read_toml(scenario_path, str(scenario_path))
    point = make_point(scenario_path, data, {}, scenario_hash(scenario))
    return propagate(point, scenario, n, seed, executor="processes" if (workers or 2) > 1 else "inline",
                     workers=workers)


# --- demo and bench -------------------------------------------------------------------------------


@app.command()
def demo(as_json: bool = typer.Option(False, "--json", help="print JSON only")):
    """ds4 PR #504 in miniature: one slab vs per-size-class caches on the mixed q2/q4 DeepSeek-V4-Flash."""
    from sim.explore.demo import run_demo

    result = run_demo()
    if as_json:
        _print_json(result)
        return
    _print(result["title"])
    _print(_table(result["table_title"], result["rows"]))
    for line in result["notes"]:
        _print(line)


@app.command()
def bench(
    tokens: int = typer.Option(100_000, help="decode tokens of the benchmark trace"),
    quick: bool = typer.Option(False, "--quick", help="the cache core and the seed scenarios only (under a minute)"),
    sweeps: bool = typer.Option(False, "--sweeps", help="also the 1,000-point sweep and the worker speed-up (minutes)"),
    scenario: Optional[list[Path]] = typer.Option(None, "--scenario", metavar="FILE",
                                                  help="time this scenario file instead of the seeds (repeatable)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON only"),
):
    """Speed and memory of the cache core against the targets (rows: name, value, unit, target)."""
    from sim.explore.bench import run_bench

    def show(group: str, number: int, of: int) -> None:  # on stderr: stdout stays the table or the JSON
        typer.echo(f"bench [{number}/{of}]: {group} ...", err=True)

    rows = run_bench(tokens, sweeps=sweeps, quick=quick, progress=show, scenarios=scenario or None)
    if as_json:
        _print_json(rows)
        return
    _print(_table("expertsim bench", rows, ["name", "value", "unit", "target", "met"]))


@app.command()
def calibrate(
    output: Optional[Path] = typer.Option(None, "-o", "--output",
                                          help="calibration file to write (default calibration-GPU.json); "
                                               "with --replay: the replay report (JSON)"),
    replay: Optional[Path] = typer.Option(None, "--replay", metavar="RESULTS",
                                          help="replay the copy plan of `expertsim run -o RESULTS` on this GPU"),
    calibration: Optional[Path] = typer.Option(None, "--calibration",
                                               help="calibration file for --replay (default: the run's profile's)"),
    from_samples: Optional[Path] = typer.Option(None, "--from-samples",
                                                help="refit the raw samples of a calibration file (no GPU)"),
    sizes: Optional[str] = typer.Option(None, help="expert sizes in MiB, e.g. 1,2,4,8,16"),
    experts: Optional[str] = typer.Option(None, help="experts per step, e.g. 1,2,4,...,512"),
    repeats: Optional[int] = typer.Option(None, help="repeats per configuration (default 5); with --replay: runs "
                                                     "of each step, their median compared (default 3)"),
    seed: int = typer.Option(0, help="random seed (slots, data, order)"),
    max_steps: Optional[int] = typer.Option(None, help="--replay: at most this many steps, evenly spaced"),
    tune: bool = typer.Option(True, "--tune/--no-tune", help="tune the gather kernel's launch shape first"),
    force: bool = _force(),
    as_json: bool = typer.Option(False, "--json", help="print JSON only"),
):
    """Measure copy costs on this GPU (D2D, H2D pinned/mapped, D2H; per-call latency, sync) and fit the model."""
    from sim.calibrate import api

    if output is not None:
        claim_file(output, force, "--output")
    log = (lambda msg: typer.echo(f"calibrate: {msg}", err=True))
    if replay is not None:
        report = api.replay(replay, calibration, max_steps=max_steps, seed=seed, repeats=repeats, output=output,
                            log=log)
        if as_json:
            _print_json({k: v for k, v in report.items() if k != "per_step"})
            return
        drift = report["host_drift"]
        host = "" if drift is None else f"; host probe {100 * drift:+.1f} % against the calibration's"
        _print(_table(f"replay of {replay} on {report['gpu']} (calibration: {report['calibration']['gpu']}, "
                      f"{report['calibration']['status']}, {report['repeats']} runs a step{host}); goal "
                      f"{report['goal']}", report["summary"]))
        return
    if from_samples is not None:
        result = api.refit(from_samples, output)
    else:
        result = api.measure(sizes_mib=api.parse_list(sizes, "--sizes"),
                             experts=api.parse_list(experts, "--experts", int), repeats=repeats, seed=seed,
                             tune=tune, output=output, log=log)
    record = result["record"]
    if as_json:
        _print_json({"file": result["file"], **{k: v for k, v in record.items() if k != "samples"}})
        return
    tables = api.report_rows(record)
    _print(_table(f"calibration {result['file'] or '(not written)'}", tables["summary"], ["key", "value"]))
    _print(_table("fitted cost model (us, GB/s) and relative fit error", tables["parameters"]))
    if tables["speed"]:
        _print(_table("speed", tables["speed"], ["name", "value", "unit", "target", "met", "detail"]))
    if tables["engine_vs_gather"]:
        _print(_table("the engines' way (ce_sync) vs the gather kernel, per step", tables["engine_vs_gather"]))
    _print(_table("hardware-profile fields these numbers stand for", tables["simulator_profile"], ["key", "value"]))


# --- sweep ----------------------------------------------------------------------------------------

SWEEP_COLUMNS = ("decode_tok_s", "prefill_tok_s", "decode_hit_rate", "ttft_s", "cache_slots", "lent_slots", "error")
# An untimed engine has no tok/s or TTFT: its table shows the cache's figures and the path that computed them.
COUNTS_SWEEP_COLUMNS = ("cache_slots", "cache_mib", "decode_hit_rate", "prefill_hit_rate", "hit_rate", "misses",
                        "method", "error")


def _command_again(*flags: str) -> str:
    """This command line, to paste into a shell, with `flags` in place of any it had among them."""
    import shlex

    return shlex.join(["expertsim", *(a for a in sys.argv[1:] if a not in flags), *flags])


@app.command()
def sweep(
    scenario_path: Path = typer.Argument(..., metavar="SCENARIO", help="scenario TOML"),
    grid: list[str] = typer.Option(..., "--grid", help="KEY=v1,v2,... or KEY=start:stop:step (stop included); "
                                                         "KEY a dotted scenario key, e.g. engine.flags.prefill-chunk"),
    output: Path = typer.Option(..., "-o", "--output", help="results folder (Parquet, one file per point)"),
    resume: bool = typer.Option(False, "--resume", help="continue a sweep in OUTPUT: skip the finished points"),
    retry_failed: bool = typer.Option(False, "--retry-failed", help="with --resume: compute the failed points again"),
    executor: str = typer.Option("processes", help="processes (local) or dask"),
    scheduler: Optional[str] = typer.Option(None, help="Dask scheduler address (default: a LocalCluster)"),
    workers: Optional[int] = typer.Option(None, help="worker processes (default: the CPU count)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON only"),
):
    """Run a scenario over a grid of settings; each point's headline metrics go to a Parquet dataset."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    from sim.engines import extra_metrics
    from sim.explore.runner import METRICS
    from sim.explore.sweep import expand_grid, open_results, read_points, run_sweep

    points = expand_grid(scenario_path, grid)
    # a folder of another sweep fails before the progress bar; what is on disk is read once, here
    opened = open_results(output, points, resume) if points else None
    total = len({p.point_id for p in points})
    options = dict(executor=executor, workers=workers, scheduler=scheduler, resume=resume, retry_failed=retry_failed,
                   opened=opened)
    try:
        if as_json:
            result = run_sweep(points, output, **options)
        else:
            with Progress(TextColumn("sweep"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          TextColumn("ETA"), TimeRemainingColumn(), console=Console(stderr=True)) as bar:
                task = bar.add_task("sweep", total=total)

                def advance(row, finished, total):
                    bar.update(task, completed=finished, total=total)

                result = run_sweep(points, output, progress=advance, **options)
    except Interrupted:
        saved = len(read_points(output)[0]) if points else 0
        typer.echo(f"expertsim: interrupted: {saved} of {total} points are saved in {output}; continue with: "
                   f"{_command_again('--resume')}", err=True)
        sys.exit(EXIT_INTERRUPTED)
    frame = result.points_frame()
    order = {p.point_id: i for i, p in reversed(list(enumerate(points)))}
    frame = frame[frame["point_id"].isin(order)].sort_values("point_id", key=lambda ids: ids.map(order))
    keys = list(points[0].overrides) if points else []
    extra = [c for c in (*extra_metrics(), "method") if c in frame]  # absent from rows of older sweeps
    metrics = [c for c in METRICS if c in frame]  # a folder of an older version may lack some
    rows = json.loads(frame[["point_id", *keys, *metrics, *extra, "scenario_hash", "error", "wall_s"]]
                      .to_json(orient="records"))
    failed = (f"expertsim: sweep: {len(result.failed)} of {total} points failed (their errors are in the table); "
              f"retry them with: {_command_again('--resume', '--retry-failed')}") if result.failed else None
    if as_json:
        _print_json({"output": str(output), "points": result.total, "computed": len(result.computed),
                     "resumed": len(result.resumed), "failed": len(result.failed), "recomputed_damaged": result.damaged,
                     "rows": rows})
        if failed:
            typer.echo(failed, err=True)
            sys.exit(EXIT_POINTS_FAILED)
        return
    short = {k: k.rsplit(".", 1)[-1] for k in keys}
    columns = COUNTS_SWEEP_COLUMNS if "hit_rate" in frame else SWEEP_COLUMNS
    shown = [{**{short[k]: r[k] for k in keys}, **{c: r.get(c) for c in columns}} for r in rows]
    for r in shown:
        if r["error"] and len(r["error"]) > 60:
            r["error"] = "..." + r["error"][-57:]
    _print(_table(f"sweep of {scenario_path}: {result.total} points ({len(result.computed)} run, "
                     f"{len(result.resumed)} resumed, {len(result.failed)} failed) in {output}",
                     shown, [*short.values(), *columns]))
    for path in result.damaged:
        _print(f"damaged point file {path}: recomputed")
    for path in result.left_damaged:
        _print(f"damaged point file {path}: skipped (not a point of this grid)")
    if failed:
        typer.echo(failed, err=True)
        sys.exit(EXIT_POINTS_FAILED)


@app.command()
def plan(
    scenario_path: Path = typer.Argument(..., metavar="SCENARIO", help="scenario TOML"),
    objective: Optional[str] = typer.Option(None, "--objective", help="summary metric to maximise, -METRIC to "
                                            f"minimise (default: {DEFAULT_OBJECTIVES})"),
    constraint: list[str] = typer.Option([], "--constraint", help="METRIC OP NUMBER, e.g. vram_free_mib>=2048"),
    grid: list[str] = typer.Option([], "--grid", help="KEY=v1,v2,... candidates in place of the defaults"),
    workers: int = typer.Option(1, help="processes to run the candidates on"),
    as_json: bool = typer.Option(False, "--json", help="print JSON only"),
):
    """Recommend an engine's cache, reserve, prefill and buffer settings for a scenario, with the numbers why."""
    from sim.explore.plan import NoFeasiblePlan, make_plan

    try:
        result = make_plan(scenario_path, objective, constraint, grid or None, workers=workers)
    except NoFeasiblePlan as exc:
        if as_json:
            _print_json({**exc.plan.as_dict(), "error": str(exc)})
        else:
            typer.echo(f"expertsim: plan: {exc}", err=True)
        sys.exit(1)
    payload = result.as_dict()
    if as_json:
        _print_json(payload)
        return
    _print(f"plan for {scenario_path}: maximise {payload['objective']}"
              + (f" subject to {', '.join(payload['constraints'])}" if payload["constraints"] else "")
              + f" ({len(result.candidates)} candidates)")
    _print(_table("recommended", [{"key": k, "value": v, "scenario": result.base_settings.get(k)}
                                     for k, v in payload["recommended"].items()], ["key", "value", "scenario"]))
    for line in payload["explanations"]:
        _print(f"- {line}")


@app.command()
def validate(
    case: list[str] = typer.Option([], "--case", help="a case id (scenarios/validation/ID.toml); repeat for more; "
                                   "default: every case"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="folder for validation.json and .parquet"),
    workers: Optional[int] = typer.Option(None, help="worker processes (default: the CPU count)"),
    uncertainty: int = typer.Option(0, "--uncertainty", min=0, metavar="N",
                                    help="also run N Latin-hypercube samples of every arm's estimated inputs: "
                                         "each figure's p10-p90 band"),
    seed: int = typer.Option(0, "--seed", help="the samples' seed"),
    force: bool = _force(),
    as_json: bool = typer.Option(False, "--json", help="print the record as JSON only"),
):
    """Simulate every published measurement (scenarios/validation/) and compare: predicted, measured, error."""
    from sim.explore.validate import REPLAY_SPREAD_FILE, load_cases, replay_table, validate_cases, write_record

    if output is not None:
        claim_folder(output, force, "--output")
    cases = load_cases(case or None)
    record = validate_cases(cases, workers=workers, uncertainty=uncertainty, seed=seed)
    if output is not None:
        record["files"] = write_record(record, output)
    if as_json:
        _print_json(record)
        return
    shown = []
    for r in record["rows"]:
        if r["metric"] is None:
            shown.append({"case": r["case"], "role": r["role"], "figure": r["note"]})
            continue
        measured = r["measured_low"] if r["measured_low"] == r["measured_high"] else \
            f"{_fmt(r['measured_low'])}-{_fmt(r['measured_high'])}"
        error = None if r["error"] is None else (f"{r['error']:+.1f} pt" if r["kind"] == "percent"
                                                 else f"{r['error']:+.1%}")
        shown.append({"case": r["case"], "role": r["role"], "figure": f"{r['metric']} {r['kind']} {r['arms']}",
                      "predicted": r["predicted"], "measured": measured, "error": error,
                      "ok": {True: "yes", False: "no", None: r["failed"] and "failed"}[r["within"]],
                      "p10-p90": None if r.get("band_p10") is None else
                      f"{_fmt(r['band_p10'])}-{_fmt(r['band_p90'])}" + ("" if r["in_band"] else " (misses)"),
                      "why not in band": r.get("band_reason"),
                      "out of domain": len(r["out_of_domain"]) or None})
    t = record["totals"]
    _print(_table(f"validation: {t['expressible']} of {t['cases']} cases expressible, {t['prediction_rows_within']}"
                     f" of {t['prediction_rows_judged']} prediction figures within tolerance", shown,
                     ["case", "role", "figure", "predicted", "measured", "error", "ok",
                      *(["p10-p90", "why not in band"] if uncertainty else []), "out of domain"]))
    _print(_table(f"GPU copy replay per machine: median relative error per step (recorded on H200s, "
                  f"{REPLAY_SPREAD_FILE.name})", replay_table(record["gpu_replay"])))


class PlotlyJs(str, Enum):
    """How a report loads plotly.js (sim.explore.report.PLOTLY_JS_MODES): an Enum, which every typer release
    in our range turns into a choice with its own usage error."""

    inline = "inline"
    cdn = "cdn"


@app.command()
def report(
    results: Path = typer.Argument(..., metavar="RESULTS", help="a run (-o of run) or sweep results folder"),
    output: Path = typer.Option(Path("report.html"), "-o", "--output", help="HTML file to write"),
    force: bool = _force(),
    plotly_js: PlotlyJs = typer.Option(
        PlotlyJs.inline, "--plotly-js", help="inline: plotly.js in the page (about 4.8 MB, works offline); "
                                      "cdn: a <script src> to plotly's CDN (small, needs the network)"),
    as_json: bool = typer.Option(False, "--json", help="print JSON only"),
):
    """One HTML report (plotly; self-contained and offline unless --plotly-js cdn) of a run or sweep results
    folder."""
    from sim.explore.report import write_report

    claim_file(output, force, "--output")
    written = write_report(results, output, plotly_js.value)
    if as_json:
        _print_json(written)
        return
    _print(f"{written['output']}: {written['title']}: {written['figures']} figures, {written['traces']} traces")


def main() -> None:
    """The console script. Usage errors go through click's own standalone handling (the usage line, one
    message, exit 2), whichever copy of click typer carries; bad input is one line and exit 2; Ctrl-C is one
    line and exit 130."""
    ctrl_c = _CtrlC()
    try:
        app(prog_name="expertsim")
    except InputError as exc:
        typer.echo(f"expertsim: error: {exc}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    except (Interrupted, Exception) as exc:
        if not isinstance(exc, Interrupted) and not ctrl_c.dropped:
            raise
        ctrl_c.closing = True
        # a failure after a dropped Ctrl-C is the interrupt's: it cut that code short (see _CtrlC)
        typer.echo("expertsim: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    finally:
        ctrl_c.restore()
