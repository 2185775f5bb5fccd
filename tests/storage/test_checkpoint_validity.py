import os

import pytest

from stoker.arithmetic import schedule
from stoker.config import TrainConfig
from stoker.failures import CheckpointInvalid, ConfigError
from stoker.storage.checkpoints import (
    COMMIT_FILE,
    KEEP_MARKER,
    commit_checkpoint,
    find_latest_valid,
    list_checkpoints,
    local_checkpoint_dir,
    new_checkpoint_key,
    prune_checkpoints,
    rank_receipt_key,
    rehydrate,
    validate_checkpoint,
)
from stoker.storage.manifest import INVALID_MARKER
from stoker.storage.store import Store, join


def _fake_checkpoint(store, run, step, commit=True):
    key = new_checkpoint_key(store, run, step)
    store.write_bytes(join(key, ".metadata"), b"meta" * 10)
    store.write_bytes(join(key, "__0_0.distcp"), bytes(range(256)) * 4)
    store.write_bytes(join(key, "__1_0.distcp"), bytes(range(256)) * 4)
    if commit:
        commit_checkpoint(store, key, {"step": step, "world_size": 2})
    return key


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return Store("file://" + str(tmp_path))
    root, options = request.getfixturevalue("s3_root")
    return Store(root, options)


def _damage(store, key, how):
    shard = join(key, "__1_0.distcp")
    data = store.read_bytes(shard)
    if how == "no manifest":
        store.rm(join(key, COMMIT_FILE))
    elif how == "truncated shard":
        store.write_bytes(shard, data[: len(data) // 2])
    elif how == "flipped byte":
        store.write_bytes(shard, data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif how == "listed file missing":
        store.rm(shard)
    elif how == "manifest not json":
        store.write_bytes(join(key, COMMIT_FILE), b"{not json")
    elif how == "a listed file is a directory":
        store.rm(shard)
        store.write_bytes(join(shard, "inner"), data)
    elif how == "an entry without its checksum":
        manifest = store.read_json(join(key, COMMIT_FILE))
        del manifest["files"]["__1_0.distcp"]["sha256"]
        store.write_json(join(key, COMMIT_FILE), manifest)
    elif how == "upload stopped halfway":
        store.rm(join(key, COMMIT_FILE))
        store.write_bytes(shard, data[: len(data) // 3])


DAMAGE = [
    "no manifest",
    "truncated shard",
    "flipped byte",
    "listed file missing",
    "manifest not json",
    "upload stopped halfway",
    "a listed file is a directory",
    "an entry without its checksum",
]


@pytest.mark.parametrize(
    "how,reason",
    [
        ("listed file missing", "listed file __1_0.distcp is missing"),
        ("a listed file is a directory", "listed file __1_0.distcp is a directory, not a file"),
        ("an entry without its checksum", "entry for __1_0.distcp has no size and sha256"),
    ],
)
def test_each_damage_is_reported_as_what_it_is(store, how, reason):
    key = _fake_checkpoint(store, "r", 10)
    _damage(store, key, how)
    for deep in (False, True):
        verdict = validate_checkpoint(store, key, deep=deep)
        assert not verdict and reason in verdict.reason


@pytest.mark.parametrize("how", DAMAGE)
def test_damaged_checkpoint_is_never_loaded_and_resume_takes_the_previous(store, how, tmp_path):
    """The choice reads manifests and listings only; damage only a checksum shows (a flipped
    byte) is found by the host's full check, which marks the checkpoint invalid in the
    store, so the next choice skips it."""
    _fake_checkpoint(store, "r", 10)
    newest = _fake_checkpoint(store, "r", 20)
    assert validate_checkpoint(store, newest, deep=True)
    _damage(store, newest, how)
    verdict = validate_checkpoint(store, newest, deep=True)
    assert not verdict and verdict.reason
    cache = str(tmp_path / "cache")
    choice = find_latest_valid(store, "r")
    if choice.checkpoint.step == 20:  # only a checksum can tell
        assert how == "flipped byte"
        with pytest.raises(CheckpointInvalid, match="marked invalid"):
            rehydrate(store, newest, cache)
        assert store.exists(join(newest, INVALID_MARKER))
        choice = find_latest_valid(store, "r")
        assert "marked invalid by a host" in choice.skipped[0][1]
    assert choice.checkpoint.step == 10
    assert [ref.step for ref, _ in choice.skipped] == [20]
    assert os.path.isdir(rehydrate(store, choice.checkpoint.key, cache))


def test_flipped_byte_needs_the_deep_check(store):
    key = _fake_checkpoint(store, "r", 5)
    _damage(store, key, "flipped byte")
    assert validate_checkpoint(store, key, deep=False)  # sizes still match
    assert "checksum" in validate_checkpoint(store, key, deep=True).reason


def test_resume_skips_checkpoint_without_commit_marker(store):
    _fake_checkpoint(store, "r", 1)
    _fake_checkpoint(store, "r", 2, commit=False)
    choice = find_latest_valid(store, "r")
    assert choice.checkpoint.step == 1 and "no manifest" in choice.skipped[0][1]
    assert find_latest_valid(store, "other-run").checkpoint is None


def test_newest_first_and_attempt_suffix(store):
    _fake_checkpoint(store, "r", 3, commit=False)
    _fake_checkpoint(store, "r", 3)  # a retry of step 3 takes a new folder
    _fake_checkpoint(store, "r", 12)
    assert [r.name for r in list_checkpoints(store, "r")] == ["step-00000012", "step-00000003.a1", "step-00000003"]


def test_retention_keeps_k_committed_and_marked(store):
    keys = [_fake_checkpoint(store, "r", s) for s in (1, 2, 3, 4)]
    store.write_bytes(join(keys[0], KEEP_MARKER), b"")
    deleted = prune_checkpoints(store, "r", keep_latest_k=2)
    assert deleted == [keys[1]]
    assert [r.step for r in list_checkpoints(store, "r")] == [4, 3, 1]


@pytest.mark.parametrize("how", DAMAGE)
def test_resume_with_a_local_cache_downloads_only_a_valid_checkpoint(s3_root, tmp_path, how):
    root, options = s3_root
    store = Store(root, options)
    _fake_checkpoint(store, "r", 10)
    newest = _fake_checkpoint(store, "r", 20)
    _damage(store, newest, how)
    cache = str(tmp_path / "cache")
    with pytest.raises(ValueError, match="not valid"):
        rehydrate(store, newest, cache)
    choice = find_latest_valid(store, "r")
    assert choice.checkpoint.step == 10 and [r.step for r, _ in choice.skipped] == [20]
    local = rehydrate(store, choice.checkpoint.key, cache)
    assert sorted(os.listdir(local)) == sorted([".metadata", "__0_0.distcp", "__1_0.distcp", COMMIT_FILE])
    leftovers = [
        p
        for p in os.listdir(os.path.dirname(local))
        if ".tmp-" in p or (p.startswith("step-00000020") and not p.endswith(".lock"))
    ]
    assert leftovers == []  # nothing of the damaged one is kept


def test_resume_skips_a_checkpoint_of_another_model_or_run_with_its_reason(store, tmp_path):
    ours = {"run_name": "r", "model_hash": "m-ours"}
    older = _fake_checkpoint(store, "r", 100, commit=False)
    commit_checkpoint(store, older, {"step": 100, "world_size": 2, **ours})
    foreign = _fake_checkpoint(store, "r", 200, commit=False)  # a wider model, same run name
    commit_checkpoint(store, foreign, {"step": 200, "world_size": 2, "run_name": "r", "model_hash": "m-wide"})
    cache = str(tmp_path / "cache")
    choice = find_latest_valid(store, "r", expected=ours)
    assert choice.checkpoint.key == older
    [(ref, reason)] = choice.skipped
    assert ref.key == foreign and "another model hash" in reason and "m-wide" in reason
    # named explicitly (--resume-from), it is refused before any byte is read
    with pytest.raises(ConfigError, match="another model hash"):
        rehydrate(store, foreign, cache, expected=ours)
    assert not os.path.exists(local_checkpoint_dir(cache, store, foreign))


def test_a_stale_host_copy_is_discarded_when_the_store_holds_another_commit(s3_root, tmp_path):
    store, cache = Store(*s3_root), str(tmp_path / "cache")
    key = _fake_checkpoint(store, "r", 100)
    old = rehydrate(store, key, cache)
    assert open(os.path.join(old, "__1_0.distcp"), "rb").read() == bytes(range(256)) * 4
    store.rm("runs/r")  # the run is trained again under the same name: same key, new bytes
    store.write_bytes(join(key, ".metadata"), b"meta" * 10)
    store.write_bytes(join(key, "__0_0.distcp"), b"new-0" * 50)
    store.write_bytes(join(key, "__1_0.distcp"), b"new-1" * 50)
    commit_checkpoint(store, key, {"step": 100, "world_size": 2})
    fresh = rehydrate(store, key, cache)
    assert open(os.path.join(fresh, "__1_0.distcp"), "rb").read() == b"new-1" * 50


def test_receipts_without_a_commit_are_skipped_and_retention_removes_them(store):
    """Every rank uploaded and wrote its receipt, rank 0 died before commit.json: the folder
    is never committed after the fact (the receipts may not be of one save); it is skipped
    with its reason, and deleted once a newer checkpoint is committed, as are empty folders."""
    _fake_checkpoint(store, "r", 10)
    orphan = _fake_checkpoint(store, "r", 20, commit=False)
    for rank in (0, 1):
        store.write_json(rank_receipt_key(orphan, rank), {"rank": rank, "files": {}})
    empty = new_checkpoint_key(store, "r", 25)
    store.write_bytes(join(empty, "partial.distcp"), b"")
    choice = find_latest_valid(store, "r")
    assert choice.checkpoint.step == 10
    assert [(ref.step, "no manifest" in why) for ref, why in choice.skipped] == [(25, True), (20, True)]
    assert prune_checkpoints(store, "r", keep_latest_k=2) == []  # nothing newer is committed yet
    _fake_checkpoint(store, "r", 30)
    assert sorted(prune_checkpoints(store, "r", keep_latest_k=2)) == sorted([orphan, empty])
    assert [r.step for r in list_checkpoints(store, "r")] == [30, 10]


def test_a_local_checkpoint_is_fully_checked_once_per_host(tmp_path):
    store, cache = Store("file://" + str(tmp_path / "store")), str(tmp_path / "cache")
    key = _fake_checkpoint(store, "r", 7)
    assert rehydrate(store, key, cache) == store.local_path(key)
    assert os.path.exists(local_checkpoint_dir(cache, store, key) + ".verified.json")
    assert rehydrate(store, key, cache)  # a hit: the stamp holds
    # damage after the check, keeping the size and resetting the mtime: the stamp (ctime,
    # inode) breaks, so this host hashes again, and marks it
    path = store.local_path(join(key, "__1_0.distcp"))
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(CheckpointInvalid, match="__1_0.distcp fails its sha256"):
        rehydrate(store, key, cache)
    assert not validate_checkpoint(store, key)


def test_a_run_refuses_other_data_or_another_model_before_launch(tmp_path):
    """Resuming may change the world size, parallelism or micro-batch, never the tensor
    shapes or the data: the run folder refuses both with a clear error before anything runs."""
    from stoker.config import load_config
    from stoker.contracts.results import DataShards, ShardInfo
    from stoker.storage.runs import pin_run_folder
    from tests.conftest import tiny_dict

    store = Store("file://" + str(tmp_path))
    store.write_bytes("shards/aaa/tokenizer.json", b"{}")
    store.write_bytes("shards/bbb/tokenizer.json", b"{}")

    def one(key, name="main"):
        return ShardInfo(
            cache_key=key,
            key=f"shards/{key}",
            url=store.url(f"shards/{key}"),
            cache_hit=True,
            num_train_tokens=1,
            num_val_tokens=1,
            vocab_size=384,
            dtype="uint16",
            name=name,
        )

    def shards(key):
        return DataShards([one(key)])

    cfg = load_config(tiny_dict(store.root, run_name="pinned"))
    pin_run_folder(store, cfg, shards("aaa"))
    split = load_config(
        tiny_dict(
            store.root,
            run_name="pinned",
            launch={"nproc_per_node": 1},
            train={"micro_batch_size": 4},
            engine={"parallelism": "fsdp"},
        )
    )
    pin_run_folder(store, split, shards("aaa"))  # another split of the same run: fine
    with pytest.raises(ConfigError, match="was trained on shard set aaa"):
        pin_run_folder(store, cfg, shards("bbb"))
    wider = load_config(tiny_dict(store.root, run_name="pinned", model={"n_embd": 64}))
    with pytest.raises(ConfigError, match="already holds a different model"):
        pin_run_folder(store, wider, shards("aaa"))
    # a mixture's run: sources may be added or dropped; a source keeps its shard set
    mixed = load_config(tiny_dict(store.root, run_name="mixed"))
    pin_run_folder(store, mixed, DataShards([one("aaa", "web"), one("ccc", "docs")], mixture=True))
    pin_run_folder(store, mixed, DataShards([one("aaa", "web"), one("ddd", "code")], mixture=True))
    with pytest.raises(ConfigError, match=r"data.sources\[docs\]: run 'mixed' was trained on shard set ccc"):
        pin_run_folder(store, mixed, DataShards([one("aaa", "web"), one("eee", "docs")], mixture=True))


def test_a_damaged_host_cache_copy_of_a_checkpoint_is_dropped_and_fetched_again(s3_root, tmp_path, caplog):
    root, options = s3_root
    store, cache = Store(root, options), str(tmp_path / "cache")
    key = _fake_checkpoint(store, "r", 7)
    local = rehydrate(store, key, cache)
    path = os.path.join(local, "__1_0.distcp")
    st = os.stat(path)
    with open(path, "r+b") as f:  # the host's copy: same size, mtime reset
        f.seek(100)
        f.write(bytes([(bytes(range(256)) * 4)[100] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with caplog.at_level("WARNING", logger="stoker.host_cache"):
        assert rehydrate(store, key, cache) == local
    assert open(path, "rb").read() == bytes(range(256)) * 4
    assert "__1_0.distcp fails its sha256 checksum" in caplog.text and "fetching it again" in caplog.text
    assert validate_checkpoint(store, key)  # the store's copy is fine: not marked invalid


def test_retention_spares_a_checkpoint_whose_evaluation_is_pending(store):
    import time

    from stoker.storage.checkpoints import EVAL_PIN, finish_evaluation, pin_for_evaluation

    keys = [_fake_checkpoint(store, "r", s) for s in (1, 2, 3, 4)]
    pin_for_evaluation(store, keys[0])  # step 1's evaluation has not read it yet
    assert prune_checkpoints(store, "r", keep_latest_k=2) == [keys[1]]
    assert [r.step for r in list_checkpoints(store, "r")] == [4, 3, 1]
    # its evaluation is done: the pin goes, and the retention it held off happens then
    assert finish_evaluation(store, "r", keys[0], keep_latest_k=2) == [keys[0]]
    assert [r.step for r in list_checkpoints(store, "r")] == [4, 3]
    # a pin older than the limit (an evaluation that died) keeps nothing
    old = _fake_checkpoint(store, "r", 0)
    store.write_json(join(old, EVAL_PIN), {"at": time.time() - 100})
    assert prune_checkpoints(store, "r", keep_latest_k=2, pin_seconds=50) == [old]
    assert finish_evaluation(store, "r", keys[2], keep_latest_k=2) == []  # never pinned: no-op


def _trained(store, run, step, train):
    """A committed checkpoint at `step` of a run trained under `train`'s schedule (its signature
    in the manifest, as the ranks write it)."""
    key = _fake_checkpoint(store, run, step, commit=False)
    commit_checkpoint(store, key, {"step": step, "world_size": 2, "schedule": schedule.signature(train)})
    return key


def _wsd(max_steps, decay_steps):
    return TrainConfig(
        max_steps=max_steps, warmup_steps=2, lr_schedule="wsd", decay_steps=decay_steps, lr=1e-2, min_lr=1e-3
    )


@pytest.mark.parametrize("schedule_known", [True, False], ids=["the schedule in force", "control: newest K alone"])
def test_retention_keeps_the_stable_checkpoint_the_newest_k_are_not(tmp_path, schedule_known):
    """Two kept, a checkpoint every 2 steps, a decay from step 11: the newest two (20, 18) are
    inside the decay, and the answer of a run trained longer is step 10, the newest before it.
    The ranks' retention keeps it, and so does the one an evaluation held off (finish_evaluation,
    which once pruned to the newest K alone). The control (no schedule: K alone) loses it, so the
    assertion can fail."""
    from stoker.storage.checkpoints import finish_evaluation, pin_for_evaluation

    store, train = Store("file://" + str(tmp_path)), _wsd(20, 9)
    assert schedule.stable_until(train) == 11
    keys = {step: _trained(store, "r", step, train) for step in range(2, 21, 2)}
    pin_for_evaluation(store, keys[2])  # step 2's evaluation is pending: retention spares it for now
    given = train if schedule_known else None
    prune_checkpoints(store, "r", keep_latest_k=2, train=given)
    finish_evaluation(store, "r", keys[2], keep_latest_k=2, train=given)  # its evaluation done: pruned again
    kept = [r.step for r in list_checkpoints(store, "r")]
    assert kept == ([20, 18, 10] if schedule_known else [20, 18])
    longer = _wsd(40, 9)  # trained longer: it goes on from step 10, or from nothing
    choice = find_latest_valid(store, "r", train=longer)
    assert (choice.checkpoint.step if choice.checkpoint else None) == (10 if schedule_known else None)


def test_retention_during_an_extension_keeps_what_the_schedule_in_force_goes_on_from(tmp_path):
    """A run decayed from step 16 (checkpoints 16, 19, 20) trained longer (a decay from step 30)
    goes on from 16 and commits 17: its newest checkpoint before its decay is 17, not the old 20
    (inside the old decay, never gone on from), though 20 is the newest at or before step 30.
    Keeping by step alone kept 20 and deleted 17 and 16: a crash then would start the run over."""
    store, old, longer = Store("file://" + str(tmp_path)), _wsd(20, 4), _wsd(40, 10)
    for step in (16, 19, 20):
        _trained(store, "r", step, old)
    _trained(store, "r", 17, longer)
    assert not schedule.may_go_on_from(schedule.signature(old), 20, longer)  # though 20 <= 30
    prune_checkpoints(store, "r", keep_latest_k=2, train=longer)
    assert [r.step for r in list_checkpoints(store, "r")] == [20, 19, 17]
    assert find_latest_valid(store, "r", train=longer).checkpoint.step == 17


def test_a_missing_checkpoint_is_a_permanent_error_said_once(store, tmp_path):
    from stoker.failures import CheckpointUnavailable, is_transient

    keys = [_fake_checkpoint(store, "r", s) for s in (1, 2)]
    store.rm(keys[0])  # deleted (retention) before it was read
    with pytest.raises(CheckpointUnavailable, match="does not exist.*keep_latest_k") as err:
        rehydrate(store, keys[0], str(tmp_path / "cache"))
    assert not is_transient(err.value)
    assert isinstance(err.value, CheckpointInvalid)  # a resume still falls back from it
