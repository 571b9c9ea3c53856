"""ds4's Metal streaming expert cache: one table of (layer, expert) entries for the whole model, its victims
chosen by route hotness (antirez/ds4 ds4_metal.m, read at upstream b0309611 of 2026-08-05, the newest upstream
state in reach before the @84cc882 of 2026-08-14; file lines are that file's):

  table      g_stream_expert_cache[80][384]: one entry per (layer, expert), valid or not, with a last_used
             stamp (a global clock bumped on every hit and every install) (L552-L623)
  budget     one global count of valid entries; every layer may use any entry (effective_cap is the layer's
             expert count, L10599-L10618: residency is global, not per layer); a miss takes a free slot while
             the count is below the budget, else it reuses a victim's slot (prepare_load_buffers L13353,
             take_reusable_batch L13048 for slots of <= 16 MiB)
  victim     the valid entry with the lowest route hotness, the oldest last_used on ties, never one of the
             layer's own selected experts (take_reusable L12936, prune_global L13515)
  hotness    route_hotness[layer][expert] += 1 for every selection, hit or miss (so an expert evicted
             before its second hit still gains, prune_layer L12873), halved for every expert each 16
             decode tokens (DS4_METAL_STREAM_EXPERT_HOTNESS_DECAY_TOKENS, decay_route_hotness L11816), the
             token counter advanced when a token reaches layer 0 (note_token L11910), and cleared when a
             decode-style prompt starts (reset_route_hotness, ds4.c L29935 metal_graph_prefill_decode_streaming_range)
  split      once the cache is warm (>= 4 decode tokens and >= min(1024, budget / 2) entries, split_ready
             L11806) a layer with >= 3 misses and >= 1 hit runs its hits' experts while the misses load
             (split_worthwhile L10637)

Per layer the engine asks the order the Metal code has: the misses are found and their victims chosen
(begin_selected_load L14057), the selection is counted in the hotness, the hits are stamped (peek L13580) and
the loaded experts installed (install_loaded L13625), each stamp a tick of the clock.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# fmt: off
HOTNESS_DECAY_TOKENS = 16      # DS4_METAL_STREAM_EXPERT_HOTNESS_DECAY_TOKENS (ds4_metal.m L559)
SPLIT_MIN_DECODE_TOKENS = 4    # ds4_gpu_stream_expert_split_min_decode_tokens (L11793)
SPLIT_MIN_CACHED = 1024        # ds4_gpu_stream_expert_split_min_cached: 1024, or budget / 2 below 2048 (L11797)
SPLIT_MIN_MISSES = 3           # split_worthwhile: at least 3 misses beside at least 1 hit (L10637)
# fmt: on


@dataclass(frozen=True)
class LayerLookup:
    """One layer's selection through the cache: `resident` per selected expert (in selection order), the
    experts to load (each missing expert once, in selection order) and the keys whose slots they take
    (-1: a free slot)."""

    resident: np.ndarray
    loads: np.ndarray
    victims: np.ndarray

    @property
    def hits(self) -> int:
        return int(self.resident.sum())

    @property
    def misses(self) -> int:
        return len(self.resident) - self.hits


class RouteHotnessCache:
    """The Metal cache's state across a run (see the module docstring); keys are layer * n_experts + expert."""

    def __init__(self, n_layers: int, n_experts: int, budget_experts: int):
        if budget_experts < 1:
            raise ValueError("the Metal expert cache needs a budget of at least one expert")
        n_keys = n_layers * n_experts
        self.n_experts = n_experts
        self.budget = int(budget_experts)
        self.valid = np.zeros(n_keys, np.bool_)
        self.hotness = np.zeros(n_keys, np.int64)
        self.last_used = np.zeros(n_keys, np.int64)
        self.clock = 0
        self.count = 0
        self.tokens = 0  # decode-path tokens that reached layer 0
        self.decay_mark = 0  # the token count of the last halving (0: not started)
        self.evictions = 0

    def note_token(self) -> None:
        """A token reaches layer 0's routed experts (note_token): the token counter, then any halving due."""
        self.tokens += 1
        self._maybe_decay()

    def reset_hotness(self) -> None:
        """A decode-style prompt starts: every hotness cleared, the next halving 16 tokens from now."""
        self.hotness[:] = 0
        self.decay_mark = self.tokens

    def _maybe_decay(self) -> None:
        if self.tokens == 0:
            return
        if self.decay_mark == 0:
            self.decay_mark = self.tokens
            return
        while self.tokens - self.decay_mark >= HOTNESS_DECAY_TOKENS:
            self.hotness >>= 1
            self.decay_mark += HOTNESS_DECAY_TOKENS

    def split_ready(self) -> bool:
        """split_ready: the cache is warm enough for the hits-first split (module docstring)."""
        min_cached = self.budget // 2 if self.budget < 2 * SPLIT_MIN_CACHED else SPLIT_MIN_CACHED
        return self.tokens >= SPLIT_MIN_DECODE_TOKENS and self.count >= min_cached

    def access(self, layer: int, experts: np.ndarray) -> LayerLookup:
        """One routed layer's selected experts (in router order) through the cache."""
        keys = layer * self.n_experts + np.asarray(experts, np.int64)
        resident = self.valid[keys].copy()
        loads = np.unique(keys[~resident], return_index=True)
        loads = keys[~resident][np.sort(loads[1])]  # each missing key once, in selection order
        free = max(0, self.budget - self.count)
        n_evict = max(0, len(loads) - free)
        victims = np.full(len(loads), -1, np.int64)
        if n_evict:
            candidates = np.flatnonzero(self.valid)
            candidates = candidates[~np.isin(candidates, keys)]  # never the layer's own selection
            order = np.lexsort((self.last_used[candidates], self.hotness[candidates]))
            chosen = candidates[order[:n_evict]]
            victims[free: free + len(chosen)] = chosen
            self.valid[chosen] = False
            self.count -= len(chosen)
            self.evictions += len(chosen)
        # the selection counts in the hotness (a halving may fall due first), then the hits are stamped
        self._maybe_decay()
        np.add.at(self.hotness, keys, 1)
        hit_keys = keys[resident]
        self.last_used[hit_keys] = self.clock + 1 + np.arange(len(hit_keys))
        self.clock += len(hit_keys)
        installed = loads[: free + np.count_nonzero(victims >= 0)]
        self.valid[installed] = True
        self.last_used[installed] = self.clock + 1 + np.arange(len(installed))
        self.clock += len(installed)
        self.count += len(installed)
        return LayerLookup(resident, loads % self.n_experts, victims)
