"""Reading results folders: a run's (summary.json and steps.parquet, and links.parquet and routing.parquet where
the run wrote them) and the grid of a sweep's manifest.json (its points: sim.explore.sweep.load_sweep). A file
that is missing, unreadable or lacks a column raises InputError naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from sim.errors import InputError
from sim.results import LINK_COLUMNS
from sim.trace.format import MISSING, PHASE_DECODE, PHASE_PREFILL

RUN_FILES = ("summary.json", "steps.parquet")
ROUTING_COLUMNS = ("phase", "token", "layer", "class", "expert_bytes", "experts")  # sim.results.routing_table


def results_kind(results: Path) -> str:
    """"run" or "sweep": which kind of results folder `results` is (InputError when it is neither or lacks a file
    its kind needs)."""
    if not results.is_dir():
        raise InputError(str(results), "results", str(results), "not a folder (expected a run or sweep results folder)")
    if (results / "manifest.json").is_file():
        if not (results / "points").is_dir():
            raise InputError(str(results), "points", str(results / "points"), "sweep results folder without points/")
        return "sweep"
    if (results / "summary.json").exists() or (results / "steps.parquet").exists():
        missing = [name for name in RUN_FILES if not (results / name).is_file()]
        if missing:
            raise InputError(str(results), "missing", ", ".join(missing), "run results folder lacks these files")
        return "run"
    raise InputError(str(results), "results", str(results), "neither a run results folder (summary.json, "
                     "steps.parquet) nor a sweep results folder (manifest.json, points/)")


def load_run(results: str | Path) -> tuple[dict, pd.DataFrame]:
    """summary.json and steps.parquet of a run folder: (summary, steps)."""
    results = Path(results)
    try:
        summary = json.loads((results / "summary.json").read_text())
    except (OSError, ValueError) as exc:
        raise InputError(str(results), "summary.json", str(results / "summary.json"), f"unreadable: {exc}") from None
    try:
        steps = pd.read_parquet(results / "steps.parquet")
    except Exception as exc:  # noqa: BLE001 - any unreadable Parquet is bad input
        raise InputError(str(results), "steps.parquet", str(results / "steps.parquet"),
                         f"unreadable: {type(exc).__name__}") from None
    need = {"request", "phase", "step", "layer", "start_s", "end_s", "lookups", "hits"}
    if not need <= set(steps.columns):
        raise InputError(str(results), "steps.parquet", ", ".join(sorted(need - set(steps.columns))),
                         "missing columns")
    return summary, steps


def _read_table(results: Path, name: str, columns: tuple[str, ...]):
    """An optional file of a run folder (absent in folders written before it existed) as a pyarrow Table: None
    when missing."""
    import pyarrow.parquet as pq

    path = results / name
    if not path.exists():
        return None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - any unreadable Parquet is bad input
        raise InputError(str(results), name, str(path), f"unreadable: {type(exc).__name__}") from None
    if not set(columns) <= set(table.column_names):
        raise InputError(str(results), name, ", ".join(sorted(set(columns) - set(table.column_names))),
                         "missing columns")
    return table


def load_links(results: str | Path) -> pd.DataFrame | None:
    """links.parquet of a run folder: every busy interval of every link; None when the folder has none."""
    table = _read_table(Path(results), "links.parquet", LINK_COLUMNS)
    return None if table is None else table.to_pandas()


def load_routing(results: str | Path):
    """routing.parquet of a run folder as (Trace, Geometry), size classes and expert bytes as the run recorded
    them; None when the folder has none."""
    import pyarrow.compute as pc

    from sim.cache.replay import Geometry
    from sim.trace.format import Trace, TraceHeader

    results = Path(results)
    table = _read_table(results, "routing.parquet", ROUTING_COLUMNS)
    if table is None:
        return None
    where = str(results / "routing.parquet")
    if not table.num_rows:
        raise InputError(where, "rows", 0, "no routed cell")
    lists = table.column("experts").combine_chunks()
    widths = pc.unique(pc.list_value_length(lists)).to_pylist()
    if len(widths) != 1 or not widths[0]:
        raise InputError(where, "experts", widths, "every cell lists the same number (top-k >= 1) of experts")
    cells = lists.flatten().to_numpy(zero_copy_only=False).astype(np.int64).reshape(-1, widths[0])
    frame = table.drop_columns(["experts"]).to_pandas()
    phase = frame["phase"].astype(str).to_numpy()
    if not np.isin(phase, ("prefill", "decode")).all():
        raise InputError(where, "phase", sorted(set(phase) - {"prefill", "decode"})[0], "expected prefill or decode")
    for name, bad in (("layer", frame["layer"] < 0), ("class", frame["class"] < 0),
                      ("expert_bytes", frame["expert_bytes"] < 0)):
        if bad.any():
            raise InputError(where, name, int(frame[name][bad].iloc[0]), "must be >= 0")
    if cells.min() < 0 or cells.max() >= int(MISSING):
        raise InputError(where, "experts", f"{cells.min()}..{cells.max()}", f"expert ids are 0..{int(MISSING) - 1}")
    # one layer per cell: its size class and expert bytes; one expert size per class
    per_layer = frame.groupby("layer")[["class", "expert_bytes"]].nunique()
    per_class = frame.groupby("class")["expert_bytes"].nunique()
    if (per_layer > 1).any(axis=None) or (per_class > 1).any():
        raise InputError(where, "class/expert_bytes", "varies", "one size class per layer, one expert size per class")
    # one trace row per (phase, token), in file order: a new row wherever phase or token changes
    layer = frame["layer"].to_numpy(np.int64)
    token = frame["token"].to_numpy(np.int64)
    new_row = np.r_[True, (phase[1:] != phase[:-1]) | (token[1:] != token[:-1])]
    row = np.cumsum(new_row) - 1
    n_layers, n_experts, top_k = int(layer.max()) + 1, int(cells.max()) + 1, cells.shape[1]
    if len(np.unique(row * n_layers + layer)) != len(row):
        raise InputError(where, "token/layer", "repeated", "one row per (token, layer) cell")
    experts = np.full((int(row[-1]) + 1, n_layers, top_k), MISSING, np.uint16)
    experts[row, layer] = cells
    first = frame.drop_duplicates("layer")
    class_of_layer = np.zeros(n_layers, np.int16)  # a layer without cells is never looked up: any class
    class_of_layer[first["layer"].to_numpy(np.int64)] = first["class"].to_numpy(np.int64)
    expert_bytes = np.zeros(n_layers, np.int64)
    expert_bytes[first["layer"].to_numpy(np.int64)] = first["expert_bytes"].to_numpy(np.int64)
    class_bytes = np.zeros(int(class_of_layer.max()) + 1, np.int64)
    class_bytes[first["class"].to_numpy(np.int64)] = first["expert_bytes"].to_numpy(np.int64)
    decode = phase[new_row] == "decode"
    if decode.any() and not decode[int(np.argmax(decode)):].all():
        raise InputError(where, "phase", "prefill after decode", "the prompt's rows come before the decode rows")
    header = TraceHeader("run", n_layers, n_experts, top_k, where, "")
    trace = Trace(header, np.zeros(len(decode)), np.arange(len(decode)),
                  np.where(decode, PHASE_DECODE, PHASE_PREFILL), experts)
    return trace, Geometry(n_layers, n_experts, expert_bytes, class_of_layer, class_bytes)


def _manifest(results: Path) -> dict:
    try:
        return json.loads((results / "manifest.json").read_text())
    except (OSError, ValueError):
        raise InputError(str(results), "manifest.json", str(results / "manifest.json"), "unreadable") from None


def grid_values(results: Path) -> dict[str, list[str]]:
    """Each grid key's values as text, in the order the sweep's grids gave them (empty for a sweep written
    before expertsim kept them)."""
    return _manifest(results).get("values", {})


def sweep_dims(results: Path, frame: pd.DataFrame) -> list[str]:
    """The grid keys of the sweep's manifest.json, in the grids' order, whose value varies over the rows of
    `frame` (the sweep's points)."""
    manifest = _manifest(results)
    keys: list[str] = []
    for grid in manifest.get("grids", []):
        keys += [k for k in grid if k not in keys]
    return [k for k in keys if k in frame.columns and frame[k].nunique(dropna=True) > 1]
