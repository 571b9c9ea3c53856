"""The commands over many runs: `expertsim sweep`, `plan`, `validate` and `report`."""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from sim.cli.common import (EXIT_POINTS_FAILED, MAX_SAMPLES, MAX_SEED, MAX_WORKERS, app, flag, force_option,
                            print_json, wide_option)
from sim.cli.tables import format_cell, show, table
from sim.cli.progress import working
from sim.cli.signals import Interrupted
from sim.engines import ENGINES
from sim.outputs import claim_file, claim_folder

DEFAULT_OBJECTIVES = ", ".join(f"{e.default_objective} for {e.label}" for e in ENGINES.values() if e.timed)

SWEEP_COLUMNS = ("decode_tok_s", "prefill_tok_s", "decode_hit_rate", "ttft_s", "cache_slots", "lent_slots", "error")
# An untimed engine has no tok/s or TTFT: its table shows the cache's figures and the path that computed them.
COUNTS_SWEEP_COLUMNS = ("cache_slots", "cache_mib", "decode_hit_rate", "prefill_hit_rate", "hit_rate", "misses",
                        "method", "error")


def _command_again(*flags: str) -> str:
    """This command line, to paste into a shell, with `flags` in place of any it had among them."""
    import shlex

    return shlex.join(["expertsim", *(a for a in sys.argv[1:] if a not in flags), *flags])


def _failed_line(rows: list[dict], total: int) -> str:
    """The sweep's closing line when points failed: how many of each kind (sim.explore.runner's error kinds), what
    each kind means for running it again, and the command that does."""
    from sim.explore.runner import CRASHED, REFUSED, WORKER_LOST

    from collections import Counter

    counts = Counter(r.get("error_kind") or "unknown" for r in rows if r["error"])
    why = {REFUSED: "refused (the engine's refusal, or a setting out of range: they fail again)",
           CRASHED: "crashed (an expertsim bug: please report the error with the scenario)",
           WORKER_LOST: "lost with their worker process (they may run when run again)",
           "unknown": "failed in an older version's sweep"}
    parts = "; ".join(f"{counts[k]} {why[k]}" for k in why if k in counts)
    return (f"expertsim: sweep: {sum(counts.values())} of {total} point{'s' * (total != 1)} failed (their errors are "
            f"under the table): {parts}; run them again with {_command_again('--resume', '--retry-failed')}")


@app.command()
def sweep(
    scenario_path: Path = typer.Argument(..., metavar="SCENARIO", help="scenario TOML"),
    grid: list[str] = typer.Option(..., "--grid", help="KEY=v1,v2,... or KEY=start:stop:step (stop included); "
                                                         "KEY a dotted scenario key, e.g. engine.flags.prefill-chunk"),
    output: Path = typer.Option(..., "-o", "--output", help="results folder (Parquet, one file per point)"),
    resume: bool = flag("--resume", help="continue a sweep in OUTPUT: skip the finished points"),
    retry_failed: bool = flag("--retry-failed", help="with --resume: compute the failed points again"),
    executor: str = typer.Option("processes", help="processes (local) or dask"),
    scheduler: Optional[str] = typer.Option(None, help="Dask scheduler address (default: a LocalCluster)"),
    workers: Optional[int] = typer.Option(None, min=1, max=MAX_WORKERS,
                                          help="worker processes (default: the CPU count)"),
    as_json: bool = flag("--json", help="print JSON only"),
    wide: bool = wide_option(),
):
    """Run a scenario over a grid of settings; each point's headline metrics go to a Parquet dataset."""
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
        with working("sweep", quiet=as_json) as live:
            live.stage("points")
            live.count(0, total)
            result = run_sweep(points, output, progress=lambda row, finished, of: live.count(finished, of),
                               **options)
    except Interrupted as interrupt:
        saved = len(read_points(output)[0]) if points else 0
        typer.echo(f"expertsim: interrupted: {saved} of {total} points are saved in {output}; continue with: "
                   f"{_command_again('--resume')}", err=True)
        sys.exit(interrupt.exit_code)
    frame = result.points_frame()
    order = {p.point_id: i for i, p in reversed(list(enumerate(points)))}
    frame = frame[frame["point_id"].isin(order)].sort_values("point_id", key=lambda ids: ids.map(order))
    keys = list(points[0].overrides) if points else []
    extra = [c for c in (*extra_metrics(), "method") if c in frame]  # absent from rows of older sweeps
    metrics = [c for c in METRICS if c in frame]  # a folder of an older version may lack some
    kinds = ["error_kind"] if "error_kind" in frame else []  # absent from rows of older sweeps
    rows = json.loads(frame[["point_id", *keys, *metrics, *extra, "scenario_hash", "error", *kinds, "wall_s"]]
                      .to_json(orient="records"))
    failed = _failed_line(rows, total) if result.failed else None
    if as_json:
        print_json({"output": str(output), "points": result.total, "computed": len(result.computed),
                   "resumed": len(result.resumed), "failed": len(result.failed), "recomputed_damaged": result.damaged,
                   "rows": rows})
        if failed:
            typer.echo(failed, err=True)
            sys.exit(EXIT_POINTS_FAILED)
        return
    short = {k: k.rsplit(".", 1)[-1] for k in keys}
    columns = COUNTS_SWEEP_COLUMNS if "hit_rate" in frame else SWEEP_COLUMNS
    shown = [{**{short[k]: r[k] for k in keys}, **{c: r.get(c) for c in columns}} for r in rows]
    plural = "s" * (result.total != 1)
    show(table(f"sweep of {scenario_path}: {result.total} point{plural} ({len(result.computed)} run, "
               f"{len(result.resumed)} resumed, {len(result.failed)} failed) in {output}",
               shown, [*short.values(), *columns]), wide=wide)
    for r in rows:  # whole, under the table: a narrow terminal may leave the table's error column out
        if r["error"]:
            show(f"failed: {', '.join(f'{short[k]}={r[k]}' for k in keys)}: {r['error']}")
    for path in result.damaged:
        show(f"damaged point file {path}: recomputed")
    for path in result.left_damaged:
        show(f"damaged point file {path}: skipped (not a point of this grid)")
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
    workers: int = typer.Option(1, min=1, max=MAX_WORKERS, help="processes to run the candidates on"),
    as_json: bool = flag("--json", help="print JSON only"),
    wide: bool = wide_option(),
):
    """Recommend an engine's cache, reserve, prefill and buffer settings for a scenario, with the numbers why."""
    from sim.explore.plan import NoFeasiblePlan, make_plan

    try:
        with working("plan", quiet=as_json) as live:
            live.stage("running the candidates")
            result = make_plan(scenario_path, objective, constraint, grid or None, workers=workers)
    except NoFeasiblePlan as exc:
        if as_json:
            print_json({**exc.plan.as_dict(), "error": str(exc)})
        else:
            typer.echo(f"expertsim: plan: {exc}", err=True)
        sys.exit(1)
    payload = result.as_dict()
    if as_json:
        print_json(payload)
        return
    show(f"plan for {scenario_path}: maximise {payload['objective']}"
         + (f" subject to {', '.join(payload['constraints'])}" if payload["constraints"] else "")
         + f" ({len(result.candidates)} candidates)")
    show(table("recommended", [{"key": k, "value": v, "scenario": result.base_settings.get(k)}
                               for k, v in payload["recommended"].items()], ["key", "value", "scenario"]), wide=wide)
    for line in payload["explanations"]:
        show(f"- {line}")


@app.command()
def validate(
    case: list[str] = typer.Option([], "--case", help="a case id (scenarios/validation/ID.toml); repeat for more; "
                                   "default: every case"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="folder for validation.json and .parquet"),
    workers: Optional[int] = typer.Option(None, min=1, max=MAX_WORKERS,
                                          help="worker processes (default: the CPU count)"),
    uncertainty: int = typer.Option(0, "--uncertainty", min=0, max=MAX_SAMPLES, metavar="N",
                                    help="also run N Latin-hypercube samples of every arm's estimated inputs: "
                                         "each figure's p10-p90 band, and for a ratio what moves its effect"),
    seed: int = typer.Option(0, "--seed", min=0, max=MAX_SEED, help="the samples' seed"),
    force: bool = force_option(),
    as_json: bool = flag("--json", help="print the record as JSON only"),
    wide: bool = wide_option(),
):
    """Simulate every published measurement (scenarios/validation/) and compare: predicted, measured, error."""
    from sim.explore.validate import (REPLAY_SPREAD_FILE, drivers_text, effect_text, error_text, load_cases,
                                      replay_table, validate_cases, verdict_text, write_record)

    if output is not None:
        claim_folder(output, force, "--output")
    cases = load_cases(case or None)
    with working("validate", quiet=as_json) as live:
        live.stage("the cases' runs")
        record = validate_cases(cases, workers=workers, uncertainty=uncertainty, seed=seed, progress=live.count)
    if output is not None:
        record["files"] = write_record(record, output)
    if as_json:
        print_json(record)
        return
    shown = []
    for r in record["rows"]:
        if r["metric"] is None:
            shown.append({"case": r["case"], "role": r["role"], "figure": r["note"]})
            continue
        measured = r["measured_low"] if r["measured_low"] == r["measured_high"] else \
            f"{format_cell(r['measured_low'])}-{format_cell(r['measured_high'])}"
        shown.append({"case": r["case"], "role": r["role"], "figure": f"{r['metric']} {r['kind']} {r['arms']}",
                      "predicted": r["predicted"], "measured": measured,
                      "effect predicted / measured": effect_text(r), "error": error_text(r),
                      "ok": verdict_text(r),
                      "p10-p90": None if r.get("band_p10") is None else
                      f"{format_cell(r['band_p10'])}-{format_cell(r['band_p90'])}"
                      + ("" if r["in_band"] else " (misses)"),
                      "why not in band": r.get("band_reason"),
                      "what moves the effect": drivers_text(r) or None,
                      "out of domain": len(r["out_of_domain"]) or None})
    t = record["totals"]
    show(table(f"validation: {t['expressible']} of {t['cases']} cases expressible, {t['calibration_cases']} "
               f"calibration; {t['ratio_rows_within']} of {t['ratio_rows']} ratio effects pass "
               f"({t['ratio_rows_wrong_sign']} of the wrong sign); {t['prediction_rows_within']} of "
               f"{t['prediction_rows_judged']} prediction figures within tolerance", shown,
               ["case", "role", "figure", "predicted", "measured", "effect predicted / measured", "error", "ok",
                *(["p10-p90", "why not in band", "what moves the effect"] if uncertainty else []), "out of domain"]),
         wide=wide)
    show(table(f"GPU copy replay per machine: median relative error per step (recorded on H200s, "
               f"{REPLAY_SPREAD_FILE.name})", replay_table(record["gpu_replay"])), wide=wide)


class PlotlyJs(str, Enum):
    """How a report loads plotly.js (sim.explore.report.PLOTLY_JS_MODES): an Enum, which every typer release
    in our range turns into a choice with its own usage error."""

    inline = "inline"
    cdn = "cdn"


@app.command()
def report(
    results: Path = typer.Argument(..., metavar="RESULTS", help="a run (-o of run) or sweep results folder"),
    output: Path = typer.Option(Path("report.html"), "-o", "--output", help="HTML file to write"),
    force: bool = force_option(),
    plotly_js: PlotlyJs = typer.Option(
        PlotlyJs.inline, "--plotly-js", help="inline: plotly.js in the page (about 4.8 MB, works offline); "
                                      "cdn: a <script src> to plotly's CDN (small, needs the network)"),
    as_json: bool = flag("--json", help="print JSON only"),
):
    """One HTML report (plotly; self-contained and offline unless --plotly-js cdn) of a run or sweep results
    folder."""
    from sim.explore.report import write_report

    claim_file(output, force, "--output")
    written = write_report(results, output, plotly_js.value)
    if as_json:
        print_json(written)
        return
    show(f"{written['output']}: {written['title']}: {written['figures']} figures, {written['traces']} traces")
