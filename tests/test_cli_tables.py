"""sim.cli.tables: a table laid out for a terminal's width never runs past it and never cuts a word or a number;
what it leaves out it names. Rendered through rich itself, as the commands print it."""

import re

from hypothesis import assume, given, settings
from hypothesis import strategies as st
from rich.console import Console

from sim.cli.tables import Table, layout, table

_BOX = re.compile(r"[\u2500-\u257f]+")  # box drawing
NOTE_WORDS = {"more", "column:", "columns:", "--wide", "shows", "them)"}  # "(2 more columns: a, b; --wide shows them)"


def rendered(shown: Table, width: int) -> list[str]:
    console = Console(width=width, record=True, highlight=False, color_system=None, force_terminal=False)
    with console.capture() as captured:
        for part in layout(shown, width):
            console.print(part)
    return captured.get().splitlines()


def tokens(lines) -> set[str]:
    return {word for line in lines for word in _BOX.sub(" ", line).split()}


def cell_tokens(shown: Table) -> set[str]:
    return tokens([shown.title, *shown.columns, *(cell for row in shown.cells for cell in row)])


ROWS = [{"name": "rtx-4070-laptop-8gb-windows", "os": "windows", "vram_gib": 7.9961, "ram_gib": 64.0,
         "ssd_gbps": 6.5, "path": "/home/someone/expertsim/scenarios/hardware/rtx-4070-laptop-8gb-windows.toml"},
        {"name": "h200", "os": "linux", "vram_gib": 140.4, "ram_gib": 128.0, "ssd_gbps": 1.51,
         "path": "/home/someone/expertsim/scenarios/hardware/h200.toml"}]


def test_a_table_that_fits_is_shown_whole_with_numbers_as_formatted():
    lines = rendered(table("profiles", ROWS), 200)
    assert max(map(len, lines)) <= 200
    assert {"7.9961", "140.4", "1.51", "6.50", "/home/someone/expertsim/scenarios/hardware/h200.toml"} <= tokens(lines)
    assert not {"1.5100", "6.5000", "6.5"} & tokens(lines)  # a column's cells at the places it needs, alike


def test_few_rows_too_wide_side_by_side_are_turned_on_their_side():
    per_class = [{"class": c, **{f"figure_{k}": 1_000_000 * (k + 1) + c for k in range(12)}} for c in (0, 1)]
    lines = rendered(table("per class", per_class), 80)
    assert max(map(len, lines)) <= 80
    assert any("class 0" in line and "class 1" in line for line in lines)  # the rows are now columns
    row = next(line for line in lines if "figure_11" in line)
    assert "12,000,000" in row and "12,000,001" in row


def test_many_rows_too_wide_keep_the_columns_that_fit_and_name_the_rest():
    shown = table("profiles", ROWS * 4)
    lines = rendered(shown, 80)
    assert max(map(len, lines)) <= 80
    assert lines[-1] == "(1 more column: path; --wide shows them)"
    assert "7.9961" in tokens(lines) and not any("/home" in line for line in lines)


def test_a_terminal_too_narrow_for_two_columns_gets_one_block_per_row():
    lines = rendered(table("profiles", ROWS * 4), 30)
    assert lines[0] == "profiles" and max(map(len, lines)) <= 30
    assert "vram_gib  140.4" in lines and "rtx-4070-laptop-8gb-windows" in tokens(lines)


def test_a_key_value_table_too_narrow_is_a_line_per_key():
    lines = rendered(table("trace written", [{"key": "sha256", "value": "f" * 64}, {"key": "rows", "value": 100_064}],
                           ["key", "value"]), 72)
    assert lines == ["trace written", "sha256  " + "f" * 64, "rows    100,064"]


def test_a_key_value_list_that_would_wrap_is_a_block_per_row():
    """Found by the property test below: a blank key's padding before a number made one 21-character word at 20
    columns, which the terminal folded ("-10,00" / "0")."""
    lines = rendered(table("t", [{"_": None, "__": -10000}, {"_": 10_000_000.0, "__": None}], ["_", "__"]), 20)
    assert max(map(len, lines)) <= 20 and "__  -10,000" in lines and "_   10,000,000.0" in lines


def test_wide_shows_every_column_at_its_full_width(capsys, monkeypatch):
    """--wide: the whole table even where the output is narrower (here an 80-column "pipe", as the docs' pages
    print at 100); without it the path column is left out and named."""
    from sim.cli import tables

    monkeypatch.setattr(tables, "PIPED_WIDTH", 80)
    tables.show(table("profiles", ROWS * 4), wide=True)
    row = next(line for line in capsys.readouterr().out.splitlines() if "rtx-4070-laptop-8gb-windows.toml" in line)
    assert "7.9961" in row and "windows" in row and len(row) > 80
    tables.show(table("profiles", ROWS * 4))
    narrow = capsys.readouterr().out.splitlines()
    assert max(map(len, narrow)) <= 80 and narrow[-1] == "(1 more column: path; --wide shows them)"


WORDS = st.text(alphabet="abcdefghij_-/.", min_size=1, max_size=30)
NUMBERS = st.one_of(st.integers(-10**12, 10**12), st.floats(-1e9, 1e9, allow_nan=False))
CELLS = st.one_of(WORDS, NUMBERS, st.lists(WORDS, min_size=1, max_size=6).map(" ".join), st.none())


@settings(max_examples=200, deadline=None)
@given(columns=st.lists(WORDS, min_size=1, max_size=9, unique=True), data=st.data(),
       width=st.integers(min_value=20, max_value=160))
def test_any_table_at_any_width_stays_inside_it_and_cuts_no_word(columns, data, width):
    rows = data.draw(st.lists(st.fixed_dictionaries({c: CELLS for c in columns}), min_size=1, max_size=8))
    shown = table("t", rows, columns)
    lines = rendered(shown, width)
    longest_word = max(len(w) for w in tokens([*shown.columns, *(c for r in shown.cells for c in r)]))
    assume(longest_word + 4 <= width)  # room for a word and its punctuation: below it no layout can help
    assert max(map(len, lines)) <= width, "\n".join(lines)
    named = cell_tokens(shown) | NOTE_WORDS | {f"({n}" for n in range(len(columns))}
    named |= {name + end for name in shown.columns for end in (",", ";")}
    assert tokens(lines) <= named, tokens(lines) - named
