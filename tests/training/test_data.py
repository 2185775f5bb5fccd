import numpy as np

from tests.conftest import prepare_shards
from training.data import TokenStream, batch_offsets, eval_offsets, train_batch


def test_batch_order_is_a_pure_function_of_seed_step_rank():
    a = batch_offsets(seed=1, step=5, rank=1, micro=0, count=8, high=10_000)
    b = batch_offsets(seed=1, step=5, rank=1, micro=0, count=8, high=10_000)
    assert np.array_equal(a, b)
    for other in [dict(seed=2, step=5, rank=1), dict(seed=1, step=6, rank=1), dict(seed=1, step=5, rank=0)]:
        assert not np.array_equal(a, batch_offsets(**other, micro=0, count=8, high=10_000))


def test_eval_windows_are_fixed_and_in_range():
    offs = eval_offsets(1000, 32, 10)
    assert np.array_equal(offs, eval_offsets(1000, 32, 10))
    assert offs.min() >= 0 and offs.max() <= 1000 - 33


def test_batches_come_from_the_shards(tiny_config):
    cfg = tiny_config()
    store, shards = prepare_shards(cfg)
    stream = TokenStream(store.local_path(shards.key), "train")
    x, y = train_batch(stream, 32, 4, seed=1, step=0, rank=0, micro=0)
    assert x.shape == y.shape == (4, 32)
    assert int(x.max()) < stream.vocab_size
    assert (x[:, 1:] == y[:, :-1]).all()  # targets are the inputs shifted by one
