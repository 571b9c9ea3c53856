"""A routing model's parameters: the geometry and per-layer arrays the per-token kernel
(sim/trace/generator_kernel.py) draws from, and the working-set membership that turns each layer's calibrated
size knob into the kernel's thresholds. sim/trace/generator_model.py builds them from a preset;
sim/trace/generator_calibration.py fits the knobs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sim.trace.generator_kernel import GeneratorState, _kernel_rows, read_back_rows

# (token, layer) picks one kernel call generates before it returns to Python: ~0.1 s of a 48-layer top-10 model
BLOCK_PICKS = 1 << 20


class GenerationStopped(Exception):
    """A generation another thread asked to stop (its `stop` event set): a worker of an interrupted run."""


@dataclass(frozen=True)
class _Geometry:
    n_layers: int
    n_experts: int
    top_k: int


@dataclass
class _Model:
    name: str
    geo: _Geometry
    w: np.ndarray            # [L, E] base weights (corrected so the long-run marginal is q_target / k)
    q_target: np.ndarray     # [L, E] target marginal inclusion per token
    sigma: np.ndarray        # [L] log-normal spread of the request tilt inside the working set
    shift: np.ndarray        # [L] working-set size knob c_l (calibrated): larger = larger set
    pop_pref: float          # lambda: how much more likely popular experts are in a request's set
    leak: float              # weight factor of experts outside the working set
    local: np.ndarray        # [L] bool: layer has request working sets
    eta: float
    group_of: np.ndarray
    members: np.ndarray
    gstart: np.ndarray
    n_groups: np.ndarray
    ctx_of: np.ndarray
    n_ctx: int
    kappa: np.ndarray
    stick: float
    rho: np.ndarray          # [2, L] chance that each expert of the previous token is kept (prefill, decode)
    recall: np.ndarray       # [L] chance that a pick still free copies an expert of an earlier token
    lag_cum: np.ndarray      # [J] cumulative law of that token's distance back: 2 + index
    partner: np.ndarray
    seg_p: float
    drift: float
    is_hash: np.ndarray
    vocab_cum: np.ndarray
    tok_rho: float           # hash layers: chance that a token repeats an earlier token of the request
    tok_lag_cum: np.ndarray  # [Jt] cumulative lag law of such a repeat
    hash_seed: int
    calibrated: dict
    temper: np.ndarray = None  # [L] power of the base weights (calibrated): the long-run skew after reuse

    @property
    def thr(self) -> np.ndarray:
        """[L, E] threshold: expert e is in a request's working set when its score z exceeds thr."""
        return -_norm_ppf(_membership(self, self.shift))

    @property
    def w_run(self) -> np.ndarray:
        """The base weights the kernel draws from: w^temper per layer, renormalised."""
        if self.temper is None:
            return self.w
        w = self.w ** self.temper[:, None]
        return w / w.sum(1, keepdims=True)

    def run(self, seed: int, n_req: int, prompt: int, decode: int, stop=None) -> np.ndarray:
        """[rows, layers, k] expert ids: the blocks of `blocks` in one array."""
        out = np.empty((n_req * (prompt + decode), self.w.shape[0], self.geo.top_k), np.uint16)
        for first, rows in self.blocks(seed, n_req, prompt, decode, stop):
            out[first: first + len(rows)] = rows
        return out

    def blocks(self, seed: int, n_req: int, prompt: int, decode: int, stop=None):
        """The trace's rows, a block per kernel call: (first row, uint16 [rows, layers, k]), each block a view
        that the next one overwrites. Only the rows the kernel reads back (read_back_rows) are kept from one block
        to the next, so a million-token prompt can be consumed without holding it. Python takes a Ctrl-C between
        two blocks (a million-token prompt in one call ignored it for a minute); `stop` (a threading.Event) set by
        another thread ends the generation at the next block (GenerationStopped). The trace is the same whatever
        the block size."""
        steps = prompt + decode
        total = n_req * steps
        n_layers, n_experts = self.w.shape
        state = GeneratorState(np.uint64(seed), n_layers, n_experts, self.geo.top_k, self.n_ctx, self.n_groups, steps,
                               self.lag_cum)
        w_run, thr = self.w_run, self.thr  # computed properties: once, not per block
        block = max(1, min(total, BLOCK_PICKS // (n_layers * self.geo.top_k)))
        back = read_back_rows(self.lag_cum)
        window = np.empty((back + block, n_layers, self.geo.top_k), np.uint16)  # row r at window[r - first + back]
        for first in range(0, total, block):
            if stop is not None and stop.is_set():
                raise GenerationStopped(f"stopped at row {first:,} of {total:,}")
            last = min(total, first + block)
            if first:  # the rows read back, from the end of the block before to the front
                window[:back] = window[block: block + back].copy()
            _kernel_rows(window, first - back, first, last, prompt, decode, state.st, state.zg, state.zi,
                         state.cum, state.lag_guide, state.by_ctx, state.tok_of, state.stamp, state.counters,
                         self.geo.top_k, w_run, self.sigma, thr, self.leak, self.local, self.eta, self.group_of,
                         self.members, self.gstart, self.n_groups, self.ctx_of, self.n_ctx, self.kappa, self.stick,
                         self.rho, self.recall, self.lag_cum, self.partner, self.seg_p, self.drift, self.is_hash,
                         self.vocab_cum, self.tok_rho, self.tok_lag_cum, np.uint64(self.hash_seed))
            yield first, window[back: back + last - first]


def _norm_cdf(x: np.ndarray) -> np.ndarray:
    """Standard normal CDF (Abramowitz & Stegun 7.1.26, |error| < 1.5e-7)."""
    z = np.abs(x) / math.sqrt(2.0)
    t = 1.0 / (1.0 + 0.3275911 * z)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    erf = 1.0 - poly * np.exp(-z * z)
    return 0.5 * (1.0 + np.sign(x) * erf)


def _norm_ppf(p: np.ndarray) -> np.ndarray:
    """Inverse standard normal CDF (Acklam's rational approximation, relative error < 1.2e-9)."""
    a = (-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02, 1.383577518672690e+02,
         -3.066479806614716e+01, 2.506628277459239e+00)
    b = (-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02, 6.680131188771972e+01,
         -1.328068155288572e+01)
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00, -2.549671010115154e+00,
         4.374664141464968e+00, 2.938163982698783e+00)
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00, 3.754408661907416e+00)
    p = np.clip(np.asarray(p, float), 1e-12, 1 - 1e-12)

    def tail(q):
        num = ((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]
        return num / ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1)
    q = p - 0.5
    r = q * q
    mid = (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q / (
        ((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)
    low = tail(np.sqrt(-2 * np.log(np.minimum(p, 0.5))))
    high = -tail(np.sqrt(-2 * np.log(np.minimum(1 - p, 0.5))))
    return np.where(p < 0.02425, low, np.where(p > 1 - 0.02425, high, mid))


# An expert's chance to be in a request's working set is at least its long-run inclusion per token over
# this: a set member cannot be picked by more than every token, so a lower chance would force the weight
# correction to make rare members huge.
MAX_INCLUSION_IN_SET = 0.8


def _membership(model: _Model, shift: np.ndarray) -> np.ndarray:
    """[L, E] chance that expert e is in a request's working set: Phi(lambda log(p_e E) + c_l), popular
    experts more often, floored so that the set can carry the expert's long-run inclusion."""
    e = model.geo.n_experts
    pref = model.pop_pref * np.log(np.maximum(model.q_target / model.geo.top_k * e, 1e-12))
    floor = np.minimum(model.q_target / MAX_INCLUSION_IN_SET, 0.999)
    return np.maximum(_norm_cdf(pref + np.asarray(shift, float)[:, None]), floor)
