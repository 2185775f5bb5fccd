"""The data order of a mixture (arithmetic.mixture): exact quotas over every block of K global
batches, on any split of the global batch over ranks; epochs per source; the bad inputs of
data.sources and data.schedule, each one line before any compute."""

import numpy as np
import pytest

from stoker.arithmetic import mixture
from stoker.arithmetic.mixture import MAX_BLOCK_STEPS, Mixture, quotas
from stoker.config import ConfigError, build_config, load_config
from tests.conftest import tiny_dict


def test_k_is_the_smallest_block_whose_shares_are_whole_windows():
    assert quotas([0.7, 0.3], 8) == ((28, 12), 5, True)  # 5 steps x 8 windows: 28 and 12
    assert quotas([1, 1, 1], 8) == ((8, 8, 8), 3, True)
    assert quotas([3, 1], 8) == ((6, 2), 1, True)
    assert quotas([0.333, 0.667], 8) == ((333, 667), 125, True)
    got, k, exact = quotas([0.1234567, 1], 8)  # would need K = 10,000,000 steps: rounded
    assert (k, exact, sum(got)) == (MAX_BLOCK_STEPS, False, MAX_BLOCK_STEPS * 8)
    assert abs(got[0] - 0.1234567 / 1.1234567 * k * 8) < 1


def _sources_seen(m: Mixture, step: int, world: int, accum: int, micro: int) -> np.ndarray:
    """The sources of step's global batch as the ranks read it: each (rank, micro) slice."""
    parts = [m.picks(step, (r * accum + a) * micro, micro) for r in range(world) for a in range(accum)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


@pytest.mark.parametrize("world,accum,micro", [(1, 4, 2), (2, 2, 2)])
def test_every_block_of_k_batches_holds_the_configured_proportions_exactly(world, accum, micro):
    names, windows = ["domain", "web", "code"], [500, 2000, 90]
    schedule = [(10, {"domain": 0.8, "web": 0.2}), (25, {"code": 0.5})]
    m = Mixture(names, [0.5, 0.3, 0.2], schedule, 8, 7, windows)
    one = Mixture(names, [0.5, 0.3, 0.2], schedule, 8, 7, windows)  # world 1, one slice
    for seg in m.segments:
        end = seg.end or seg.start + 4 * seg.block_steps
        assert seg.exact
        for block in range(seg.start, end - seg.block_steps + 1, seg.block_steps):
            seen = [_sources_seen(m, s, world, accum, micro)[0] for s in range(block, block + seg.block_steps)]
            counts = np.bincount(np.concatenate(seen), minlength=3)
            assert tuple(counts) == seg.quotas, (seg, block)
    for step in range(0, 40, 3):  # the same windows whatever the split
        a, b = _sources_seen(m, step, world, accum, micro), one.picks(step)
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    segs = m.segments
    assert [s.quotas for s in segs] == [(20, 12, 8), (16, 4, 4), (64, 16, 40)]  # 0.8:0.2:0.2, then 0.8:0.2:0.5
    assert [s.block_steps for s in segs] == [5, 3, 15]


def test_a_source_that_runs_out_starts_a_new_epoch_in_a_new_order():
    m = Mixture(["small", "big"], [1, 1], [], 8, 3, [12, 10_000])
    drawn: list[int] = []
    for step in range(9):  # 36 windows of 'small': three epochs
        src, win = m.picks(step)
        drawn += win[src == 0].tolist()
    assert len(drawn) == 36
    epochs = [drawn[i : i + 12] for i in range(0, 36, 12)]
    assert all(sorted(e) == list(range(12)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert m.epochs_after(9).tolist() == [3.0, 36 / 10_000]
    assert m.last_step_within(0, 1.0, 9) == 3  # 12 windows after 3 steps, 16 after 4
    assert m.last_step_within(1, 1.0, 9) == 9


@pytest.mark.parametrize(
    "data,expected",
    [
        ({"sources": [{"name": "a", "source": " "}]}, "data.sources.0.source: is empty"),
        ({"sources": [{"name": "a", "source": "/x", "weight": 0}]}, "data.sources.0.weight: must be > 0"),
        ({"sources": [{"name": "a", "source": "/x", "weight": -1}]}, "data.sources.0.weight: must be > 0"),
        ({"sources": [{"name": "a", "source": "/x", "weight": "lots"}]}, "data.sources.0.weight: Input should be a"),
        ({"sources": [{"name": "a", "source": "/x", "weight": "nan"}]}, "data.sources.0.weight: Input should be a"),
        ({"sources": [{"name": "a", "source": "/x"}, {"name": "a", "source": "/y"}]}, "data.sources: names 'a' twice"),
        ({"sources": [{"name": "a b", "source": "/x"}]}, "data.sources.0.name:"),
        (
            {
                "sources": [{"name": "a", "source": "/x"}, {"name": "b", "source": "/y"}],
                "schedule": [{"at_step": 5, "weights": {"a": 1}}, {"at_step": 3, "weights": {"b": 1}}],
            },
            "data.schedule: has at_step 3 after at_step 5",
        ),
        (
            {
                "sources": [{"name": "a", "source": "/x"}, {"name": "b", "source": "/y"}],
                "schedule": [{"at_step": 8, "weights": {"a": 1}}],
            },
            "data.schedule: changes the weights at step 8, but the run ends at train.max_steps=8",
        ),
        (
            {"sources": [{"name": "a", "source": "/x"}], "schedule": [{"at_step": 2, "weights": {"web": 1}}]},
            "data.schedule: at_step 2 names 'web', not a source of data.sources",
        ),
        (
            {"sources": [{"name": "a", "source": "/x"}], "schedule": [{"at_step": 2, "weights": {"a": 0}}]},
            "data.schedule.0.weights: gives 'a' the weight 0.0, which is not a positive number",
        ),
        ({"source": "/x", "sources": [{"name": "a", "source": "/y"}]}, "data: sets both data.source and data.sources"),
    ],
)
def test_bad_mixtures_are_one_line_each_naming_the_field_and_the_fix(tmp_path, data, expected):
    with pytest.raises(ConfigError) as err:
        load_config(tiny_dict("file://" + str(tmp_path), data=data))
    assert len(err.value.problems) == 1, err.value.problems
    assert err.value.problems[0].startswith(expected), err.value.problems


def test_a_mixture_source_takes_the_data_sections_options_unless_it_sets_its_own(tmp_path):
    cfg = build_config(  # the sources are not there: the options are the subject
        tiny_dict(
            "file://" + str(tmp_path),
            data={
                "max_bytes": 1000,
                "text_field": "body",
                "sources": [{"name": "a", "source": "/x"}, {"name": "b", "source": "/y", "max_bytes": 0}],
            },
        )
    )
    (a, wa, ca), (b, wb, cb) = cfg.data.source_configs()
    assert (a, wa, ca.source, ca.max_bytes, ca.text_field) == ("a", 1.0, "/x", 1000, "body")
    assert (b, cb.max_bytes, cb.sources) == ("b", 0, [])


def test_the_picks_of_a_step_are_the_same_whatever_step_was_asked_before():
    """The picks are computed for the steps ahead (mixture.CHUNK_POSITIONS at a time): read step
    after step, across a weight change, epochs and chunk ends, each step's picks equal those of a
    mixture asked that step first (a resume there), whose first chunk starts at it."""
    windows, schedule = [97, 1000, 131], [(50, {"a": 0.2, "b": 0.2, "c": 0.6})]
    make = lambda: Mixture(["a", "b", "c"], [0.5, 0.3, 0.2], schedule, 20, 7, windows)  # noqa: E731
    ahead, chunk = make(), mixture.CHUNK_POSITIONS // 20
    steps = 2 * chunk + 30
    for s in range(steps):
        src, win = ahead.picks(s)
        if s % 37 and s % chunk not in (0, chunk - 1) and s != 50:
            continue  # a fresh mixture computes a whole chunk: asked at some steps only
        alone = make()
        part = alone.picks(s, 5, 7)  # a micro-batch of it, asked first
        alone_src, alone_win = alone.picks(s)
        assert np.array_equal(src, alone_src) and np.array_equal(win, alone_win), s
        assert np.array_equal(part[1], win[5:12]), s
    assert ahead.epochs_after(steps).min() > 1  # every source past an epoch
