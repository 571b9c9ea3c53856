"""The replay's [engine] table: the `expertsim cache` options it runs with (sim/cache/replay.py, docs/cache.md)."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, PlainValidator

from sim.schema import Strict


def _check_slots(value: object) -> int | list[int]:
    """One slot count for every pool, or an array of one per pool (whole numbers >= 0)."""
    def count(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if count(value) or (isinstance(value, list) and value and all(count(v) for v in value)):
        return value
    raise ValueError("must be a slot count >= 0 for every pool, or an array of one count per pool")


class ReplayFlags(Strict):
    """The `expertsim cache` options a cache-only replay runs with (sim/cache/replay.py, docs/cache.md).
    The literals are replay.POLICIES, SCOPES and PREFILL_MODES (tests/test_cache_only.py checks they agree):
    importing the cache module here would load numba for every scenario."""

    KEY_KIND: ClassVar[str] = "replay flag"
    policy: Literal["lru", "lfu", "opt", "static", "ds4-slab"] = "lru"
    # Pools: one per layer, per size class, or one; ds4-slab is always one slab with a capacity per class.
    scope: Literal["layer", "class", "global"] = "layer"
    slots: Annotated[int | list[int], PlainValidator(_check_slots)]
    prefill_mode: Literal["evict", "append"] = Field("evict", alias="prefill-mode")
    # The static policy's ranking: a rank,layer,expert CSV relative to the scenario; unset = the workload's own
    # access counts (an oracle profile, as `expertsim cache` does without --profile).
    profile: Annotated[str, Field(min_length=1)] | None = None


class Settings(Strict):
    """No engine: the workload's routing replayed through one cache, counts only, no timing."""

    KEY_KIND: ClassVar[str] = "replay engine key"
    name: Literal["replay"]
    flags: ReplayFlags

