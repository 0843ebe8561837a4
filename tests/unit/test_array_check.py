"""The content record of a cached array (``tst_megatron/data/array_check.py``): the array as
built passes; another shape, dtype, a value outside the built range, or other values at the
sampled blocks (a permutation of the same values) are each named."""

import numpy as np

from tst_megatron.data import array_check


def test_the_built_array_passes_and_each_change_is_named():
    rng = np.random.default_rng(0)
    built = rng.permutation(1_000_000).astype(np.uint32)  # larger than the sampled blocks
    record = array_check.summary(built)
    assert record["min"] == 0 and record["max"] == 999_999
    assert array_check.problem(built.copy(), record) is None
    assert "where <u4 [1000000] was built" in array_check.problem(built[:-1], record)
    assert "where <u4" in array_check.problem(built.astype(np.int64), record)
    wide = built.copy()
    wide[0] = 2_000_000
    assert "outside [0, 999999]" in array_check.problem(wide, record)
    shuffled = rng.permutation(built)  # the same values and range, elsewhere
    assert "other values" in array_check.problem(shuffled, record)
    last = built.copy()
    last[-1], last[-2] = last[-2], last[-1]  # the last block is always sampled
    assert "other values" in array_check.problem(last, record)
    assert "no content record" in array_check.problem(built, None)


def test_a_small_array_is_hashed_whole():
    built = np.arange(100, dtype=np.int64)
    record = array_check.summary(built)
    changed = built.copy()
    changed[50] = 49
    assert "other values" in array_check.problem(changed, record)
    assert (
        array_check.problem(np.zeros(0, dtype=np.int64), array_check.summary(np.zeros(0, np.int64)))
        is None
    )
