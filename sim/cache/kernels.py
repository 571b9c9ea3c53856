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
MODE_EVICT, MODE_APPEND = 0, 1


# --- LRU -------------------------------------------------------------------------------------------
# Exact LRU as one circular doubly linked list per pool over the key ids, with a sentinel node per pool
# (node n_keys + pool) so that no access branches on an empty list: the most recent key follows the
# sentinel, the LRU victim precedes it. A key's links and slot share one node (PREV, NEXT, SLOT, unused),
# so a hit touches one cache line per key involved; a hit is four loads and six stores into a table that
# stays in L2. (A lazily cleaned FIFO of stamps does a hit in two stores but pays for every stale entry
# later; it measured 2x slower here.)
PREV, NEXT, SLOT = 0, 1, 2
NOT_RESIDENT = np.uint32(0xFFFFFFFF)  # node[key, SLOT] of a key that holds no slot


def lru_state(n_keys: int, capacity: np.ndarray) -> dict:
    """Empty LRU state for pools of the given slot capacities (numpy arrays, mutated by the kernels)."""
    capacity = np.asarray(capacity, dtype=np.int64)
    n_pools = len(capacity)
    # Unsigned: numba adds a negative-index wrap-around to every index of a signed type, and this loop
    # indexes with values it has just loaded; uint32 indices measured ~10 % faster.
    node = np.full((n_keys + n_pools, 4), NOT_RESIDENT, np.uint32)
    sentinels = np.arange(n_keys, n_keys + n_pools, dtype=np.int32)
    node[n_keys:, PREV] = sentinels
    node[n_keys:, NEXT] = sentinels
    return {
        "node": node,
        "capacity": capacity.copy(),
        "count": np.zeros(n_pools, np.int64),
        # a pool fills at most one slot per key: a larger capacity needs no more columns
        "key_of_slot": np.full((n_pools, max(min(int(capacity.max(initial=0)), n_keys), 1)), -1, np.int32),
    }


# The access loop is written out once, here, with no function call inside it, not even a rarely taken
# one: a call that takes arrays makes numba reference-count them and keeps LLVM from holding anything in
# registers across it, which measured 5x slower. Whole traces and single engine steps both come here.
@njit(cache=True)
def lru_run(experts, phase, layer_ids, pool_of_layer, n_experts, prefill_mode,
            node, capacity, count, key_of_slot, counts, outcome_out, slot_out, victim_out):
    """Access every expert of experts[rows, j, k] (65535 = missing cell) in order; column j is model
    layer layer_ids[j]. Decode rows evict, prefill rows use prefill_mode. Adds to
    counts[layer, phase, outcome]; when outcome_out is not empty, also writes per access the outcome,
    the slot used (-1 for a direct load) and the evicted key (-1 if none)."""
    record = outcome_out.shape[0] > 0
    n_keys = node.shape[0] - capacity.shape[0]
    rows, columns, top_k = experts.shape
    i = 0
    for r in range(rows):
        ph = phase[r]
        mode = prefill_mode if ph == 0 else MODE_EVICT
        for column in range(columns):
            if experts[r, column, 0] == 0xFFFF:
                continue
            layer = layer_ids[column]
            pool = pool_of_layer[layer]
            head = np.uint32(n_keys + pool)
            base = np.uint32(layer * n_experts)
            hits = 0
            inserts = 0
            evictions = 0
            for j in range(top_k):
                key = base + np.uint32(experts[r, column, j])
                s = node[key, SLOT]
                victim = -1
                if s != NOT_RESIDENT:
                    before = node[key, PREV]
                    after = node[key, NEXT]
                    node[before, NEXT] = after
                    node[after, PREV] = before
                    hits += 1
                    outcome = HIT
                elif count[pool] < capacity[pool]:
                    s = np.uint32(count[pool])
                    count[pool] += 1
                    node[key, SLOT] = s
                    key_of_slot[pool, s] = key
                    inserts += 1
                    outcome = INSERT
                elif mode == MODE_APPEND or capacity[pool] == 0:
                    outcome = DIRECT
                else:
                    old = node[head, PREV]
                    before = node[old, PREV]
                    node[before, NEXT] = head
                    node[head, PREV] = before
                    s = node[old, SLOT]
                    node[old, SLOT] = NOT_RESIDENT
                    node[key, SLOT] = s
                    key_of_slot[pool, s] = key
                    victim = np.int64(old)
                    evictions += 1
                    outcome = EVICT
                if outcome != DIRECT:
                    first = node[head, NEXT]
                    node[key, NEXT] = first
                    node[first, PREV] = key
                    node[head, NEXT] = key
                    node[key, PREV] = head
                if record:
                    outcome_out[i] = outcome
                    slot_out[i] = -1 if outcome == DIRECT else np.int32(s)
                    victim_out[i] = victim
                    i += 1
            counts[layer, ph, HIT] += hits
            counts[layer, ph, INSERT] += inserts
            counts[layer, ph, EVICT] += evictions
            counts[layer, ph, DIRECT] += top_k - hits - inserts - evictions


@njit(cache=True)
def lru_flush_pool(pool, node, capacity, count, key_of_slot):
    """Release every slot of a pool (ds4's release_all / a slab rebuilt for another size)."""
    for s in range(count[pool]):
        k = key_of_slot[pool, s]
        node[k, SLOT] = NOT_RESIDENT
        key_of_slot[pool, s] = -1
    count[pool] = 0
    head = node.shape[0] - capacity.shape[0] + pool
    node[head, PREV] = np.uint32(head)
    node[head, NEXT] = np.uint32(head)


@njit(cache=True)
def slab_replay(experts, phase, class_of_layer, capacity_of_class, n_experts, prefill_mode,
                node, capacity, count, key_of_slot, counts, size_changes):
    """ds4 before #504: one slab (pool 0) built for the last-seen expert size.

    An access of another size class releases the whole slab and rebuilds it with that class's
    capacity, so a mixed-quant model flushes at every q2<->q4 layer transition.
    """
    rows, layers, top_k = experts.shape
    pool_zero = np.zeros(layers, np.int64)
    layer_ids = np.arange(layers)
    no_record = np.empty(0, np.int8)
    no_slots = np.empty(0, np.int32)
    no_victims = np.empty(0, np.int64)
    current = -1
    for r in range(rows):
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
                lru_flush_pool(0, node, capacity, count, key_of_slot)
                capacity[0] = capacity_of_class[c]
                current = c
            lru_run(experts[r:r + 1, start:stop], phase[r:r + 1], layer_ids[start:stop], pool_zero, n_experts,
                    prefill_mode, node, capacity, count, key_of_slot, counts, no_record, no_slots, no_victims)
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
    n_keys = layers * n_experts
    max_cap = max(1, min(capacity.max(), n_keys))  # a pool fills at most one slot per key
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


# --- counts ----------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def key_counts(experts, n_experts, counts):
    """Add each (layer, expert) key's accesses in a [rows, layers, k] block to counts[layer * n_experts +
    expert] (missing cells skipped): one pass over the uint16 ids, no int64 key array."""
    rows, layers, top_k = experts.shape
    for r in range(rows):
        for layer in range(layers):
            base = layer * n_experts
            for j in range(top_k):
                e = experts[r, layer, j]
                if e != 0xFFFF:
                    counts[base + e] += 1


@njit(cache=True, nogil=True)
def last_access_cells(experts, n_experts, seen):
    """(rows, layers) int64, ascending: the (row, layer) cells that hold some key's last access in a
    [rows, layers, k] block (missing cells never), counting keys already `seen` (bool per key, updated) as
    accessed after the block: a prompt's blocks passed last first give its cells block by block. One backward
    pass, the cells written from the end: a cell holds at least one key's last access, so there are at most
    layers x n_experts of them and the memory is per key, not per token (a bool per cell was 43 MB of a
    million-token prompt's 43 layers)."""
    rows, layers, top_k = experts.shape
    cap = min(rows * layers, layers * n_experts)
    out_row = np.empty(cap, np.int64)
    out_layer = np.empty(cap, np.int64)
    at = cap
    for r in range(rows - 1, -1, -1):
        for layer in range(layers - 1, -1, -1):
            if experts[r, layer, 0] == 0xFFFF:
                continue
            base = layer * n_experts
            kept = False
            for j in range(top_k):
                key = base + experts[r, layer, j]
                if not seen[key]:
                    seen[key] = True
                    kept = True
            if kept:
                at -= 1
                out_row[at] = r
                out_layer[at] = layer
    return out_row[at:].copy(), out_layer[at:].copy()


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
    n_keys = layers * n_experts
    max_cap = max(1, min(capacity.max(), n_keys))  # a pool holds at most one entry per key
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


# --- the OS page cache of the model files: byte capacity, an inactive and an active list ----------------
# Key ids are nodes of two circular doubly linked lists with a sentinel each (INACTIVE = n_keys, ACTIVE =
# n_keys + 1). Keys have sizes in bytes; both lists together hold at most `capacity` bytes. A miss enters the
# inactive list, a hit there (a second reference) moves the key to the active list; room is made from the
# inactive list's tail, and the active list's tail is moved to the inactive list's head while the inactive
# list holds less than `inactive_share` of the bytes, as a kernel's page-out keeps its inactive target. With
# inactive_share = 1 every key is demoted as soon as it is promoted, so the inactive list is one LRU list.
# The page cache evicts file pages, not experts, but the engines read an expert's bytes together, so an
# expert's file extent is the unit here. state = [inactive bytes, active bytes, capacity];
# where[key] = 0 (not cached), 1 (inactive), 2 (active).

@njit(cache=True)
def _unlink(prev, nxt, key):
    p = prev[key]
    n = nxt[key]
    nxt[p] = n
    prev[n] = p


@njit(cache=True)
def _push_head(prev, nxt, sentinel, key):
    first = nxt[sentinel]
    nxt[sentinel] = key
    prev[key] = sentinel
    nxt[key] = first
    prev[first] = key


@njit(cache=True)
def _balance(prev, nxt, where, sizes, state, inactive_share):
    active = prev.shape[0] - 1
    inactive = active - 1
    while state[1] > 0 and state[0] < inactive_share * (state[0] + state[1]):
        victim = prev[active]
        _unlink(prev, nxt, victim)
        _push_head(prev, nxt, inactive, victim)
        where[victim] = 1
        state[1] -= sizes[victim]
        state[0] += sizes[victim]


@njit(cache=True)
def _evict_to(prev, nxt, where, sizes, state, limit):
    """Evict tails, the inactive list's first, until the lists hold at most `limit` bytes."""
    active = prev.shape[0] - 1
    inactive = active - 1
    while state[0] + state[1] > limit:
        victim = prev[inactive]
        code = 1
        if victim == inactive:
            victim = prev[active]
            code = 2
            if victim == active:
                break
        _unlink(prev, nxt, victim)
        where[victim] = 0
        state[code - 1] -= sizes[victim]


@njit(cache=True)
def _page_cache_access_one(key, sizes, insert, prev, nxt, where, state, inactive_share):
    """One read of `key`: an active hit moves to the active head; an inactive hit is promoted to the active
    head; a miss is inserted at the inactive head when `insert` (a key larger than the capacity is not kept).
    Whether it was a hit."""
    active = prev.shape[0] - 1
    inactive = active - 1
    code = where[key]
    if code == 2:
        _unlink(prev, nxt, key)
        _push_head(prev, nxt, active, key)
        return True
    if code == 1:
        _unlink(prev, nxt, key)
        _push_head(prev, nxt, active, key)
        where[key] = 2
        state[0] -= sizes[key]
        state[1] += sizes[key]
    else:
        if not insert or sizes[key] > state[2]:
            return False
        _evict_to(prev, nxt, where, sizes, state, state[2] - sizes[key])
        _push_head(prev, nxt, inactive, key)
        where[key] = 1
        state[0] += sizes[key]
    _balance(prev, nxt, where, sizes, state, inactive_share)
    return code == 1


@njit(cache=True)
def page_cache_access(keys, sizes, insert, prev, nxt, where, state, inactive_share, hit_out):
    """Each key read in order (_page_cache_access_one); writes hit_out[i]."""
    for i in range(keys.shape[0]):
        hit_out[i] = _page_cache_access_one(keys[i], sizes, insert, prev, nxt, where, state, inactive_share)


@njit(cache=True)
def page_cache_read(first, offsets, sizes, prev, nxt, where, state, inactive_share, drop):
    """The keys first + offsets[i] read in order, misses inserted (_page_cache_access_one), and then, when
    `drop`, dropped (page_cache_drop). Returns how many were hits."""
    hits = 0
    for i in range(offsets.shape[0]):
        if _page_cache_access_one(first + np.int64(offsets[i]), sizes, True, prev, nxt, where, state,
                                  inactive_share):
            hits += 1
    if drop:
        page_cache_drop(first, offsets, prev, nxt, where, sizes, state)
    return hits


@njit(cache=True)
def page_cache_shrink(prev, nxt, where, sizes, state, inactive_share):
    """Evict until the lists fit the capacity (after it was lowered)."""
    _evict_to(prev, nxt, where, sizes, state, state[2])
    _balance(prev, nxt, where, sizes, state, inactive_share)


@njit(cache=True)
def page_cache_drop(first, offsets, prev, nxt, where, sizes, state):
    """Drop the keys first + offsets[i] (posix_fadvise DONTNEED after a read)."""
    for i in range(offsets.shape[0]):
        key = first + np.int64(offsets[i])
        if where[key]:
            _unlink(prev, nxt, key)
            state[where[key] - 1] -= sizes[key]
            where[key] = 0
