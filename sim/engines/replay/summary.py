"""What a cache-only replay reports: its figures, and the headline keys a replay has no figure for. Pure: no
numba (the cache module's Geometry is a type here only)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from sim.trace.format import PHASE_DECODE, PHASE_PREFILL
from sim.units import MIB

if TYPE_CHECKING:
    from sim.cache.replay import Geometry

# Headline keys of an engine run that a replay has no figure for: null, never 0.
NO_MEANING = ("lent_slots", "prefill_buffer_mib", "file_blob_reads", "prefill_tok_s", "decode_tok_s",
              "belady_decode_hit_rate", "belady_gap", "ttft_s", "simulated_s", "gpu_idle_s")
# What `figures` gives: the keys a run's summary and the sweep's one-pass rows share.
FIGURES = ("cache_slots", "cache_mib", "decode_hit_rate", "prefill_hit_rate", "hit_rate", "lookups", "hits",
           "misses", "load_bytes")


def cache_size(geometry: Geometry, policy: str, scope: str, capacity: np.ndarray) -> tuple[int, float]:
    """Slots and MiB of the cache. A pool of one layer or size class holds that size per slot; a global pool of
    mixed sizes is priced at its largest expert, since any slot may take it; ds4's slab is rebuilt for each size
    class, so it is at most its largest build."""
    if policy == "ds4-slab":
        return int(capacity.max()), float((capacity * geometry.class_bytes).max()) / MIB
    per_slot = {"layer": geometry.expert_bytes, "class": geometry.class_bytes,
                "global": geometry.expert_bytes.max(initial=0)}[scope]
    return int(capacity.sum()), float((capacity * per_slot).sum()) / MIB


def _rate(hits, lookups) -> float | None:
    return int(hits) / int(lookups) if lookups else None  # a phase without lookups has no rate (not 0)


def figures(geometry: Geometry, policy: str, scope: str, capacity: np.ndarray, lookups: np.ndarray,
            hits: np.ndarray, load_bytes) -> dict:
    """The FIGURES of a cache from its lookups and hits per phase (int [2]) and its loaded bytes. A run and the
    sweep's one-pass path both report through here, so their figures agree to the bit."""
    slots, mib = cache_size(geometry, policy, scope, capacity)
    return {
        "cache_slots": slots,
        "cache_mib": mib,
        "decode_hit_rate": _rate(hits[PHASE_DECODE], lookups[PHASE_DECODE]),
        "prefill_hit_rate": _rate(hits[PHASE_PREFILL], lookups[PHASE_PREFILL]),
        "hit_rate": _rate(hits.sum(), lookups.sum()),
        "lookups": int(lookups.sum()),
        "hits": int(hits.sum()),
        "misses": int(lookups.sum() - hits.sum()),
        "load_bytes": int(load_bytes),
    }


def records(frame: pd.DataFrame) -> list[dict]:
    """Rows as plain Python values (numpy scalars would be written as strings; NaN -> None)."""
    return [{k: None if isinstance(v, float) and np.isnan(v) else v.item() if isinstance(v, np.generic) else v
             for k, v in row.items()} for row in frame.to_dict(orient="records")]
