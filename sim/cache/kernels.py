"""Numba kernels of the expert caches: one call per trace or per engine step, never one per access.

Keys are global expert ids `layer * n_experts + expert`. Every cache is a set of *pools*, each with its own
slot capacity: a pool per layer (per-layer scope), per size class (ds4 after #504) or one pool (global
scope, ds4's legacy slab). Slots are tracked so that an engine model can name the slab slot each copy
reads or writes.

Outcome of one access (what an engine does with it):
HIT (copy from the slot), INSERT (load into a free slot), EVICT (load into the victim's slot),
DIRECT (load straight to the consumer, not cached: append-only mode, a full static cache, OPT's bypass).
"""

from __future__ import annotations

import numpy as np
from numba import njit

HIT, INSERT, EVICT, DIRECT = 0, 1, 2, 3
N_OUTCOMES = 4
MODE_EVICT, MODE_APPEND = 0, 1


# --- LRU -------------------------------------------------------------------------------------------
# Exact LRU as one circular doubly linked list per pool over the key ids, with a sentinel node per pool
# (node n_keys + pool) so that no access branches on an empty list: the most recent key follows the
# sentinel, the LRU victim precedes it. A hit is four loads and six stores into arrays that stay in L2.
# (A lazily cleaned FIFO of stamps does a hit in two stores but pays for every stale entry later; it
# measured 2x slower here.) slot[key] >= 0 means resident.


def lru_state(n_keys: int, capacity: np.ndarray) -> dict:
    """Empty LRU state for pools of the given slot capacities (numpy arrays, mutated by the kernels)."""
    capacity = np.asarray(capacity, dtype=np.int64)
    n_pools = len(capacity)
    sentinels = np.arange(n_keys, n_keys + n_pools, dtype=np.int32)
    links = np.zeros(n_keys + n_pools, np.int32)
    links[n_keys:] = sentinels
    return {
        "slot": np.full(n_keys, -1, np.int32),
        "prev": links.copy(),
        "next": links.copy(),
        "capacity": capacity.copy(),
        "count": np.zeros(n_pools, np.int64),
        "key_of_slot": np.full((n_pools, max(int(capacity.max(initial=0)), 1)), -1, np.int32),
    }


# The access loop is written out once, here, with no function call inside it, not even a rarely taken
# one: a call that takes arrays makes numba reference-count them and keeps LLVM from holding anything in
# registers across it, which measured 5x slower. Callers batch a token step (or a run of layers) per call.
@njit(cache=True)
def lru_access_batch(keys, pools, n, mode, slot, prev, nxt, capacity, count, key_of_slot,
                     outcome_out, slot_out, victim_out):
    """Access keys[:n] in order (pools[i] = pool of keys[i]); per key write the outcome, the slot it
    occupies (-1 for a direct load) and the evicted key (-1 if none)."""
    n_keys = slot.shape[0]
    for i in range(n):
        key = keys[i]
        pool = pools[i]
        head = n_keys + pool
        victim_out[i] = -1
        s = slot[key]
        if s >= 0:
            before = prev[key]
            after = nxt[key]
            nxt[before] = after
            prev[after] = before
            outcome_out[i] = HIT
        elif count[pool] < capacity[pool]:
            s = count[pool]
            count[pool] = s + 1
            slot[key] = s
            key_of_slot[pool, s] = key
            outcome_out[i] = INSERT
        elif mode == MODE_APPEND or capacity[pool] == 0:
            outcome_out[i] = DIRECT
            slot_out[i] = -1
            continue
        else:
            old = prev[head]
            before = prev[old]
            nxt[before] = head
            prev[head] = before
            s = slot[old]
            slot[old] = -1
            slot[key] = s
            key_of_slot[pool, s] = key
            victim_out[i] = old
            outcome_out[i] = EVICT
        first = nxt[head]
        nxt[key] = first
        prev[first] = key
        nxt[head] = key
        prev[key] = head
        slot_out[i] = s


@njit(cache=True)
def lru_flush_pool(pool, slot, prev, nxt, count, key_of_slot):
    """Release every slot of a pool (ds4's release_all / a slab rebuilt for another size)."""
    for s in range(count[pool]):
        k = key_of_slot[pool, s]
        slot[k] = -1
        key_of_slot[pool, s] = -1
    count[pool] = 0
    head = slot.shape[0] + pool
    prev[head] = head
    nxt[head] = head


@njit(cache=True)
def _row_keys(experts, r, layer_from, layer_to, n_experts, pool_of_layer, keys, pools, layer_of):
    """The keys of row r, layers [layer_from, layer_to), missing cells skipped; returns their count."""
    n = 0
    top_k = experts.shape[2]
    for layer in range(layer_from, layer_to):
        if experts[r, layer, 0] == 0xFFFF:
            continue
        base = layer * n_experts
        pool = pool_of_layer[layer]
        for j in range(top_k):
            keys[n] = base + experts[r, layer, j]
            pools[n] = pool
            layer_of[n] = layer
            n += 1
    return n


@njit(cache=True)
def _count_outcomes(outcome, layer_of, n, top_k, ph, counts):
    """Add a batch's outcomes to counts[layer, phase, outcome]; a cell's k accesses share a layer."""
    for cell in range(0, n, top_k):
        hit = 0
        insert = 0
        evict = 0
        for i in range(cell, cell + top_k):
            o = outcome[i]
            hit += o == HIT
            insert += o == INSERT
            evict += o == EVICT
        layer = layer_of[cell]
        counts[layer, ph, HIT] += hit
        counts[layer, ph, INSERT] += insert
        counts[layer, ph, EVICT] += evict
        counts[layer, ph, DIRECT] += top_k - hit - insert - evict


@njit(cache=True)
def lru_replay(experts, phase, pool_of_layer, n_experts, prefill_mode, slot, prev, nxt, capacity, count,
               key_of_slot, counts):
    """Whole-trace entry: experts uint16 [rows, layers, k] (65535 = missing cell), one batch per row.

    Decode rows evict; prefill rows use `prefill_mode`. counts[layer, phase, outcome] is incremented.
    """
    rows, layers, top_k = experts.shape
    width = layers * top_k
    keys = np.empty(width, np.int64)
    pools = np.empty(width, np.int64)
    layer_of = np.empty(width, np.int64)
    outcome = np.empty(width, np.int8)
    slots = np.empty(width, np.int32)
    victims = np.empty(width, np.int64)
    for r in range(rows):
        ph = phase[r]
        n = _row_keys(experts, r, 0, layers, n_experts, pool_of_layer, keys, pools, layer_of)
        lru_access_batch(keys, pools, n, prefill_mode if ph == 0 else MODE_EVICT, slot, prev, nxt, capacity,
                         count, key_of_slot, outcome, slots, victims)
        _count_outcomes(outcome, layer_of, n, top_k, ph, counts)


@njit(cache=True)
def slab_replay(experts, phase, class_of_layer, capacity_of_class, n_experts, prefill_mode,
                slot, prev, nxt, capacity, count, key_of_slot, counts, size_changes):
    """ds4 before #504: one slab (pool 0) built for the last-seen expert size.

    An access of another size class releases the whole slab and rebuilds it with that class's
    capacity, so a mixed-quant model flushes at every q2<->q4 layer transition.
    """
    rows, layers, top_k = experts.shape
    pool_zero = np.zeros(layers, np.int64)
    keys = np.empty(layers * top_k, np.int64)
    pools = np.empty(layers * top_k, np.int64)
    layer_of = np.empty(layers * top_k, np.int64)
    outcome = np.empty(layers * top_k, np.int8)
    slots = np.empty(layers * top_k, np.int32)
    victims = np.empty(layers * top_k, np.int64)
    current = -1
    for r in range(rows):
        ph = phase[r]
        mode = prefill_mode if ph == 0 else MODE_EVICT
        start = 0
        while start < layers:
            # a run of layers of one size class, served by the slab as built for that size
            c = class_of_layer[start]
            stop = start + 1
            while stop < layers and class_of_layer[stop] == c:
                stop += 1
            has_cell = False
            for layer in range(start, stop):
                if experts[r, layer, 0] != 0xFFFF:
                    has_cell = True
            if has_cell and c != current:
                if current >= 0:
                    size_changes[0] += 1
                lru_flush_pool(0, slot, prev, nxt, count, key_of_slot)
                capacity[0] = capacity_of_class[c]
                current = c
            n = _row_keys(experts, r, start, stop, n_experts, pool_zero, keys, pools, layer_of)
            lru_access_batch(keys, pools, n, mode, slot, prev, nxt, capacity, count, key_of_slot,
                             outcome, slots, victims)
            _count_outcomes(outcome, layer_of, n, top_k, ph, counts)
            start = stop


# --- static profile-ranked cache (Strata's fill) -----------------------------------------------------


@njit(cache=True)
def static_replay(experts, phase, resident, n_experts, counts):
    """A cache filled once and never changed: resident keys hit, everything else is a direct load."""
    rows, layers, top_k = experts.shape
    for r in range(rows):
        ph = phase[r]
        for layer in range(layers):
            if experts[r, layer, 0] == 0xFFFF:
                continue
            base = layer * n_experts
            for j in range(top_k):
                if resident[base + experts[r, layer, j]]:
                    counts[layer, ph, HIT] += 1
                else:
                    counts[layer, ph, DIRECT] += 1


# --- LFU ------------------------------------------------------------------------------------------
# In-cache LFU: a key's count starts at 1 when it enters and is forgotten when it leaves; ties go to the
# least recently used (libCacheSim's LFU does the same). The victim search scans the pool's slots:
# O(capacity) per eviction, which is fine for an exploration policy that is not on any speed target.


@njit(cache=True)
def lfu_replay(experts, phase, pool_of_layer, n_experts, prefill_mode, capacity, counts):
    rows, layers, top_k = experts.shape
    n_pools = capacity.shape[0]
    max_cap = max(1, capacity.max())
    n_keys = layers * n_experts
    freq = np.zeros(n_keys, np.int64)
    last = np.full(n_keys, -1, np.int64)
    slot = np.full(n_keys, -1, np.int64)
    key_of_slot = np.full((n_pools, max_cap), -1, np.int64)
    count = np.zeros(n_pools, np.int64)
    t = 0
    for r in range(rows):
        ph = phase[r]
        mode = prefill_mode if ph == 0 else MODE_EVICT
        for layer in range(layers):
            if experts[r, layer, 0] == 0xFFFF:
                continue
            pool = pool_of_layer[layer]
            for j in range(top_k):
                key = layer * n_experts + experts[r, layer, j]
                t += 1
                if slot[key] >= 0:
                    freq[key] += 1
                    last[key] = t
                    counts[layer, ph, HIT] += 1
                    continue
                if count[pool] < capacity[pool]:
                    s = count[pool]
                    count[pool] += 1
                    counts[layer, ph, INSERT] += 1
                elif mode == MODE_APPEND or capacity[pool] == 0:
                    counts[layer, ph, DIRECT] += 1
                    continue
                else:
                    s = 0
                    best = key_of_slot[pool, 0]
                    for i in range(1, capacity[pool]):
                        k = key_of_slot[pool, i]
                        if freq[k] < freq[best] or (freq[k] == freq[best] and last[k] < last[best]):
                            best = k
                            s = i
                    slot[best] = -1
                    freq[best] = 0
                    counts[layer, ph, EVICT] += 1
                slot[key] = s
                key_of_slot[pool, s] = key
                freq[key] = 1
                last[key] = t


# --- Belady / OPT (MIN with bypass) ----------------------------------------------------------------
# The bound: on a miss with a full pool, keep whichever of {new key, residents} are used soonest. A max-heap
# per pool over the residents' next-use times, indexed by key so that a hit can re-key in place.

NEVER = np.iinfo(np.int64).max


@njit(cache=True)
def next_use(experts, n_experts):
    """For every access (flattened row, layer, k order, missing cells skipped) the index of the next
    access to the same key, or NEVER. Returns (next_use, n_accesses)."""
    rows, layers, top_k = experts.shape
    n = 0
    for r in range(rows):
        for layer in range(layers):
            if experts[r, layer, 0] != 0xFFFF:
                n += top_k
    nxt = np.empty(n, np.int64)
    seen = np.full(layers * n_experts, NEVER, np.int64)
    i = n
    for r in range(rows - 1, -1, -1):
        for layer in range(layers - 1, -1, -1):
            if experts[r, layer, 0] == 0xFFFF:
                continue
            for j in range(top_k - 1, -1, -1):
                i -= 1
                key = layer * n_experts + experts[r, layer, j]
                nxt[i] = seen[key]
                seen[key] = i
    return nxt


@njit(cache=True)
def _heap_swap(heap, pool, a, b, pos):
    ka = heap[pool, a]
    kb = heap[pool, b]
    heap[pool, a] = kb
    heap[pool, b] = ka
    pos[kb] = a
    pos[ka] = b


@njit(cache=True)
def _sift_up(heap, pool, i, pos, prio):
    while i > 0:
        parent = (i - 1) >> 1
        if prio[heap[pool, parent]] >= prio[heap[pool, i]]:
            break
        _heap_swap(heap, pool, i, parent, pos)
        i = parent


@njit(cache=True)
def _sift_down(heap, pool, i, size, pos, prio):
    while True:
        left = 2 * i + 1
        if left >= size:
            break
        big = left
        right = left + 1
        if right < size and prio[heap[pool, right]] > prio[heap[pool, left]]:
            big = right
        if prio[heap[pool, i]] >= prio[heap[pool, big]]:
            break
        _heap_swap(heap, pool, i, big, pos)
        i = big


@njit(cache=True)
def opt_replay(experts, phase, pool_of_layer, n_experts, capacity, nxt, bypass, counts):
    """MIN over each pool. With bypass (the bound) a newcomer needed later than every resident is not
    cached; without it the newcomer always displaces the resident needed last (libCacheSim's Belady)."""
    rows, layers, top_k = experts.shape
    n_pools = capacity.shape[0]
    max_cap = max(1, capacity.max())
    n_keys = layers * n_experts
    prio = np.full(n_keys, -1, np.int64)  # next use of a resident key
    pos = np.full(n_keys, -1, np.int64)   # heap index of a resident key, -1 if not resident
    heap = np.full((n_pools, max_cap), -1, np.int64)
    size = np.zeros(n_pools, np.int64)
    i = 0
    for r in range(rows):
        ph = phase[r]
        for layer in range(layers):
            if experts[r, layer, 0] == 0xFFFF:
                continue
            pool = pool_of_layer[layer]
            for j in range(top_k):
                key = layer * n_experts + experts[r, layer, j]
                nu = nxt[i]
                i += 1
                if pos[key] >= 0:
                    prio[key] = nu  # later than before: the key can only move up a max-heap
                    _sift_up(heap, pool, pos[key], pos, prio)
                    counts[layer, ph, HIT] += 1
                    continue
                cap = capacity[pool]
                if size[pool] < cap:
                    s = size[pool]
                    size[pool] = s + 1
                    heap[pool, s] = key
                    pos[key] = s
                    prio[key] = nu
                    _sift_up(heap, pool, s, pos, prio)
                    counts[layer, ph, INSERT] += 1
                    continue
                if cap == 0 or (bypass and nu >= prio[heap[pool, 0]]):
                    counts[layer, ph, DIRECT] += 1  # bypass: the newcomer is needed last
                    continue
                old = heap[pool, 0]
                pos[old] = -1
                heap[pool, 0] = key
                pos[key] = 0
                prio[key] = nu
                _sift_down(heap, pool, 0, size[pool], pos, prio)
                counts[layer, ph, EVICT] += 1
