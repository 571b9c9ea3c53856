"""Rows kept in a temporary file (sim/trace/rowfile.py) against the array they were written from: the oracle is
numpy's own slicing of that array."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.trace import rowfile
from sim.trace.rowfile import FileRows, RowFile, row_blocks


def written(rows: np.ndarray, pieces: list[int]) -> FileRows:
    """The rows appended to a RowFile in pieces of these lengths (the rest in one last piece)."""
    file, at = RowFile(rows.shape[1:]), 0
    for n in pieces:
        file.append(rows[at: at + n])
        at += len(rows[at: at + n])
    file.append(rows[at:])
    return file.rows()


arrays = st.tuples(st.integers(0, 40), st.integers(1, 4), st.integers(1, 3), st.integers(0, 2**32 - 1)).map(
    lambda a: np.random.default_rng(a[3]).integers(0, 2**16, size=a[:3], dtype=np.uint16))
bounds = st.one_of(st.none(), st.integers(-50, 50))


@settings(max_examples=200, deadline=None)
@given(arrays, st.lists(st.integers(0, 12), max_size=5), bounds, bounds, bounds, bounds)
def test_file_rows_slice_and_read_as_the_array_does(rows, pieces, a, b, c, d):
    kept = written(rows, pieces)
    assert len(kept) == len(rows) and kept.shape == rows.shape and kept.dtype == rows.dtype and kept.ndim == 3
    assert np.array_equal(np.asarray(kept), rows)
    assert np.array_equal(np.asarray(kept[a:b]), rows[a:b])
    assert np.array_equal(np.asarray(kept[a:b][c:d]), rows[a:b][c:d])
    assert len(kept[a:b][c:d]) == len(rows[a:b][c:d])


def test_only_a_slice_of_rows_is_a_range():
    kept = written(np.zeros((6, 2, 3), np.uint16), [])
    for key in (0, (slice(None), 0), slice(0, 6, 2), [1, 2]):
        with pytest.raises(TypeError, match="read them first"):
            kept[key]


@settings(max_examples=60, deadline=None)
@given(arrays, st.integers(1, 64), st.booleans())
def test_row_blocks_cover_the_rows_in_order(rows, block_bytes, reverse):
    rowfile_blocks = rowfile.ROW_BLOCK_BYTES
    rowfile.ROW_BLOCK_BYTES = block_bytes
    try:
        for source in (rows, written(rows, [5])):
            blocks = list(row_blocks(source, reverse=reverse))
            firsts = [first for first, _ in blocks]
            assert firsts == sorted(firsts, reverse=reverse)
            ordered = sorted(blocks, key=lambda fb: fb[0])
            assert np.array_equal(np.concatenate([b for _, b in ordered]) if blocks else rows[:0], rows)
            assert all(first == sum(len(b) for f, b in ordered if f < first) for first, _ in blocks)
            if isinstance(source, FileRows) and len(rows):  # a file is read a block's bytes at a time
                per_row = rows.itemsize * rows.shape[1] * rows.shape[2]
                assert all(len(b) == max(1, block_bytes // per_row) for f, b in ordered[:-1])
    finally:
        rowfile.ROW_BLOCK_BYTES = rowfile_blocks


def test_rows_of_another_shape_are_refused():
    file = RowFile((2, 3))
    with pytest.raises(ValueError, match="shape"):
        file.append(np.zeros((4, 3, 2), np.uint16))


def test_a_full_disk_is_one_line_naming_the_temporary_directory(monkeypatch):
    import errno

    from sim.errors import InputError

    file = RowFile((2, 3))

    def full(_data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(file._file, "write", full)
    with pytest.raises(InputError) as caught:
        file.append(np.zeros((4, 2, 3), np.uint16))
    message = str(caught.value)
    assert "\n" not in message and "No space left on device" in message and "TMPDIR" in message
    assert "48 bytes" in message  # 4 rows x 2 x 3 ids x 2 bytes
