"""The calibration of a routing model by pilot runs of the per-token kernel: the working-set size per layer
(from the prefill-union target), the keep probabilities (from the reuse target), and the correction of the base
weights that keeps each expert's long-run share at its popularity.
"""

from __future__ import annotations

import math

import numpy as np

from sim.trace.generator_params import _membership, _Model
from sim.trace.stats import prefill_union_by_layer, reuse_by_layer


# The most a pick can be a copy of an earlier pick: the rest stay fresh draws, so a layer keeps meeting new
# experts however strong its reuse.
RHO_MAX = 0.95


def _inclusion(u: np.ndarray, k: int, lam: np.ndarray | None = None, steps: int = 40):
    """Inclusion probabilities of k picks without replacement with weights u (last axis), by the
    exponential-clock approximation pi_e = 1 - exp(-lam u_e) with sum pi = k. Returns (pi, lam)."""
    u = u / u.sum(axis=-1, keepdims=True)
    if lam is None:
        lam = np.full(u.shape[:-1] + (1,), float(k))
    for _ in range(steps):
        ex = np.exp(-lam * u)
        f = (1 - ex).sum(-1, keepdims=True) - k
        df = (u * ex).sum(-1, keepdims=True)
        lam = np.maximum(lam - f / np.maximum(df, 1e-300), 1e-9)
    return 1 - np.exp(-lam * u), lam


def _correction_rng(model: _Model):
    return np.random.default_rng([model.hash_seed, 0xC0FFEE])


def _tilt_samples(model: _Model, rng, n_mc: int) -> np.ndarray:
    """[n_mc * contexts, L, E] weight factors of random request working sets times each context's boost."""
    n, e = model.w.shape
    a = math.sqrt(1 - model.eta ** 2)
    zg = rng.standard_normal((n_mc, n, e))
    zi = rng.standard_normal((n_mc, n, e))
    z = a * np.take_along_axis(zg, np.broadcast_to(model.group_of[None].astype(np.int64), zg.shape), 2) \
        + model.eta * zi
    inside = (z > model.thr[None]) | ~model.local[None, :, None]
    tilt = np.where(model.local[None, :, None], np.exp(model.sigma[None, :, None] * z), 1.0)
    if model.n_ctx > 1:
        boost = np.where(model.ctx_of[None] == np.arange(model.n_ctx)[:, None, None], model.kappa[None, :, None], 1.0)
        tilt = tilt[:, None] * boost[None]
        inside = inside[:, None]
    tilt = np.where(inside, tilt, model.leak)
    return tilt.reshape(-1, n, e)


def _correct_marginal(model: _Model, rng, n_mc: int = 16, iters: int = 8) -> None:
    """Adjust base weights so that the mean per-token inclusion over request working sets and token
    contexts equals q_target (routed layers)."""
    fix = ~model.is_hash
    if not fix.any():
        return
    k = model.geo.top_k
    tilt = _tilt_samples(model, rng, n_mc if model.local.any() else 1)
    w = model.w.copy()
    target = np.maximum(model.q_target, 1e-7)
    lam = None
    start = w / w.sum(1, keepdims=True)
    for i in range(iters):
        incl, lam = _inclusion(w[None] * tilt, k, lam, 40 if i == 0 else 8)
        w = np.where(fix[:, None], w * (target / np.maximum(incl.mean(0), 1e-12)) ** 0.9, w)
        w /= w.sum(1, keepdims=True)
        w = np.clip(w, start / 30, start * 30)  # a guard: no expert's weight runs away
    model.w = w


def _pilot_union(model: _Model, chunk: int, n_req: int, seed: int) -> np.ndarray:
    ex = model.run(seed, n_req, chunk, 0)
    req = np.repeat(np.arange(n_req, dtype=np.int32), chunk)
    phase = np.zeros(ex.shape[0], np.uint8)
    mean, _ = prefill_union_by_layer(ex, req, phase, chunk, model.geo.n_experts)
    return mean


def _pilot_reuse(model: _Model, n_req: int, steps: int, seed: int) -> np.ndarray:
    half = steps // 2
    ex = model.run(seed, n_req, half, steps - half)
    req = np.repeat(np.arange(n_req, dtype=np.int32), steps)
    phase = np.tile(np.r_[np.zeros(half, np.uint8), np.ones(steps - half, np.uint8)], n_req)
    hits, pairs = reuse_by_layer(ex, req, phase)
    with np.errstate(invalid="ignore", divide="ignore"):
        return hits / (model.geo.top_k * pairs)


def _calibrate_rho(model: _Model, reuse_t: np.ndarray, rounds: int, seed: int) -> None:
    """Per layer and phase, the copy probability whose pilot runs meet the adjacent-reuse target. The reuse rises
    with rho, so each layer keeps a bracket [lo, hi] and steps by the secant through its ends (false position),
    all layers of one pilot run at once; the pilot streams are fixed, so the search is deterministic."""
    ok = ~np.isnan(reuse_t)
    target = np.where(ok, reuse_t, 0.0)
    lo, hi = np.zeros_like(target), np.full_like(target, RHO_MAX)
    rho = np.where(ok, model.rho, 0.0)
    model.rho = lo.copy()
    m_lo = _pilot_reuse(model, 8, 384, seed)
    model.rho = hi.copy()
    m_hi = _pilot_reuse(model, 8, 384, seed)
    m_lo, m_hi = np.nan_to_num(m_lo), np.nan_to_num(m_hi)
    for i in range(rounds):
        with np.errstate(invalid="ignore", divide="ignore"):
            rho = np.where(m_hi > m_lo, lo + (target - m_lo) * (hi - lo) / (m_hi - m_lo), 0.5 * (lo + hi))
        rho = np.clip(rho, lo + 0.02 * (hi - lo), hi - 0.02 * (hi - lo))
        model.rho = np.where(ok, rho, 0.0)
        m = np.nan_to_num(_pilot_reuse(model, 8, 384, seed))
        low = m < target
        lo, m_lo = np.where(low, rho, lo), np.where(low, m, m_lo)
        hi, m_hi = np.where(low, hi, rho), np.where(low, m_hi, m)
    # the baseline overlap alone already exceeds the target: keep nothing on purpose
    rho = np.where(m_lo >= target, 0.0, rho)
    model.rho = np.where(ok & (m_hi > target), rho, np.where(ok, RHO_MAX, 0.0))


def _shift_for_size(model: _Model, size: np.ndarray) -> np.ndarray:
    """Per-layer shift c_l such that the expected working-set size sum_e membership = size."""
    lo = np.full(model.geo.n_layers, -12.0)
    hi = np.full(model.geo.n_layers, 12.0)
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        small = _membership(model, mid).sum(1) < size
        lo = np.where(small, mid, lo)
        hi = np.where(small, hi, mid)
    return 0.5 * (lo + hi)


def _set_size(model: _Model, size) -> None:
    model.shift = np.where(model.local, _shift_for_size(model, np.broadcast_to(size, model.shift.shape)), 0.0)


def _calibrate(model: _Model, reuse_t: np.ndarray, union_t) -> None:
    """Find each layer's working-set size (from the prefill-union target) and keep probabilities (from the
    reuse target) by pilot runs; the base weights get the marginal correction for the sizes found."""
    seed = 7_777
    w0 = model.w.copy()

    def correct():  # the same random stream as the final correction in generator_model._build
        model.w = w0.copy()
        _correct_marginal(model, _correction_rng(model))

    if union_t is None or not model.local.any():
        correct()
        _calibrate_rho(model, reuse_t, 6, seed)
        _calibrate_temper(model, seed + 5000)
        return
    chunk, target = union_t
    n_req = max(4, min(16, 4096 // chunk))
    e, k = model.geo.n_experts, model.geo.top_k
    n_layers = model.geo.n_layers
    # 1. With uncorrected weights: the union grows with the set size, except for tiny sets, where the k
    #    picks exhaust the set. Scan sizes from the full set down, take the first bracket where the union
    #    falls to the target (or the narrowest point if none does) and refine it by bisection.
    sizes = np.linspace(float(e), min(3.0 * k, float(e)), 12)
    unions = np.empty((sizes.size, n_layers))
    for i, size in enumerate(sizes):
        _set_size(model, size)
        unions[i] = _pilot_union(model, chunk, n_req, seed + i)
    below = unions <= target[None, :]
    first = np.where(below.any(0), below.argmax(0), np.argmin(unions, 0))
    hi = sizes[np.maximum(first - 1, 0)]
    lo = sizes[first]

    def bisect(lo, hi, steps, seed0, corrected):
        for step in range(steps):
            mid = 0.5 * (lo + hi)
            _set_size(model, mid)
            if corrected:
                correct()
            too_wide = _pilot_union(model, chunk, n_req, seed0 + step) > target
            hi = np.where(too_wide, mid, hi)
            lo = np.where(too_wide, lo, mid)
        return 0.5 * (lo + hi)

    size = bisect(lo, hi, 4, seed + 50, corrected=False)
    # 2. Calibrate reuse at that size, then refine the size with the marginal correction redone at every
    #    step (the correction moves the union), and recalibrate reuse for the final size.
    _set_size(model, size)
    correct()
    _calibrate_rho(model, reuse_t, 4, seed + 1000)
    size = bisect(np.maximum(0.6 * size, min(2.0 * k, e)), np.minimum(1.6 * size, e), 6, seed + 2000,
                  corrected=True)
    _set_size(model, size)
    correct()
    _calibrate_rho(model, reuse_t, 6, seed + 3000)
    _calibrate_temper(model, seed + 5000)


def _hot_share(model: _Model, heat: np.ndarray) -> np.ndarray:
    """[L] share of a layer's selections taken by its hottest quarter of experts (ranked by q_target)."""
    e = model.geo.n_experts
    top = np.argsort(-model.q_target, axis=1)[:, : max(1, e // 4)]
    return np.take_along_axis(heat, top, 1).sum(1) / np.maximum(heat.sum(1), 1)


def _calibrate_temper(model: _Model, seed: int, rounds: int = 5) -> None:
    """Per layer, the power tau of the base weights (w^tau) whose pilot runs give the hottest quarter of experts its
    long-run share of q_target. The reuse mechanisms copy earlier picks, and a pick that finds its expert taken
    falls to a fresh draw, so the analytic marginal correction (which sees fresh draws only) leaves the skew a
    little off; tau puts it back. Secant steps on the log of the share error, all layers from one pilot."""
    fix = ~model.is_hash
    want = _hot_share(model, model.q_target)
    tau = np.ones(model.geo.n_layers)
    n_req, steps = 8, 1024
    prev = None
    for i in range(rounds):
        model.temper = tau.copy()
        ex = model.run(seed, n_req, steps // 2, steps - steps // 2)
        heat = np.zeros((model.geo.n_layers, model.geo.n_experts))
        for layer in range(model.geo.n_layers):
            heat[layer] = np.bincount(ex[:, layer].ravel().astype(np.int64), minlength=model.geo.n_experts)
        got = _hot_share(model, heat)
        err = np.log(want / np.maximum(got, 1e-9))
        if prev is None:
            step = 2.0 * err  # a first guess of d(log share)/d(tau) ~ 0.5
        else:
            slope = (np.log(np.maximum(got, 1e-9)) - prev[1]) / np.where(np.abs(tau - prev[0]) > 1e-6, tau - prev[0],
                                                                          np.nan)
            slope = np.where(np.isfinite(slope) & (slope > 0.05), slope, 0.5)
            step = err / slope
        prev = (tau.copy(), np.log(np.maximum(got, 1e-9)))
        tau = np.where(fix, np.clip(tau + np.clip(step, -0.3, 0.3), 0.5, 2.0), 1.0)
    model.temper = np.round(tau, 4)
