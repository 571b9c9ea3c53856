"""Tables on stdout that fit the terminal without cutting a word or a number.

A table is first described (title, column names, formatted cells), then laid out for the width it meets:
- it fits: a table whose every column is at least as wide as its longest word or number, so the terminal folds
  text between words only;
- `--wide`: every column at its full width, wider than the terminal if it must be (`less -S` scrolls it);
- a few rows that do not fit side by side: the table turned on its side, one column per row;
- otherwise the columns that fit, in their order, and a line naming the rest (`--wide` and `--json` have them);
- a terminal too narrow even for two columns: each row as a block of "column  value" lines.
Written to a pipe or a file, a table is never cut: one line per row, for grep and awk.

Hand-written rather than rich's own fitting: rich shrinks a column below its longest word and folds the word
("vram_g / ib", a path in 6-character pieces), which is what a reader must never see."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from rich.console import Console
from rich.table import Table as RichTable

PIPED_WIDTH = 10_000  # columns of a table written to a pipe or file: never cut, one line per row for grep and awk
TURN_AT_MOST_ROWS = 4  # a wide table of this many rows or fewer reads better on its side than with columns left out
_NUMBER = re.compile(r"[-+]?[\d,]*\.?\d+(e[-+]?\d+)?")


@dataclass(frozen=True)
class Table:
    title: str
    columns: tuple[str, ...]
    cells: tuple[tuple[str, ...], ...]  # formatted, one tuple per row

    @cached_property  # the layout asks for the widths more than once (fit, then the columns' share of the room)
    def least_widths(self) -> list[int]:
        """Each column's narrowest width that splits no word and no number: its longest word, header included."""
        return [max((len(word) for text in (name, *(row[i] for row in self.cells)) for word in text.split()),
                    default=1) for i, name in enumerate(self.columns)]

    @cached_property
    def full_widths(self) -> list[int]:
        return [max(len(text) for text in (name, *(row[i] for row in self.cells))) for i, name in
                enumerate(self.columns)]

    def numeric(self, i: int) -> bool:
        filled = [row[i] for row in self.cells if row[i]]
        return bool(filled) and all(_NUMBER.fullmatch(text) for text in filled)


def table(title: str, rows: list[dict], columns: list[str] | None = None) -> Table:
    """Rows as a Table, each column's small figures (under 10) at the decimals the column needs, at most four."""
    columns = columns or (list(rows[0]) if rows else [])
    places = {c: max((_decimals_needed(row.get(c)) for row in rows), default=SMALL_DECIMALS) for c in columns}
    return Table(title, tuple(columns),
                 tuple(tuple(format_cell(row.get(c), places[c]) for c in columns) for row in rows))


SMALL_DECIMALS = 4  # a hit rate's resolution


def _decimals_needed(value) -> int:
    """The decimals a small figure shows without losing a digit of its four (1 at least: it is no count); 0 for
    anything else, which does not widen its column's."""
    if not isinstance(value, (float, np.floating)) or np.isnan(value) or abs(value) >= 10:
        return 0
    return max(1, len(f"{value:.{SMALL_DECIMALS}f}".rstrip("0").partition(".")[2]))


def format_cell(value, decimals: int = SMALL_DECIMALS) -> str:
    """One cell: a float under 10 at `decimals` places (a column's: its cells line up; "6.5", not "6.5000", in a
    column of sizes), a larger one at one place with thousands separators, an integer with them."""
    if isinstance(value, (float, np.floating)):
        if np.isnan(value):
            return "-"
        return f"{value:.{decimals}f}" if abs(value) < 10 else f"{value:,.1f}"
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return f"{int(value):,}"
    return "" if value is None else str(value)


def show(*items, wide: bool = False) -> None:
    """Print text and tables to stdout as it is now (a test runner or a notebook may have replaced it): at the
    terminal's width, laid out as the module's docstring says, and when piped at a width that never cuts a row."""
    at_terminal = sys.stdout.isatty()  # there, text wraps between words; in a pipe, a line stays one line
    console = Console(highlight=False, soft_wrap=not at_terminal, width=None if at_terminal else PIPED_WIDTH)
    for item in items:
        if not isinstance(item, Table):
            console.print(item)
            continue
        if wide:  # a console as wide as the table: rich never prints wider than its console
            room = max(console.width, _table_width(item.full_widths))
            console = Console(highlight=False, soft_wrap=not at_terminal, width=room)
        for renderable in layout(item, console.width):
            console.print(renderable)


def layout(shown: Table, width: int) -> list:
    """What to print for `shown` at `width` columns: its title, then rich tables and lines of text, none wider
    than `width`."""
    least = shown.least_widths
    if _table_width(least) <= width:
        return [shown.title, _rich(shown, width)]
    if len(shown.cells) <= TURN_AT_MOST_ROWS:
        turned = _on_its_side(shown)
        if _table_width(turned.least_widths) <= width:
            return [shown.title, _rich(turned, width)]
    kept = [0]
    for i in range(1, len(shown.columns)):
        if _table_width([least[k] for k in (*kept, i)]) <= width:
            kept.append(i)
    if len(kept) < 2:
        return _blocks(shown, width)
    left_out = [name for i, name in enumerate(shown.columns) if i not in kept]
    part = Table(shown.title, tuple(shown.columns[i] for i in kept),
                 tuple(tuple(row[i] for i in kept) for row in shown.cells))
    return [shown.title, _rich(part, width),
            f"({len(left_out)} more column{'s' * (len(left_out) > 1)}: {', '.join(left_out)}; --wide shows them)"]


def _table_width(column_widths: list[int]) -> int:
    """A rich table's width: each column with a space either side, and a rule before each and after the last."""
    return sum(column_widths) + 3 * len(column_widths) + 1


def _rich(shown: Table, width: int) -> RichTable:
    """The table with each column's width fixed here: rich's own shrinking may take a column below its longest
    word when another column is wide, and fold the word."""
    rendered = RichTable()  # the title is a line of its own, which wraps at the terminal's width, not the table's
    for i, (name, fixed) in enumerate(zip(shown.columns, _column_widths(shown, width))):
        rendered.add_column(name, overflow="fold", width=fixed, justify="right" if shown.numeric(i) else "left")
    for row in shown.cells:
        rendered.add_row(*row)
    return rendered


def _column_widths(shown: Table, width: int) -> list[int]:
    """Every column at its least width, and the room left shared in proportion to what each lacks of its full
    width (all full widths where they fit)."""
    least, full = shown.least_widths, shown.full_widths
    room = width - _table_width(least)
    lacking = [f - m for f, m in zip(full, least)]
    if sum(lacking) <= room:
        return full
    given = [room * lack // sum(lacking) for lack in lacking]
    for i in sorted(range(len(given)), key=lambda i: given[i] - lacking[i])[:room - sum(given)]:
        given[i] += 1  # the rounding's remainder, to the columns that lack the most
    return [m + g for m, g in zip(least, given)]


def _on_its_side(shown: Table) -> Table:
    """One column per row, headed by the row's first cell (with the column's name if that cell is a bare number);
    one row per remaining column."""
    heads = tuple(f"{shown.columns[0]} {row[0]}" if _NUMBER.fullmatch(row[0]) else row[0] for row in shown.cells)
    return Table(shown.title, ("", *heads),
                 tuple((name, *(row[i] for row in shown.cells)) for i, name in enumerate(shown.columns) if i))


def _blocks(shown: Table, width: int) -> list[str]:
    """Each row as lines of "column  value", a blank line between rows: for a terminal too narrow for a table.
    A table of two columns (key and value) is already a list: a line per row, where each fits the width (a line
    that does not would wrap, and the terminal folds a value behind a blank key's padding as one word)."""
    lines = [shown.title]
    if len(shown.columns) == 2:
        pad = max((len(row[0]) for row in shown.cells), default=0)
        pairs = [f"{key:<{pad}}  {value}" for key, value in shown.cells]
        if max(map(len, pairs), default=0) <= width:
            return [*lines, *pairs]
    pad = max(map(len, shown.columns), default=0)
    for row in shown.cells:
        lines += ["", *(f"{name:<{pad}}  {text}" for name, text in zip(shown.columns, row))]
    return lines
