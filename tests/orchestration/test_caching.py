"""Prefect result caching over the object store (stoker/orchestration/caching.py): a task run shows
Cached only while the store holds its output with a valid manifest, its result says
cache_hit=True, the records live in the store, and a checkpoint is evaluated once. Real
parts: the Prefect test server, a moto S3 endpoint, real evaluation processes."""

import pytest

from stoker.config import load_config
from stoker.contracts.results import EvalResult, ShardInfo
from stoker.storage.store import Store
from tests.conftest import prepare_shards, task_states, tiny_dict


# ---- the parts, without Prefect --------------------------------------------------------
def test_a_record_read_back_says_cache_hit_and_only_stoker_types_are_read():
    from stoker.orchestration.caching import StoreResultSerializer

    ser = StoreResultSerializer()
    built = ShardInfo("k", "shards/k", "file:///s/shards/k", 10, 2, 384, "<u2", cache_hit=False)
    back = ser.loads(ser.dumps(built))
    assert back == ShardInfo(**{**built.as_dict(), "cache_hit": True})
    ev = EvalResult(checkpoint_uri="file:///c", step=4, val_loss=1.5, val_ppl=4.5, windows=3, seconds=2.0)
    assert ser.loads(ser.dumps(ev)) == ev
    with pytest.raises(TypeError):
        ser.dumps({"not": "ours"})
    with pytest.raises(KeyError):  # a record of a type stoker does not know is never built
        ser.loads(b'{"type": "Popen", "data": {}}')
    with pytest.raises(TypeError):  # a record whose type changed since: unreadable, the task runs
        ser.loads(b'{"type": "DatasetInfo", "data": {"fingerprint": "f"}}')


def test_content_keys_are_the_stores_and_a_record_counts_only_with_its_output(tiny_config):
    """The keys name what data.prepare made (a change there fails here), and a record's output
    is held only while the store has it with a valid manifest."""
    from stoker.data import prepare
    from stoker.tasks import data as keys

    cfg = tiny_config()
    store, shards = prepare_shards(cfg)
    dataset = prepare.download_dataset(cfg.data, store)
    tok = prepare.train_tokenizer(dataset, cfg.tokenizer, store)
    params = {"data": cfg.data, "storage": cfg.storage, "dataset": dataset, "datasets": [dataset], "tokenizer": tok}
    [link] = store.walk_files("datasets/by-source")
    assert keys.dataset_key(store, params).startswith(link.removesuffix(".json") + "-")
    recipe = keys.tokenizer_key(store, {**params, "tokenizer": cfg.tokenizer}).split("-")[0]
    assert store.exists(f"tokenizers/{recipe}/tokenizer.json")
    assert keys.shards_key(store, params).startswith(shards.cache_key + "-")
    assert keys.holds_dataset(store, dataset) and keys.holds_tokenizer(store, tok)
    [one] = shards.sets
    assert keys.holds_shards(store, one)
    store.rm(f"{one.key}/manifest.json")
    assert not keys.holds_shards(store, one)
    store.rm("tokenizers")
    assert not keys.holds_tokenizer(store, tok)
    store.rm("datasets")
    assert not keys.holds_dataset(store, dataset)


# ---- through Prefect -------------------------------------------------------------------
DATA_TASKS = ["download_dataset", "train_tokenizer", "tokenize_and_shard"]
# no Prefect record: they run each time (their log lines, artifacts, the run's samples of what
# they removed), their decisions read from the store by content (DedupInfo.cache_hit, FilterInfo's)
UNCACHED = ["filter_documents", "dedup_and_decontaminate"]


@pytest.mark.e2e
def test_data_tasks_show_cached_only_while_the_s3_store_holds_their_output(prefect_server, s3_root):
    from stoker.flows.pipeline import prepare_data

    root, options = s3_root
    cfg = load_config(tiny_dict(root, storage={"storage_options": options}))
    args = (cfg.data, cfg.tokenizer, cfg.storage)

    first = prepare_data(*args, return_state=True)
    assert not first.result().cache_hit and not any(d.cache_hit for d in first.result().dedup)
    assert task_states(first, DATA_TASKS + UNCACHED) == dict.fromkeys(DATA_TASKS + UNCACHED, "Completed")
    store = Store(root, options)
    records = store.walk_files("prefect-results")  # the records live in the store itself
    assert sorted(name.split("/")[0] for name in records) == sorted(DATA_TASKS)

    second = prepare_data(*args, return_state=True)
    assert task_states(second, DATA_TASKS + UNCACHED) == {
        **dict.fromkeys(DATA_TASKS, "Cached"),
        **dict.fromkeys(UNCACHED, "Completed"),
    }
    shards = second.result()
    assert shards.cache_hit and shards.cache_key == first.result().cache_key
    assert shards.dedup and all(d.cache_hit for d in shards.dedup)

    # a record that cannot be read is no record: the task runs (and finds its shards)
    [record] = [name for name in records if name.startswith("tokenize_and_shard/")]
    store.write_bytes(f"prefect-results/{record}", b"{not json")
    unreadable = prepare_data(*args, return_state=True)
    assert task_states(unreadable, DATA_TASKS)["tokenize_and_shard"] == "Completed" and unreadable.result().cache_hit
    assert store.read_bytes(f"prefect-results/{record}") != b"{not json"  # recorded anew

    for folder in ("datasets", "dedup", "tokenizers", "shards"):  # the data deleted; the records stay
        store.rm(folder)
    third = prepare_data(*args, return_state=True)
    # built again, not masked
    assert task_states(third, DATA_TASKS + UNCACHED) == dict.fromkeys(DATA_TASKS + UNCACHED, "Completed")
    assert not third.result().cache_hit
    assert store.exists(f"{third.result().key}/manifest.json")


def _checkpoint(cfg, store, shards, step: int) -> str:
    """A committed checkpoint of the run's model (written in this process, no training)."""
    import torch

    from stoker.families.gpt2.model import GPT
    from stoker.families.spec import param_groups
    from tests.training.test_checkpoint import save_and_commit

    model = GPT(cfg.model, shards.vocab_size, seed=step)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    key, _ = save_and_commit(
        store,
        cfg.resolved_run_name(),
        model=model,
        optimizer=opt,
        scheduler=sched,
        step=step,
        tokens_seen=0,
        seed=0,
        rank=0,
        world_size=1,
        meta={"run_name": cfg.resolved_run_name(), "model_hash": cfg.model_hash(), "numerics": "finite"},
        keep_latest_k=2,
    )
    return key


@pytest.mark.e2e
def test_a_checkpoint_is_evaluated_once_even_by_two_evaluations_at_once_and_a_replaced_one_again(
    prefect_server, tiny_config, monkeypatch
):
    from concurrent.futures import ThreadPoolExecutor
    from threading import Barrier

    from stoker.flows.evaluation_flow import evaluate_checkpoint_flow
    from stoker.storage.checkpoints import COMMIT_FILE, EVAL_PIN, pin_for_evaluation
    from stoker.storage.runs import pin_run_folder
    from stoker.tasks import evaluation as evaluate

    cfg = tiny_config(run_name="cached")
    store, shards = prepare_shards(cfg)
    pin_run_folder(store, cfg, shards)
    key = _checkpoint(cfg, store, shards, step=4)
    processes = []
    real = evaluate.run_evaluation
    monkeypatch.setattr(evaluate, "run_evaluation", lambda *a, **k: processes.append(a[2]) or real(*a, **k))

    # two triggers of one checkpoint at once (the automation and a user, say): one evaluates,
    # the other waits for its lock in the store, then reads its record (Cached)
    together = Barrier(2)

    def trigger(_):
        together.wait()
        return evaluate_checkpoint_flow(store.url(key), return_state=True)

    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(trigger, range(2)))
    assert sorted(task_states(s, ["evaluate_checkpoint"])["evaluate_checkpoint"] for s in both) == [
        "Cached",
        "Completed",
    ]
    assert processes == [key]  # one evaluation process
    first = next(s for s in both if task_states(s, ["evaluate_checkpoint"])["evaluate_checkpoint"] == "Completed")
    assert both[0].result() == both[1].result()
    locks = "prefect-results/.locks"
    assert not store.exists(locks) or not store.walk_files(locks)  # the lock released
    # the same checkpoint again (a second trigger): Cached, no evaluation process, same answer;
    # a pin its first evaluation failed to remove is not left behind by the hit
    pin_for_evaluation(store, key)
    second = evaluate_checkpoint_flow(store.url(key), return_state=True)
    assert task_states(second, ["evaluate_checkpoint"])["evaluate_checkpoint"] == "Cached" and processes == [key]
    assert second.result() == first.result() and isinstance(second.result(), EvalResult)
    assert not store.exists(f"{key}/{EVAL_PIN}")
    assert store.walk_files("prefect-results/evaluate_checkpoint")

    # replaced (same folder, another commit manifest): another hash, evaluated again
    manifest = store.read_json(f"{key}/{COMMIT_FILE}")
    store.write_json(f"{key}/{COMMIT_FILE}", {**manifest, "committed_at": manifest["committed_at"] + 1})
    third = evaluate_checkpoint_flow(store.url(key), return_state=True)
    assert task_states(third, ["evaluate_checkpoint"])["evaluate_checkpoint"] == "Completed" and processes == [key, key]
