"""Exact LRU miss-ratio curves in one pass (Mattson's stack distances), per pool.

LRU is a stack algorithm: an access hits a cache of c slots exactly when its stack distance (the number of
distinct keys touched since the key's previous access, itself included) is at most c. One pass that
histograms the distances therefore gives the hits of every capacity at once.

The distance is a count of "latest access" marks after the key's previous access. Marks live in a bitmap
over pool-local time with a Fenwick tree over its 64-bit words, so a distance costs one popcount plus a
few tree steps instead of the O(distance) walk down an explicit stack (the naive Mattson scan). Time is
renumbered whenever it reaches twice the pool's key count, so the bitmap stays small (a layer of 512
experts: 16 words) and renumbering is amortised O(1).
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import intrinsic


@intrinsic
def _popcount64(typingctx, x):
    # numba exposes no popcount; LLVM's ctpop compiles to the POPCNT instruction.
    sig = types.uint64(types.uint64)

    def codegen(context, builder, signature, args):
        return builder.ctpop(args[0])

    return sig, codegen


@njit(cache=True, inline="always")
def _tree_add(tree, base, n_words, word, delta):
    i = word + 1
    while i <= n_words:
        tree[base + i] += delta
        i += i & (-i)


@njit(cache=True, inline="always")
def _tree_prefix(tree, base, word):
    """Marks in words [0, word)."""
    total = 0
    i = word
    while i > 0:
        total += tree[base + i]
        i -= i & (-i)
    return total


@njit(cache=True)
def _renumber(pool, bits, word_base, n_words, tree, tree_base, key_at, time_base, last):
    """Move the live marks of a pool to times 0..m-1 (same order); returns m."""
    nw = n_words[pool]
    wb = word_base[pool]
    tb = time_base[pool]
    m = 0
    for w in range(nw):
        word = bits[wb + w]
        while word != 0:
            b = _popcount64((word & (~word + np.uint64(1))) - np.uint64(1))  # index of the lowest set bit
            word &= word - np.uint64(1)
            key = key_at[tb + w * 64 + b]
            key_at[tb + m] = key
            last[key] = m
            m += 1
    for w in range(nw):
        bits[wb + w] = np.uint64(0)
        tree[tree_base[pool] + w + 1] = 0
    for t in range(m):
        bits[wb + (t >> 6)] |= np.uint64(1) << np.uint64(t & 63)
    for w in range(nw):
        _tree_add(tree, tree_base[pool], nw, w, int(_popcount64(bits[wb + w])))
    return m


@njit(cache=True)
def stack_distance_histograms(experts, phase, pool_of_layer, keys_per_pool, n_experts, hist, cold):
    """hist[layer, phase, d] += accesses at stack distance d (1-based) within the layer's pool;
    cold[layer, phase] += first accesses of a key."""
    rows, layers, top_k = experts.shape
    n_pools = keys_per_pool.shape[0]
    n_words = np.empty(n_pools, np.int64)
    word_base = np.empty(n_pools, np.int64)
    tree_base = np.empty(n_pools, np.int64)
    time_base = np.empty(n_pools, np.int64)
    wsum = 0
    tsum = 0
    for p in range(n_pools):
        n_words[p] = (2 * keys_per_pool[p] + 63) // 64 + 1
        word_base[p] = wsum
        tree_base[p] = wsum + p  # the tree has n_words + 1 entries (1-based)
        time_base[p] = tsum
        wsum += n_words[p]
        tsum += n_words[p] * 64
    bits = np.zeros(wsum, np.uint64)
    tree = np.zeros(wsum + n_pools, np.int64)
    key_at = np.zeros(tsum, np.int32)
    now = np.zeros(n_pools, np.int64)
    live = np.zeros(n_pools, np.int64)
    last = np.full(layers * n_experts, -1, np.int64)
    for r in range(rows):
        ph = phase[r]
        for layer in range(layers):
            if experts[r, layer, 0] == 0xFFFF:
                continue
            p = pool_of_layer[layer]
            wb = word_base[p]
            tb = tree_base[p]
            nw = n_words[p]
            for j in range(top_k):
                key = layer * n_experts + experts[r, layer, j]
                lt = last[key]
                if lt < 0:
                    cold[layer, ph] += 1
                    live[p] += 1
                else:
                    w = lt >> 6
                    bit = np.uint64(1) << np.uint64(lt & 63)
                    below = _tree_prefix(tree, tb, w) + int(_popcount64(bits[wb + w] & (bit - np.uint64(1))))
                    hist[layer, ph, live[p] - below] += 1
                    bits[wb + w] &= ~bit
                    _tree_add(tree, tb, nw, w, -1)
                t = now[p]
                if t == nw * 64:
                    t = _renumber(p, bits, word_base, n_words, tree, tree_base, key_at, time_base, last)
                bits[wb + (t >> 6)] |= np.uint64(1) << np.uint64(t & 63)
                _tree_add(tree, tb, nw, t >> 6, 1)
                key_at[time_base[p] + t] = key
                last[key] = t
                now[p] = t + 1
