"""`expertsim run` (an engine serving a scenario, optionally under uncertainty) and `expertsim demo`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from sim.cli.common import MAX_SAMPLES, MAX_SEED, MAX_WORKERS, app, flag, force_option, print_json, wide_option
from sim.cli.progress import working
from sim.cli.tables import format_cell, show, table
from sim.engines import ENGINES
from sim.errors import InputError
from sim.outputs import claim_file, claim_folder


@app.command()
def run(
    scenario_path: Path = typer.Argument(..., metavar="SCENARIO", help="scenario TOML"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="folder for summary, steps and copy plan"),
    as_json: bool = flag("--json", help="print the summary as JSON only"),
    wide: bool = wide_option(),
    perfetto: Optional[Path] = typer.Option(None, "--perfetto", metavar="FILE",
                                            help="write the run's timeline as a Chrome/Perfetto trace (JSON)"),
    uncertainty: int = typer.Option(0, "--uncertainty", min=0, max=MAX_SAMPLES, metavar="N",
                                    help="also run N Latin-hypercube samples of the profile's estimated inputs: "
                                         "p10/median/p90 of each metric and which input moves it most"),
    seed: int = typer.Option(0, "--seed", min=0, max=MAX_SEED, help="the samples' seed"),
    workers: Optional[int] = typer.Option(None, min=1, max=MAX_WORKERS,
                                          help="worker processes for --uncertainty (default: the CPU count)"),
    settings: list[str] = typer.Option([], "--set", metavar="KEY=VALUE",
                                       help="change one scenario setting for this run (a dotted key as in sweep's "
                                            "--grid, e.g. engine.flags.prefill-chunk=4096); repeat for more"),
    force: bool = force_option(),
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
    with working("run", quiet=as_json) as live:
        result = run_scenario(scenario, stage=live.stage)
        if uncertainty:
            live.stage(f"{uncertainty} uncertainty samples")
            result.summary["uncertainty"] = _uncertainty(scenario_path, scenario, uncertainty, seed, workers, data)
    if overrides:
        result.summary["provenance"]["settings"] = overrides  # the scenario hash covers them too
    if output is not None:
        result.summary["files"] = write_results(result, output)
    if perfetto is not None:
        from sim.results import link_frame
        from sim.explore.report import write_perfetto

        write_perfetto(result.steps, result.summary, perfetto, link_frame(result.links))
        result.summary["perfetto"] = str(perfetto)
    if as_json:
        print_json(result.summary)
        return
    s = result.summary
    from sim.explore.runner import METRICS

    title = (f"{s['engine']} {s['variant']} on {s['hardware']}, {s['model']}" if engine.timed else
             f"{s['provenance']['command_line']}, {s['model']} (cache only)")
    show(table(f"{scenario_path}: {title}", [{"key": k, "value": s[k]} for k in engine.headline or METRICS if k in s],
               ["key", "value"]), wide=wide)
    for name in engine.summary_tables:
        show(table(name.replace("_", " "), s[name]), wide=wide)
    for notice in s["engine_state"].get("notices", []):
        show(f"engine: {notice}")
    for warning in s.get("out_of_domain", []):
        show(f"out of domain: {warning}")
    if "uncertainty" in s:
        from sim.explore.uncertainty import rank_sensitivity

        u = s["uncertainty"]
        show(table(f"under uncertainty: {u['n']} samples of {len(u['inputs'])} estimated inputs "
                   f"({u['failed_samples']} failed)",
                   [{"key": k, **{q: b[q] for q in ("p10", "median", "p90")}} for k, b in u["bands"].items()
                    if b["n"] and k in s], ["key", "p10", "median", "p90"]), wide=wide)
        metric = "decode_tok_s" if s.get("decode_tok_s") else "prefill_tok_s"
        top = rank_sensitivity(u["sensitivity"], metric)[:8]
        show(table(f"what moves {metric} most: each input alone at the ends of its range",
                   [{"input": r["input"], "range": f"{format_cell(r['low'])}-{format_cell(r['high'])}",
                     "at low": r[f"{metric}@low"], "at high": r[f"{metric}@high"]} for r in top],
                   ["input", "range", "at low", "at high"]), wide=wide)


def _uncertainty(scenario_path: Path, scenario, n: int, seed: int, workers: Optional[int], data: dict | None) -> dict:
    from sim.explore.runner import make_point
    from sim.explore.uncertainty import propagate
    from sim.scenario import scenario_hash
    from sim.schema import read_toml

    data = data if data is not None else read_toml(scenario_path, str(scenario_path))
    point = make_point(scenario_path, data, {}, scenario_hash(scenario))
    return propagate(point, scenario, n, seed, executor="processes" if (workers or 2) > 1 else "inline",
                     workers=workers)


@app.command()
def demo(as_json: bool = flag("--json", help="print JSON only"),
         wide: bool = wide_option()):
    """ds4 PR #504 in miniature: one slab vs per-size-class caches on the mixed q2/q4 DeepSeek-V4-Flash."""
    from sim.explore.demo import run_demo

    with working("demo", quiet=as_json) as live:
        live.stage("replaying five caches")
        result = run_demo()
    if as_json:
        print_json(result)
        return
    show(result["title"])
    show(table(result["table_title"], result["rows"]), wide=wide)
    for line in result["notes"]:
        show(line)
