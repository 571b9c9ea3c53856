"""Plan: search an engine's own knobs for a scenario's hardware + model + workload (docs/plan.md).

    plan = make_plan("scenarios/strata-658-borrow.toml", objective="prefill_tok_s",
                     constraints=["vram_free_mib>=2048"])
    plan.best.settings, plan.explanations

Candidates come from `sweep.expand_grid` (the same `--grid KEY=...` spelling and checks); combinations that
cannot load, and ones the engine's memory plan shows cannot fit (Engine.plan_memory: why no expert cache can
exist, a reserve larger than what is free at sizing), are pruned before running. Each remaining candidate is
simulated by the experiment runner (sim/explore/runner.py: here, or on spawned processes with workers > 1).
Constraints filter, the objective ranks, ties (no difference within 3 %) go to the candidate that changes fewest
settings of the scenario. Each recommended setting is explained by the candidates that differ from the
recommendation in that setting only.
"""

from __future__ import annotations

import math
import operator
import re
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

from sim.engines import ENGINES, engine_of
from sim.engines.base import setting
from sim.errors import InputError
from sim.explore.runner import METRICS, load_scenario_data, run_points

WHERE = "plan"
NO_DIFFERENCE = 0.03  # alternatives within 3 % of the objective are reported as "no difference"

OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "==": operator.eq,
       "=": operator.eq}
_CONSTRAINT = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(>=|<=|==|=|>|<)\s*(\S+)\s*$")

# ------------------------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class Constraint:
    key: str
    op: str
    bound: float
    text: str

    def ok(self, metrics: dict) -> bool:
        value = metrics.get(self.key)
        return value is not None and not _nan(value) and OPS[self.op](value, self.bound)

    def shortfall(self, metrics: dict) -> float:
        """How far a candidate misses this constraint, relative to the bound (0 when met)."""
        if self.ok(metrics):
            return 0.0
        value = metrics.get(self.key)
        if value is None or _nan(value):
            return math.inf
        return abs(value - self.bound) / max(abs(self.bound), 1.0) + 1e-9


def _nan(value) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _known(key: str, option: str, text: str) -> None:
    if key not in METRICS:
        raise InputError(WHERE, option, text, f"unknown metric {key!r}; known: {', '.join(METRICS)}")


def parse_constraint(text: str) -> Constraint:
    """`decode_tok_s>=20`, `file_blob_reads<=0`, `vram_free_mib>=2048` -> Constraint; else a one-line InputError."""
    m = _CONSTRAINT.match(text or "")
    if not m:
        raise InputError(WHERE, "--constraint", text, "write METRIC OP NUMBER, OP one of >= <= > < ==, "
                                                       "e.g. decode_tok_s>=20")
    key, op, number = m.groups()
    _known(key, "--constraint", text)
    try:
        bound = float(number.replace("_", ""))
    except ValueError:
        raise InputError(WHERE, "--constraint", text, f"{number!r} is not a number") from None
    if math.isnan(bound):
        raise InputError(WHERE, "--constraint", text, "the bound must be a number")
    return Constraint(key, op, bound, f"{key}{op}{number}")


def parse_objective(text: str) -> tuple[str, int]:
    """`decode_tok_s` (maximise) or `-ttft_s` (minimise) -> (key, sign)."""
    text = (text or "").strip()
    sign, key = (-1, text[1:].strip()) if text.startswith("-") else (1, text.lstrip("+").strip())
    _known(key, "--objective", text)
    return key, sign


# ------------------------------------------------------------------------------------------ defaults


def _spec(key: str, values: list) -> str:
    def show(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        return str(v)
    return f"{key}={','.join(show(v) for v in values)}"


def default_knobs(data: dict) -> tuple[list[tuple[str, list]], list[tuple[str, list]]]:
    """(primary, secondary) knobs with their default candidates, the scenario's own value first: the
    engine's own search space (Engine.search_space). Primary knobs are searched as a full grid; secondary
    ones one at a time from the best primary candidate."""
    axes = ENGINES[(data.get("engine") or {}).get("name")].search_space(data)
    primary = [(a.knob.key, a.values) for a in axes if a.primary]
    return primary, [(a.knob.key, a.values) for a in axes if not a.primary]


def prune_reason(scenario) -> str | None:
    """Why a loaded candidate cannot fit (the engine's memory plan, or its refusal to start), else None."""
    try:
        return engine_of(scenario).plan_memory(scenario).why_no_cache
    except InputError as exc:  # the engine would refuse to start: nothing to run
        return exc.why


@dataclass
class Candidate:
    settings: dict  # knob key -> value (every knob of the plan)
    changed: int  # settings that differ from the scenario's own
    metrics: dict | None = None
    notices: list = field(default_factory=list)
    error: str | None = None  # did not load / failed to run
    pruned: str | None = None  # cannot fit (planner)
    violations: list = field(default_factory=list)

    @property
    def ran(self) -> bool:
        return self.metrics is not None

    @property
    def feasible(self) -> bool:
        return self.ran and not self.violations

    def as_dict(self) -> dict:
        return {"settings": self.settings, "metrics": self.metrics, "violations": self.violations,
                "error": self.error, "pruned": self.pruned, "notices": self.notices}


def _run_all(points: list, workers: int) -> list[dict]:
    """The candidates' rows, in the order of `points`, from the experiment runner."""
    executor = "inline" if workers <= 1 or len(points) <= 1 else "processes"
    with closing(run_points(points, executor, min(workers, max(len(points), 1)))) as finished:
        rows = {p.point_id: row for p, row in finished}
    return [rows[p.point_id] for p in points]


# ------------------------------------------------------------------------------------------- the plan


class NoFeasiblePlan(Exception):
    """No candidate meets the constraints: carries the plan with its closest candidates."""

    def __init__(self, plan: "Plan"):
        self.plan = plan
        by_text = {c.text: c for c in plan.constraints}
        shown = "; ".join(f"{_settings_text(c.settings, plan.base_settings)} misses "
                          + ", ".join(f"{v} ({_num(c.metrics.get(by_text[v].key), by_text[v].key)})"
                                      for v in c.violations) for c in plan.closest[:3])
        if not plan.closest:
            shown = "no candidate ran"
        super().__init__(f"no candidate meets {', '.join(c.text for c in plan.constraints)}; closest: {shown}")


@dataclass
class Plan:
    scenario: str
    engine: str
    objective: str
    sign: int
    constraints: list[Constraint]
    knobs: list[str]
    base_settings: dict
    candidates: list[Candidate]
    best: Candidate | None = None
    explanations: list[str] = field(default_factory=list)
    closest: list[Candidate] = field(default_factory=list)

    def as_dict(self) -> dict:
        obj = ("-" if self.sign < 0 else "") + self.objective
        return {"scenario": self.scenario, "engine": self.engine, "objective": obj,
                "constraints": [c.text for c in self.constraints], "knobs": self.knobs,
                "feasible": self.best is not None,
                "recommended": None if self.best is None else self.best.settings,
                "metrics": None if self.best is None else self.best.metrics,
                "changes": {} if self.best is None else {k: v for k, v in self.best.settings.items()
                                                         if self.base_settings.get(k) != v},
                "explanations": self.explanations,
                "closest": [c.as_dict() for c in self.closest],
                "candidates": [c.as_dict() for c in self.candidates]}


def _key_of(settings: dict, knobs: list[str]) -> tuple:
    return tuple(repr(settings.get(k)) for k in knobs)


def _expand(path: str, base: dict, knobs: list[tuple[str, list]], base_settings: dict, workers: int,
            constraints: list[Constraint], seen: dict) -> list[Candidate]:
    from sim.explore.sweep import expand_grid

    points = expand_grid(path, [_spec(k, v) for k, v in knobs])
    keys = [k for k, _ in knobs]
    fresh, todo = [], []
    for p in points:
        settings = {**base_settings, **p.overrides}
        ident = _key_of(settings, list(settings))
        if ident in seen:
            continue
        cand = Candidate(settings, sum(base_settings.get(k) != settings.get(k) for k in keys))
        seen[ident] = cand
        fresh.append(cand)
        if p.error is not None:
            cand.error = p.error
            continue
        cand.pruned = prune_reason(load_scenario_data(path, p.data))
        if cand.pruned is None:
            todo.append((cand, p))
    for (cand, _), row in zip(todo, _run_all([p for _, p in todo], workers)):
        cand.error = row["error"]
        if cand.error is None:
            cand.metrics = {k: None if row[k] is None else float(row[k]) for k in METRICS}
            cand.notices = row["notices"][:6]
            cand.violations = [c.text for c in constraints if not c.ok(cand.metrics)]
    return fresh


def _score(c: Candidate, key: str, sign: int) -> float:
    value = c.metrics.get(key)
    return -math.inf if value is None or _nan(value) else sign * value


def _pick(cands: list[Candidate], key: str, sign: int) -> Candidate | None:
    """The feasible candidate that changes fewest of the scenario's settings among those with no difference from
    the best objective (`no_difference`, as the explanations say it: a change for less is noise to the model), the
    best objective among those."""
    feasible = [c for c in cands if c.feasible]
    if not feasible:
        return None
    top = max(_score(c, key, sign) for c in feasible)
    tied = [c for c in feasible if _score(c, key, sign) == top or no_difference(top, _score(c, key, sign))]
    return min(tied, key=lambda c: (c.changed, -_score(c, key, sign)))


def no_difference(a: float, b: float) -> bool:
    """Two figures of the objective within NO_DIFFERENCE of the larger; a missing one (not finite) differs."""
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= NO_DIFFERENCE * max(abs(a), abs(b), 1e-12)


MAX_NEIGHBOURHOOD_ROUNDS = 4  # stage 3 rounds; each round runs at most one candidate per knob value


def make_plan(scenario_path: str | Path, objective: str | None = None, constraints: list[str] | None = None,
              grids: list[str] | None = None, workers: int = 1) -> Plan:
    """Search the knobs (the default candidates, or `grids`), apply the constraints, maximise the objective.

    Raises InputError for bad input, NoFeasiblePlan when no candidate meets the constraints.
    """
    from sim.explore.sweep import parse_grid
    from sim.schema import read_toml
    from sim.scenario import load_scenario

    path = str(scenario_path)
    parsed = [parse_constraint(c) for c in constraints or []]
    load_scenario(path)  # a bad scenario fails first, with the loader's own line
    base = read_toml(Path(path), path)
    engine = (base.get("engine") or {}).get("name")
    key, sign = parse_objective(objective or ENGINES[engine].default_objective)
    if grids:
        primary = []
        for spec in grids:
            k, _, values = parse_grid(spec, base, f"{path} --grid {spec.partition('=')[0].strip()}")
            primary.append((k, values))
        secondary: list[tuple[str, list]] = []
    else:
        primary, secondary = default_knobs(base)
    knobs = [k for k, _ in primary + secondary]
    base_settings = {k: setting(base, k) for k in knobs}
    seen: dict = {}
    # stage 1: the primary knobs as a full grid, the secondary ones at their first candidate
    stage1 = primary + [(k, v[:1]) for k, v in secondary]
    cands = _expand(path, base, stage1, base_settings, workers, parsed, seen)
    best = _pick(cands, key, sign)
    def around(anchor: dict, varied: list[tuple[str, list]]) -> list[Candidate]:
        """Each varied knob alone, every other knob at the anchor's value."""
        out = []
        for k, values in varied:
            fixed = [(kk, [anchor[kk]]) for kk in knobs if kk != k and anchor.get(kk) is not None]
            out += _expand(path, base, [*fixed, (k, values)], base_settings, workers, parsed, seen)
        return out

    # stage 2: each secondary knob alone, from the best of stage 1 (or the scenario's own settings)
    cands += around(best.settings if best is not None else {**base_settings, **{k: v[0] for k, v in secondary}},
                    secondary)
    # stage 3: every knob's other values around the best (coordinate ascent until the best holds), so that
    # each choice is explained against candidates that differ from it in that knob only
    best = _pick(cands, key, sign)
    for _ in range(MAX_NEIGHBOURHOOD_ROUNDS):
        if best is None:
            break
        cands += around(best.settings, primary + secondary)
        again = _pick(cands, key, sign)
        if again is best:
            break
        best = again
    plan = Plan(path, engine, key, sign, parsed, knobs, base_settings, cands)
    plan.best = best
    if plan.best is None:
        ran = [c for c in cands if c.ran]
        plan.closest = sorted(ran, key=lambda c: (sum(x.shortfall(c.metrics) for x in parsed),
                                                  -_score(c, key, sign)))[:5]
        raise NoFeasiblePlan(plan)
    plan.explanations = explain(plan)
    return plan


# ---------------------------------------------------------------------------------------- explaining

UNITS = {"decode_tok_s": "tok/s decode", "prefill_tok_s": "tok/s prefill", "ttft_s": "s TTFT",
         "vram_free_mib": "MiB VRAM free", "file_blob_reads": "file-blob reads"}


def _label(plan: "Plan", key: str, value) -> str:
    knob = ENGINES[plan.engine].knob(key)
    return knob.label(value) if knob is not None else f"{key.rsplit('.', 1)[-1]}={value}"


def _num(value, metric: str) -> str:
    if value is None or _nan(value):
        return "-"
    if metric in ("decode_hit_rate", "prefill_hit_rate"):
        return f"{value:.1%}"
    if abs(value) >= 100 or float(value).is_integer():
        return f"{value:,.0f}"
    return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.2f}"


def _settings_text(settings: dict, base: dict) -> str:
    changed = [f"{k.rsplit('.', 1)[-1]}={v}" for k, v in settings.items() if base.get(k) != v]
    return "{" + (", ".join(changed) or "the scenario's own settings") + "}"


def explain(plan: Plan) -> list[str]:
    """One line per knob: the recommendation against the candidates that differ from it in that knob only."""
    best, key = plan.best, plan.objective
    lines = []
    for knob in plan.knobs:
        alts = [c for c in plan.candidates if c is not best and c.settings.get(knob) != best.settings.get(knob)
                and all(c.settings.get(k) == best.settings.get(k) for k in plan.knobs if k != knob)]
        known = ENGINES[plan.engine].knob(knob)
        name = known.title if known is not None else knob
        chosen = _label(plan, knob, best.settings.get(knob))
        keep = " (the scenario's own)" if plan.base_settings.get(knob) == best.settings.get(knob) else ""
        if not alts:
            lines.append(f"{name}: {chosen}{keep}: no alternative was run")
            continue
        parts = []
        for alt in alts:
            other = _label(plan, knob, alt.settings.get(knob))
            if not alt.ran:
                parts.append(f"{other} {'cannot fit: ' + alt.pruned if alt.pruned else 'failed: ' + str(alt.error)}")
                continue
            parts.append(_compare(best, alt, other, key, plan))
        lines.append(f"{name}: {chosen}{keep}: " + "; ".join(parts))
    return lines


def _compare(best: Candidate, alt: Candidate, other: str, key: str, plan: Plan) -> str:
    b, a = best.metrics, alt.metrics
    unit = UNITS.get(key, key)
    bv, av = b.get(key), a.get(key)
    text = f"{_num(bv, key)} vs {_num(av, key)} {unit} ({other})"
    if None not in (bv, av) and no_difference(bv, av):
        text = f"no {key} difference within 3 % vs {other}: {_num(bv, key)} vs {_num(av, key)} {unit}"
    extra = []
    for m in ("decode_tok_s", "prefill_tok_s", "file_blob_reads", "lent_slots", "prefill_buffer_mib",
              "vram_free_mib"):
        if m == key or b.get(m) is None or a.get(m) is None:
            continue
        if abs(b[m] - a[m]) > 1e-6 * max(abs(b[m]), abs(a[m]), 1.0) and (m != "prefill_buffer_mib"):
            extra.append(f"{_num(b[m], m)} vs {_num(a[m], m)} {UNITS.get(m, m)}")
    if extra:
        text += " with " + ", ".join(extra)
    if alt.violations:
        text += f"; {other} misses {', '.join(alt.violations)}"
    if best.settings != alt.settings and _owns(plan, best) and not _owns(plan, alt):
        text += (f"; {b['prefill_buffer_mib']:,.0f} MiB of spare VRAM pays for the owned buffers "
                 f"({b['vram_free_mib']:,.0f} MiB still free)")
    return text


def _owns(plan: "Plan", c: Candidate) -> bool:
    m = c.metrics or {}
    return (m.get("lent_slots") == 0 and (m.get("prefill_buffer_mib") or 0) > 0
            and ENGINES[plan.engine].owned_buffers(c.settings))


__all__ = ["Constraint", "NoFeasiblePlan", "Plan", "default_knobs", "explain", "make_plan", "parse_constraint",
           "parse_objective", "prune_reason"]
