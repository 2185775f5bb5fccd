import numpy as np
import torch

from stoker.arithmetic.mixture import Mixture
from stoker.training.data import Batches, TokenStream, TrainWindows, eval_offsets, train_batch
from tests.conftest import prepare_shards


def test_batch_order_is_a_pure_function_of_seed_and_step():
    def picks(seed, step):
        return Mixture(["main"], [1.0], [], 8, seed, [10_000]).picks(step)[1]

    a = picks(seed=1, step=5)
    assert np.array_equal(a, picks(seed=1, step=5))
    for other in [dict(seed=2, step=5), dict(seed=1, step=6)]:
        assert not np.array_equal(a, picks(**other))


def test_one_source_takes_every_window_once_per_epoch_then_a_new_order():
    m = Mixture(["main"], [1.0], [], 8, 0, [40])
    first = np.concatenate([m.picks(s)[1] for s in range(5)])  # 5 steps x 8 = one epoch
    second = np.concatenate([m.picks(s)[1] for s in range(5, 10)])
    assert sorted(first) == sorted(second) == list(range(40))
    assert not np.array_equal(first, second)
    assert m.epochs_after(10)[0] == 2.0


def test_a_step_sees_the_same_global_batch_at_any_world_size(tiny_config):
    """Resuming on another number of ranks (or another micro-batch split) trains on the same
    sequences: only their split over ranks and micro-steps changes."""
    cfg = tiny_config()
    store, shards = prepare_shards(cfg)
    windows = TrainWindows.one(TokenStream(store.local_path(shards.key), "train"), 16, seed=3, global_batch=8)

    def global_batch(world, accum, micro_batch):
        rows = [
            train_batch(windows, micro_batch, step=7, rank=r, micro=m, accum=accum)[0]
            for r in range(world)
            for m in range(accum)
        ]
        return torch.cat(rows)

    one = global_batch(1, 1, 8)
    assert torch.equal(one, global_batch(2, 2, 2))
    assert torch.equal(one, global_batch(4, 1, 2))
    assert not torch.equal(one, train_batch(windows, 8, step=8, rank=0, micro=0, accum=1)[0])


def test_prefetched_batches_equal_direct_reads_and_count_the_wait(tiny_config):
    cfg = tiny_config()
    store, shards = prepare_shards(cfg)
    windows = TrainWindows.one(TokenStream(store.local_path(shards.key), "train"), 16, seed=3, global_batch=8)
    kw = dict(micro_batch=2, rank=1, accum=2, device=torch.device("cpu"))
    ahead, plain = Batches(windows, prefetch=True, **kw), Batches(windows, prefetch=False, **kw)
    order = [(0, 0), (0, 1), (1, 0), (1, 1), (5, 0)]  # the last one is out of order: read directly
    for step, micro in order:
        x, y = ahead.get(step, micro)
        direct = train_batch(windows, 2, step=step, rank=1, micro=micro, accum=2)
        assert torch.equal(x, direct[0]) and torch.equal(y, direct[1])
        assert torch.equal(x, plain.get(step, micro)[0])
        ahead.prefetch(step, micro)
        plain.prefetch(step, micro)  # off: reads nothing
        assert plain.ahead is None
    assert ahead.ahead[0] == (5, 1) and ahead.wait_seconds > 0
    ahead.close()


def test_eval_windows_are_fixed_and_in_range():
    offs = eval_offsets(1000, 32, 10)
    assert np.array_equal(offs, eval_offsets(1000, 32, 10))
    assert offs.min() >= 0 and offs.max() <= 1000 - 33


def test_batches_come_from_the_shards(tiny_config):
    cfg = tiny_config()
    store, shards = prepare_shards(cfg)
    stream = TokenStream(store.local_path(shards.key), "train")
    x, y = train_batch(TrainWindows.one(stream, 32, seed=1, global_batch=4), 4, step=0, rank=0, micro=0, accum=1)
    assert x.shape == y.shape == (4, 32)
    assert int(x.max()) < stream.vocab_size
    assert (x[:, 1:] == y[:, :-1]).all()  # targets are the inputs shifted by one
