"""`expertsim trace import | gen | record | stats | locality | hotlist | check-generator`: routing traces in, their
statistics, and the popularity list a profiling run gives."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from sim.cli.common import flag, force_option, print_json, trace_app, wide_option
from sim.cli.progress import working
from sim.cli.tables import show, table
from sim.errors import InputError
from sim.outputs import claim_file


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


def _report_written(summary: dict, as_json: bool, wide: bool, title: str = "trace written") -> None:
    if as_json:
        print_json(summary)
    else:
        show(table(title, [{"key": k, "value": v} for k, v in summary.items()], ["key", "value"]), wide=wide)


@trace_app.command("import")
def trace_import(
    file: Path = typer.Argument(..., help="vLLM select_experts JSONL, or a generic CSV/JSONL"),
    output: Path = typer.Option(..., "-o", "--output", help="Parquet trace to write"),
    fmt: str = typer.Option("auto", "--format", help="auto | vllm-jsonl | csv | jsonl"),
    n_experts: Optional[int] = typer.Option(None, help="experts per layer (default: from --model, else max id + 1)"),
    model: Optional[str] = typer.Option(None, help="model preset name the trace belongs to"),
    force: bool = force_option(),
    as_json: bool = flag("--json", help="print JSON only"),
    wide: bool = wide_option(),
):
    """Convert a routing log into an expertsim trace."""
    from sim.trace.importers import import_trace

    claim_file(output, force, "--output")
    with working("trace import", quiet=as_json) as live:
        live.stage(f"reading {file.name}")
        trace = import_trace(file, fmt, n_experts=n_experts, model=model)
        live.stage(f"writing {output.name}")
        _write_trace(trace, output)
    _report_written(_trace_summary(trace, output), as_json, wide)


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
    force: bool = force_option(),
    as_json: bool = flag("--json", help="print JSON only"),
    wide: bool = wide_option(),
):
    """Generate a synthetic trace that reproduces measured routing statistics (the preset's, or yours)."""
    from sim.trace.generate import generate_trace

    claim_file(output, force, "--output")
    statistics = {k: v for k, v in (("reuse_decode", reuse_decode), ("reuse_prefill", reuse_prefill),
                                    ("entropy", entropy)) if v is not None}
    with working("trace gen", quiet=as_json) as live:
        live.stage(f"generating {requests:,} x {prompt_tokens + decode_tokens:,} tokens")
        trace = generate_trace(preset, prompt_tokens, decode_tokens, seed, requests, statistics or None)
        live.stage(f"writing {output.name}")
        _write_trace(trace, output)
    _report_written(_trace_summary(trace, output), as_json, wide)


@trace_app.command("record")
def trace_record(
    model: Path = typer.Option(..., help="local Hugging Face MoE model directory"),
    output: Path = typer.Option(..., "-o", "--output", help="Parquet trace to write"),
    prompt: Optional[str] = typer.Option(None, help="prompt text (needs the model's tokenizer)"),
    prompt_tokens: Optional[int] = typer.Option(None, help="random prompt of this many token ids"),
    decode_tokens: int = typer.Option(16, help="greedy decode steps"),
    seed: int = typer.Option(0),
    requests: int = typer.Option(1),
    force: bool = force_option(),
    as_json: bool = flag("--json", help="print JSON only"),
    wide: bool = wide_option(),
):
    """Record router top-k per layer from a transformers MoE model (needs expertsim[record])."""
    from sim.trace.record import record_trace

    claim_file(output, force, "--output")
    trace = record_trace(model, prompt=prompt, prompt_tokens=prompt_tokens, decode_tokens=decode_tokens,
                         seed=seed, requests=requests)
    _write_trace(trace, output)
    _report_written(_trace_summary(trace, output), as_json, wide)


@trace_app.command("stats")
def trace_stats_cmd(
    trace_path: Path = typer.Argument(..., metavar="TRACE"),
    as_json: bool = flag("--json", help="print JSON only"),
    wide: bool = wide_option(),
):
    """Routing statistics: reuse per layer, entropy, skew, prefill unions, co-activation."""
    from sim.trace.format import read_trace
    from sim.trace.stats import trace_stats

    with working("trace stats", quiet=as_json) as live:
        live.stage("reading the trace")
        trace = read_trace(trace_path)
        live.stage("measuring reuse, skew, unions and co-activation")
        stats = trace_stats(trace)
    if as_json:
        print_json(stats)
        return
    show(table(f"{trace_path}", [{"statistic": k, "value": v} for k, v in stats["summary"].items()],
               ["statistic", "value"]), wide=wide)
    show(table("per layer", stats["per_layer"]), wide=wide)
    show(table("prefill union vs chunk length", stats["prefill_union"]), wide=wide)
    for part, values in (stats.get("coactivation") or {}).items():
        rows = [{"statistic": k, "value": v} for k, v in values.items() if not isinstance(v, (list, dict))]
        show(table(f"co-activation ({part.replace('_', ' ')})", rows, ["statistic", "value"]), wide=wide)


@trace_app.command("hotlist")
def trace_hotlist_cmd(
    trace_path: Path = typer.Argument(..., metavar="TRACE", help="a profiling run's trace"),
    output: Path = typer.Option(..., "-o", "--output", help="rank,layer,expert CSV to write"),
    force: bool = force_option(),
    as_json: bool = flag("--json", help="print JSON only"),
    wide: bool = wide_option(),
):
    """A popularity-ordered (layer, expert) list in ds4's hotlist format, from a profiling run's trace: for
    DS4_METAL_STREAMING_EXPERT_HOTLIST and `cache --policy static --profile`."""
    import pandas as pd

    from sim.cache.replay import trace_profile
    from sim.trace.format import read_trace

    claim_file(output, force, "--output")
    trace = read_trace(trace_path)
    keys = trace_profile(trace)
    layer, expert = keys // trace.header.n_experts, keys % trace.header.n_experts
    try:
        pd.DataFrame({"rank": range(len(keys)), "layer": layer, "expert": expert}).to_csv(output, index=False)
    except OSError as exc:
        raise InputError(str(output), "output", str(output), f"cannot write: {exc.strerror}") from None
    summary = {"output": str(output), "pairs": len(keys), "of": trace.header.n_layers * trace.header.n_experts,
               "tokens": trace.n_rows, "trace_sha256": trace.sha256()}
    _report_written(summary, as_json, wide, "hotlist written")


def _ints(text: str, option: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InputError("trace locality", option, text, "comma-separated integers, e.g. 8,16,32") from None


@trace_app.command("locality")
def trace_locality_cmd(
    trace_path: Path = typer.Argument(..., metavar="TRACE"),
    capacities: str = typer.Option("8,16,32,64,128", help="LRU cache sizes in slots (per layer, or of the "
                                   "shared pool), comma-separated"),
    rows: str = typer.Option("all", help="rows replayed: all | decode | prefill"),
    cold: str = typer.Option("trace", help="trace: one cold start, requests one after another; request: the "
                             "cache is cleared at every request"),
    keys_per_expert: int = typer.Option(1, min=1, max=3, help="cache keys one expert takes (3 where gate, up and "
                                        "down are cached apart in one slot budget)"),
    pool: str = typer.Option("layer", help="layer: a cache per layer; shared: one cache over all layers"),
    within: str = typer.Option("1,2,4,8,16,32,64", help="token distances d of 'reused within d tokens'"),
    as_json: bool = flag("--json", help="print JSON only"),
    wide: bool = wide_option(),
):
    """Locality as expert-cache studies measure it: LRU hit rates under a protocol, reuse within d tokens,
    and the routed mass of the hottest (layer, expert) pairs."""
    from sim.trace.format import read_trace
    from sim.trace.locality import LruProtocol, hot_pair_coverage, lru_hit_rates, reuse_within

    trace = read_trace(trace_path)
    protocol = LruProtocol(rows=rows, cold=cold, keys_per_expert=keys_per_expert, pool=pool)
    out = {"lru": lru_hit_rates(trace, _ints(capacities, "--capacities"), protocol),
           "reuse_within": reuse_within(trace, _ints(within, "--within"), rows), "hot_pairs": hot_pair_coverage(trace)}
    if as_json:
        print_json(out)
        return
    lru = out["lru"]
    show(table(f"{trace_path}: LRU ({pool} pool, rows {rows}, cold {cold}, {keys_per_expert} key(s) per expert)",
               [{"slots": c, "hit_rate": h} for c, h in zip(lru["capacities"], lru["hit_rate"])],
               ["slots", "hit_rate"]), wide=wide)
    show(table("reused within d tokens", [{"d": d, "share": v} for d, v in
                                          zip(out["reuse_within"]["distances"], out["reuse_within"]["share"])],
               ["d", "share"]), wide=wide)
    show(table("hottest pairs", [{"fraction": f, "pairs": n, "share": v} for f, n, v in
                                 zip(*(out["hot_pairs"][k] for k in ("fractions", "pairs", "share")))],
               ["fraction", "pairs", "share"]), wide=wide)


@trace_app.command("check-generator")
def trace_check_generator(
    preset: str = typer.Option(..., help="generator preset"),
    as_json: bool = flag("--json", help="print JSON only"),
    wide: bool = wide_option(),
):
    """The preset's generated routing against the published locality figures it was fitted to or is checked
    against (each re-measured on traces generated the way the study ran its model)."""
    from sim.trace.generator_targets import locality_report

    rows = locality_report(preset)
    if as_json:
        print_json({"preset": preset, "rows": rows})
        return
    show(table(f"{preset}: generated vs measured", [{k: r[k] for k in ("target", "size", "measured", "generated",
                                                                       "error", "tolerance", "within", "fit")}
                                                    for r in rows]), wide=wide)
