"""Exact LRU miss-ratio curves in one pass (Mattson's stack distances), per pool.

LRU is a stack algorithm: an access hits a cache of c slots exactly when its stack distance (the number of
distinct keys touched since the key's previous access, itself included) is at most c. One pass that
histograms the distances therefore gives the hits of every capacity at once.

The distance is a count of "latest access" marks after the key's previous access. Marks live in a bitmap
over pool-local time. Every time step sets one mark and every re-access removes one, so the marks before a
time are that time minus the removals before it: a Fenwick tree over the bitmap's 64-bit words counts
removals only. A distance then costs one popcount, one tree prefix and one tree update (a tree of all
marks would need a second update per access) instead of the O(distance) walk down an explicit stack (the
naive Mattson scan). Time is renumbered whenever it reaches twice the pool's key count, so the bitmap stays small (a layer of 512
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


# The access loop below holds no function call (not even to the rare renumbering): in numba a call that
# takes arrays reference-counts them and keeps LLVM from holding values in registers, which measured
# several times slower in the cache kernels. The Fenwick tree steps are therefore written out in place.
@njit(cache=True)
def stack_distance_histograms(experts, phase, pool_of_layer, group_of_layer, keys_per_pool, n_experts, hist, cold):
    """hist[group, phase, d] += accesses at stack distance d (1-based) within the layer's pool;
    cold[group, phase] += first accesses of a key (group = group_of_layer[layer])."""
    rows, layers, top_k = experts.shape
    n_pools = keys_per_pool.shape[0]
    n_words = np.empty(n_pools, np.uint64)
    word_base = np.empty(n_pools, np.uint64)
    tree_base = np.empty(n_pools, np.uint64)  # the tree of a pool has n_words + 1 entries (1-based)
    wsum = 0
    for p in range(n_pools):
        n_words[p] = (2 * keys_per_pool[p] + 63) // 64 + 1
        word_base[p] = wsum
        tree_base[p] = wsum + p
        wsum += n_words[p]
    bits = np.zeros(wsum, np.uint64)
    tree = np.zeros(wsum + n_pools, np.int32)
    key_at = np.zeros(wsum * 64, np.uint32)  # the key whose latest access is at this pool-local time
    now = np.zeros(n_pools, np.uint64)
    live = np.zeros(n_pools, np.uint64)
    never = np.uint32(0xFFFFFFFF)
    last = np.full(layers * n_experts, never, np.uint32)  # pool-local time of a key's latest access
    one = np.uint64(1)
    for r in range(rows):
        ph = phase[r]
        for layer in range(layers):
            if experts[r, layer, 0] == 0xFFFF:
                continue
            p = np.uint64(pool_of_layer[layer])
            group = np.uint64(group_of_layer[layer])
            wb = word_base[p]
            tb = tree_base[p]
            nw = n_words[p]
            base = np.uint64(layer * n_experts)
            for j in range(top_k):
                key = base + np.uint64(experts[r, layer, j])
                lt = last[key]
                if lt == never:
                    cold[group, ph] += 1
                    live[p] += one
                else:
                    w = np.uint64(lt >> 6)
                    bit = one << np.uint64(lt & 63)
                    # marks before lt: every earlier time got one when it happened, minus the removed ones
                    removed = np.uint64(0)
                    i = w
                    while i > 0:  # Fenwick prefix: removed marks in words [0, w)
                        removed += np.uint64(tree[tb + i])
                        i &= i - one
                    below = w * np.uint64(64) - removed + _popcount64(bits[wb + w] & (bit - one))
                    hist[group, ph, live[p] - below] += 1
                    bits[wb + w] &= ~bit
                    i = w + one
                    while i <= nw:  # Fenwick update: one more removed mark in word w
                        tree[tb + i] += 1
                        i += i & (~i + one)
                t = now[p]
                if t == nw * 64:
                    # Renumber: move the live marks to times 0..m-1, in order, and rebuild the tree.
                    m = np.uint64(0)
                    for w2 in range(nw):
                        word = bits[wb + w2]
                        while word != 0:
                            b = _popcount64((word & (~word + one)) - one)  # index of the lowest set bit
                            word &= word - one
                            moved = key_at[(wb + w2) * 64 + b]
                            key_at[wb * 64 + m] = moved
                            last[moved] = np.uint32(m)
                            m += one
                        bits[wb + w2] = 0
                        tree[tb + w2 + one] = 0  # times 0..m-1 are all live again: nothing removed
                    full = m >> np.uint64(6)  # whole words of marks, then the partial one
                    for w2 in range(full):
                        bits[wb + w2] = ~np.uint64(0)
                    if m & np.uint64(63):
                        bits[wb + full] = (one << (m & np.uint64(63))) - one
                    t = m
                bits[wb + (t >> 6)] |= one << np.uint64(t & 63)
                key_at[wb * 64 + t] = key
                last[key] = np.uint32(t)
                now[p] = t + one
