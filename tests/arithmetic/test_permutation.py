"""The keyed bijection behind the data order (arithmetic.permutation): every index exactly once
for any size, an order per key, in range and distinct at 2**62, and a mixture of 10**10
windows per source that computes its picks without memory per window."""

import tracemalloc

import numpy as np
import pytest

from stoker.arithmetic.mixture import Mixture
from stoker.arithmetic.permutation import Bijection, bijection

SIZES = [1, 2, 3, 4, 5, 7, 8, 97, 1000, 1024, 4096, 65537] + np.random.default_rng(0).integers(9, 20_000, 4).tolist()


@pytest.mark.parametrize("n", SIZES)
def test_every_index_comes_out_exactly_once(n):
    got = bijection(np.arange(n), n, (7, n))
    assert got.dtype == np.int64
    assert np.array_equal(np.sort(got), np.arange(n))


def test_the_same_key_gives_the_same_order_and_another_key_another():
    for n in (8, 9, 97, 4096):
        a = bijection(np.arange(n), n, (1, 2, 3))
        assert np.array_equal(a, Bijection(n, (1, 2, 3))(np.arange(n)))
        for other in ((1, 2, 4), (2, 2, 3), (1, 2)):
            assert not np.array_equal(a, bijection(np.arange(n), n, other)), (n, other)
    assert not np.array_equal(bijection(np.arange(1000), 1000, (0,)), np.arange(1000))  # not the identity


def test_an_index_maps_alone_as_it_does_in_an_array_of_any_dtype():
    n, key = 10**6 + 3, (5,)
    whole = bijection(np.arange(0, n, 997), n, key)
    assert np.array_equal(whole, bijection(np.arange(0, n, 997, dtype=np.uint64), n, key))
    assert [int(bijection(i, n, key)) for i in (0, 997, 1994)] == whole[:3].tolist()
    assert bijection(np.arange(6).reshape(2, 3), n, key).shape == (2, 3)


@pytest.mark.parametrize("n", [10**10, 2**62])
def test_a_huge_domain_gives_values_in_range_and_distinct(n):
    index = np.unique(np.random.default_rng(1).integers(0, n, 10**5, dtype=np.int64))
    index = np.concatenate([index, [0, n - 1]])
    got = bijection(index, n, (3, 4))
    assert got.min() >= 0 and got.max() < n
    assert len(np.unique(got)) == len(np.unique(index))


def test_indices_outside_the_domain_and_empty_domains_are_refused():
    with pytest.raises(ValueError):
        bijection(np.array([10]), 10, (0,))
    with pytest.raises(ValueError):
        bijection(np.array([-1]), 10, (0,))
    with pytest.raises(ValueError):
        Bijection(0, (0,))


def test_a_mixture_of_ten_billion_windows_a_source_stores_no_window_order():
    """At a step deep into the run (each source past its first epoch), a step's picks
    are in range and the memory they take is the batch's, not the sources' windows (a stored
    permutation of 10**10 windows would be 40-80 GB)."""
    windows = [10**10, 10**10 + 7, 3 * 10**9]
    m = Mixture(["web", "code", "books"], [0.5, 0.3, 0.2], [], 512, 11, windows)
    step = 100_000_000  # 5.12e10 windows drawn before it
    assert m.epochs_after(step).min() > 1
    tracemalloc.start()
    try:
        picked = [m.picks(s) for s in range(step, step + 4)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak  # the picks of the chunk of steps ahead (mixture.CHUNK_POSITIONS)
    src = np.concatenate([p[0] for p in picked])
    win = np.concatenate([p[1] for p in picked])
    assert np.all(win >= 0) and np.all(win < np.asarray(windows)[src])
    for i in range(3):  # consecutive draws of an epoch: no window twice
        assert len(np.unique(win[src == i])) == np.sum(src == i)
