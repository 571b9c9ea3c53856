"""ds4's Metal expert cache (sim/cache/hotness.py), against the rules of ds4_metal.m @b0309611 worked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from sim.cache.hotness import HOTNESS_DECAY_TOKENS, RouteHotnessCache


def keys_of(lookup, layer: int, n_experts: int = 8) -> list[int]:
    return [layer * n_experts + int(e) for e in lookup.loads]


def test_misses_take_free_slots_until_the_budget_then_evict_the_coldest_oldest():
    cache = RouteHotnessCache(n_layers=3, n_experts=8, budget_experts=3)
    first = cache.access(0, np.array([1, 2]))
    assert first.hits == 0 and keys_of(first, 0) == [1, 2] and list(first.victims) == [-1, -1]
    second = cache.access(1, np.array([5, 1]))  # one free slot left: the first load takes it, the second evicts
    assert keys_of(second, 1) == [13, 9]
    # every valid entry outside layer 1 has hotness 1; the oldest stamp is expert 1 of layer 0 (installed first)
    assert list(second.victims) == [-1, 1]
    assert cache.count == 3 and sorted(np.flatnonzero(cache.valid)) == [2, 9, 13]


def test_a_hot_entry_outlives_a_more_recent_cold_one():
    cache = RouteHotnessCache(n_layers=2, n_experts=8, budget_experts=2)
    cache.access(0, np.array([0]))
    cache.access(0, np.array([0]))  # a hit: hotness 2
    cache.access(0, np.array([3]))  # hotness 1, stamped after expert 0
    lookup = cache.access(1, np.array([4]))
    assert list(lookup.victims) == [3]  # the colder entry goes, though expert 0 was used longer ago


def test_the_layers_own_selection_is_never_a_victim_and_a_repeated_expert_loads_once():
    cache = RouteHotnessCache(n_layers=1, n_experts=8, budget_experts=2)
    cache.access(0, np.array([0, 1]))
    lookup = cache.access(0, np.array([0, 6, 6]))  # 6 twice: one load; 0 is selected, so only 1 can go
    assert lookup.resident.tolist() == [True, False, False] and lookup.misses == 2
    assert list(lookup.loads) == [6] and list(lookup.victims) == [1]


def test_hotness_halves_every_16_tokens_and_a_prompt_clears_it():
    cache = RouteHotnessCache(n_layers=1, n_experts=8, budget_experts=8)
    cache.note_token()  # the first token starts the count
    for _ in range(4):
        cache.access(0, np.array([2]))
    assert cache.hotness[2] == 4
    for _ in range(HOTNESS_DECAY_TOKENS):
        cache.note_token()
    assert cache.hotness[2] == 2
    cache.reset_hotness()
    assert cache.hotness.sum() == 0


@pytest.mark.parametrize("budget, entries, tokens, ready", [
    (4342, 1023, 4, False), (4342, 1024, 4, True), (4342, 1024, 3, False),  # 1024 entries at a budget >= 2048
    (701, 350, 4, True), (701, 349, 4, False),  # budget / 2 below 2048
])
def test_the_split_waits_for_a_warm_cache(budget, entries, tokens, ready):
    cache = RouteHotnessCache(n_layers=43, n_experts=256, budget_experts=budget)
    cache.count, cache.tokens = entries, tokens
    assert cache.split_ready() is ready
