"""`expertsim cache`: a trace replayed through an expert cache, or its exact LRU miss-ratio curve."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import typer

from sim.cli.common import app, flag, print_json, wide_option
from sim.cli.progress import working
from sim.cli.tables import show, table
from sim.cli.inputs import layout_for
from sim.errors import InputError
from sim.units import GIB


def _gib(n_bytes) -> float:
    return float(n_bytes) / GIB


# The columns that count bytes: without a model's expert sizes there are none to count (each expert would be
# counted as 1 byte), so they are left empty and the output says why.
BYTE_COLUMNS = ("load_bytes", "load_gib", "hit_bytes", "expert_bytes", "bytes", "miss_bytes")


def _unsized_note(trace_model: str) -> str:
    return (f"bytes not counted: the trace's model '{trace_model}' is not a preset, so its expert sizes are "
            "unknown; --model NAME (or a .gguf) gives them")


def _without_bytes(records: list[dict]) -> list[dict]:
    return [{k: (None if k in BYTE_COLUMNS else v) for k, v in r.items()} for r in records]


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
    mrc: bool = flag("--mrc", help="print the exact LRU miss-ratio curve (one pass)"),
    as_json: bool = flag("--json", help="print JSON only"),
    wide: bool = wide_option(),
):
    """Replay a trace through an expert cache: hit rate, misses, direct loads and bytes."""
    from sim.cache.replay import Geometry, lru_mrc, mrc_exact
    from sim.trace.format import read_trace

    with working("cache", quiet=as_json) as live:
        live.stage("reading the trace")
        trace = read_trace(trace_path)
        layout = layout_for(model, trace.header.model)
        geometry = Geometry.of(trace, layout, str(trace_path))
        unsized = None if layout is not None else _unsized_note(trace.header.model)
        if mrc:
            if not mrc_exact(policy, prefill_mode):
                raise InputError("cache", "--mrc", f"{policy}/{prefill_mode}",
                                 "the one-pass curve is exact for an evicting LRU only")
            live.stage("one pass for every capacity")
            curve = lru_mrc(trace, geometry, scope)
        else:
            scope, result = _replay(trace, geometry, policy, scope, slots_per_layer, slots, prefill_mode, profile,
                                    live)
    if mrc:
        _print_mrc(curve, trace, as_json, wide, unsized)
        return
    summary = result.summary()
    summary["load_gib"] = _gib(summary["load_bytes"])
    tables = {name: frame.to_dict(orient="records") for name, frame in
              (("per_phase", result.per_phase()), ("per_class", result.per_class()), ("per_layer", result.per_layer()))}
    if unsized:
        summary = _without_bytes([summary])[0]
        tables = {name: _without_bytes(rows) for name, rows in tables.items()}
    if as_json:
        print_json({"summary": summary, **tables, **({"bytes": unsized} if unsized else {})})
        return
    shown = {k: v for k, v in summary.items() if k not in ("trace_sha256",)}
    show(table(f"{trace_path}: {policy}, scope {scope}",
               [{"key": k, "value": v} for k, v in shown.items()], ["key", "value"]), wide=wide)
    for name, rows in tables.items():
        show(table(name.replace("_", " "), rows), wide=wide)
    if unsized:
        typer.echo(unsized, err=True)


def _replay(trace, geometry, policy: str, scope: str, slots_per_layer: str | None, slots: str | None,
            prefill_mode: str, profile: Path | None, live):
    """The --slots or --slots-per-layer capacity checked against the scope, then the replay: (the scope the policy
    replays, its result)."""
    from sim.cache.replay import capacity_pools, parse_slots, read_profile, replay

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
    live.stage(f"replaying {policy}, scope {scope}")
    return scope, replay(trace, geometry, policy, scope, capacity, prefill_mode, ranking)


def _print_mrc(curve, trace, as_json: bool, wide: bool, unsized: str | None) -> None:
    frame = curve.curve()
    if unsized:
        frame[[c for c in BYTE_COLUMNS if c in frame.columns]] = None
    if as_json:
        print_json({"scope": curve.scope, "trace_sha256": trace.sha256(),
                    "curve": {c: frame[c].tolist() for c in frame.columns}, **({"bytes": unsized} if unsized else {})})
        return
    rows = []
    for c, part in frame.groupby("class"):
        # every capacity is in the JSON; the table shows a log-spaced sample
        picks = np.unique(np.geomspace(1, len(part) - 1, 16).astype(int)) if len(part) > 2 else np.arange(len(part))
        rows += part.iloc[picks].to_dict(orient="records")
    show(table(f"LRU miss-ratio curve, scope {curve.scope} (per class; bytes = slots x expert bytes)", rows), wide=wide)
    if unsized:
        typer.echo(unsized, err=True)
