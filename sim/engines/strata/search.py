"""Strata's knobs and plan's default search over them."""

from __future__ import annotations

from sim.engines.base import Knob, SearchAxis, candidates, setting
from sim.engines.strata.settings import (BUILDS, KEY_CACHE, KEY_CONV, KEY_HEADROOM, KEY_NO_BORROW, KEY_OWN,
                                         KEY_PREFILL, KEY_RESERVE)

KNOBS = (
    Knob(KEY_CACHE, "expert cache", "experts"),
    Knob(KEY_OWN, "own vs borrow", labels={"1": "own buffers", "0": "borrowed buffers"}),
    Knob(KEY_NO_BORROW, "own vs borrow", labels={True: "own buffers", False: "borrowed buffers"}),
    Knob(KEY_PREFILL, "prefill chunk", "tokens"),
    Knob(KEY_RESERVE, "VRAM reserve", "MiB"),
    Knob(KEY_HEADROOM, "RAM headroom", "GiB"),
    Knob(KEY_CONV, "conversation cache", "MiB"),
)
CACHE, OWN, NO_BORROW, PREFILL, RESERVE, HEADROOM, CONV = KNOBS


def search_space(data: dict) -> list[SearchAxis]:
    """The cache, own against borrowed buffers (the fork's switch, else --no-prefill-borrow) and the prompt chunk as
    a grid; then the reserve, the RAM headroom and the conversation budget one at a time. The scenario's own value
    first."""
    variant = (data.get("engine") or {}).get("variant")
    cache = setting(data, KEY_CACHE) or "auto"
    axes = [SearchAxis(CACHE, candidates(cache, "auto", 5400) if cache == "auto" else candidates(cache, "auto"), True)]
    if variant in BUILDS and BUILDS[variant].independent_buffers:
        axes.append(SearchAxis(OWN, candidates(setting(data, KEY_OWN), "1", "0"), True))
    else:
        axes.append(SearchAxis(NO_BORROW, candidates(setting(data, KEY_NO_BORROW) or False, True), True))
    axes.append(SearchAxis(PREFILL, candidates(setting(data, KEY_PREFILL) or "auto", 4096), True))
    axes += [SearchAxis(RESERVE, candidates(setting(data, KEY_RESERVE), 700, 1536), False),
             SearchAxis(HEADROOM, candidates(setting(data, KEY_HEADROOM), "4", "6"), False),
             SearchAxis(CONV, candidates(setting(data, KEY_CONV), 0, 2048), False)]
    return axes


def owned_buffers(settings: dict) -> bool:
    """Whether a candidate's settings give the prompt path buffers of its own."""
    return settings.get(KEY_OWN) == "1" or settings.get(KEY_NO_BORROW) is True
