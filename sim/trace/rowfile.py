"""A long prompt's routing kept in a temporary file instead of memory (issue 33: a million-token prompt's expert ids
are 916 MiB for a 48-layer top-10 model, more than a run may hold).

The generator writes the rows block by block (generator_params._Model.blocks) into a `RowFile`; an engine that reads
its prompt a chunk at a time gets `FileRows`, a range of the file that slices like an array (`rows[a:b]` is another
range, nothing read) and is read when it becomes an array (`np.asarray(rows)`). A pass over every row reads a block
at a time (`row_blocks`), so the memory is a block's, not the prompt's. The file is unnamed (deleted once closed) and
closed when the last range of it is gone.

Hand-written rather than numpy's memmap: the pages of a mapping that are read count in the process's resident memory
until the kernel reclaims them, which is the memory this avoids; a read into a fresh array does not.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Iterator

import numpy as np

from sim.errors import InputError

ROW_BLOCK_BYTES = 32 << 20  # what a pass over a file's rows reads at a time


class RowFile:
    """Rows of one shape appended in order, then read back by range. Thread-safe reads (one file position)."""

    def __init__(self, row_shape: tuple[int, ...], dtype=np.uint16):
        self.row_shape, self.dtype = tuple(int(n) for n in row_shape), np.dtype(dtype)
        self.row_bytes = int(np.prod(self.row_shape)) * self.dtype.itemsize
        self.n_rows = 0
        self._file = tempfile.TemporaryFile(prefix="expertsim-rows-")
        self._lock = threading.Lock()

    def append(self, rows: np.ndarray) -> None:
        if rows.shape[1:] != self.row_shape:
            raise ValueError(f"rows of shape {rows.shape[1:]} appended to a file of rows {self.row_shape}")
        with self._lock:
            try:
                self._file.seek(self.n_rows * self.row_bytes)
                self._file.write(np.ascontiguousarray(rows, self.dtype).data)
            except OSError as exc:  # a full disk: the run cannot go on, and says where the rows were going
                raise InputError(tempfile.gettempdir(), "temporary file of a long prompt's routing",
                                 f"{(self.n_rows + len(rows)) * self.row_bytes:,} bytes",
                                 f"cannot be written ({exc.strerror}); point TMPDIR at a disk with room") from None
            self.n_rows += len(rows)

    def rows(self) -> FileRows:
        """Every row written so far, as a range."""
        return FileRows(self, 0, self.n_rows)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Rows start .. stop - 1 as a fresh array."""
        out = np.empty((stop - start, *self.row_shape), self.dtype)
        view = memoryview(out.reshape(-1).view(np.uint8))
        with self._lock:
            self._file.seek(start * self.row_bytes)
            done = self._file.readinto(view)  # a buffered file reads until the view is full or the file ends
        if done < len(view):
            raise OSError(f"the rows' temporary file ended at byte {start * self.row_bytes + done}")
        return out


class FileRows:
    """Rows start .. stop - 1 of a RowFile: len, shape, dtype and slices like an array of them; np.asarray reads
    them. Only a step-1 slice is a range; anything else is read first (np.asarray(rows)[...])."""

    __slots__ = ("file", "start", "stop")

    def __init__(self, file: RowFile, start: int, stop: int):
        self.file, self.start, self.stop = file, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self), *self.file.row_shape)

    @property
    def dtype(self) -> np.dtype:
        return self.file.dtype

    @property
    def ndim(self) -> int:
        return 1 + len(self.file.row_shape)

    def __getitem__(self, key) -> FileRows:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("rows kept in a file take a slice of rows; read them first (np.asarray) for more")
        start, stop, _ = key.indices(len(self))
        return FileRows(self.file, self.start + start, self.start + max(start, stop))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        rows = self.file.read(self.start, self.stop)
        return rows if dtype is None else rows.astype(dtype)


def row_blocks(rows, reverse: bool = False) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, rows) a block at a time, last block first with `reverse`: an array whole, a file's rows in
    reads of about ROW_BLOCK_BYTES."""
    n = len(rows)
    per_row = max(1, rows.dtype.itemsize * int(np.prod(rows.shape[1:])))
    step = n if isinstance(rows, np.ndarray) else max(1, ROW_BLOCK_BYTES // per_row)
    starts = range(0, n, max(step, 1))
    for first in reversed(starts) if reverse else starts:
        yield first, np.asarray(rows[first: first + step])
