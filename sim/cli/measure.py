"""Measuring this machine and this code: `expertsim bench` and `expertsim calibrate`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from sim.cli.common import app, flag, force_option, print_json, wide_option
from sim.cli.tables import show, table
from sim.outputs import claim_file


@app.command()
def bench(
    tokens: int = typer.Option(100_000, help="decode tokens of the benchmark trace"),
    quick: bool = flag("--quick", help="the cache core and the seed scenarios only (under a minute)"),
    sweeps: bool = flag("--sweeps", help="also the 1,000-point sweep and the worker speed-up (minutes)"),
    scenario: Optional[list[Path]] = typer.Option(None, "--scenario", metavar="FILE",
                                                  help="time this scenario file instead of the seeds (repeatable)"),
    as_json: bool = flag("--json", help="print JSON only"),
    wide: bool = wide_option(),
):
    """Speed and memory of the cache core against the targets (rows: name, value, unit, target)."""
    from sim.explore.bench import run_bench

    def announce(group: str, number: int, of: int) -> None:  # on stderr: stdout stays the table or the JSON
        typer.echo(f"bench [{number}/{of}]: {group} ...", err=True)

    rows = run_bench(tokens, sweeps=sweeps, quick=quick, progress=announce, scenarios=scenario or None)
    if as_json:
        print_json(rows)
        return
    show(table("expertsim bench", rows, ["name", "value", "unit", "target", "met"]), wide=wide)


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
    tune: bool = flag("--tune/--no-tune", default=True, help="tune the gather kernel's launch shape first"),
    force: bool = force_option(),
    as_json: bool = flag("--json", help="print JSON only"),
    wide: bool = wide_option(),
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
            print_json({k: v for k, v in report.items() if k != "per_step"})
            return
        drift = report["host_drift"]
        host = "" if drift is None else f"; host probe {100 * drift:+.1f} % against the calibration's"
        show(table(f"replay of {replay} on {report['gpu']} (calibration: {report['calibration']['gpu']}, "
                   f"{report['calibration']['status']}, {report['repeats']} runs a step{host}); goal "
                   f"{report['goal']}", report["summary"]), wide=wide)
        return
    if from_samples is not None:
        result = api.refit(from_samples, output)
    else:
        result = api.measure(sizes_mib=api.parse_list(sizes, "--sizes"),
                             experts=api.parse_list(experts, "--experts", int), repeats=repeats, seed=seed,
                             tune=tune, output=output, log=log)
    record = result["record"]
    if as_json:
        print_json({"file": result["file"], **{k: v for k, v in record.items() if k != "samples"}})
        return
    tables = api.report_rows(record)
    show(table(f"calibration {result['file'] or '(not written)'}", tables["summary"], ["key", "value"]), wide=wide)
    show(table("fitted cost model (us, GB/s) and relative fit error", tables["parameters"]), wide=wide)
    if tables["speed"]:
        show(table("speed", tables["speed"], ["name", "value", "unit", "target", "met", "detail"]), wide=wide)
    if tables["engine_vs_gather"]:
        show(table("the engines' way (ce_sync) vs the gather kernel, per step", tables["engine_vs_gather"]), wide=wide)
    show(table("hardware-profile fields these numbers stand for", tables["simulator_profile"], ["key", "value"]),
         wide=wide)
