"""TOML text as the starting files are written: keys and values on one line, and comments wrapped at the
repository's width."""

from __future__ import annotations

import json
import math
import re
import textwrap
from collections.abc import Sequence

LINE_WIDTH = 118  # the repository's scenario files wrap at ~120 columns

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key, ensure_ascii=False)


def dotted(path: Sequence[str]) -> str:
    return ".".join(toml_key(p) for p in path)


def toml_value(value) -> str:
    """One TOML value on one line (a JSON string is a TOML basic string)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"TOML files here hold finite numbers only, not {value}")
        return repr(value)
    if isinstance(value, str):  # JSON's escapes are TOML's, but for DEL, which TOML wants escaped
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + " }" if value else "{}"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def _wrap(text: str, width: int) -> list[str]:
    """Lines of at most `width` characters, breaking at spaces only (paths and key names stay whole)."""
    return textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False)


def commented(code: str, note: str, column: int) -> list[str]:
    """`code` with `note` as its end-of-line comment, wrapped onto comment lines at the same column."""
    lead = code.ljust(column) if len(code) < column else code + "  "
    pieces = _wrap(note, max(LINE_WIDTH - len(lead) - 4, 40)) or [""]
    return [f"{lead}# {pieces[0]}", *(f"{' ' * len(lead)}#   {p}" for p in pieces[1:])]


def comment_block(text: str) -> list[str]:
    """A header comment: the first line as it is, the rest indented under it."""
    lines = _wrap(text, LINE_WIDTH - 4)
    return [f"# {lines[0]}", *(f"#   {line}" for line in lines[1:])]
