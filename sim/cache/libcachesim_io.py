"""A trace as libCacheSim sees it: one request per expert lookup, in replay order.

libCacheSim is the independent oracle of the cache kernels (tests) and the speed yardstick of
`expertsim bench`; its fastest reader is the oracleGeneral binary format (24-byte records: u32 time,
u64 object id, u32 size, i64 next-access time, -1 for none), which Belady needs anyway.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sim.cache.kernels import next_use
from sim.trace.format import MISSING, Trace

ORACLE_GENERAL = np.dtype([("time", "<u4"), ("obj_id", "<u8"), ("obj_size", "<u4"), ("next_access", "<i8")])


def flatten_keys(trace: Trace) -> np.ndarray:
    """Global expert keys (layer * n_experts + expert) in replay order, missing cells skipped."""
    h = trace.header
    keys = np.arange(h.n_layers, dtype=np.int64)[None, :, None] * h.n_experts + trace.experts
    return keys[trace.experts != MISSING]


def write_oracle_general(trace: Trace, path: str | Path) -> int:
    """Write the trace's lookups as an oracleGeneral file; returns the number of requests."""
    keys = flatten_keys(trace)
    nxt = next_use(trace.experts, trace.header.n_experts)
    records = np.empty(len(keys), ORACLE_GENERAL)
    records["time"] = np.arange(len(keys), dtype=np.uint32)
    records["obj_id"] = keys
    records["obj_size"] = 1
    records["next_access"] = np.where(nxt == np.iinfo(np.int64).max, -1, nxt)
    records.tofile(str(path))
    return len(keys)
