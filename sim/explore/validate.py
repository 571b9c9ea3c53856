"""Validation: every published measurement of the engines as a case, simulated through the experiment runner.

    cases = load_cases()                      # scenarios/validation/*.toml, one case per file
    record = validate_cases(cases, workers=2) # {"rows": [...], "cases": [...], "provenance": {...}}

A case (one TOML file, `Case` below) holds a base scenario (the `[scenario]` table, as a scenario file would),
its arms (each the base with some settings changed, in sweep's dotted-key spelling) and what was measured:
a ratio between two arms (the primary figure: it cancels what the engines' authors did not publish), a
percentage, or an absolute figure, each with its source. One policy for all (TOLERANCE, `judge_effect`): a ratio
row is judged on its *effect* (ratio - 1, what turning the knob does), a percent row within 10 points, an absolute
row within 25 %. A case's role is derived, never typed: `calibration` when a calibration record
(sim/engines/records.py) names the case, else `prediction`. A measurement the model cannot express stays in
the table as `not expressible: <what is missing>`.

A measured figure may be a range (run-to-run spread as reported): the error is then the distance to the
nearer end, zero inside it.
"""

from __future__ import annotations

import json
import math
import re
from contextlib import closing
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np
from pydantic import Field, field_validator, model_validator

from sim.calibrate.fit import REPLAY_GOAL_MEDIAN_ERROR
from sim.engines.records import RECORDS
from sim.errors import InputError
from sim.explore.runner import METRICS, make_point, run_points
from sim.outputs import dumps
from sim.schema import Strict, read_toml, validate

CASES_DIR = Path(__file__).resolve().parents[2] / "scenarios" / "validation"
# The GPU copy replay measured on several H200s (expertsim calibrate --replay; docs/calibration.md): validate runs
# without a GPU, so it reports these recorded replays per machine rather than making new ones.
REPLAY_SPREAD_FILE = CASES_DIR.parent / "hardware" / "calibration" / "h200-replay-spread.json"
SCHEMA = "expertsim.validation/1"
# Tolerances: a percentage within 10 points, an absolute figure within 25 % (issue 11). A ratio between arms is
# judged on its effect (issue 31, `judge_effect`): the prediction within max(5 points, a third of the measured
# effect) of the measured effect, and of the same sign where the measured effect is at least 5 % either way. A
# fixed band on the ratio would let "no effect" pass every effect smaller than the band.
TOLERANCE = {"percent": 10.0, "absolute": 0.25}
EFFECT_FLOOR = 0.05      # 5 points of effect: below it an effect is within run-to-run noise (its sign is not judged)
EFFECT_SHARE = 1 / 3     # ... above it the prediction may miss by a third of the measured effect
PERCENT_METRICS = ("decode_hit_rate", "prefill_hit_rate", "belady_decode_hit_rate")  # 0-1 in the summary


class Arm(Strict):
    name: str = Field(min_length=1)
    # dotted scenario keys -> values, as sweep's --grid keys (engine.flags.prefill-chunk = 4096)
    set: dict[str, Any] = Field(default_factory=dict)


class Measured(Strict):
    metric: Literal[METRICS]  # type: ignore[valid-type]
    kind: Literal["ratio", "percent", "absolute"]
    arms: list[str] = Field(min_length=1, max_length=2)  # ratio: [numerator, denominator]; else one arm
    value: float | int | None = None
    range: list[float] | None = Field(None, min_length=2, max_length=2)  # the reported spread, low and high
    source: str = Field(min_length=8)
    note: str | None = None

    @model_validator(mode="after")
    def _shape(self) -> "Measured":
        if (self.value is None) == (self.range is None):
            raise ValueError("give the measured figure as value = X or range = [LOW, HIGH], one of them")
        if self.range is not None and not self.range[0] <= self.range[1]:
            raise ValueError("range = [LOW, HIGH] needs LOW <= HIGH")
        if len(self.arms) != (2 if self.kind == "ratio" else 1):
            raise ValueError("a ratio names two arms [numerator, denominator]; a percent or absolute figure one")
        if self.kind == "percent" and self.metric not in PERCENT_METRICS:
            raise ValueError(f"a percent figure is a hit rate: one of {', '.join(PERCENT_METRICS)}")
        return self

    @property
    def low(self) -> float:
        return self.value if self.range is None else self.range[0]

    @property
    def high(self) -> float:
        return self.value if self.range is None else self.range[1]


class Case(Strict):
    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    title: str = Field(min_length=4)
    source: str = Field(min_length=4)
    # what the model lacks to express the case; a case with it has no scenario, arms or measurements
    not_expressible: str | None = None
    scenario: dict | None = None  # the base scenario inline, as a scenario file holds it
    base: str | None = None  # or a scenario file, relative to the case file (a seed scenario)
    arms: list[Arm] = Field(default_factory=list)
    measured: list[Measured] = Field(default_factory=list)

    @field_validator("arms", mode="after")
    @classmethod
    def _unique(cls, arms: list[Arm]) -> list[Arm]:
        names = [a.name for a in arms]
        if len(set(names)) != len(names):
            raise ValueError(f"arm names must be unique, got {names}")
        return arms

    @model_validator(mode="after")
    def _complete(self) -> "Case":
        if self.not_expressible is not None:
            if self.scenario or self.base or self.arms or self.measured:
                raise ValueError("a case that is not expressible has no scenario, arms or measured figures")
            return self
        if (self.scenario is None) == (self.base is None) or not self.arms or not self.measured:
            raise ValueError("a case needs a [scenario] table or a base = \"scenario file\" (one of them), [[arms]] "
                             "and [[measured]] figures (or not_expressible = \"what is missing\")")
        names = {a.name for a in self.arms}
        for m in self.measured:
            unknown = [a for a in m.arms if a not in names]
            if unknown:
                raise ValueError(f"measured {m.metric} names unknown arms {unknown}; arms: {sorted(names)}")
        return self

    @property
    def role(self) -> str:
        """calibration when a calibration record was fitted from this case, else prediction."""
        return "calibration" if any(r.case == self.id for r in RECORDS) else "prediction"


def load_case(path: str | Path) -> Case:
    path = Path(path)
    case = validate(str(path), Case, read_toml(path, str(path)))
    if case.id != path.stem:
        raise InputError(str(path), "id", case.id, f"must be the file's name ({path.stem})")
    return case


def case_paths(folder: Path = CASES_DIR) -> list[Path]:
    return sorted(folder.glob("*.toml"))


def load_cases(ids: list[str] | None = None, folder: Path = CASES_DIR) -> list[tuple[Path, Case]]:
    """The cases of `folder` (all, or those named in `ids`, in that order); an unknown id is one line."""
    paths = {p.stem: p for p in case_paths(folder)}
    if ids:
        unknown = [i for i in ids if i not in paths]
        if unknown:
            raise InputError("--case", "case", unknown[0], f"no such case; known: {', '.join(sorted(paths))}")
        chosen = [paths[i] for i in dict.fromkeys(ids)]
    else:
        chosen = list(paths.values())
    return [(p, load_case(p)) for p in chosen]


# ---------------------------------------------------------------------------------------------- comparing


def _figure(metric: str, value: float | None) -> float | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return value * 100 if metric in PERCENT_METRICS else float(value)


def judge_effect(predicted_ratio: float, low: float, high: float) -> dict:
    """A ratio row judged on its effect (ratio - 1): the error is the distance in points to the nearer end of the
    measured range (0 inside it), the tolerance max(5 points, a third of that end's effect), and where the whole
    measured range lies 5 % or more on one side of 1 the predicted effect must lie on that side too."""
    effect = predicted_ratio - 1.0
    low_effect, high_effect = low - 1.0, high - 1.0
    nearest = low_effect if effect < low_effect else high_effect if effect > high_effect else effect
    tolerance = max(EFFECT_FLOOR, EFFECT_SHARE * abs(nearest))
    measured_sign = 1 if low_effect >= EFFECT_FLOOR else -1 if high_effect <= -EFFECT_FLOOR else 0
    sign_agrees = None if measured_sign == 0 else effect * measured_sign > 0
    error = effect - nearest
    return {"predicted_effect": effect, "measured_effect_low": low_effect, "measured_effect_high": high_effect,
            "error": error, "tolerance": tolerance, "sign_agrees": sign_agrees,
            "within": sign_agrees is not False and abs(error) <= tolerance + 1e-12}


def compare(m: Measured, rows: dict[str, dict]) -> dict:
    """One measured figure against the arms' rows: predicted, error, within tolerance (or why not computed). A
    ratio row's error and tolerance are in points of effect (`judge_effect`), a percent row's in points, an
    absolute row's relative to the nearer end of the measured range."""
    failed = [rows[a]["error"] for a in m.arms if rows[a]["error"]]
    values = [_figure(m.metric, rows[a].get(m.metric)) for a in m.arms]
    predicted = None
    if not failed and None not in values:
        if m.kind == "ratio":
            predicted = values[0] / values[1] if values[1] else None
        else:
            predicted = values[0]
    ood = sorted({note for a in m.arms for note in rows[a].get("out_of_domain") or []})
    return {"metric": m.metric, "kind": m.kind, "arms": "/".join(m.arms), "predicted": predicted,
            "measured_low": m.low, "measured_high": m.high, **judge(m.kind, predicted, m.low, m.high),
            "failed": failed[0] if failed else None, "out_of_domain": ood, "source": m.source, "note": m.note}


def judge(kind: str, predicted: float | None, low: float, high: float) -> dict:
    """A predicted figure against a measured one (or range) by the kind's rule: error, tolerance, within (None
    where nothing was predicted) and, for a ratio, the effects and whether their signs agree."""
    judged = {"predicted_effect": None, "measured_effect_low": None, "measured_effect_high": None,
              "sign_agrees": None, "error": None, "within": None, "tolerance": TOLERANCE.get(kind)}
    if kind == "ratio":
        judged["measured_effect_low"], judged["measured_effect_high"] = low - 1.0, high - 1.0
        if predicted is not None:
            judged.update(judge_effect(predicted, low, high))
    elif predicted is not None:
        if kind == "percent":
            error = 0.0 if low <= predicted <= high else (predicted - low if predicted < low else predicted - high)
        else:
            nearest = low if predicted < low else high if predicted > high else predicted
            error = 0.0 if nearest == predicted else (predicted - nearest) / nearest
        judged.update(error=error, within=abs(error) <= TOLERANCE[kind] + 1e-12)
    return judged


def effect_text(row: dict) -> str:
    """A ratio row's effects side by side, 'predicted +44.7 % / measured +68.7 %' ('' for other rows)."""
    if row["kind"] != "ratio" or row["measured_effect_low"] is None:
        return ""
    low, high = row["measured_effect_low"], row["measured_effect_high"]
    measured = f"{100 * low:+.1f} %" if low == high else f"{100 * low:+.1f} to {100 * high:+.1f} %"
    predicted = "-" if row["predicted_effect"] is None else f"{100 * row['predicted_effect']:+.1f} %"
    return f"{predicted} / {measured}"


def error_text(row: dict) -> str:
    """The error in the row's own unit: points of effect (ratio), points (percent), relative (absolute)."""
    if row["error"] is None:
        return ""
    if row["kind"] == "ratio":
        return f"{100 * row['error']:+.1f} pt (<= {100 * row['tolerance']:.1f})"
    return f"{row['error']:+.1f} pt" if row["kind"] == "percent" else f"{100 * row['error']:+.1f} %"


def verdict_text(row: dict) -> str:
    """yes / no / no: wrong sign / failed: why."""
    if row["within"] is None:
        return f"failed: {row['failed']}" if row["failed"] else ""
    if row["sign_agrees"] is False:
        return "no: wrong sign"
    return "yes" if row["within"] else "no"


def base_of(path: Path, case: Case) -> tuple[Path, dict]:
    """The base scenario's file (what its relative paths resolve against) and data."""
    if case.base is None:
        return path, dict(case.scenario)
    base = (path.parent / case.base).resolve()
    return base, read_toml(base, f"{path}: base")


def _case_row(case: Case) -> dict:
    return {"case": case.id, "title": case.title, "role": case.role, "case_source": case.source}


def validate_cases(cases: list[tuple[Path, Case]], executor: str = "processes", workers: int | None = None,
                   uncertainty: int = 0, seed: int = 0,
                   progress: Callable[[int, int], None] | None = None) -> dict:
    """Simulate every arm of the expressible cases (one runner call for all) and compare each measured figure.
    With `uncertainty` N, every arm is also run on N Latin-hypercube samples of its estimated inputs (the same
    sample i in every arm of a case that runs on the same profile) and each figure gets its p10-p90 band.
    `progress(done, of)` is called as each arm's run finishes."""
    from sim.scenario import load_scenario, scenario_hash

    points = {}
    for path, case in cases:
        if case.not_expressible is not None:
            continue
        where, data = base_of(path, case)
        base_hash = scenario_hash(load_scenario(where, data))  # a bad base fails here, in one line
        for arm in case.arms:
            points[(case.id, arm.name)] = make_point(where, data, arm.set, base_hash)
    rows_by_arm: dict[tuple[str, str], dict] = {}
    if points:
        # the same point can be an arm of two cases: run it once
        unique = list({p.point_id: p for p in points.values()}.values())
        found = {}
        with closing(run_points(unique, executor, workers, share_routing=True)) as finished:
            for p, row in finished:
                found[p.point_id] = row
                if progress is not None:
                    progress(len(found), len(unique))
        rows_by_arm = {key: found[p.point_id] for key, p in points.items()}
    sampled: dict[tuple[str, str], list[dict]] = {}
    if uncertainty and points:
        sampled = _sample_arms(points, uncertainty, seed, executor, workers)
    rows, summary = [], []
    for path, case in cases:
        head = _case_row(case)
        if case.not_expressible is not None:
            rows.append({**head, "metric": None, "kind": None, "arms": None, "predicted": None, "measured_low": None,
                         "measured_high": None, "predicted_effect": None, "measured_effect_low": None,
                         "measured_effect_high": None, "sign_agrees": None, "error": None, "tolerance": None,
                         "within": None, "failed": None, "out_of_domain": [], "source": case.source,
                         "note": f"not expressible: {case.not_expressible}"})
            summary.append({**head, "expressible": False, "arms": 0})
            continue
        arm_rows = {arm.name: rows_by_arm[(case.id, arm.name)] for arm in case.arms}
        for m in case.measured:
            row = {**head, **compare(m, arm_rows)}
            if sampled:
                row.update(_band(m, {a: sampled[(case.id, a)] for a in m.arms}))
                row["band_reason"] = band_reason(row)
            rows.append(row)
        summary.append({**head, "expressible": True, "arms": len(case.arms),
                        "arm_rows": {name: _arm_figures(row) for name, row in arm_rows.items()}})
    return {"schema": SCHEMA, "rows": rows, "cases": summary, "totals": totals(rows, summary),
            "gpu_replay": replay_by_machine(), "provenance": provenance(cases)}


def _sample_arms(points: dict, n: int, seed: int, executor: str, workers: int | None) -> dict:
    """Every arm's rows on n samples of its inputs (arms on the same profile share sample i's values): for each arm
    a list of (the sample's input values, its row), None where the sample did not run."""
    from sim.explore.runner import load_scenario_data
    from sim.explore.uncertainty import latin_hypercube, sample_points, uncertain_inputs

    todo, keys = [], {}
    for key, point in points.items():
        if point.error is not None:
            continue
        inputs = uncertain_inputs(load_scenario_data(point.scenario_path, point.data))
        for i, sample in enumerate(sample_points(point, inputs, latin_hypercube(inputs, n, seed))):
            sample = type(sample)(**{**vars(sample), "point_id": f"{key[0]}/{key[1]}/{i}"})
            todo.append(sample)
            keys[sample.point_id] = (key, i)
    found: dict = {key: [None] * n for key in points}
    with closing(run_points(todo, executor, workers, share_routing=True)) as finished:
        for sample, row in finished:
            key, i = keys[sample.point_id]
            found[key][i] = (sample.profile_values, row)
    return found


# An effect's drivers: the inputs whose sampled values move it, by Spearman's rank correlation over the samples
# (the Latin hypercube pairs the inputs at random, so one input's correlation is its own share of the effect's
# spread). Below EFFECT_DRIVER_MIN_RHO a correlation over a handful of samples is noise; the top few are shown.
EFFECT_DRIVER_MIN_RHO = 0.5
EFFECT_DRIVERS_SHOWN = 3


def _band(m: Measured, samples: dict[str, list]) -> dict:
    """The figure's p10-p90 over the samples, and whether the measured figure (or its range) meets that band; for
    a ratio also what moves its effect: the inputs whose values correlate with it, and whether every sample
    predicts an effect of the same sign (then the sign comes from the mechanism, not from an estimated figure)."""
    import pandas as pd

    from sim.explore.uncertainty import quantiles

    values, inputs = [], []
    for i in range(min(len(rows) for rows in samples.values())):
        pairs = [samples[a][i] for a in m.arms]
        if any(p is None or p[1]["error"] for p in pairs):
            continue
        figs = [_figure(m.metric, row.get(m.metric)) for _, row in pairs]
        if None in figs or (m.kind == "ratio" and not figs[1]):
            continue
        values.append(figs[0] / figs[1] if m.kind == "ratio" else figs[0])
        inputs.append({path: v for given, _ in pairs for path, v in given.items()})
    q = quantiles(values)
    consistent = None if q["p10"] is None else (m.low <= q["p90"] and m.high >= q["p10"])
    out = {"band_p10": q["p10"], "band_median": q["median"], "band_p90": q["p90"], "band_samples": q["n"],
           "in_band": consistent}
    if m.kind == "ratio":
        effects = pd.Series(values, dtype=float) - 1.0
        table = pd.DataFrame(inputs)
        # Spearman's rho as the Pearson correlation of the ranks (pandas' own spearman needs scipy)
        ranks = effects.rank()
        rho = table.apply(lambda column: column.rank().corr(ranks)) if len(values) > 2 else pd.Series(dtype=float)
        rho = rho.dropna()
        strong = rho[rho.abs() >= EFFECT_DRIVER_MIN_RHO].sort_values(key=abs, ascending=False)
        out["effect_drivers"] = [{"input": path, "rho": float(r)} for path, r in
                                 strong.head(EFFECT_DRIVERS_SHOWN).items()]
        signs = set(np.sign(effects[effects != 0]))
        out["effect_sign_stable"] = None if not values else len(signs) <= 1
    return out


def band_reason(row: dict) -> str | None:
    """Why a prediction's measured figure lies outside its p10-p90 band (None when it is inside, or not banded),
    from the row itself: a band of zero width (no estimated input moves the figure), a miss inside tolerance
    (the estimates alone do not span the rest of the error), or a miss outside it (the figure's note says what
    the model lacks, where the case gives one)."""
    if row.get("in_band") is not False:
        return None
    if row["band_p90"] - row["band_p10"] <= 1e-9 * max(1.0, abs(row["band_median"])):
        return "no estimated input moves it: it follows from the engine's rules and sourced figures"
    if row["within"]:
        return "within tolerance; the estimated inputs' ranges alone do not span the rest of the error"
    return "outside tolerance: " + (row["note"] or "a mechanism or setting the model lacks")


def drivers_text(row: dict) -> str:
    """What moves a ratio row's effect under --uncertainty: 'same sign in every sample; host.memcpy_gbps
    (rho +0.82)', or '' where the row was not sampled."""
    if row.get("effect_sign_stable") is None:
        return ""
    head = "same sign in every sample" if row["effect_sign_stable"] else "sign differs between samples"
    drivers = ", ".join(f"{d['input']} (rho {d['rho']:+.2f})" for d in row["effect_drivers"])
    return f"{head}; {drivers or 'no input correlates with it'}"


def _arm_figures(row: dict) -> dict:
    return {**{k: row.get(k) for k in METRICS}, "error": row["error"], "notices": row.get("notices", []),
            "out_of_domain": row.get("out_of_domain", [])}


def totals(rows: list[dict], cases: list[dict]) -> dict:
    """Counts the issues' targets are stated in: cases expressible, ratio rows (prediction and calibration) whose
    effect passes and whose sign is wrong, prediction rows within tolerance."""
    predictions = [r for r in rows if r["role"] == "prediction" and r["metric"] is not None]
    judged = [r for r in predictions if r["within"] is not None]
    banded = [r for r in predictions if r.get("in_band") is not None]
    ratios = [r for r in rows if r["kind"] == "ratio" and r["within"] is not None]
    return {"cases": len(cases), "expressible": sum(c["expressible"] for c in cases),
            "calibration_cases": sum(c["role"] == "calibration" for c in cases),
            "ratio_rows": len(ratios), "ratio_rows_within": sum(bool(r["within"]) for r in ratios),
            "ratio_rows_wrong_sign": sum(r["sign_agrees"] is False for r in ratios),
            "prediction_rows": len(predictions), "prediction_rows_judged": len(judged),
            "prediction_rows_within": sum(bool(r["within"]) for r in judged),
            "prediction_rows_banded": len(banded), "prediction_rows_in_band": sum(bool(r["in_band"]) for r in banded)}


def provenance(cases: list[tuple[Path, Case]]) -> dict:
    """What the record was made from: the package version and each case file's sha256."""
    from sim.version import __version__
    from sim.schema import sha256_file

    return {"package_version": __version__, "cases": {case.id: sha256_file(path) for path, case in cases},
            "gpu_replay": {REPLAY_SPREAD_FILE.name: sha256_file(REPLAY_SPREAD_FILE)}}


def write_record(record: dict, out_dir: str | Path) -> dict:
    """validation.json (the record) and validation.parquet (one row per measured figure) under out_dir."""
    import pandas as pd

    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "validation.json").write_text(dumps(record, indent=2) + "\n")
        frame = pd.DataFrame(record["rows"])
        frame["out_of_domain"] = frame["out_of_domain"].map(dumps)
        if "effect_drivers" in frame:  # lists of records, as JSON text like out_of_domain
            frame["effect_drivers"] = frame["effect_drivers"].map(lambda d: None if d is None or d != d else dumps(d))
        frame.to_parquet(out / "validation.parquet", index=False)
    except OSError as exc:
        raise InputError(str(out), "output", str(out), f"cannot write: {exc.strerror}") from None
    return {"json": str(out / "validation.json"), "parquet": str(out / "validation.parquet")}


def replay_by_machine(spread_file: Path = REPLAY_SPREAD_FILE) -> list[dict]:
    """The recorded GPU replays, one row per machine and way of copying: the median errors with the machine's own
    calibration and with another machine's, at the replay's host state where the calibration recorded the probe,
    moved by the anchors where the replay timed them, and whether every replay with its own calibration met the
    goal (None where it has none)."""
    rows = json.loads(Path(spread_file).read_text())["rows"]  # a committed record, not user input
    out: dict[tuple[str, str, str], dict] = {}  # (machine, way, timing)
    for r in rows:
        machine = r["machine"].split(" (")[0]
        calibrated_on = re.search(r"\(machine (\w+)", r["calibration"]).group(1)
        row = out.setdefault((machine, r["way"], r["timing"]), {"machine": machine, "way": r["way"],
                                                                "timing": r["timing"], "own": [], "other": [],
                                                                "host_adjusted": [], "anchor_adjusted": []})
        row["own" if calibrated_on == machine else "other"].append(r["median_error"])
        if r.get("host_adjusted_median_error") is not None:
            row["host_adjusted"].append(r["host_adjusted_median_error"])
        if r.get("anchor_adjusted_median_error") is not None:
            row["anchor_adjusted"].append(r["anchor_adjusted_median_error"])
    for row in out.values():
        row["own_within_goal"] = all(e <= REPLAY_GOAL_MEDIAN_ERROR for e in row["own"]) if row["own"] else None
    return list(out.values())


def percent_range(errors: list[float]) -> str:
    """Median errors as the terminal and the docs show them: '' for none, '4.2 %', '6.3 % (2 replays)' where they
    print alike, or '3.4-5.0 % (4 replays)'."""
    if not errors:
        return ""
    low, high = f"{100 * min(errors):.1f}", f"{100 * max(errors):.1f}"
    if len(errors) == 1:
        return f"{low} %"
    return f"{low} % ({len(errors)} replays)" if low == high else f"{low}-{high} % ({len(errors)} replays)"


def replay_table(rows: list[dict]) -> list[dict]:
    """replay_by_machine's rows with their errors as text."""
    verdict = {True: "yes", False: "no", None: "no own calibration"}
    return [{"machine": r["machine"], "way": r["way"], "timing": r["timing"],
             "own calibration": percent_range(r["own"]), "another's": percent_range(r["other"]),
             "at the replay's host state": percent_range(r["host_adjusted"]),
             "with the anchors": percent_range(r["anchor_adjusted"]),
             f"own <= {REPLAY_GOAL_MEDIAN_ERROR:.0%}": verdict[r["own_within_goal"]]} for r in rows]


@lru_cache(maxsize=4)
def validate_all(workers: int | None = None) -> dict:
    """Every case, once per process (the docs exhibit and the tests share it)."""
    return validate_cases(load_cases(), workers=workers)


__all__ = ["CASES_DIR", "EFFECT_FLOOR", "EFFECT_SHARE", "REPLAY_SPREAD_FILE", "Case", "Measured", "TOLERANCE",
           "band_reason", "compare", "drivers_text", "effect_text", "error_text", "judge", "judge_effect", "load_case", "load_cases", "percent_range", "provenance",
           "replay_by_machine", "replay_table", "totals", "validate_all", "validate_cases", "verdict_text",
           "write_record"]
