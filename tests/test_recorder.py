"""The recorder's copy rows: rows given one at a time (`copy`) and blocks of rows given as arrays (`copies_of`, steps
done at once) make the same frame, in the order they were recorded, as every row given one at a time."""

import numpy as np
import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.engines.recorder import COPY_COLUMNS, COPY_COUNTS, Recorder

ROW = st.tuples(st.integers(0, 50), st.sampled_from(["H2D", "D2D", "D2H"]), st.integers(1, 9),
                st.integers(1, 2**40), st.sampled_from(["file", "slab:gate"]), st.sampled_from(["ring", "staging:up"]))
# a recording: pieces in order, each one row given alone (False) or a block of rows given at once (True)
RECORDING = st.lists(st.tuples(st.booleans(), st.lists(ROW, min_size=1, max_size=6)), max_size=8)


@settings(max_examples=60, deadline=None)
@given(RECORDING)
def test_blocks_and_single_rows_keep_their_order(recording):
    blocks, one_at_a_time = Recorder(), Recorder()
    for as_block, rows in recording:
        for row in rows:
            one_at_a_time.copy(*row)
        if as_block:
            columns = list(zip(*rows))
            blocks.copies_of(*(np.array(values, np.int64 if name in COPY_COUNTS else object)
                               for name, values in zip(COPY_COLUMNS, columns)))
        else:
            for row in rows:
                blocks.copy(*row)
    pd.testing.assert_frame_equal(blocks.copy_frame(), one_at_a_time.copy_frame())
    pd.testing.assert_frame_equal(blocks.copy_frame(), one_at_a_time.copy_frame())  # building it twice: the same


def test_a_run_that_keeps_no_copy_plan_keeps_no_block():
    recorder = Recorder(copy_plan=False)
    recorder.copies_of(np.array([1]), np.array(["H2D"], object), np.array([2]), np.array([3]),
                       np.array(["file"], object), np.array(["ring"], object))
    assert recorder.copy_frame().empty
