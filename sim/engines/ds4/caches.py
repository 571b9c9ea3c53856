"""ds4's expert caches in VRAM during a run: one LRU pool per size class (#504 and later) or one slab (pre-504),
sized, grown and released as the engine does (sizing.prepare_class_cache), and the grow-only compact staging."""

from __future__ import annotations

import numpy as np

from sim.cache.replay import LRUCache
from sim.engines.ds4.geometry import Layers
from sim.engines.ds4.sizing import CacheState, NoticeDedup, prepare_class_cache


class ExpertCaches:
    """The pools' allocations and contents; a host thread pays every cudaMalloc and cudaFree (it waits)."""

    def __init__(self, machine, layers: Layers, per_class: bool, budget_experts: int, reserve_bytes: int,
                 staging_bytes: int, notices: list):
        self.m, self.layers, self.per_class = machine, layers, per_class
        self.budget_experts, self.reserve_bytes, self.notices = budget_experts, reserve_bytes, notices
        n_pools = layers.n_classes if per_class else 1
        self.cache = LRUCache(layers.count, layers.n_experts, np.zeros(n_pools, np.int64))
        self.allocated = [False] * n_pools
        self.flushes = [0] * n_pools  # releases of a pool that held experts (their contents lost)
        self.size_changes = {"prefill": 0, "decode": 0}  # pre-504: slab released for another size class
        self.phase = "prefill"  # what the engine runs now: a slab's size changes are counted per phase
        self.slab_class = -1
        self.dedup = [NoticeDedup() for _ in range(n_pools)]
        self.staging_bytes = staging_bytes
        # the pool of every layer (int64 [layer]): its size class's, or the one slab
        self.pool_of_layers = layers.class_of_layer.astype(np.int64) if per_class else np.zeros(layers.count, np.int64)

    def pool_of(self, layer: int) -> int:
        return int(self.pool_of_layers[layer])

    def steps_as_is(self, classes: list) -> int:
        """How many of these steps (their layers' size classes), from the first, prepare() would leave the caches
        as they are for, without a free, an allocation or a notice: each one's pool allocated for its class and
        either at the budget or, below it, with no room to grow (sizing.prepare_class_cache keeps it). Nothing
        such a step does changes that for the next; the first step that is not as is ends the run (a slab's
        change of size class does)."""
        n = len(classes)
        for cls in set(classes):
            if not self._pool_as_is(cls if self.per_class else 0, cls):
                n = min(n, classes.index(cls))
        return n

    def _pool_as_is(self, pool: int, cls: int) -> bool:
        if not self.allocated[pool] or (not self.per_class and self.slab_class != cls):
            return False
        if self.cache.capacity[pool] >= self.budget_experts:
            return True
        held = self.pool_state(pool)
        out = prepare_class_cache(held, self.layers.class_keys[cls], self.budget_experts, self.m.memory.vram_free(),
                                  self.reserve_bytes)
        return out.state is held

    def _which_class(self, cls: int) -> str:
        """What the engine's line leaves unsaid after #504: which size class's cache it is about (its MiB/expert
        tells it apart only to a reader who knows the classes' sizes)."""
        if not self.per_class or len(self.layers.class_keys) == 1:  # one class: the line is about all of them
            return ""
        n_layers = int((self.layers.class_of_layer == cls).sum())
        return (f" [size class {cls + 1} of {len(self.layers.class_keys)}: {n_layers} of "
                f"{len(self.layers.class_of_layer)} layers; each class's cache is sized on its own]")

    def pool_bytes(self, pool: int) -> int:
        """VRAM of the pool's three slabs (0 when it is not allocated)."""
        if not self.allocated[pool]:
            return 0
        return int(self.cache.capacity[pool]) * self.layers.class_bytes[pool if self.per_class else self.slab_class]

    def cache_bytes(self) -> int:
        return sum(self.pool_bytes(pool) for pool in range(len(self.allocated)))

    def _set_pool_memory(self, pool: int) -> None:
        self.m.memory.set("vram", f"expert cache pool {pool}", self.pool_bytes(pool))

    # A pool's frees and allocations are plans: generators that change the caches' state as the engine does and
    # yield the seconds of each cudaFree and cudaMalloc where the host thread waits for it. `_waits` runs a plan
    # on a thread as a SimPy process; `prepare_at_once` runs one at once for a step done in one compiled call.

    def _free_plan(self, pool: int):
        """cudaFree of one pool's slabs: its cached experts are lost."""
        yield self.m.alloc_seconds(self.pool_bytes(pool), release=True)
        self.flushes[pool] += self.cache.count(pool) > 0
        self.cache.flush(pool)
        self.cache.resize(pool, 0)
        self.allocated[pool] = False
        self._set_pool_memory(pool)

    def release_all(self, thread):
        """cuda_stream_expert_cache_release_all: free every cache (their contents are lost; the thread waits)."""
        yield from _waits(thread, self._release_plan())

    def _release_plan(self):
        for pool, allocated in enumerate(self.allocated):
            if allocated:
                yield from self._free_plan(pool)
        self.slab_class = -1

    def prepare(self, thread, cls: int, target_experts: int | None = None):
        """prepare(): the cache of this size class for a target (default: the budget), through the pure rule
        sizing.prepare_class_cache; the thread pays the frees and allocations. Returns the pool."""
        return (yield from _waits(thread, self._prepare_plan(cls, target_experts)))

    def prepare_at_once(self, cls: int) -> list[float]:
        """`prepare` of the budget done now: the seconds of the waits the thread would pay, in turn (its pool is
        the class's, or the slab)."""
        return list(self._prepare_plan(cls, None))

    def _prepare_plan(self, cls: int, target_experts: int | None):
        target = self.budget_experts if target_experts is None else min(target_experts, self.budget_experts)
        pool = cls if self.per_class else 0
        if not self.per_class and self.slab_class != cls:
            if self.allocated[0]:
                self.size_changes[self.phase] += 1
            self.dedup[0].reset()  # note_size() resets the cap and the notice on a size change
        if self.allocated[pool] and (self.per_class or self.slab_class == cls) and self.cache.capacity[pool] >= target:
            return pool  # the rule's "big enough: as is" answer, taken per layer step without building its inputs
        held = self.pool_state(pool)
        out = prepare_class_cache(held, self.layers.class_keys[cls], target, self.m.memory.vram_free(),
                                  self.reserve_bytes)
        if held is not None and out.state is held:
            return pool
        printed = self.dedup[pool].emit(out.notice)
        if printed is not None:
            self.notices.append(printed + self._which_class(cls))
        if held is not None:  # a size change or growth releases the old allocation and its contents
            yield from self._free_plan(pool)
        capacity = out.state.capacity_experts if out.state is not None else 0
        self.cache.resize(pool, capacity)
        self.allocated[pool] = out.state is not None
        self.slab_class = cls
        if capacity:
            yield self.m.alloc_seconds(capacity * self.layers.class_bytes[cls], release=False)
        self._set_pool_memory(pool)
        return pool

    def pool_state(self, pool: int) -> CacheState | None:
        """The pool's allocation as prepare() sees it: its size key and capacity, None when not allocated."""
        if not self.allocated[pool]:
            return None
        cls = pool if self.per_class else self.slab_class
        return CacheState(self.layers.class_keys[cls], int(self.cache.capacity[pool]))

    def grow_staging(self, thread, n_bytes: int):
        """The grow-only compact staging buffer: on growth cudaFree the old one and cudaMalloc the new one;
        after #504 the caches are sacrificed only when VRAM is really short (begin_compact_load)."""
        if n_bytes <= self.staging_bytes:
            return
        if self.staging_bytes:
            yield thread.hold(self.m.alloc_seconds(self.staging_bytes, release=True))
        if self.per_class and n_bytes - self.staging_bytes > self.m.memory.vram_free():
            yield from self.release_all(thread)
        self.staging_bytes = n_bytes
        self.m.memory.set("vram", "compact staging", n_bytes)
        yield thread.hold(self.m.alloc_seconds(n_bytes, release=False))


def _waits(thread, plan):
    """A plan run on a host thread (a SimPy process): each seconds it yields a wait of the thread's. Returns the
    plan's value."""
    while True:
        try:
            seconds = next(plan)
        except StopIteration as done:
            return done.value
        yield thread.hold(seconds)
