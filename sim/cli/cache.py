"""`expertsim cache`: a trace replayed through an expert cache, or its exact LRU miss-ratio curve."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import typer

from sim.cli.common import app, print_json, show, table
from sim.cli.inputs import layout_for
from sim.errors import InputError
from sim.units import GIB


def _gib(n_bytes) -> float:
    return float(n_bytes) / GIB


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
    geometry = Geometry.of(trace, layout_for(model, trace.header.model), str(trace_path))
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
        print_json({"summary": summary, **{k: v.to_dict(orient="records") for k, v in tables.items()}})
        return
    shown = {k: v for k, v in summary.items() if k not in ("trace_sha256",)}
    show(table(f"{trace_path}: {policy}, scope {scope}",
               [{"key": k, "value": v} for k, v in shown.items()], ["key", "value"]))
    for name, frame in tables.items():
        show(table(name.replace("_", " "), frame.to_dict(orient="records")))


def _print_mrc(curve, trace, as_json: bool) -> None:
    frame = curve.curve()
    if as_json:
        print_json({"scope": curve.scope, "trace_sha256": trace.sha256(),
                   "curve": {c: frame[c].tolist() for c in frame.columns}})
        return
    rows = []
    for c, part in frame.groupby("class"):
        # every capacity is in the JSON; the table shows a log-spaced sample
        picks = np.unique(np.geomspace(1, len(part) - 1, 16).astype(int)) if len(part) > 2 else np.arange(len(part))
        rows += part.iloc[picks].to_dict(orient="records")
    show(table(f"LRU miss-ratio curve, scope {curve.scope} (per class; bytes = slots x expert bytes)", rows))
