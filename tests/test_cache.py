"""Cache kernels against known answers, reference implementations and libCacheSim."""

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.cache import kernels
from sim.cache.kernels import DIRECT, EVICT, HIT, INSERT, MODE_APPEND
from sim.cache.libcachesim_io import flatten_keys, write_oracle_general
from sim.cache.replay import Geometry, LRUCache, parse_slots, replay, trace_profile
from sim.errors import InputError
from sim.trace.format import MISSING, Trace, TraceHeader


def make_trace(experts, phase=None, n_experts=None) -> Trace:
    experts = np.asarray(experts, np.uint16)
    rows, layers, k = experts.shape
    n_experts = n_experts or int(experts[experts != MISSING].max(initial=0)) + 1
    phase = np.ones(rows) if phase is None else phase
    return Trace(TraceHeader("test", layers, n_experts, k, "hand", ""), np.zeros(rows), np.arange(rows),
                 phase, experts)


def sequence_trace(seq, n_experts=None) -> Trace:
    return make_trace(np.array(seq).reshape(-1, 1, 1), n_experts=n_experts)


def misses(trace, policy, capacity, scope="global", **kw) -> int:
    return replay(trace, Geometry.of(trace), policy, scope, np.atleast_1d(capacity), **kw).summary()["misses"]


# --- known answers --------------------------------------------------------------------------------

ABACB = [0, 1, 0, 2, 1]  # A B A C B


def test_known_answer_lru_and_opt():
    trace = sequence_trace(ABACB)
    assert misses(trace, "lru", 2) == 4
    assert misses(trace, "opt", 2) == 3


def test_known_answer_lfu_static_and_append():
    trace = sequence_trace(ABACB)
    # LFU: A(1) B(1) A->2 C evicts B (freq 1, older than nothing else of freq 1) then B misses again
    assert misses(trace, "lfu", 2) == 4
    # static oracle profile ranks A, B (2 uses each) first: only C misses
    assert misses(trace, "static", 2) == 1
    # append-only prefill: A, B fill the slots, C is a direct load, B hits
    phase = np.zeros(5)
    result = replay(make_trace(np.array(ABACB).reshape(-1, 1, 1), phase), Geometry.of(trace), "lru", "global",
                    np.array([2]), prefill_mode="append").summary()
    assert (result["misses"], result["direct_loads"], result["evictions"]) == (3, 1, 0)


def test_zero_capacity_is_all_direct_loads():
    trace = sequence_trace(ABACB)
    for policy in ("lru", "lfu", "opt", "static"):
        s = replay(trace, Geometry.of(trace), policy, "global", np.array([0])).summary()
        assert s["hits"] == 0 and s["direct_loads"] == 5, policy


def test_missing_cells_are_skipped():
    experts = np.array([[[0, 1]], [[MISSING, MISSING]], [[0, 1]]])
    s = replay(make_trace(experts, n_experts=2), Geometry.of(make_trace(experts, n_experts=2)), "lru",
               "global", np.array([2])).summary()
    assert (s["lookups"], s["hits"]) == (4, 2)


def test_per_layer_pools_do_not_share_slots():
    # two layers, one slot each: layer 0 alternates, layer 1 repeats one expert
    experts = np.array([[[0], [5]], [[1], [5]], [[0], [5]]])
    trace = make_trace(experts, n_experts=6)
    result = replay(trace, Geometry.of(trace), "lru", "layer", np.array([1, 1]))
    per_layer = result.per_layer()
    assert per_layer["hits"].tolist() == [0, 2]


# --- the ds4 slab and size classes ---------------------------------------------------------------


class _TwoClassLayout:
    """Stand-in ModelLayout with layers 0-1 of 6.75 MiB experts and layer 2 of 13.5 MiB (q2-q4 style)."""

    name = "two-class"
    n_experts = 4
    n_routed_layers = 3

    class _Layer:
        def __init__(self, gate, down):
            self.gate_bytes, self.down_bytes = gate, down

    layers = (_Layer(2_162_688, 2_752_512), _Layer(2_162_688, 2_752_512), _Layer(4_718_592, 4_718_592))

    def expert_bytes_per_layer(self):
        return np.array([2 * layer.gate_bytes + layer.down_bytes for layer in self.layers])


def test_size_classes_first_touch_order_and_bytes():
    trace = make_trace(np.zeros((1, 3, 1)), n_experts=4)
    g = Geometry.of(trace, _TwoClassLayout())
    assert g.class_of_layer.tolist() == [0, 0, 1]
    assert g.class_bytes.tolist() == [7_077_888, 14_155_776]


def test_slab_flushes_on_every_size_change_and_per_class_keeps_both():
    # each token touches expert 0 in all three layers: 2 sizes, so the slab flushes twice per token
    trace = make_trace(np.zeros((10, 3, 1)), n_experts=4)
    g = Geometry.of(trace, _TwoClassLayout())
    slab = replay(trace, g, "ds4-slab", "global", np.array([8, 8]))
    per_class = replay(trace, g, "lru", "class", np.array([8, 8]))
    assert slab.summary()["hits"] == 0  # every layer-2 visit flushes layers 0-1: the cache never warms
    assert slab.summary()["size_changes"] == 19
    assert per_class.summary()["hits"] == 27  # all but the three first touches
    assert per_class.per_class()["load_bytes"].tolist() == [2 * 7_077_888, 14_155_776]


def test_slab_uniform_model_equals_global_lru():
    rng = np.random.default_rng(3)
    trace = make_trace(rng.integers(0, 16, (200, 4, 1)), n_experts=16)
    assert misses(trace, "ds4-slab", 12) == misses(trace, "lru", 12)


# --- the stateful engine API ----------------------------------------------------------------------


def test_lru_cache_reports_slots_and_victims():
    cache = LRUCache(1, 4, np.array([2]))
    outcome, slot, victim = cache.access(0, np.array([0, 1, 0, 2, 1]), 0)
    assert outcome.tolist() == [INSERT, INSERT, HIT, EVICT, EVICT]
    assert slot.tolist() == [0, 1, 0, 1, 0]  # C takes B's slot, then B takes A's
    assert victim.tolist() == [-1, -1, -1, 1, 0]
    outcome, _, _ = cache.access(0, np.array([3]), 0, mode=MODE_APPEND)
    assert outcome.tolist() == [DIRECT]
    cache.flush(0)
    assert not cache.resident().any() and cache.count(0) == 0


def test_a_pool_larger_than_its_keys_allocates_a_slot_per_key():
    """Issue 34: a slot count past the keys (a user's 'hold everything') sizes the slot table by the keys, not by
    the count (2**31 - 1 slots were an 8 GiB table)."""
    assert kernels.lru_state(8, np.array([10**6]))["key_of_slot"].shape == (1, 8)
    cache = LRUCache(2, 4, np.array([0]))
    cache.resize(0, 10**6)
    assert cache.state["key_of_slot"].shape == (1, 8)
    outcome, _, _ = cache.access(0, np.array([0, 1, 2, 3, 0]), 0)
    assert outcome.tolist() == [INSERT, INSERT, INSERT, INSERT, HIT]


# --- references -----------------------------------------------------------------------------------


def ordered_dict_lru(seq, capacity):
    cache, hits = OrderedDict(), 0
    for key in seq:
        if key in cache:
            cache.move_to_end(key)
            hits += 1
        elif capacity:
            if len(cache) >= capacity:
                cache.popitem(last=False)
            cache[key] = True
    return hits


def brute_force_opt(seq, capacity):
    """MIN with bypass by definition: on a full miss drop whichever of cache+new is needed last."""
    cache, hits = set(), 0
    for i, key in enumerate(seq):
        if key in cache:
            hits += 1
            continue
        if not capacity:
            continue

        def next_use(k):
            for j in range(i + 1, len(seq)):
                if seq[j] == k:
                    return j
            return len(seq) + k  # distinct "never" values keep ties deterministic; any choice is optimal

        if len(cache) < capacity:
            cache.add(key)
            continue
        furthest = max(cache | {key}, key=next_use)
        if furthest != key:
            cache.remove(furthest)
            cache.add(key)
    return hits


routing = st.integers(1, 3).flatmap(lambda layers: st.integers(2, 9).flatmap(
    lambda n_experts: st.integers(1, n_experts).flatmap(lambda k: st.lists(
        st.lists(st.permutations(range(n_experts)).map(lambda p: list(p[:k])), min_size=layers, max_size=layers),
        min_size=1, max_size=40).map(lambda rows: (np.array(rows, np.uint16), n_experts)))))


@settings(max_examples=300, deadline=None)
@given(routing, st.integers(0, 12))
def test_lru_equals_ordered_dict_reference(data, capacity):
    experts, n_experts = data
    trace = make_trace(experts, n_experts=n_experts)
    seq = flatten_keys(trace).tolist()
    assert len(seq) - misses(trace, "lru", capacity) == ordered_dict_lru(seq, capacity)


@settings(max_examples=200, deadline=None)
@given(routing, st.integers(0, 6), st.integers(0, 6), st.booleans())
def test_steps_in_one_call_equal_an_ordered_dict_lru_per_pool(data, cap0, cap1, split):
    """LRUCache.access_steps (a ds4 decode token's lookups in one kernel call): each step's outcomes are those
    of an OrderedDict LRU per pool fed the steps one after another; layers share pools (`split`: layer 0 in
    pool 0, the others in pool 1; else all in pool 0)."""
    experts, n_experts = data
    rows, layers, k = experts.shape
    pool_of_layer = np.array([0 if (layer == 0 or not split) else 1 for layer in range(layers)], np.int64)
    capacity = [cap0, cap1]
    cache = LRUCache(layers, n_experts, np.array(capacity))
    reference = [OrderedDict(), OrderedDict()]
    step_layers = np.tile(np.arange(layers), rows)
    outcome, counts = cache.access_steps(step_layers, experts.reshape(rows * layers, k), pool_of_layer)
    for i, layer in enumerate(step_layers.tolist()):
        pool = int(pool_of_layer[layer])
        lru, expected = reference[pool], []
        for e in experts.reshape(rows * layers, k)[i].tolist():
            key = layer * n_experts + e
            if key in lru:
                lru.move_to_end(key)
                expected.append(HIT)
            elif not capacity[pool]:
                expected.append(DIRECT)
            else:
                expected.append(INSERT if len(lru) < capacity[pool] else EVICT)
                if len(lru) >= capacity[pool]:
                    lru.popitem(last=False)
                lru[key] = True
        assert outcome[i].tolist() == expected
        assert counts[i].tolist() == [expected.count(o) for o in (HIT, INSERT, EVICT, DIRECT)]


@settings(max_examples=200, deadline=None)
@given(routing, st.integers(0, 8))
def test_opt_equals_brute_force_and_bounds_lru(data, capacity):
    experts, n_experts = data
    trace = make_trace(experts, n_experts=n_experts)
    seq = flatten_keys(trace).tolist()
    opt_hits = len(seq) - misses(trace, "opt", capacity)
    assert opt_hits == brute_force_opt(seq, capacity)
    # the bound of every demand-filled cache (static starts pre-filled, so it can beat a cold OPT)
    for policy in ("lru", "lfu"):
        assert opt_hits >= len(seq) - misses(trace, policy, capacity), policy


@settings(max_examples=200, deadline=None)
@given(routing, st.integers(0, 10))
def test_lru_hits_never_fall_with_capacity(data, capacity):
    experts, n_experts = data
    trace = make_trace(experts, n_experts=n_experts)
    for scope in ("layer", "global"):
        n_pools = experts.shape[1] if scope == "layer" else 1
        small = misses(trace, "lru", np.full(n_pools, capacity), scope)
        large = misses(trace, "lru", np.full(n_pools, capacity + 1), scope)
        assert large <= small


@settings(max_examples=150, deadline=None)
@given(routing, st.integers(0, 10))
def test_append_mode_never_evicts_and_counts_add_up(data, capacity):
    experts, n_experts = data
    trace = make_trace(experts, phase=np.zeros(len(experts)), n_experts=n_experts)
    result = replay(trace, Geometry.of(trace), "lru", "global", np.array([capacity]), prefill_mode="append")
    c = result.counts.sum(axis=(0, 1))
    assert c[EVICT] == 0
    assert c[INSERT] == min(capacity, len(np.unique(flatten_keys(trace))))
    assert c.sum() == trace.n_lookups


# --- libCacheSim as an independent oracle --------------------------------------------------------

lcs = pytest.importorskip("libcachesim")


def libcachesim_misses(trace, tmp_path, cache_class, capacity) -> int:
    path = tmp_path / "trace.oracleGeneral.bin"
    n = write_oracle_general(trace, path)
    reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
    miss_ratio, _ = cache_class(capacity).process_trace(reader)
    return round(miss_ratio * n)


@pytest.mark.parametrize("seed", range(6))
def test_libcachesim_lru_lfu_belady_agree(tmp_path, seed):
    rng = np.random.default_rng(seed)
    n_experts, layers, k, rows = 24, 3, 4, 300
    weights = 1 / np.arange(1, n_experts + 1) ** 0.9
    experts = np.stack([np.stack([rng.choice(n_experts, k, replace=False, p=weights / weights.sum())
                                  for _ in range(layers)]) for _ in range(rows)])
    trace = make_trace(experts, n_experts=n_experts)
    g = Geometry.of(trace)
    for capacity in (1, 5, 17, 40):
        assert misses(trace, "lru", capacity) == libcachesim_misses(trace, tmp_path, lcs.LRU, capacity)
        assert misses(trace, "lfu", capacity) == libcachesim_misses(trace, tmp_path, lcs.LFU, capacity)
        # libCacheSim's Belady always admits the newcomer: our MIN without bypass is the same policy
        counts = np.zeros((layers, 2, 4), np.int64)
        kernels.opt_replay(trace.experts, trace.phase, g.pools("global"), n_experts, np.array([capacity]),
                           kernels.next_use(trace.experts, n_experts), False, counts)
        admit_misses = int(counts[..., 1:].sum())
        assert admit_misses == libcachesim_misses(trace, tmp_path, lcs.Belady, capacity)
        assert misses(trace, "opt", capacity) <= admit_misses


def test_static_profile_ranking_is_by_frequency():
    trace = sequence_trace([2, 2, 2, 0, 1, 1], n_experts=3)
    assert trace_profile(trace).tolist() == [2, 1, 0]


def test_bad_cache_arguments_are_one_line_errors():
    trace = sequence_trace(ABACB)
    g = Geometry.of(trace)
    with pytest.raises(InputError, match="policy"):
        replay(trace, g, "fifo", "global", np.array([1]))
    with pytest.raises(InputError, match="scope"):
        replay(trace, g, "lru", "galaxy", np.array([1]))
    with pytest.raises(InputError, match="prefill_mode"):
        replay(trace, g, "opt", "global", np.array([1]), prefill_mode="append")
    with pytest.raises(InputError, match="slots"):
        parse_slots("3,x", 2, "slots")
    with pytest.raises(InputError, match="expected 1 or 2"):
        parse_slots("1,2,3", 2, "slots")


# --- a real trace against figures measured independently (reference/routing-traces.md §1 #1) -------

MIXTRAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "mixtral-routing"


@pytest.mark.skipif(not MIXTRAL.is_dir(), reason="../shared/data is not beside the checkout")
@pytest.mark.parametrize("name, measured_percent", [
    ("humaneval_2_routing.jsonl", (34, 48, 60, 70, 80)),
    ("gsm8k_2_routing.jsonl", (29, 43, 57, 69, 79)),
])
def test_per_layer_lru_hit_rates_on_real_mixtral_decode(name, measured_percent):
    from sim.trace.importers import import_trace

    trace = import_trace(MIXTRAL / name, model="mixtral-8x7b")
    g = Geometry.of(trace)
    for capacity, measured in zip(range(2, 7), measured_percent):
        simulated = 100 * replay(trace, g, "lru", "layer", np.full(32, capacity)).summary()["hit_rate"]
        assert abs(simulated - measured) <= 1.05, (capacity, simulated, measured)  # figures rounded to 1 %


def test_key_counts_match_a_bincount_of_the_keys():
    from sim.cache.kernels import key_counts

    rng = np.random.default_rng(3)
    experts = rng.integers(0, 9, size=(50, 4, 3)).astype(np.uint16)
    experts[5, 2] = 0xFFFF  # a missing cell is not an access
    layer = np.broadcast_to(np.arange(4)[None, :, None], experts.shape)
    present = experts != 0xFFFF
    expected = np.bincount((layer * 9 + experts)[present].astype(np.int64), minlength=36)
    counts = np.zeros(36, np.int64)
    key_counts(experts, 9, counts)
    assert counts.tolist() == expected.tolist()


def test_more_slots_than_a_pool_has_experts_behave_as_an_unbounded_cache():
    from sim.trace.generate import generate_trace

    trace = generate_trace("mixtral-8x7b", 16, 16, 0, 1)  # 8 experts per layer, 32 layers
    geometry = Geometry.of(trace, None, "t")
    # known answer: a cache that never evicts misses each distinct (layer, expert) once, its first use
    distinct = sum(len(np.unique(trace.experts[:, layer])) for layer in range(trace.header.n_layers))
    for policy in ("lru", "lfu", "opt"):
        huge = replay(trace, geometry, policy, "layer", np.full(32, 999_999_999_999), "evict").summary()
        assert huge["misses"] == distinct and huge["evictions"] == 0, policy


# --- a prompt reduced to its last accesses (what lets a million-token prompt be bounded in memory) --------


def brute_force_last_access_cells(experts):
    """The (row, layer) cells holding some key's last access, by definition: scan every access in order and
    remember where each key was seen last."""
    last = {}
    for r, row in enumerate(experts):
        for layer, cell in enumerate(row):
            for e in cell:
                if e != MISSING:
                    last[(layer, int(e))] = (r, layer)
    keep = np.zeros(experts.shape[:2], bool)
    for cell in last.values():
        keep[cell] = True
    return keep


def lru_decode_hits(seq, phases, capacity):
    cache, hits = OrderedDict(), 0
    for key, phase in zip(seq, phases):
        if key in cache:
            cache.move_to_end(key)
            hits += phase == 1
        elif capacity:
            if len(cache) >= capacity:
                cache.popitem(last=False)
            cache[key] = True
    return hits


prompt_then_decode = routing.flatmap(lambda data: st.integers(1, len(data[0])).map(lambda n: (*data, n)))


@settings(max_examples=200, deadline=None)
@given(prompt_then_decode, st.integers(0, 10))
def test_last_access_rows_keep_what_decode_hits_depend_on(data, capacity):
    from sim.cache.replay import decode_bound_hits, last_access_rows

    experts, n_experts, prompt_rows = data
    prompt, decode = experts[:prompt_rows], experts[prompt_rows:]
    cell_rows, cell_layers = kernels.last_access_cells(prompt, n_experts, np.zeros(prompt.shape[1] * n_experts, bool))
    keep = np.zeros(prompt.shape[:2], bool)
    keep[cell_rows, cell_layers] = True
    assert (keep == brute_force_last_access_cells(prompt)).all()
    assert (np.diff(cell_rows * prompt.shape[1] + cell_layers) > 0).all()  # each cell once, in (row, layer) order
    reduced = last_access_rows(prompt, n_experts)
    assert len(reduced) <= prompt.shape[1] * n_experts  # at most a row per key, whatever the prompt's length

    def whole(p):
        rows = np.concatenate([p, decode])
        phase = np.r_[np.zeros(len(p)), np.ones(len(decode))].astype(np.uint8)
        return make_trace(rows, phase, n_experts)

    full, short = whole(prompt), whole(reduced)

    def lru_hits(trace):  # an OrderedDict LRU over the accesses in the kernels' order (row, layer, k)
        cells = trace.experts[:, :, 0] != MISSING
        phase_of_access = np.repeat(trace.phase, cells.sum(axis=1) * trace.experts.shape[2])
        return lru_decode_hits(flatten_keys(trace).tolist(), phase_of_access.tolist(), capacity)

    assert lru_hits(full) == lru_hits(short)
    # and the Belady bound of the decode hits is the same (one pool: the traces have a single size class)
    bound = [decode_bound_hits(t, Geometry.of(t), np.array([capacity])).sum() for t in (full, short)]
    assert bound[0] == bound[1]


@settings(max_examples=100, deadline=None)
@given(routing, st.integers(1, 5))
def test_last_access_cells_read_block_by_block_are_the_whole_prompts(data, block_rows):
    """A prompt kept in a file (sim.trace.rowfile) is passed a block at a time, last block first, the keys seen in
    later blocks carried: the cells and their ids are those of the whole prompt (oracle: the definition)."""
    from sim.cache.replay import last_access_cells_of
    from sim.trace import rowfile

    experts, n_experts = data
    file = rowfile.RowFile(experts.shape[1:])
    file.append(experts)
    layers, top_k = experts.shape[1:]
    previous, rowfile.ROW_BLOCK_BYTES = rowfile.ROW_BLOCK_BYTES, block_rows * layers * top_k * 2
    try:
        rows, cell_layers, cells = last_access_cells_of(file.rows(), layers, n_experts)
    finally:
        rowfile.ROW_BLOCK_BYTES = previous
    keep = np.zeros(experts.shape[:2], bool)
    keep[rows, cell_layers] = True
    assert (keep == brute_force_last_access_cells(experts)).all()
    assert (np.diff(rows * layers + cell_layers) > 0).all()
    assert np.array_equal(cells, experts[rows, cell_layers])
