"""ds4's knobs and plan's default search over them."""

from __future__ import annotations

from sim.engines.base import Knob, SearchAxis, candidates, setting
from sim.engines.ds4.settings import KEY_BUDGET, KEY_CHUNK, KEY_RESERVE, KEY_VARIANT

KNOBS = (
    Knob(KEY_VARIANT, "variant", labels={"pr504": "per-class caches (pr504)", "pre-504": "one slab (pre-504)"}),
    Knob(KEY_BUDGET, "expert budget", "experts"),
    Knob(KEY_RESERVE, "VRAM reserve", "GiB"),
    Knob(KEY_CHUNK, "prefill chunk", "tokens"),
)
VARIANT, BUDGET, RESERVE, CHUNK = KNOBS


def search_space(data: dict) -> list[SearchAxis]:
    """The slab against per-class caches (for those two variants) and the expert budget as a grid; then the
    reserve and the prefill chunk one at a time. The scenario's own value first."""
    variant = (data.get("engine") or {}).get("variant")
    axes = []
    if variant in ("pre-504", "pr504"):
        axes.append(SearchAxis(VARIANT, candidates(variant, "pr504" if variant == "pre-504" else "pre-504"), True))
    axes.append(SearchAxis(BUDGET, candidates(setting(data, KEY_BUDGET), "4096"), True))
    axes.append(SearchAxis(RESERVE, candidates(setting(data, KEY_RESERVE), "8", "16"), False))
    axes.append(SearchAxis(CHUNK, candidates(setting(data, KEY_CHUNK), 4096, 8192), False))
    return axes
