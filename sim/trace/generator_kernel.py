"""The generator's per-token loop: one numba kernel with its own splitmix64 generator, so a (model, seed,
sizes) triple gives the same trace on every run (docs/trace-generator.md: the mechanisms it draws).

Only arrays go in and out; sim/trace/generator_model.py builds them from a preset and calibrates them.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

# --------------------------------------------------------------------------------------- kernel


@nb.njit(inline="always")
def _next(st):
    st[0] += np.uint64(0x9E3779B97F4A7C15)
    z = st[0]
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@nb.njit(inline="always")
def _rand(st):
    return (_next(st) >> np.uint64(11)) * (1.0 / 9007199254740992.0)


@nb.njit(inline="always")
def _normal(st):
    u1 = _rand(st)
    while u1 <= 1e-300:
        u1 = _rand(st)
    u2 = _rand(st)
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


@nb.njit(inline="always")
def _mix(x):
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@nb.njit(inline="always")
def _search(cum, x):
    lo = 0
    hi = cum.shape[0] - 1
    while lo < hi:
        mid = (lo + hi) >> 1
        if cum[mid] > x:
            hi = mid
        else:
            lo = mid + 1
    return lo


@nb.njit(cache=True)
def _build_guide(cum, guide):
    """guide[b]: where _search(cum, x) ends for x at the start of bucket b of len(guide) equal buckets over
    [0, cum[-1]]; _guided_search starts there."""
    last = cum.shape[0] - 1
    step = cum[last] / guide.shape[0]
    i = 0
    for b in range(guide.shape[0]):
        while i < last and cum[i] <= b * step:
            i += 1
        guide[b] = i


@nb.njit(inline="always")
def _guided_search(cum, guide, x):
    """_search(cum, x) in a step or two: from the guide's entry for x's bucket, walked to the first index whose
    cum exceeds x (the last index if none does). The same index as _search whatever the guide holds, since cum
    never decreases; the guide only shortens the walk. (The recall's binary search over its lag law, a draw per
    recalled pick, took a fifth of the kernel's time on the Qwen3.8 preset.)"""
    last = cum.shape[0] - 1
    n_buckets = guide.shape[0]
    b = 0
    if x > 0.0 and cum[last] > 0.0:
        b = n_buckets - 1 if x >= cum[last] else min(int(x / cum[last] * n_buckets), n_buckets - 1)
    i = guide[b]
    while i > 0 and cum[i - 1] > x:
        i -= 1
    while i < last and cum[i] <= x:
        i += 1
    return i


@nb.njit(inline="always")
def _pick(x, n, sel, srt, stamp, mark):
    """Append expert x to the n picks: sel in pick order, srt kept ascending, x stamped; returns n + 1."""
    sel[n] = x
    stamp[x] = mark
    i = n - 1
    while i >= 0 and srt[i] > x:
        srt[i + 1] = srt[i]
        i -= 1
    srt[i + 1] = x
    return n + 1


@nb.njit(inline="always")
def _mate(a, layer, c, group_of, members, gstart, stamp, mark, mate_weight, st):
    """A group mate of expert a not yet picked, by its current weight (so the working set and the token's context
    still apply); -1 when none has weight."""
    g = group_of[layer, a]
    s0 = gstart[layer, g]
    size = gstart[layer, g + 1] - s0
    if size <= 1:
        return -1
    tot = 0.0
    for i in range(size):
        y = members[layer, s0 + i]
        mate_weight[i] = -1.0 if stamp[y] == mark else c[y] - (c[y - 1] if y > 0 else 0.0)
        if mate_weight[i] >= 0.0:
            tot += mate_weight[i]
    if tot <= 0.0:
        return -1
    pick = _rand(st) * tot
    x = -1
    for i in range(size):
        if mate_weight[i] < 0.0:
            continue
        x = members[layer, s0 + i]
        pick -= mate_weight[i]
        if pick <= 0.0:
            break
    return x


@nb.njit(cache=True)
def _build_cum(cum, w, sigma, thr, leak, local, eta, zg, zi, group_of, ctx_of, kappa, n_ctx, layer):
    """The layer's cumulative weights per context. An expert's tilt (one exp) is computed once for all contexts;
    each context's sum adds the same terms in the same order as a sum per context would."""
    e_n = w.shape[1]
    a = math.sqrt(1.0 - eta * eta)
    for e in range(e_n):
        u = w[layer, e]
        inside = True
        if local[layer]:
            z = a * zg[layer, group_of[layer, e]] + eta * zi[layer, e]
            if z <= thr[layer, e]:
                u *= leak  # outside the request's working set: a small, untilted weight
                inside = False
            else:
                u *= math.exp(sigma[layer] * z)
        for c in range(n_ctx):
            v = u
            if inside and n_ctx > 1 and ctx_of[layer, e] == c:
                v *= kappa[layer]
            cum[layer, c, e] = (cum[layer, c, e - 1] if e > 0 else 0.0) + v


def read_back_rows(lag_cum: np.ndarray) -> int:
    """How far back the kernel reads a request's earlier rows: the previous token (temporal reuse) and a recalled
    token 2 + _search(lag_cum, u) back, at most 2 + len(lag_cum) - 1."""
    return len(lag_cum) + 1


# Buckets of a search guide of a short cumulative law (the recall's lag law): walks of a step or two
SEARCH_GUIDE_BUCKETS = 1024


class GeneratorState:
    """What the per-token loop carries from one block of rows to the next: the generator's state word, the
    request's working-set scores and their cumulative weights, its token ids (hash layers), its recent rows grouped
    by context (recall), the token's context and the pick stamps; and the recall's lag guide. Blocks of rows are
    generated in order and give the same trace as one call would."""

    def __init__(self, seed, n_layers: int, n_experts: int, top_k: int, n_ctx: int, n_groups: np.ndarray, steps: int,
                 lag_cum: np.ndarray):
        self.st = np.empty(1, np.uint64)
        self.st[0] = (int(seed) * 0xD1B54A32D192ED03 + 0x2545F4914F6CDD1D) % 2**64  # uint64 arithmetic, wrapping
        self.zg = np.zeros((n_layers, max(int(n_groups.max(initial=1)), 1)))  # a score per working-set group
        self.zi = np.zeros((n_layers, n_experts))
        self.cum = np.zeros((n_layers, n_ctx, n_experts))
        self.lag_guide = np.zeros(SEARCH_GUIDE_BUCKETS, np.int32)
        _build_guide(lag_cum, self.lag_guide)
        # A recalled token's experts of the current context, without a scan of its row: for each of the request's
        # last `ring` rows (a power of two, so a row's slot is its position's low bits) and each layer, where each
        # context's run starts (n_ctx + 1 offsets), then its experts ordered by context, in pick order within one.
        # Offsets and experts in one record: a recall reads one place, not the row and every expert's context.
        ring = 1 << (read_back_rows(lag_cum) - 1).bit_length()
        self.by_ctx = np.zeros((ring, n_layers, n_ctx + 1 + top_k), np.uint16)
        self.tok_of = np.zeros(max(steps, 1), np.int64)  # the request's token ids so far (hash layers)
        # stamp[e] == mark: e is already picked for the current (token, layer); one O(1) test instead of a scan
        self.stamp = np.zeros(n_experts, np.int64)
        self.counters = np.zeros(2, np.int64)  # [the token's context, mark]


@nb.njit(cache=True, nogil=True)  # nogil: independent requests can be generated on several cores
def _kernel_rows(out, base, first_row, last_row, prompt, decode, st, zg, zi, cum, lag_guide, by_ctx, tok_of, stamp,
                 counters, k, w, sigma, thr, leak, local, eta, group_of, members, gstart, n_groups, ctx_of, n_ctx,
                 kappa, stick, rho, recall, lag_cum, partner, seg_p, drift, is_hash, vocab_cum, tok_rho, tok_lag_cum,
                 hash_seed):
    """Rows first_row..last_row - 1 of the trace, row r at out[r - base]. Rows of earlier blocks are read back
    (temporal reuse and recall), up to read_back_rows(lag_cum) rows before first_row: `out` holds them below."""
    n_layers, e_n = w.shape
    steps = prompt + decode
    sel = np.zeros(k, np.int64)
    srt = np.zeros(k, np.int64)  # the picks of the current (token, layer) in ascending id order
    ctx, mark = counters[0], counters[1]
    mate_weight = np.zeros(members.shape[1])  # group mates' current weights, 0 once picked
    ring_mask = by_ctx.shape[0] - 1
    filled = np.zeros(n_ctx, np.int64)  # where a row's next expert of each context goes, as the row is grouped
    any_hash = False
    for layer in range(n_layers):
        if is_hash[layer]:
            any_hash = True
    keep_d = math.sqrt(1.0 - drift)
    add_d = math.sqrt(drift)
    for row in range(first_row, last_row):
        t = row % steps
        if t == 0:  # a request begins: its working-set scores
            for layer in range(n_layers):
                if is_hash[layer]:
                    continue
                for g in range(n_groups[layer]):
                    zg[layer, g] = _normal(st)
                for e in range(e_n):
                    zi[layer, e] = _normal(st)
                _build_cum(cum, w, sigma, thr, leak, local, eta, zg, zi, group_of, ctx_of, kappa, n_ctx, layer)
            ctx = 0
        ph = 0 if t < prompt else 1
        if t > 0 and seg_p > 0.0 and _rand(st) < seg_p:
            for layer in range(n_layers):
                if is_hash[layer] or not local[layer]:
                    continue
                for g in range(n_groups[layer]):
                    zg[layer, g] = keep_d * zg[layer, g] + add_d * _normal(st)
                for e in range(e_n):
                    zi[layer, e] = keep_d * zi[layer, e] + add_d * _normal(st)
                _build_cum(cum, w, sigma, thr, leak, local, eta, zg, zi, group_of, ctx_of, kappa, n_ctx, layer)
        if n_ctx > 1 and (t == 0 or _rand(st) >= stick):
            ctx = int(_rand(st) * n_ctx)
        tid = -1
        if any_hash:
            # a token repeats one of the request's earlier tokens (its lag drawn from tok_lag_cum) or is a
            # fresh draw from the vocabulary's rank-frequency law
            if t > 0 and _rand(st) < tok_rho:
                j = 1 + _search(tok_lag_cum, _rand(st))
                if j <= t:
                    tid = tok_of[t - j]
            if tid < 0:
                tid = _search(vocab_cum, _rand(st) * vocab_cum[vocab_cum.shape[0] - 1])
            tok_of[t] = tid
        for layer in range(n_layers):
            n = 0
            mark += 1
            removed = 0.0  # the summed weights of the picks so far, in pick order
            if is_hash[layer]:
                attempt = 0
                while n < k:
                    h = _mix(hash_seed ^ (np.uint64(layer) << np.uint64(40)) ^ (np.uint64(tid) << np.uint64(8))
                             ^ np.uint64(attempt))
                    attempt += 1
                    x = int(h % np.uint64(e_n))
                    dup = False
                    for j in range(n):
                        if sel[j] == x:
                            dup = True
                            break
                    if not dup:
                        sel[n] = x
                        n += 1
            else:
                c = cum[layer, ctx]
                total = c[e_n - 1]
                if t > 0:
                    # temporal reuse, short range: each of the previous token's experts is kept with
                    # probability rho (per layer and phase)
                    p_keep = rho[ph, layer]
                    for j in range(k):
                        if _rand(st) < p_keep:
                            y = np.int64(out[row - base - 1, layer, j])
                            n = _pick(y, n, sel, srt, stamp, mark)
                            removed += c[y] - (c[y - 1] if y > 0 else 0.0)
                    # long range: each pick still free is, with probability recall, a copy of an expert of
                    # the request's token j back (j - 2 drawn from lag_cum): one of that token's experts at
                    # random, among those of the current token's context if it has any (so the context keeps
                    # its cross-layer pull); one picked already leaves the pick to a fresh draw
                    p_recall = recall[layer]
                    if p_recall > 0.0:
                        for _ in range(k - n):
                            if n >= k or _rand(st) >= p_recall:
                                continue
                            j = 2 + _guided_search(lag_cum, lag_guide, _rand(st))
                            if j > t:  # before the request's first token: nothing to recall
                                continue
                            slot = (t - j) & ring_mask
                            own = np.int64(by_ctx[slot, layer, ctx + 1]) - np.int64(by_ctx[slot, layer, ctx])
                            pick = int(_rand(st) * (own if own > 0 else k))
                            if own > 0:
                                y = np.int64(by_ctx[slot, layer, n_ctx + 1 + by_ctx[slot, layer, ctx] + pick])
                            else:
                                y = np.int64(out[row - base - j, layer, pick])
                            if stamp[y] == mark:  # picked already: this pick stays fresh (no bias to the rare)
                                continue
                            n = _pick(y, n, sel, srt, stamp, mark)
                            removed += c[y] - (c[y - 1] if y > 0 else 0.0)
                            # a recalled pick draws its co-activation partner like a fresh pick does
                            if n < k and partner[layer] > 0.0 and _rand(st) < partner[layer]:
                                z = _mate(sel[n - 1], layer, c, group_of, members, gstart, stamp, mark,
                                          mate_weight, st)
                                if z >= 0:
                                    n = _pick(z, n, sel, srt, stamp, mark)
                                    removed += c[z] - (c[z - 1] if z > 0 else 0.0)
                while n < k:
                    x = -1
                    if n > 0 and partner[layer] > 0.0 and _rand(st) < partner[layer]:
                        x = _mate(sel[int(_rand(st) * n)], layer, c, group_of, members, gstart, stamp, mark,
                                  mate_weight, st)
                    if x < 0:
                        # an exact draw without replacement: a point of the range with the picked
                        # experts cut out, mapped back onto cum by adding the widths of the cut
                        # intervals below it (picked ids visited in ascending order)
                        left = total - removed
                        if left > total * 1e-9:
                            xx = _rand(st) * left
                            for j in range(n):
                                y = srt[j]
                                if (c[y - 1] if y > 0 else 0.0) <= xx:
                                    xx += c[y] - (c[y - 1] if y > 0 else 0.0)
                                else:
                                    break
                            y = _search(c, xx)
                            if c[y] - (c[y - 1] if y > 0 else 0.0) > 0.0 and stamp[y] != mark:
                                x = y
                    if x < 0:  # fewer than k experts with weight: take a free id from a random start
                        y = int(_rand(st) * e_n)
                        while stamp[y] == mark:
                            y = (y + 1) % e_n
                        x = y
                    n = _pick(x, n, sel, srt, stamp, mark)
                    removed += c[x] - (c[x - 1] if x > 0 else 0.0)
            for j in range(k):
                out[row - base, layer, j] = sel[j]
            if recall[layer] > 0.0:  # the row grouped by context, for the tokens that recall it (a counting sort)
                slot = t & ring_mask
                for cx in range(n_ctx + 1):
                    by_ctx[slot, layer, cx] = 0
                for j in range(k):
                    by_ctx[slot, layer, ctx_of[layer, sel[j]] + 1] += 1
                for cx in range(n_ctx):
                    by_ctx[slot, layer, cx + 1] += by_ctx[slot, layer, cx]
                    filled[cx] = n_ctx + 1 + by_ctx[slot, layer, cx]
                for j in range(k):
                    cx = ctx_of[layer, sel[j]]
                    by_ctx[slot, layer, filled[cx]] = sel[j]
                    filled[cx] += 1
    counters[0], counters[1] = ctx, mark


