"""The generator's model of a preset: geometry, per-layer popularity, working sets, co-activation groups,
and the working-set sizes and keep probabilities that sim/trace/generator_calibration.py fits to the spec's
targets (stored in generator_presets.json; a spec without a stored calibration is calibrated at first use).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from pathlib import Path

import numpy as np

from sim.errors import InputError
from sim.trace.generator_calibration import _calibrate, _correct_marginal, _correction_rng
from sim.trace.generator_params import _Geometry, _Model
from sim.trace.generator_spec import GENERATOR_PRESETS, REUSE_SHAPE_FLAT, REUSE_SHAPE_QWEN3

DERIVED_PATH = Path(__file__).with_name("generator_presets.json")
# DeepSeek-V2-Lite figures from its real per-token trace (traces/derive_deepseek_v2_lite.py), kept apart: their
# source is a git repository, not ../shared/data
V2_LITE_PATH = Path(__file__).with_name("generator_deepseek_v2_lite.json")

# --------------------------------------------------------------------------------------- geometry


# Models the generator knows that have no model preset (sim.model.presets): routed layers x experts, top-k.
# DeepSeek-V2-Lite: 27 blocks, the first dense (first_k_dense_replace = 1), 64 routed experts, top-6, 2 shared
# (routing-traces.md §6); its trace's gate hooks are layers 1-26.
GENERATOR_ONLY_GEOMETRY = {"deepseek-v2-lite": (26, 64, 6)}


def _geometry(model: str) -> _Geometry:
    from sim.model.presets import get_preset, preset_names

    if model in GENERATOR_ONLY_GEOMETRY and model not in preset_names():
        return _Geometry(*GENERATOR_ONLY_GEOMETRY[model])
    layout = get_preset(model)
    return _Geometry(layout.n_routed_layers, layout.n_experts, layout.top_k)


def generator_shape(preset: str) -> tuple[int, int, int]:
    """The routing a generator preset makes: (routed layers, experts, top-k) of its model."""
    from sim.trace.generator_spec import GENERATOR_PRESETS

    g = _geometry(GENERATOR_PRESETS[preset]["model"])
    return g.n_layers, g.n_experts, g.top_k


@functools.lru_cache(maxsize=1)
def _derived() -> dict:
    doc = json.loads(DERIVED_PATH.read_text())
    doc["deepseek-v2-lite"] = json.loads(V2_LITE_PATH.read_text())
    return doc


def _model_seed(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


# --------------------------------------------------------------------------------------- popularity


def _stretched_exp(e: int, beta: float, r0_frac: float) -> np.ndarray:
    r = np.arange(e, dtype=float)
    w = np.exp(-((r / (r0_frac * e)) ** beta))
    return w / w.sum()


def _r0_for_entropy(e: int, beta: float, target: float) -> float:
    lo, hi = math.log(1e-4), math.log(1e3)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        p = _stretched_exp(e, beta, math.exp(mid))
        ent = float(-(p * np.log(p)).sum() / math.log(e))
        lo, hi = (mid, hi) if ent < target else (lo, mid)
    return math.exp(0.5 * (lo + hi))


def coverage_popularity(points, n_layers: int, n_experts: int) -> np.ndarray:
    """One layer's popularity by rank from a measured coverage curve: the share of all routed lookups held by
    the hottest N (layer, expert) pairs, at a few N. Every layer holds 1 / n_layers of the lookups (each routes
    k per token) and follows the same curve, so rank r of a layer spans global ranks r*L .. (r+1)*L. Between
    the points the curve is linear (0 at 0 pairs, 1 at all pairs): the pairs of a stretch are equally hot,
    all that the points say. Raises when the points do not make a concave curve (a hotter pair after a
    colder one)."""
    total = n_layers * n_experts
    xs = np.array([0.0] + [float(x) for x, _ in points] + [float(total)])
    ys = np.array([0.0] + [float(y) for _, y in points] + [1.0])
    slopes = np.diff(ys) / np.diff(xs)
    if not (np.all(np.diff(xs) > 0) and np.all(slopes > 0) and np.all(np.diff(slopes) <= 0)):
        raise InputError("generator preset", "popularity.points", [list(p) for p in points],
                         f"must rise and flatten: increasing pair counts below {total} and shares below 1 whose "
                         "increments per pair never grow")
    edges = np.interp(np.arange(n_experts + 1, dtype=float) * n_layers, xs, ys)
    return np.diff(edges) / edges[-1]


def _rank_popularity(spec: dict, geo: _Geometry, hash_layers: set[int], seed: int) -> tuple[np.ndarray, dict]:
    """[layers, n_experts] popularity by rank (descending), plus the per-layer parameters used."""
    pop = spec["popularity"]
    n, e = geo.n_layers, geo.n_experts
    beta = np.full(n, np.nan)
    r0 = np.full(n, np.nan)
    if pop["kind"] == "derived":
        d = _derived()[pop["key"]]
        if d["n_layers"] != n or d["n_experts"] != e:
            raise InputError("generator preset", "popularity.key", pop["key"],
                             f"derived figures are for {d['n_layers']}x{d['n_experts']}, model is {n}x{e}")
        for layer in range(n):
            if layer in hash_layers:
                continue
            beta[layer] = d["popularity"]["beta"][layer]
            r0[layer] = d["popularity"]["r0_frac"][layer]
        tau = 1.0
        if "temper_hottest_median" in pop:
            routed = [x for x in range(n) if x not in hash_layers]
            target = pop["temper_hottest_median"]

            def hottest_median(t):
                return float(np.median([_stretched_exp(e, beta[x], r0[x] * t ** (-1 / beta[x]))[0] * e
                                        for x in routed]))
            lo, hi = 0.01, 1.0
            for _ in range(50):
                mid = 0.5 * (lo + hi)
                lo, hi = (mid, hi) if hottest_median(mid) < target else (lo, mid)
            tau = 0.5 * (lo + hi)
            for x in routed:  # p^tau of a stretched exponential is one with r0 * tau^(-1/beta)
                r0[x] = r0[x] * tau ** (-1 / beta[x])
        used = dict(tau=round(tau, 4))
    elif pop["kind"] == "generic":
        rng = np.random.default_rng(seed ^ 0x5EED)
        targets = np.full(n, pop["entropy_mid"]) + rng.uniform(-1, 1, n) * pop["entropy_spread"]
        targets[0] = pop["entropy_first"]
        if n > 2:
            targets[1] = 0.5 * (pop["entropy_first"] + targets[1])
        targets = np.minimum(targets, 0.9995)
        beta[:] = pop["beta"]
        for layer in range(n):
            r0[layer] = _r0_for_entropy(e, pop["beta"], float(targets[layer]))
        used = dict(entropy_targets=[round(float(x), 4) for x in targets])
    elif pop["kind"] == "coverage":
        p_layer = coverage_popularity(pop["points"], n, e)
        used = dict(coverage_points=[list(pt) for pt in pop["points"]])
        return np.tile(p_layer, (n, 1)), used
    else:
        raise InputError("generator preset", "popularity.kind", pop["kind"],
                         "must be 'derived', 'generic' or 'coverage'")
    p = np.full((n, e), 1.0 / e)
    for layer in range(n):
        if not math.isnan(beta[layer]):
            p[layer] = _stretched_exp(e, float(beta[layer]), float(r0[layer]))
    used.update(beta=[None if math.isnan(x) else round(float(x), 4) for x in beta],
                r0_frac=[None if math.isnan(x) else round(float(x), 5) for x in r0])
    return p, used


# --------------------------------------------------------------------------------------- model setup


def lag_law(lag: dict | None, first: int = 2) -> np.ndarray:
    """Cumulative law of how far back a recalled token lies: j = first..max_tokens with P(j) proportional to
    j^-exponent (no lag entry: a point mass on `first`)."""
    if not lag:
        return np.ones(1)
    j = np.arange(first, int(lag["max_tokens"]) + 1, dtype=float)
    cum = np.cumsum(j ** -float(lag["exponent"]))
    return cum / cum[-1]


def _interp_shape(knots, n: int) -> np.ndarray:
    xs = np.array([x for x, _ in knots])
    ys = np.array([y for _, y in knots])
    pos = np.linspace(0, 1, n) if n > 1 else np.zeros(1)
    return np.interp(pos, xs, ys)


def _reuse_targets(spec: dict, n: int, hash_layers: set[int]) -> np.ndarray:
    """[2, L] target reuse (prefill, decode); NaN for hash layers."""
    reuse = spec["reuse"]
    if reuse["shape"] == "derived":  # a per-layer profile measured on the model's own trace
        shape = np.array(_derived()[reuse["shape_key"]]["adjacent_reuse"]["per_layer"], float)
    else:
        shape = _interp_shape(REUSE_SHAPE_QWEN3 if reuse["shape"] == "qwen3" else REUSE_SHAPE_FLAT, n)
    routed = np.array([x not in hash_layers for x in range(n)])
    shape = shape / shape[routed].mean()
    out = np.vstack([shape * reuse["prefill"], shape * reuse["decode"]])
    out[:, ~routed] = np.nan
    return np.clip(out, 0.0, 0.95)


def _union_targets(spec: dict, geo: _Geometry, q_target: np.ndarray, hash_layers: set[int]):
    """(chunk tokens, [L] target distinct experts per layer, NaN = no locality) or None."""
    loc = spec.get("locality")
    if not loc:
        return None
    n = geo.n_layers
    if "derived" in loc and "union" in _derived()[loc["derived"]]:  # measured unions of a real trace
        chunk = int(loc["chunk"])
        target = np.array(_derived()[loc["derived"]]["union"][str(chunk)]["per_layer"], float)
    elif "derived" in loc:  # a hotlist: the experts it lists per layer, at its profile's length
        d = _derived()[loc["derived"]]
        chunk = int(d["profile_tokens"])
        target = np.array(d["listed_per_layer"], float)
    elif "absolute_first" in loc:
        chunk = int(loc["chunk"])
        target = np.full(n, float(loc["absolute_rest"]))
        first = np.array(loc["absolute_first"], float)[:n]
        target[: first.size] = first
        target *= geo.n_experts / 128.0
    else:
        chunk = int(loc["chunk"])
        pred = (1 - (1 - np.clip(q_target, 0, 1)) ** chunk).sum(1)
        target = pred * loc["ratio"]
        target[0] = pred[0] * loc["ratio_first"]
    for h in hash_layers:
        target[h] = np.nan
    return chunk, target


def _groups(rank_to_expert: np.ndarray, size: int, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Groups of `size` experts of similar popularity: consecutive ranks, lightly shuffled."""
    e = rank_to_expert.size
    order = rank_to_expert.copy()
    if size > 1:
        # swap a few neighbours so groups are not exact rank runs
        jitter = np.argsort(np.arange(e) + rng.uniform(0, size * 1.5, e))
        order = order[jitter]
    n_groups = -(-e // size)
    group_of = np.empty(e, np.int32)
    for g in range(n_groups):
        group_of[order[g * size:(g + 1) * size]] = g
    members = np.argsort(group_of, kind="stable").astype(np.int32)
    gstart = np.searchsorted(group_of[members], np.arange(n_groups + 1)).astype(np.int32)
    return group_of, members, gstart, n_groups


# Bump when the kernel or the calibration changes meaning: stored calibrations then no longer match.
CALIBRATION_VERSION = 2


def spec_key(spec: dict) -> str:
    """Everything the generated routing depends on (not the preset's name or its documentation)."""
    def strip(x):  # documentation strings do not change the routing
        if isinstance(x, dict):
            return {key: strip(v) for key, v in x.items() if key != "source"}
        return x
    body = strip({key: v for key, v in spec.items() if key not in ("model", "targets")})
    geo = _geometry(spec["model"])
    return json.dumps([CALIBRATION_VERSION, body, geo.n_layers, geo.n_experts, geo.top_k], sort_keys=True)


@functools.lru_cache(maxsize=None)
def _routing_key(name: str) -> str:
    return spec_key(GENERATOR_PRESETS[name])


def routing_key_hash(name: str) -> str:
    return hashlib.sha256(_routing_key(name).encode()).hexdigest()[:16]


def _stored_calibration(key: str) -> dict | None:
    entry = _derived().get("calibration", {}).get(hashlib.sha256(key.encode()).hexdigest()[:16])
    return entry


@functools.lru_cache(maxsize=None)
def _build_cached(key: str, calibrate: bool = False) -> _Model:
    _, body, n_layers, n_experts, top_k = json.loads(key)
    stored = None if calibrate else _stored_calibration(key)
    return _build(body, _Geometry(n_layers, n_experts, top_k), _model_seed(key), stored)


def _model(name: str, calibrate: bool = False) -> _Model:
    """The routing model of a preset: stored calibration when it matches, else calibrated now (seconds)."""
    return _build_cached(_routing_key(name), calibrate)


def model_of(spec: dict) -> _Model:
    """The routing model of any spec (a preset's with a user's statistics): calibrated at first use."""
    return _build_cached(spec_key(spec))


def calibrate_preset(name: str) -> dict:
    """Run the calibration of a preset from scratch; returns what generator_presets.json stores for it."""
    model = _model(name, calibrate=True)
    c = model.calibrated
    return dict(working_set_shift=c["working_set_shift"], rho_prefill=c["rho_prefill"], rho_decode=c["rho_decode"],
                temper=c["temper"])


def _build(spec: dict, geo: _Geometry, seed: int, stored: dict | None = None) -> _Model:
    rng = np.random.default_rng(seed)
    n, e, k = geo.n_layers, geo.n_experts, geo.top_k
    hash_layers = set(spec.get("hash_layers", ()))
    is_hash = np.array([x in hash_layers for x in range(n)])
    p_rank, pop_used = _rank_popularity(spec, geo, hash_layers, seed)
    rank_to_expert = np.array([rng.permutation(e) for _ in range(n)])
    p = np.empty((n, e))
    for layer in range(n):
        p[layer, rank_to_expert[layer]] = p_rank[layer]
    q_target = np.minimum(k * p, 0.98)

    co = spec["coactivation"]
    size = max(2, int(round(e * co["group_size_frac"]))) if e >= 16 else 1
    group_of = np.zeros((n, e), np.int32)
    members = np.zeros((n, e), np.int32)
    n_groups = np.zeros(n, np.int64)
    max_g = -(-e // size)
    gstart = np.zeros((n, max_g + 1), np.int32)
    for layer in range(n):
        g_of, mem, gs, ng = _groups(rank_to_expert[layer], size, rng)
        group_of[layer], members[layer], n_groups[layer] = g_of, mem, ng
        gstart[layer, : ng + 1] = gs
    partner = np.where(is_hash, 0.0, co["partner_prob"] if size > 1 else 0.0)

    cross = spec["cross_layer"]
    n_ctx = max(1, min(int(cross["contexts"]), e // 2))
    # Contexts hold whole co-activation groups (so a partner pick stays in the token's context) and have
    # about equal popularity mass: groups are runs of similar rank, dealt out to the contexts in blocks.
    ctx_of = np.zeros((n, e), np.int32)
    for layer in range(n):
        ng = int(n_groups[layer])
        deal = np.concatenate([rng.permutation(n_ctx) for _ in range(-(-ng // n_ctx))])[:ng]
        ctx_of[layer] = deal[group_of[layer]]
    kappa = np.linspace(cross["boost_first"], cross["boost_last"], n)

    seg = spec["segments"]
    hr = spec.get("hash_routing")
    if hr:
        law = _derived()[hr["tokens"]]["text_tokens"]["rank_frequency"]
        v = np.arange(1, hr["vocab"] + 1, dtype=float)
        vocab_cum = np.cumsum((v + law["offset"]) ** -law["exponent"])
        tok_rho = float(hr.get("repeat", {}).get("prob", 0.0))
        tok_lag = lag_law(hr["repeat"]["lag"], first=1) if tok_rho > 0 else np.ones(1)
    else:
        vocab_cum, tok_rho, tok_lag = np.ones(1), 0.0, np.ones(1)

    loc = spec.get("locality") or {}
    reuse_t = _reuse_targets(spec, n, hash_layers)
    union_t = _union_targets(spec, geo, q_target, hash_layers)
    local = np.zeros(n, bool) if union_t is None else ~np.isnan(union_t[1])
    w = -np.log1p(-q_target)  # exponential-clock weights that give inclusion q_target without a tilt
    w /= w.sum(1, keepdims=True)
    model = _Model(spec.get("model", ""), geo, w, q_target,
                   sigma=np.where(local, float(loc.get("tilt_sigma", 0.5)), 0.0), shift=np.zeros(n),
                   pop_pref=float(loc.get("popularity_preference", 0.5)), leak=float(loc.get("leak", 0.0)),
                   local=local, eta=float(loc.get("own_share", 0.5)), group_of=group_of, members=members,
                   gstart=gstart, n_groups=n_groups, ctx_of=ctx_of, n_ctx=n_ctx, kappa=kappa,
                   stick=float(cross["stick"]), rho=np.where(np.isnan(reuse_t), 0.0, reuse_t * 0.8),
                   recall=np.where(is_hash, 0.0, float(spec["reuse"].get("recall", {}).get("prob", 0.0))),
                   lag_cum=lag_law(spec["reuse"].get("recall", {}).get("lag")), partner=partner,
                   seg_p=1.0 / seg["mean_tokens"], drift=float(seg["drift"]), is_hash=is_hash, vocab_cum=vocab_cum,
                   tok_rho=tok_rho, tok_lag_cum=tok_lag, hash_seed=seed & 0x7FFF_FFFF_FFFF_FFFF, calibrated={})
    w0 = model.w.copy()
    if stored is None:
        _calibrate(model, reuse_t, union_t)
        origin = "calibrated at run time (no stored calibration matches this preset)"
    else:
        model.shift = np.array(stored["working_set_shift"], float)
        model.rho = np.array([stored["rho_prefill"], stored["rho_decode"]], float)
        model.temper = np.array(stored["temper"], float)
        origin = "generator_presets.json"
    model.calibrated = dict(
        origin=origin,
        popularity=pop_used,
        working_set_shift=[round(float(x), 4) for x in model.shift],
        rho_prefill=[round(float(x), 4) for x in model.rho[0]],
        rho_decode=[round(float(x), 4) for x in model.rho[1]],
        temper=[round(float(x), 4) for x in model.temper],
        reuse_target_prefill=[None if math.isnan(x) else round(float(x), 4) for x in reuse_t[0]],
        reuse_target_decode=[None if math.isnan(x) else round(float(x), 4) for x in reuse_t[1]],
        union_target=None if union_t is None else dict(
            chunk_tokens=union_t[0], distinct=[None if math.isnan(x) else round(float(x), 2) for x in union_t[1]]),
        group_size=size, contexts=n_ctx, model_seed=seed)
    # the kernel runs on exactly the recorded (rounded) values; the base weights are then corrected for
    # them with a fixed random stream, the same whether the calibration was stored or just computed
    model.shift = np.array(model.calibrated["working_set_shift"])
    model.rho = np.array([model.calibrated["rho_prefill"], model.calibrated["rho_decode"]])
    model.temper = np.array(model.calibrated["temper"])
    model.w = w0
    _correct_marginal(model, _correction_rng(model))
    return model
