"""Expert caches as a library: pools and capacities, a stateful LRU for engine models, whole-trace replay.

A cache is (policy, scope, capacity per pool, prefill mode):
- policy: lru, lfu, opt (Belady MIN with bypass, the bound), static (filled once from a profile ranking,
  never evicts: Strata's fill) or ds4-slab (ds4 before #504: one LRU slab for the last-seen expert size).
- scope: one pool per layer, per size class (ds4 after #504: up to 4 classes keyed by (gate, down) bytes,
  each its own global LRU) or one global pool.
- prefill mode: evict, or append (ds4's prefill after #504: hit, append while a slot is free, else load
  directly without evicting). Decode always evicts.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from sim.cache import kernels
from sim.cache.kernels import DIRECT, EVICT, HIT, INSERT, MODE_APPEND, MODE_EVICT
from sim.trace.mrc import stack_distance_histograms
from sim.errors import InputError, require_regular_file
from sim.trace.format import MISSING, PHASE_DECODE, PHASE_NAMES, Trace
from sim.trace.rowfile import row_blocks

POLICIES = ("lru", "lfu", "opt", "static", "ds4-slab")
SCOPES = ("layer", "class", "global")
PREFILL_MODES = {"evict": MODE_EVICT, "append": MODE_APPEND}


@dataclass(frozen=True)
class Geometry:
    """What a cache needs to know of the model: per trace layer its expert bytes and size class."""

    n_layers: int
    n_experts: int
    expert_bytes: np.ndarray  # int64 [n_layers]
    class_of_layer: np.ndarray  # int16 [n_layers], first-touch order
    class_bytes: np.ndarray  # int64 [n_classes]
    model: str = ""

    @property
    def n_classes(self) -> int:
        return len(self.class_bytes)

    @classmethod
    def of(cls, trace: Trace, layout=None, where: str = "trace") -> "Geometry":
        """Geometry of a trace's layers from a ModelLayout (trace layer i = layout.layers[i])."""
        h = trace.header
        if layout is None:
            ones = np.ones(h.n_layers, np.int64)
            return cls(h.n_layers, h.n_experts, ones, np.zeros(h.n_layers, np.int16), ones[:1], h.model)
        if layout.n_experts != h.n_experts:
            raise InputError(where, "n_experts", h.n_experts, f"model {layout.name} has {layout.n_experts}")
        if h.n_layers not in (layout.n_routed_layers, len(layout.layers)):
            raise InputError(where, "n_layers", h.n_layers,
                             f"model {layout.name} has {layout.n_routed_layers} routed layers "
                             f"(+{len(layout.layers) - layout.n_routed_layers} MTP)")
        return cls.of_layout(layout, h.n_layers)

    @classmethod
    def of_layout(cls, layout, n_layers: int) -> "Geometry":
        """Geometry of a model's first n_layers layers (routed, then MTP), no trace needed."""
        layer_bytes = layout.expert_bytes_per_layer()[:n_layers].astype(np.int64)
        keys = [(layer.gate_bytes, layer.down_bytes) for layer in layout.layers[:n_layers]]
        order: dict = {}
        for key in keys:
            order.setdefault(key, len(order))
        class_of_layer = np.array([order[k] for k in keys], np.int16)
        class_bytes = np.zeros(len(order), np.int64)
        class_bytes[class_of_layer] = layer_bytes
        return cls(n_layers, layout.n_experts, layer_bytes, class_of_layer, class_bytes, layout.name)

    def pools(self, scope: str) -> np.ndarray:
        if scope == "layer":
            return np.arange(self.n_layers, dtype=np.int64)
        if scope == "class":
            return self.class_of_layer.astype(np.int64)
        if scope == "global":
            return np.zeros(self.n_layers, np.int64)
        raise InputError("cache", "scope", scope, f"choose one of {', '.join(SCOPES)}")

    def keys_per_pool(self, scope: str) -> np.ndarray:
        return np.bincount(self.pools(scope), minlength=1).astype(np.int64) * self.n_experts


# The kernels number slots with uint32 (kernels.NOT_RESIDENT is the largest); a pool never holds more experts than
# it has keys, so a larger count changes nothing but would not fit them.
MAX_SLOTS = 2**31 - 1


def parse_slots(text: str | int | list, n: int, field_name: str) -> np.ndarray:
    """One count for every pool, or exactly n comma-separated counts."""
    if isinstance(text, (int, np.integer)):
        values = [int(text)]
    elif isinstance(text, list):
        values = [int(v) for v in text]
    else:
        try:
            values = [int(v) for v in str(text).split(",")]
        except ValueError:
            raise InputError("cache", field_name, text, "expected an integer or a comma-separated list") from None
    if len(values) == 1:
        values = values * n
    if len(values) != n:
        raise InputError("cache", field_name, text, f"expected 1 or {n} values")
    if min(values) < 0 or max(values) > MAX_SLOTS:
        raise InputError("cache", field_name, text, f"slot counts must be 0 to {MAX_SLOTS:,}")
    return np.array(values, np.int64)


def capacity_pools(geometry: Geometry, policy: str, scope: str) -> tuple[str, np.ndarray]:
    """The scope `policy` runs at and, per capacity it takes, the keys that capacity can hold: ds4-slab is one
    global slab rebuilt for each size class, so it takes one capacity per class."""
    if policy == "ds4-slab":
        return "global", geometry.keys_per_pool("class")
    return scope, geometry.keys_per_pool(scope)


def mrc_exact(policy: str, prefill_mode: str) -> bool:
    """Whether `lru_mrc` gives this cache's hits. Only an LRU whose every miss evicts is a stack algorithm (a
    bigger cache always holds what a smaller one holds); append mode keeps its first residents."""
    return policy == "lru" and prefill_mode == "evict"


class LRUCache:
    """LRU pools whose state persists across calls: what an engine model drives step by step."""

    def __init__(self, n_layers: int, n_experts: int, capacity: np.ndarray):
        self.n_experts = n_experts
        self.n_keys = n_layers * n_experts
        self.state = kernels.lru_state(n_layers * n_experts, capacity)
        self._capacity_view = self.state["capacity"].view()
        self._capacity_view.flags.writeable = False
        # access()'s arguments to the kernel that it never reads back, made once: an engine calls it for every
        # layer step, and seven small arrays a call were a tenth of a ds4 slab run
        self._step_layer = np.zeros(1, np.int64)
        self._step_pools = np.zeros(n_layers, np.int64)  # only the step's layer entry is read
        self._step_counts = np.zeros((n_layers, 2, 4), np.int64)  # the kernel adds to it; access() returns outcomes
        self._step_phase = (np.ones(1, np.uint8), np.zeros(1, np.uint8))  # [mode == MODE_APPEND]: a prompt's phase

    @property
    def capacity(self) -> np.ndarray:
        """Slots per pool (read-only view: change it with resize(), which writes the state's array in place)."""
        return self._capacity_view

    def resize(self, pool: int, slots: int) -> None:
        """Give an empty pool a new slot count (an engine (re)allocating a cache of another size)."""
        s = self.state
        if s["count"][pool]:
            raise ValueError(f"pool {pool} holds {s['count'][pool]} experts: flush it before resizing")
        columns = min(slots, self.n_keys)  # a pool fills at most one slot per key
        if columns > s["key_of_slot"].shape[1]:
            grown = np.full((len(s["capacity"]), columns), -1, np.int32)
            grown[:, : s["key_of_slot"].shape[1]] = s["key_of_slot"]
            s["key_of_slot"] = grown
        s["capacity"][pool] = slots

    def count(self, pool: int) -> int:
        return int(self.state["count"][pool])

    def access(self, layer: int, experts: np.ndarray, pool: int, mode: int = MODE_EVICT):
        """One layer step: access these experts of `layer` in order, in `pool`.

        Returns (outcome, slot, evicted key or -1) per expert; keys are layer * n_experts + expert."""
        experts = np.ascontiguousarray(experts, np.uint16).reshape(1, 1, -1)
        n = experts.shape[2]
        outcome = np.empty(n, np.int8)
        slot = np.empty(n, np.int32)
        victim = np.empty(n, np.int64)
        self._step_layer[0] = layer
        self._step_pools[layer] = pool
        kernels.lru_run(experts, self._step_phase[mode == MODE_APPEND], self._step_layer, self._step_pools,
                        self.n_experts, mode, *self._arrays(), self._step_counts, outcome, slot, victim)
        return outcome, slot, victim

    def access_steps(self, layers: np.ndarray, experts: np.ndarray, pool_of_layer: np.ndarray,
                     mode: int = MODE_EVICT) -> tuple[np.ndarray, np.ndarray]:
        """Several layer steps in one kernel call, in order: step i accesses experts[i] of layers[i] in pool
        pool_of_layer[layers[i]], as `access` would one step after another (an engine whose pools stay as they
        are for those steps). Returns the outcome per access [steps, k] and per step the count of each outcome
        [steps, 4] (HIT, INSERT, EVICT, DIRECT)."""
        experts = np.ascontiguousarray(experts, np.uint16)
        n_steps, k = experts.shape
        outcome = np.empty(n_steps * k, np.int8)
        slot = np.empty(n_steps * k, np.int32)
        victim = np.empty(n_steps * k, np.int64)
        counts = np.zeros((len(pool_of_layer), 2, 4), np.int64)
        phase = np.full(1, 0 if mode == MODE_APPEND else 1, np.uint8)
        kernels.lru_run(experts.reshape(1, n_steps, k), phase, np.ascontiguousarray(layers, np.int64),
                        np.ascontiguousarray(pool_of_layer, np.int64), self.n_experts, mode, *self._arrays(),
                        counts, outcome, slot, victim)
        outcome = outcome.reshape(n_steps, k)
        return outcome, (outcome[:, :, None] == np.arange(4, dtype=np.int8)).sum(axis=1)

    def _arrays(self) -> tuple:
        s = self.state
        return s["node"], s["capacity"], s["count"], s["key_of_slot"]

    def flush(self, pool: int) -> None:
        kernels.lru_flush_pool(pool, *self._arrays())

    def resident(self) -> np.ndarray:
        return self.state["node"][: self.n_keys, kernels.SLOT] != kernels.NOT_RESIDENT


def read_profile(path: str | Path, geometry: Geometry) -> np.ndarray:
    """A ranked (layer, expert) list, CSV with columns rank, layer, expert (ds4's hotlist order)."""
    where = str(path)
    require_regular_file(where, where, "a profile (CSV) file")
    try:
        frame = pd.read_csv(where)
    except FileNotFoundError:
        raise InputError(where, "path", where, "no such file") from None
    except OSError as exc:
        raise InputError(where, "path", where, f"cannot read: {exc.strerror or exc}") from None
    except (ValueError, csv.Error, UnicodeDecodeError) as exc:
        raise InputError(where, "csv", type(exc).__name__, f"unreadable profile: {exc}") from None
    for column in ("layer", "expert"):
        if column not in frame.columns:
            raise InputError(where, "columns", list(frame.columns), f"missing column {column!r}")
        if not pd.api.types.is_integer_dtype(frame[column]):
            raise InputError(where, column, str(frame[column].dtype), "must be integers")
    if "rank" in frame.columns:
        frame = frame.sort_values("rank", kind="stable")
    layer, expert = frame["layer"].to_numpy(np.int64), frame["expert"].to_numpy(np.int64)
    bad = (layer < 0) | (layer >= geometry.n_layers) | (expert < 0) | (expert >= geometry.n_experts)
    if bad.any():
        i = int(np.argmax(bad))
        raise InputError(where, f"row {i + 2}", f"layer {layer[i]}, expert {expert[i]}",
                         f"outside {geometry.n_layers} layers x {geometry.n_experts} experts")
    return layer * geometry.n_experts + expert


def trace_profile(trace: Trace) -> np.ndarray:
    """Keys ranked by how often the trace uses them (an oracle profile: the trace profiles itself)."""
    h = trace.header
    experts = trace.experts.reshape(trace.n_rows, h.n_layers, h.top_k)
    present = experts != MISSING
    keys = (np.arange(h.n_layers, dtype=np.int64)[None, :, None] * h.n_experts + experts)[present]
    freq = np.bincount(keys, minlength=h.n_layers * h.n_experts)
    return np.argsort(-freq, kind="stable")[: int((freq > 0).sum())]


def static_resident(ranking: np.ndarray, geometry: Geometry, scope: str, capacity: np.ndarray) -> np.ndarray:
    """Fill each pool with its best-ranked keys until its capacity is reached."""
    pools = geometry.pools(scope)[ranking // geometry.n_experts]
    resident = np.zeros(geometry.n_layers * geometry.n_experts, np.bool_)
    filled = np.zeros(len(capacity), np.int64)
    for key, pool in zip(ranking.tolist(), pools.tolist()):  # ≤ n_keys once per replay, not per access
        if filled[pool] < capacity[pool]:
            resident[key] = True
            filled[pool] += 1
    return resident


@dataclass
class ReplayResult:
    """Counts per (layer, phase, outcome) with the geometry to turn them into bytes and classes."""

    policy: str
    scope: str
    prefill_mode: str
    capacity: np.ndarray
    geometry: Geometry
    counts: np.ndarray  # int64 [layers, 2, 4]
    trace_sha256: str
    extra: dict = field(default_factory=dict)

    def _rows(self, counts: np.ndarray, expert_bytes: np.ndarray) -> dict:
        lookups = counts.sum(axis=-1)
        loads = counts[..., INSERT] + counts[..., EVICT] + counts[..., DIRECT]
        with np.errstate(invalid="ignore", divide="ignore"):
            hit_rate = np.where(lookups > 0, counts[..., HIT] / np.maximum(lookups, 1), np.nan)
        return {
            "lookups": lookups,
            "hits": counts[..., HIT],
            "misses": loads,
            "direct_loads": counts[..., DIRECT],
            "evictions": counts[..., EVICT],
            "hit_rate": hit_rate,
            "hit_bytes": counts[..., HIT] * expert_bytes,
            "load_bytes": loads * expert_bytes,
        }

    def per_layer(self) -> pd.DataFrame:
        c = self.counts.sum(axis=1)
        frame = pd.DataFrame(self._rows(c, self.geometry.expert_bytes))
        frame.insert(0, "class", self.geometry.class_of_layer.astype(int))
        frame.insert(0, "layer", np.arange(len(c)))
        return frame

    def per_phase(self) -> pd.DataFrame:
        c = self.counts
        by_phase = np.stack([c[:, p].sum(axis=0) for p in range(2)])
        bytes_by_phase = np.stack([(c[:, p] * self.geometry.expert_bytes[:, None]).sum(axis=0) for p in range(2)])
        rows = self._rows(by_phase, np.ones(2, np.int64))
        loads = bytes_by_phase[:, INSERT] + bytes_by_phase[:, EVICT] + bytes_by_phase[:, DIRECT]
        rows["hit_bytes"], rows["load_bytes"] = bytes_by_phase[:, HIT], loads
        frame = pd.DataFrame(rows)
        frame.insert(0, "phase", list(PHASE_NAMES))
        return frame

    def per_class(self) -> pd.DataFrame:
        g = self.geometry
        by_class = np.zeros((g.n_classes, 4), np.int64)
        np.add.at(by_class, g.class_of_layer.astype(np.int64), self.counts.sum(axis=1))
        frame = pd.DataFrame(self._rows(by_class, g.class_bytes))
        frame.insert(0, "expert_bytes", g.class_bytes)
        frame.insert(0, "class", np.arange(g.n_classes))
        return frame

    def summary(self) -> dict:
        total = self._rows(self.counts.sum(axis=(0, 1)), np.ones(1, np.int64))
        g = self.geometry
        load_bytes = int(((self.counts[..., INSERT] + self.counts[..., EVICT] + self.counts[..., DIRECT])
                          * g.expert_bytes[:, None]).sum())
        return {
            "policy": self.policy,
            "scope": self.scope,
            "prefill_mode": self.prefill_mode,
            "capacity_slots": self.capacity.tolist(),
            "model": g.model,
            "lookups": int(total["lookups"]),
            "hits": int(total["hits"]),
            "misses": int(total["misses"]),
            "direct_loads": int(total["direct_loads"]),
            "evictions": int(total["evictions"]),
            "hit_rate": float(total["hit_rate"]),
            "load_bytes": load_bytes,
            "trace_sha256": self.trace_sha256,
            **self.extra,
        }


def replay(trace: Trace, geometry: Geometry, policy: str, scope: str, capacity: np.ndarray,
           prefill_mode: str = "evict", ranking: np.ndarray | None = None) -> ReplayResult:
    """Replay a whole trace through one cache; decode rows always evict."""
    if policy not in POLICIES:
        raise InputError("cache", "policy", policy, f"choose one of {', '.join(POLICIES)}")
    if prefill_mode not in PREFILL_MODES:
        raise InputError("cache", "prefill_mode", prefill_mode, f"choose one of {', '.join(PREFILL_MODES)}")
    if policy == "opt" and prefill_mode != "evict":
        raise InputError("cache", "prefill_mode", prefill_mode, "OPT is the bound of an evicting cache")
    if policy == "ds4-slab":
        scope = "global"
    pool_of_layer = geometry.pools(scope)
    n_pools = int(pool_of_layer.max()) + 1
    capacity = np.asarray(capacity, np.int64)
    if policy != "ds4-slab" and len(capacity) != n_pools:
        raise InputError("cache", "capacity", capacity.tolist(), f"scope {scope} has {n_pools} pools")
    # Slots beyond the experts a pool can ever hold stay empty, so the kernels get at most that many: the same
    # hits and misses, and a count typed as 999999999999 does not ask for terabytes of cache arrays.
    most = geometry.keys_per_pool("global" if policy == "ds4-slab" else scope)
    usable = np.minimum(capacity, np.resize(most, len(capacity)))
    mode = PREFILL_MODES[prefill_mode]
    counts = np.zeros((geometry.n_layers, 2, 4), np.int64)
    experts, phase = trace.experts, trace.phase
    extra: dict = {}
    if policy == "lru":
        cache = LRUCache(geometry.n_layers, geometry.n_experts, usable)
        none = np.empty(0, np.int8)
        kernels.lru_run(experts, phase, np.arange(geometry.n_layers), pool_of_layer, geometry.n_experts, mode,
                        *cache._arrays(), counts, none, none.astype(np.int32), none.astype(np.int64))
    elif policy == "ds4-slab":
        # The slab's capacity is rebuilt per size class: one count per class (or one for all).
        per_class = capacity if len(capacity) == geometry.n_classes else np.repeat(capacity[:1], geometry.n_classes)
        per_class_usable = np.minimum(per_class, most[0])
        cache = LRUCache(geometry.n_layers, geometry.n_experts, np.array([per_class_usable.max()]))
        changes = np.zeros(1, np.int64)
        kernels.slab_replay(experts, phase, geometry.class_of_layer.astype(np.int64), per_class_usable,
                            geometry.n_experts, mode, *cache._arrays(), counts, changes)
        extra["size_changes"] = int(changes[0])
        capacity = per_class
    elif policy == "lfu":
        kernels.lfu_replay(experts, phase, pool_of_layer, geometry.n_experts, mode, usable, counts)
    elif policy == "opt":
        nxt = kernels.next_use(experts, geometry.n_experts)
        kernels.opt_replay(experts, phase, pool_of_layer, geometry.n_experts, usable, nxt, True, counts)
    else:
        extra["profile"] = "trace (oracle)" if ranking is None else "file"
        ranking = trace_profile(trace) if ranking is None else ranking
        kernels.static_replay(experts, phase, static_resident(ranking, geometry, scope, usable),
                              geometry.n_experts, counts)
    return ReplayResult(policy, scope, prefill_mode, capacity, geometry, counts, trace.sha256(), extra)


@dataclass
class MissRatioCurve:
    """LRU hits of every capacity from one pass: hist[group, phase, d] accesses at stack distance d.

    A group is a layer (per-layer scope) or a size class (class and global scopes): small enough to stay
    in cache while the pass runs, fine enough for per-class curves."""

    scope: str
    geometry: Geometry
    hist: np.ndarray
    cold: np.ndarray

    def hits(self, capacity: int) -> int:
        """Hits of an evicting LRU with `capacity` slots in every pool."""
        return int(self.hist[..., 1: capacity + 1].sum())

    def group_hits(self, capacity: int) -> np.ndarray:
        """int64 [group, phase]: hits of an evicting LRU with `capacity` slots in every pool."""
        return self.hist[..., 1: capacity + 1].sum(axis=-1)

    def group_lookups(self) -> np.ndarray:
        """int64 [group, phase]: every access, a re-use (at some distance) or a first one."""
        return self.hist.sum(axis=-1) + self.cold

    def group_bytes(self) -> np.ndarray:
        """int64 [group]: the expert bytes of each group's layers (a size class shares one size)."""
        return self.geometry.expert_bytes if self.scope == "layer" else self.geometry.class_bytes

    def curve(self) -> pd.DataFrame:
        """Per size class: hits, misses and miss ratio for every capacity 0..keys in the pool, in slots
        and in bytes (capacity slots x the class's expert bytes)."""
        g = self.geometry
        frames = []
        keys = g.keys_per_pool(self.scope)
        pools = g.pools(self.scope)
        for c in range(g.n_classes):
            layers = np.flatnonzero(g.class_of_layer == c)
            groups = layers if self.scope == "layer" else [c]
            hist = self.hist[groups].sum(axis=(0, 1))
            lookups = int(hist.sum() + self.cold[groups].sum())
            max_slots = int(keys[np.unique(pools[layers])].max())
            hits = np.concatenate([[0], np.cumsum(hist[1: max_slots + 1])])
            slots = np.arange(max_slots + 1)
            misses = lookups - hits
            frames.append(pd.DataFrame({
                "class": c,
                "slots": slots,
                "bytes": slots * (int(g.class_bytes[c]) * (1 if self.scope != "layer" else len(layers))),
                "hits": hits,
                "misses": misses,
                "miss_ratio": misses / max(lookups, 1),
                "miss_bytes": misses * int(g.class_bytes[c]),
            }))
        return pd.concat(frames, ignore_index=True)


def lru_mrc(trace: Trace, geometry: Geometry, scope: str) -> MissRatioCurve:
    """Exact LRU miss-ratio curves of an evicting cache, per pool, in one pass over the trace."""
    pool_of_layer = geometry.pools(scope)
    keys_per_pool = geometry.keys_per_pool(scope)
    group_of_layer = np.arange(geometry.n_layers) if scope == "layer" else geometry.class_of_layer.astype(np.int64)
    n_groups = int(group_of_layer.max()) + 1
    hist = np.zeros((n_groups, 2, int(keys_per_pool.max()) + 1), np.int64)
    cold = np.zeros((n_groups, 2), np.int64)
    stack_distance_histograms(trace.experts, trace.phase, pool_of_layer, group_of_layer, keys_per_pool,
                              geometry.n_experts, hist, cold)
    return MissRatioCurve(scope, geometry, hist, cold)


def last_access_rows(prompt: np.ndarray, n_experts: int) -> np.ndarray:
    """The prompt reduced to the cells that hold some key's last prompt access: uint16 [rows, layers, k], the
    rows that hold one, in order, every other cell missing. What follows the prompt sees the same thing from
    it either way: an LRU the same recency order of the keys at the first decode token and the same set of
    keys, the Belady bound (decode_bound_hits) the same set of keys touched. It is at most one row per key
    and it is what lets a prompt of a million tokens be bounded in memory of the keys, not of the tokens."""
    cell_rows, cell_layers, cells = last_access_cells_of(prompt, prompt.shape[1], n_experts)
    rows, row_of_cell = np.unique(cell_rows, return_inverse=True)
    reduced = np.full((len(rows), *prompt.shape[1:]), MISSING, prompt.dtype)
    reduced[row_of_cell, cell_layers] = cells
    return reduced


def last_access_cells_of(prompt, n_layers: int, n_experts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The cells of the prompt's first n_layers layers that hold some key's last access (kernels.last_access_cells):
    their rows and layers, ascending, and their expert ids [cells, k]. A prompt kept in a file (FileRows) is read
    a block at a time, last block first."""
    seen = np.zeros(n_layers * n_experts, np.bool_)
    found = []
    for first, block in row_blocks(prompt, reverse=True):
        block = block[:, :n_layers]
        rows, layers = kernels.last_access_cells(block, n_experts, seen)
        found.append((rows + first, layers, block[rows, layers]))
    if not found:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, prompt.shape[2]), prompt.dtype)
    return tuple(np.concatenate(part[::-1]) for part in zip(*found))


def decode_bound_hits(trace, geometry, capacity: np.ndarray) -> np.ndarray:
    """int64 [class]: the most decode hits any cache of `capacity` slots per class can get on this routing
    (the prompt's rows first, then the decode rows), i.e. the Belady bound of the decode hit rate.

    Such a cache can only hold keys it has been asked for (a miss loads, or bypasses), so at the first decode
    token it holds at most `capacity` keys the prompt touched; from there MIN (evict the key used last, bypass a
    newcomer used later than every resident) maximises the decode hits. The prompt's hits are worth nothing, so
    the best state at the first decode token keeps the prompt keys whose first decode use comes soonest. The OPT
    kernel does both in one pass when each prompt access is given the key's first decode use as its next use:
    it then keeps those keys through the prompt, then runs MIN. (MIN over the whole routing with plain next
    uses maximises prompt + decode hits: it may trade a decode hit for a prompt hit and is then below this
    bound.) Pools: one per size class (geometry.class_of_layer)."""
    experts, n_experts = trace.experts, geometry.n_experts
    nxt = kernels.next_use(experts, n_experts)
    rows, layers = np.nonzero(experts[:, :, 0] != MISSING)  # the kernels' access order: row, layer, k
    keys = (layers[:, None].astype(np.int64) * n_experts + experts[rows, layers]).reshape(-1)
    decode = np.repeat(trace.phase[rows] == PHASE_DECODE, experts.shape[2])
    decode_at = np.flatnonzero(decode)
    used, first = np.unique(keys[decode_at], return_index=True)  # each key's first decode access
    first_decode = np.full(geometry.n_layers * n_experts, kernels.NEVER, np.int64)
    first_decode[used] = decode_at[first]
    prompt_at = np.flatnonzero(~decode)
    nxt[prompt_at] = first_decode[keys[prompt_at]]
    counts = np.zeros((geometry.n_layers, 2, 4), np.int64)
    pool_of_layer = geometry.class_of_layer.astype(np.int64)
    kernels.opt_replay(experts, trace.phase, pool_of_layer, n_experts, np.asarray(capacity, np.int64), nxt, True,
                       counts)
    return np.bincount(pool_of_layer, weights=counts[:, PHASE_DECODE, kernels.HIT],
                       minlength=geometry.n_classes).astype(np.int64)
