"""How a report names what it shows and writes its values.

Axes are titled with a short name and unit: grid keys from the engines' knobs, metrics from their suffix
(docs/metrics.md). Values are drawn in d3 formats (`value_format`) and written out with their unit (`with_unit`),
hit rates in % either way; a table figure is as tall as its rows (`table_size`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from sim.units import GIB, MIB


def dimension_name(key: str) -> tuple[str, str]:
    """A grid key's short name and unit ("" for none): an engine's knob of that key (Engine.knobs: the engines' own
    flag semantics, ds4's reserve in whole GiB, Strata's --expert-cache a count of its largest experts), else its
    last dotted part."""
    from sim.engines import ENGINES

    knob = next((k for engine in ENGINES.values() for k in engine.knobs if k.key == key), None)
    return (knob.name, knob.unit) if knob is not None else (key.rsplit(".", 1)[-1], "")


def is_rate(metric: str) -> bool:
    """A fraction shown in % (hit rates and the Belady gap): on axes and cells (`value_format`) and in the
    headline (`with_unit`) alike."""
    return metric.endswith("hit_rate") or metric == "belady_gap"


# The unit a metric's name ends in (docs/metrics.md's naming), as the values are stored.
METRIC_SUFFIX_UNITS = (("_tok_s", "tok/s"), ("_mib", "MiB"), ("_bytes", "bytes"), ("_s", "s"))


def _metric_name(metric: str) -> tuple[str, str]:
    """A headline metric's short name and unit, from its name's suffix (METRIC_SUFFIX_UNITS); a rate is in %."""
    if is_rate(metric):
        return metric.replace("_", " "), "%"
    for suffix, unit in METRIC_SUFFIX_UNITS:
        if metric.endswith(suffix):
            return metric[: -len(suffix)].replace("_", " "), unit
    return metric.replace("_", " "), ""


def _titled(name: str, unit: str) -> str:
    return f"{name} ({unit})" if unit else name


def dimension_title(key: str) -> str:
    return _titled(*dimension_name(key))


def metric_title(metric: str) -> str:
    return _titled(*_metric_name(metric))


def value_format(metric: str) -> str:
    """The d3 format of a metric's values on axes, cells and hovers: hit rates are fractions drawn as %."""
    return ".1%" if is_rate(metric) else ",.1f"


def with_unit(key: str, value) -> str:
    """A headline figure as a reader wants it: tok/s, %, GiB or MiB, s, counts with separators."""
    if value is None or isinstance(value, (bool, str)):
        return cell_text(value)
    if isinstance(value, float) and np.isnan(value):
        return "-"
    if key.endswith("_tok_s"):
        return f"{value:,.1f} tok/s"
    if is_rate(key):
        return f"{100 * value:.1f} %"
    if key.endswith("_mib"):  # in the unit its key names (as GiB a cache_mib row read as a mislabelled figure)
        return f"{value:,.1f} MiB"
    if key.endswith("_bytes"):
        return f"{value / GIB:,.2f} GiB" if value >= GIB else f"{value / MIB:,.2f} MiB"
    if key.endswith("_s"):
        return f"{value:,.3f} s"
    if isinstance(value, (int, np.integer)):
        return f"{int(value):,}"
    return cell_text(value)


def cell_text(value) -> str:
    """A value as a table cell shows it: a float to 4 significant digits ("-" for NaN), a missing value (None, NA,
    NaT) empty, anything else as its str."""
    if isinstance(value, float):
        return "-" if np.isnan(value) else f"{value:.4g}"
    if value is None or value is pd.NA or value is pd.NaT:  # a point without an error has none, not "<NA>"
        return ""
    return str(value)


def table_size(rows: int) -> dict:
    """A table figure tall enough to show every row without scrolling: plotly draws a 28 px header and 20 px rows
    (a long value wraps onto a second line: 24 px a row of slack), under a 60 px title margin."""
    return {"height": 60 + 20 + 28 + 24 * rows, "margin": {"t": 60, "b": 20}}
