import numpy as np
import torch

from stoker.training.data import Batches, TokenStream, eval_offsets, step_offsets, train_batch
from tests.conftest import prepare_shards


def test_batch_order_is_a_pure_function_of_seed_and_step():
    a = step_offsets(seed=1, step=5, global_batch=8, high=10_000)
    assert np.array_equal(a, step_offsets(seed=1, step=5, global_batch=8, high=10_000))
    for other in [dict(seed=2, step=5), dict(seed=1, step=6)]:
        assert not np.array_equal(a, step_offsets(**other, global_batch=8, high=10_000))


def test_a_step_sees_the_same_global_batch_at_any_world_size(tiny_config):
    """Resuming on another number of ranks (or another micro-batch split) trains on the same
    sequences: only their split over ranks and micro-steps changes."""
    cfg = tiny_config()
    store, shards = prepare_shards(cfg)
    stream = TokenStream(store.local_path(shards.key), "train")

    def global_batch(world, accum, micro_batch):
        rows = [
            train_batch(stream, 16, micro_batch, seed=3, step=7, rank=r, micro=m, accum=accum, world_size=world)[0]
            for r in range(world)
            for m in range(accum)
        ]
        return torch.cat(rows)

    one = global_batch(1, 1, 8)
    assert torch.equal(one, global_batch(2, 2, 2))
    assert torch.equal(one, global_batch(4, 1, 2))
    assert not torch.equal(
        one, torch.cat([train_batch(stream, 16, 8, seed=3, step=8, rank=0, micro=0, accum=1, world_size=1)[0]])
    )


def test_prefetched_batches_equal_direct_reads_and_count_the_wait(tiny_config):
    cfg = tiny_config()
    store, shards = prepare_shards(cfg)
    stream = TokenStream(store.local_path(shards.key), "train")
    kw = dict(block_size=16, micro_batch=2, seed=3, rank=1, accum=2, world_size=2, device=torch.device("cpu"))
    ahead, plain = Batches(stream, prefetch=True, **kw), Batches(stream, prefetch=False, **kw)
    order = [(0, 0), (0, 1), (1, 0), (1, 1), (5, 0)]  # the last one is out of order: read directly
    for step, micro in order:
        x, y = ahead.get(step, micro)
        direct = train_batch(stream, 16, 2, seed=3, step=step, rank=1, micro=micro, accum=2, world_size=2)
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
    x, y = train_batch(stream, 32, 4, seed=1, step=0, rank=0, micro=0, accum=1, world_size=1)
    assert x.shape == y.shape == (4, 32)
    assert int(x.max()) < stream.vocab_size
    assert (x[:, 1:] == y[:, :-1]).all()  # targets are the inputs shifted by one
