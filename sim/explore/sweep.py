"""Sweeps: run one scenario over a grid of settings, on local processes or a Dask cluster.

    points = expand_grid("scenarios/ds4-504-per-class.toml",
                         ["engine.flags.ssd-streaming-cache-experts=2048,4096,9472",
                          "engine.env.DS4_CUDA_STREAMING_EXPERT_CACHE_RESERVE_GB=8:16:4"])
    result = run_sweep(points, "out/sweep", executor="processes", workers=4, resume=True)
    frame = load_sweep("out/sweep")

A grid key is a dotted path in the scenario's TOML spelling (`engine.flags.prefill-chunk`, `hardware`,
`workload.requests.0.prompt_tokens`); values are `v1,v2,...` (each read as a TOML value, a bare word as a
string) or `start:stop:step` (numbers, stop included). Where the schema expects a string (environment
variables, variant, hardware, model...) a value is kept as the text typed. Every point is the scenario's TOML
data with its overrides applied, loaded through `load_scenario`'s own checks.

Results folder: manifest.json (base scenario hash, grids, each key's values in grid order) and points/ID.parquet,
one row per finished point, written atomically (tmp + rename) as soon as the point finishes, so an interrupted
sweep loses nothing and `resume=True` skips every point already on disk. A point file that does not read back as one row of its point
(damaged by a full disk, or by hand) is recomputed on resume, and skipped with its name by `load_sweep`. A point's
ID hashes its overrides and the base scenario hash. A point that fails records its error (one line) and the sweep
goes on; `retry_failed=True` with `resume=True` computes the failed points again.

Points are evaluated by the experiment runner (sim/explore/runner.py), which also groups a cache-only LRU's
slot counts into one miss-ratio curve; column `method` says which path made each row ("mrc" or "run").
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import numbers
import os
import tomllib
import types
import typing
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd

from sim.engines import extra_metrics
from sim.errors import InputError
from sim.explore.runner import COUNTS, METRICS, Point, load_point, run_points, set_key, split_key

SCHEMA = "expertsim.sweep/1"
MAX_RANGE_VALUES = 100_000
EXECUTORS = ("processes", "dask")


# --------------------------------------------------------------------------------------------- grids


def _base_types(annotation: Any) -> set:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _base_types(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_base_types(a) for a in typing.get_args(annotation) if a is not type(None)))
    return {annotation}


def _field(model, name: str):
    for attr, info in model.model_fields.items():
        if name in (attr, info.alias):
            return info
    return None


def _expects_string(data: dict, parts: list[str | int]) -> bool:
    """Whether the schema wants a string at `parts` (then the grid keeps the text as typed)."""
    from sim.engines import ENGINES
    from sim.scenario import Request, Scenario, TraceSource

    head = [p for p in parts if not isinstance(p, int)]
    if len(head) == 3 and head[:2] == ["engine", "env"]:
        return True
    engine = ENGINES.get((data.get("engine") or {}).get("name"))
    settings = None if engine is None else engine.Settings  # an unknown engine: the point will not load
    flags = None if settings is None else settings.model_fields["flags"].annotation
    owners = {1: {(): Scenario}, 2: {("engine",): settings, ("trace",): TraceSource},
              3: {("engine", "flags"): flags, ("workload", "requests"): Request}}
    owner = owners.get(len(head), {}).get(tuple(head[:-1]))
    info = _field(owner, head[-1]) if owner is not None else None
    return info is not None and _base_types(info.annotation) == {str}


def _scalar(text: str) -> Any:
    """A TOML value (2048, 1.5, true, "x"), else the bare text as a string."""
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    return value if isinstance(value, (bool, int, float, str)) else text


def _number(text: str) -> int | float | None:
    value = _scalar(text.strip())
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _range(spec: str, text: str, where: str, key: str) -> list | None:
    parts = text.split(":")
    if len(parts) != 3:
        return None
    start, stop, step = (_number(p) for p in parts)
    if start is None or stop is None or step is None:
        return None
    if not all(math.isfinite(v) for v in (start, stop, step)):
        raise InputError(where, key, text, "start:stop:step needs finite numbers")
    if step == 0 or (stop - start) * step < 0:
        raise InputError(where, key, text, "start:stop:step needs a step that goes from start towards stop")
    count = int(math.floor((stop - start) / step + 1e-9)) + 1
    if count > MAX_RANGE_VALUES:
        raise InputError(where, key, text, f"{count} values; at most {MAX_RANGE_VALUES}")
    if all(isinstance(v, int) for v in (start, stop, step)):
        return [start + i * step for i in range(count)]
    return [round(start + i * step, 12) for i in range(count)]


def parse_grid(spec: str, data: dict, where: str = "--grid",
               option: str = "--grid") -> tuple[str, list[str | int], list]:
    """`key=v1,v2` or `key=start:stop:step` -> (key, key parts, values typed for the schema)."""
    key, eq, text = spec.partition("=")
    key = key.strip()
    if not eq or not key:
        raise InputError(where, option, spec, "write key=v1,v2,... or key=start:stop:step")
    try:
        parts = split_key(key)
    except ValueError:
        raise InputError(where, option, spec, "the key must be a dotted path such as engine.flags.prefill-chunk")
    if isinstance(parts[0], int):
        raise InputError(where, option, spec, "the key must start with a name")
    as_text = _expects_string(data, parts)
    values = _range(spec, text.strip(), where, key)
    if values is not None:
        if as_text:
            values = [str(v) for v in values]
    else:
        tokens = [t.strip() for t in text.split(",")]
        if not text.strip() or any(t == "" for t in tokens):
            raise InputError(where, key, text, "empty value; write key=v1,v2,... or key=start:stop:step")
        values = []
        for token in tokens:
            value = _scalar(token)
            if isinstance(value, float) and not math.isfinite(value):
                raise InputError(where, key, token, "a number must be finite")
            values.append(value if isinstance(value, str) or not as_text else token)
    unique = []
    for v in values:
        if not any(type(v) is type(u) and v == u for u in unique):
            unique.append(v)
    return key, parts, unique


def parse_settings(scenario_path: str | Path, settings: list[str]) -> tuple[dict, dict]:
    """`run --set KEY=VALUE ...`: (the scenario's TOML data with each setting applied, the overrides), with the
    grid's spelling and type rules and one value per key. The data loads through `load_scenario(path, data)`."""
    from sim.schema import read_toml

    path = str(scenario_path)
    data = read_toml(Path(path), path)
    overrides: dict = {}
    for spec in settings:
        where = f"{path} --set {spec.partition('=')[0].strip()}"
        key, parts, values = parse_grid(spec, data, where, option="--set")
        if len(values) != 1:
            raise InputError(where, "--set", spec, "one value per key (a list of values is a sweep: --grid)")
        if key in overrides:
            raise InputError(where, "--set", key, "given twice")
        set_key(data, parts, values[0], where, key)
        overrides[key] = values[0]
    return data, overrides


def expand_grid(scenario_path: str | Path, grids: list[str]) -> list[Point]:
    """Every combination of the grids' values (the first grid varies slowest), each loaded and checked.

    A bad key or a value of the wrong type -> InputError naming them. A combination that does not load while
    its values load in others (a reserve too large for one of the GPUs, say) becomes a point with `error` set.
    """
    from sim.schema import read_toml, validate
    from sim.scenario import Scenario, load_scenario, scenario_hash

    path = str(scenario_path)
    base_hash = scenario_hash(load_scenario(path))
    base = read_toml(Path(path), path)
    dims: list[tuple[str, list, list]] = []
    for spec in grids:
        where = f"{path} --grid {spec.partition('=')[0].strip()}"
        key, parts, values = parse_grid(spec, base, where)
        if any(key == k for k, _, _ in dims):
            raise InputError(where, "--grid", key, "given twice; put all its values in one --grid")
        for value in values:  # the schema alone: unknown keys, wrong types
            data = copy.deepcopy(base)
            set_key(data, parts, value, where, key)
            validate(where, Scenario, data)
        dims.append((key, parts, values))
    points: list[Point] = []
    worked: dict[tuple[str, str], bool] = {}
    first_error: dict[tuple[str, str], InputError] = {}
    for combo in itertools.product(*(values for _, _, values in dims)):
        overrides = {key: value for (key, _, _), value in zip(dims, combo)}
        point, error = load_point(path, base, overrides, base_hash)
        for key, value in overrides.items():
            if error is not None:
                first_error.setdefault((key, repr(value)), error)
            worked[(key, repr(value))] = worked.get((key, repr(value)), False) or point.error is None
        points.append(point)
    for (key, shown), ok in worked.items():
        if not ok:  # a value no combination can load is a bad value, not a failing point
            exc = first_error[(key, shown)]
            raise InputError(f"{path} --grid {key}", exc.field, exc.value, exc.why)
    return points


# ---------------------------------------------------------------------------------------------- results


# a row's text columns (pandas' string type; a point's overrides keep the types pandas infers for them)
TEXT_COLUMNS = ("error", "error_kind", "scenario_hash", "method", "notices", "out_of_domain")


def _row_frame(row: dict, overrides: dict) -> pd.DataFrame:
    """A point's row as a one-row frame: its metrics numbers (counts Int64, the others float64, anything that is
    not a number missing, as pd.to_numeric(errors="coerce") leaves it), its text columns strings. Each column is
    built typed: converting the columns of a frame built first costs the sweep's parent ~3 ms a point, a third
    of a worker's time for it (tests/test_explore.py checks the types)."""
    flat = {**row, "overrides": json.dumps(overrides, sort_keys=True),
            "notices": json.dumps(row.get("notices") or []), "out_of_domain": json.dumps(row.get("out_of_domain") or [])}
    numeric = {*METRICS, *extra_metrics()}
    columns = {}
    for key, value in flat.items():
        if key in numeric:
            value = _coerced_number(value)
            columns[key] = (pd.array([value], dtype="Int64") if key in COUNTS
                            else np.array([math.nan if value is None else value], np.float64))
        elif key in TEXT_COLUMNS:
            columns[key] = pd.array([value], dtype="string")
        else:
            columns[key] = [value]
    return pd.DataFrame(columns)


def _coerced_number(value):
    """One value as pd.to_numeric(errors="coerce") reads it: a number as it is, text that reads as one as a float,
    anything else missing (None)."""
    if value is None or isinstance(value, numbers.Number):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _write_row(frame: pd.DataFrame, path: Path) -> None:
    """The row's Parquet file: the bytes DataFrame.to_parquet writes, without its I/O layer (a millisecond of the
    parent's time a point)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), path)


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise InputError(str(path.parent), "output", str(path), f"cannot write: {exc.strerror}") from None


def read_point(path: Path) -> pd.DataFrame | None:
    """A point file's one row, or None if the file does not read back as one (truncated, not Parquet, another
    point's row)."""
    import pyarrow as pa

    try:
        frame = pd.read_parquet(path)
    except (OSError, ValueError, pa.ArrowException):
        return None
    if len(frame) != 1 or "point_id" not in frame or frame["point_id"].iloc[0] != path.stem:
        return None
    return frame


def read_points(out_dir: str | Path) -> tuple[dict[str, pd.DataFrame], list[str]]:
    """The rows on disk by point id, and the names of the point files that are damaged."""
    rows, damaged = {}, []
    point_dir = Path(out_dir) / "points"
    for path in sorted(point_dir.glob("*.parquet")) if point_dir.is_dir() else []:
        frame = read_point(path)
        if frame is None:
            damaged.append(str(path))
        else:
            rows[path.stem] = frame
    return rows, damaged


@dataclass
class SweepResult:
    out_dir: Path
    total: int
    computed: list[str] = field(default_factory=list)  # ids simulated by this call
    resumed: list[str] = field(default_factory=list)  # ids found on disk and skipped
    failed: list[str] = field(default_factory=list)  # ids whose row has an error (this call's and resumed ones)
    damaged: list[str] = field(default_factory=list)  # point files found damaged, recomputed by this call
    left_damaged: list[str] = field(default_factory=list)  # damaged files of points outside this call's grid
    rows: dict[str, pd.DataFrame] = field(default_factory=dict)  # this call's points' rows (resumed, computed)

    def frame(self) -> pd.DataFrame:
        """Every finished point of the results folder (load_sweep), this call's and other grids'."""
        return load_sweep(self.out_dir)

    def points_frame(self) -> pd.DataFrame:
        """This call's points, one row each, sorted by point id: from memory, no point file read again."""
        if not self.rows:
            return pd.DataFrame(columns=load_sweep_columns())
        return pd.concat(self.rows.values(), ignore_index=True).sort_values("point_id", ignore_index=True)


def open_results(out: Path, points: list[Point], resume: bool) -> tuple[dict[str, pd.DataFrame], list[str]]:
    """Check (or start) the results folder: the rows already finished there by point id, and the point files
    there that are damaged (read_points)."""
    base_hash, scenario = points[0].base_hash, points[0].scenario_path
    manifest_path = out / "manifest.json"
    point_dir = out / "points"
    if manifest_path.exists():
        try:
            manifest = json.loads(manifest_path.read_text())
            theirs = manifest["base_scenario_hash"]
        except (OSError, ValueError, KeyError, TypeError):
            raise InputError(str(out), "manifest.json", str(manifest_path), "unreadable sweep manifest") from None
        if theirs != base_hash:
            raise InputError(str(out), "manifest.base_scenario_hash", theirs,
                             f"results of another scenario ({manifest.get('scenario')}); {scenario} hashes to "
                             f"{base_hash}: choose another folder")
        done = {p.stem: None for p in point_dir.glob("*.parquet")} if point_dir.is_dir() else {}
        if done and not resume:
            raise InputError(str(out), "output", str(out),
                             f"holds {len(done)} points of this sweep already: pass --resume to continue it")
        grids, values = manifest.get("grids", []), manifest.get("values", {})
    else:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise InputError(str(out), "output", str(out), "not empty and not a sweep results folder "
                                                           "(no manifest.json)")
        done, grids, values = {}, [], {}
    keys = sorted({k for p in points for k in p.overrides})
    if keys not in grids:
        grids = [*grids, keys]
    # each key's values in the order the grids gave them (points come in grid order): a report draws a text
    # dimension (variants) in this order, not the alphabet's
    for key in keys:
        values[key] = list(dict.fromkeys([*values.get(key, []),
                                          *(str(p.overrides[key]) for p in points if key in p.overrides)]))
    try:
        point_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(str(out), "output", str(out), f"cannot create: {exc.strerror}") from None
    manifest = {"schema": SCHEMA, "scenario": scenario, "base_scenario_hash": base_hash, "grids": grids,
                "values": values}
    _atomic_write(manifest_path, lambda p: p.write_text(json.dumps(manifest, indent=2) + "\n"))
    return read_points(out) if done else ({}, [])


def run_sweep(points: list[Point], out_dir: str | Path, executor: str = "processes", workers: int | None = None,
              scheduler: str | None = None, resume: bool = False,
              progress: Callable[[dict, int, int], None] | None = None, mrc: bool = True,
              retry_failed: bool = False, opened: tuple[dict, list[str]] | None = None) -> SweepResult:
    """Run the points, writing each one's row to out_dir/points/ID.parquet the moment it finishes.

    `progress(row, finished, total)` is called after each point (finished counts resumed points too).
    `mrc=False` runs every point through its engine, even those the one-pass curve gives (the benchmark's
    comparison). `opened`: what open_results gave for these points, when the caller has already opened the folder.
    """
    if executor not in EXECUTORS:
        raise InputError("--executor", "executor", executor, f"must be one of: {', '.join(EXECUTORS)}")
    if workers is not None and workers < 1:
        raise InputError("--workers", "workers", workers, "must be >= 1")
    out = Path(out_dir)
    result = SweepResult(out, len(points))
    if not points:
        return result
    if len({p.base_hash for p in points}) != 1:
        raise ValueError("points of one sweep must share a base scenario")
    if retry_failed and not resume:
        raise InputError("--retry-failed", "retry_failed", True, "continues a sweep: give --resume too")
    done, damaged = opened if opened is not None else open_results(out, points, resume)
    point_dir = out / "points"
    mine = {str(point_dir / f"{p.point_id}.parquet") for p in points}
    result.damaged = [path for path in damaged if path in mine]
    result.left_damaged = [path for path in damaged if path not in mine]
    todo: list[Point] = []
    seen: set[str] = set()
    for p in points:
        if p.point_id in seen:
            continue
        seen.add(p.point_id)
        row = done.get(p.point_id)
        failed = row is not None and not pd.isna(row["error"].iloc[0])
        if row is None or (failed and retry_failed):
            todo.append(p)
            continue
        result.resumed.append(p.point_id)
        result.rows[p.point_id] = row
        if failed:
            result.failed.append(p.point_id)
    finished = len(result.resumed)

    def record(point: Point, row: dict) -> None:
        nonlocal finished
        frame = _row_frame(row, point.overrides)
        _atomic_write(point_dir / f"{point.point_id}.parquet", lambda path: _write_row(frame, path))
        result.rows[point.point_id] = frame
        finished += 1
        result.computed.append(point.point_id)
        if row["error"] is not None:
            result.failed.append(point.point_id)
        if progress is not None:
            progress(row, finished, len(seen))

    with closing(run_points(todo, executor, workers, scheduler, mrc)) as finished_points:
        for point, row in finished_points:
            record(point, row)
    return result


def load_sweep_columns() -> list[str]:
    """The columns of a point's row (an empty sweep's frame has them too)."""
    return ["point_id", "scenario_hash", *METRICS, "notices", "out_of_domain", "error", "error_kind", "method",
            "wall_s", "overrides"]


def load_sweep(out_dir: str | Path) -> pd.DataFrame:
    """All finished points of a results folder, one row each (sorted by point id); damaged point files are left
    out and named in `frame.attrs["damaged"]`."""
    out = Path(out_dir)
    if not (out / "manifest.json").is_file():
        raise InputError(str(out), "path", str(out), "not a sweep results folder (no manifest.json)")
    rows, damaged = read_points(out)
    if not rows:
        frame = pd.DataFrame(columns=load_sweep_columns())
    else:
        frame = pd.concat(rows.values(), ignore_index=True).sort_values("point_id", ignore_index=True)
    frame.attrs["damaged"] = damaged
    return frame


__all__ = ["SweepResult", "expand_grid", "load_sweep", "load_sweep_columns", "open_results", "parse_grid", "parse_settings", "read_point",
           "read_points", "run_sweep"]
