"""Schedules for continued pretraining (train.lr_schedule: cosine | wsd | constant | linear), a
run trained longer without starting over, and a branch from any committed checkpoint
(train.branch_from), with real forked gloo ranks.

One module run (`parent`: a 'wsd' run of 12 steps on 2 ranks, decay over the last 3, a checkpoint
every 2 steps and one where the decay begins, step 9) serves the tests: the learning rate it logged
at each step is the one that step used; the same config cut at 8 steps (its decay from step 5) keeps
step 5 beside the newest two, refuses a decay from step 3 (nothing there to go on from) writing
nothing, and trained to 12 goes on from step 5, killed on the way, and ends bitwise equal to it;
branches leave it at step 6 (one with its own schedule, as it would have gone on, on 2 ranks:
bitwise the parent; one that decays now, on 1 rank) and never write it."""

import hashlib
import json
import math
import os

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from stoker import preflight
from stoker.arithmetic import schedule
from stoker.config import ConfigError, TrainConfig, load_config
from stoker.failures import CheckpointInvalid
from stoker.storage.checkpoints import COMMIT_FILE, find_latest_valid, list_checkpoints, rehydrate
from stoker.storage.runs import pin_run_folder
from stoker.storage.store import join
from tests.conftest import prepare_shards, tiny_dict, train_losses
from tests.forked_ranks import run_forked, start_ranks, train_argv

# a decay of 3 steps: it begins off the checkpoint interval (step 9 of 12, step 5 of 8)
WSD = {"lr_schedule": "wsd", "decay_steps": 3, "warmup_steps": 2, "lr": 1e-2, "min_lr": 1e-3}


def _cfg(root, run, keep=2, **train):
    # every checkpoint lands: the backlog never drops one on a loaded host (the branch points)
    checkpoint = {"interval_steps": 2, "keep_latest_k": keep, "max_pending_uploads": 8}
    sections = tiny_dict(root, run_name=run, checkpoint=checkpoint)
    sections["train"].update(train)
    return load_config(sections)


def _model_tensors(store, key):
    path = store.local_path(key)
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    sd = {
        k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.items() if k.startswith(("model.", "optim."))
    }
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return sd


def _same(a, b):
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _final(store, run):
    return list_checkpoints(store, run)[0]


def _bytes_of(store, run) -> dict[str, str]:
    folder = store.local_path(f"runs/{run}")
    out = {}
    for here, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(here, name)
            out[os.path.relpath(path, folder)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def parent(tmp_path_factory):
    root = "file://" + str(tmp_path_factory.mktemp("schedules") / "store")
    cfg = _cfg(root, "parent", keep=8, max_steps=12, **WSD)  # every checkpoint kept: branch points
    store, shards = prepare_shards(cfg)
    records = run_forked(pin_run_folder(store, cfg, shards), shards.key, nproc=2)
    # every 2 steps, and step 9: where its decay begins
    assert [c.step for c in list_checkpoints(store, "parent")] == [12, 10, 9, 8, 6, 4, 2]
    return cfg, store, shards, records, root


def test_the_learning_rate_logged_at_each_step_is_the_one_that_step_used(parent):
    """Step s (1-based) is optimizer step s - 1: it logs lr x lr_multiplier(s - 1), the value the
    plan and the report draw at s (schedule.curve). Logged after scheduler.step(), as it once was,
    step 1's warm-up value was never shown and the decay's came a step early (7e-3, 4e-3, 1e-3 at
    the last three steps logged as 4e-3, 1e-3, 1e-3)."""
    cfg, _, _, records, _ = parent
    logged = {r["step"]: r["lr"] for r in records if r["event"] == "train"}
    assert sorted(logged) == list(range(1, 13))
    drawn = dict(schedule.curve(cfg.train))
    for step, lr in logged.items():
        assert lr == cfg.train.lr * schedule.lr_multiplier(step - 1, cfg.train) == drawn[step], step
    assert logged[1] == pytest.approx(1e-2 / 3)  # the first warm-up value: 1 / (warmup_steps + 1)
    assert [logged[s] for s in (9, 10, 11, 12)] == pytest.approx([1e-2, 7e-3, 4e-3, 1e-3])


def test_each_schedule_at_chosen_steps():
    t = TrainConfig(max_steps=100, warmup_steps=10, lr=1.0, min_lr=0.1)
    m = [schedule.lr_multiplier(s, t) for s in range(100)]
    assert m[0] == 1 / 11 and m[9] == 10 / 11 and m[10] == 1.0  # the warm-up stoker always had
    assert m[55] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))  # cosine, halfway
    linear = t.model_copy(update={"lr_schedule": "linear"})
    assert schedule.lr_multiplier(55, linear) == pytest.approx(0.55)
    assert schedule.lr_multiplier(99, linear) == pytest.approx(0.1 + 0.9 / 90)
    for shape, halfway in (("linear", 0.55), ("sqrt", 0.1 + 0.9 * (1 - math.sqrt(0.5))), ("cosine", 0.55)):
        wsd = t.model_copy(update={"lr_schedule": "wsd", "decay_steps": 20, "decay_shape": shape})
        assert [schedule.lr_multiplier(s, wsd) for s in (10, 50, 79)] == [1.0, 1.0, 1.0]  # stable
        assert schedule.lr_multiplier(89, wsd) == pytest.approx(halfway)  # 10 of the 20 decay steps
        assert schedule.lr_multiplier(99, wsd) == pytest.approx(0.1)  # the last step at min_lr
        assert schedule.stable_until(wsd) == 80
    constant = t.model_copy(update={"lr_schedule": "constant", "warmup_from": 0.1})
    assert schedule.lr_multiplier(0, constant) == pytest.approx(0.1 + 0.9 / 11)  # re-warmed from a tenth
    assert schedule.lr_multiplier(99, constant) == 1.0 and schedule.stable_until(constant) == 100


def test_what_a_branch_warms_up_and_decays_over():
    """Without train.rewarm a branch keeps the whole run's timeline (a cosine branch at step 50 takes
    the curve of steps 0..max_steps there); re-warmed, its warm-up counts from the branch point and
    a cosine or linear schedule decays over the branch's own steps, 'wsd' keeps its decay at the end."""
    uri = "file:///s/runs/p/checkpoints/step-00000050"
    t = TrainConfig(max_steps=100, warmup_steps=10, lr=1.0, min_lr=0.1, branch_from=uri, branch_step=50)
    whole = [schedule.lr_multiplier(s, t) for s in range(100)]
    assert whole == [schedule.lr_multiplier(s, t.model_copy(update={"branch_from": None})) for s in range(100)]
    assert whole[50] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 40 / 90)))  # no warm-up
    warm = t.model_copy(update={"rewarm": True, "warmup_from": 0.1})
    m = [schedule.lr_multiplier(s, warm) for s in range(100)]
    assert m[50] == pytest.approx(0.1 + 0.9 / 11) and m[59] == pytest.approx(0.1 + 0.9 * 10 / 11) and m[60] == 1.0
    assert m[80] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))  # halfway through 60..100
    linear = warm.model_copy(update={"lr_schedule": "linear"})
    assert schedule.lr_multiplier(80, linear) == pytest.approx(0.55)
    assert schedule.stable_until(warm) == 60 and schedule.curve(warm)[0] == (51, warm.lr * m[50])
    wsd = warm.model_copy(update={"lr_schedule": "wsd", "decay_steps": 20})
    assert [schedule.lr_multiplier(s, wsd) for s in (60, 79)] == [1.0, 1.0] and schedule.stable_until(wsd) == 80
    assert schedule.lr_multiplier(99, wsd) == pytest.approx(0.1)
    # re-warming is the schedule's: a checkpoint of the re-warmed branch is judged by it
    assert schedule.signature(warm)["hash"] != schedule.signature(t)["hash"]
    assert schedule.signature(t) == schedule.signature(t.model_copy(update={"branch_from": None, "branch_step": None}))
    assert "re-warmed at the branch point (step 50)" in schedule.describe(warm)


def test_a_bad_schedule_is_one_line_each(tmp_path):
    for train, says in (
        ({"lr_schedule": "wsd"}, "train.decay_steps: is empty, and lr_schedule 'wsd' decays over the last decay_steps"),
        ({"lr_schedule": "wsd", "decay_steps": 7}, "train.decay_steps: is longer than the 6 steps after the warm-up"),
        ({"warmup_steps": 9}, "train.warmup_steps: must be below max_steps=8"),
        ({"lr_schedule": "step"}, "train.lr_schedule: "),
        ({"rewarm": True}, "train.rewarm: is true, and this run is no branch"),
    ):
        with pytest.raises(ConfigError) as err:
            load_config(tiny_dict(f"file://{tmp_path}", train={"warmup_steps": 2, **train}))
        [line] = err.value.problems
        assert line.startswith(says), line


def test_a_wsd_run_is_named_by_its_stable_part_and_a_cosine_one_is_never_stretched(parent, tmp_path):
    cfg, store, shards, _, root = parent
    longer = _cfg(root, None, max_steps=40, **{**WSD, "decay_steps": 8})
    assert longer.resolved_run_name() == _cfg(root, None, max_steps=12, **WSD).resolved_run_name()
    assert _cfg(root, None, max_steps=12).resolved_run_name() != _cfg(root, None, max_steps=40).resolved_run_name()
    cosine = _cfg(f"file://{tmp_path}/store", "cos", max_steps=8)
    pin_run_folder(store_of(cosine), cosine, shards_in(cosine, shards, store))
    with pytest.raises(ConfigError) as err:
        pin_run_folder(store_of(cosine), _cfg(f"file://{tmp_path}/store", "cos", max_steps=12), shards)
    [line] = err.value.problems
    assert line.startswith("train.max_steps: run 'cos' was trained under a 'cosine' schedule with max_steps=8, and")
    assert "stretched, it would jump" in line and "lr_schedule 'wsd'" in line and "--branch-from" in line


def store_of(cfg):
    from stoker.storage.store import Store

    return Store(cfg.storage.root)


def shards_in(cfg, shards, store):
    """The parent's shard set, copied into another store root (its data stage, without a run)."""
    dest = store_of(cfg)
    for name in store.listdir(shards.key):
        dest.write_bytes(join(shards.key, name), store.read_bytes(join(shards.key, name)))
    return shards


def test_a_decay_moved_before_every_kept_checkpoint_is_refused_and_config_json_kept(tmp_path):
    """The run of issue 53: 20 steps of 'wsd', its decay over the last 4 (from step 16), two kept,
    a checkpoint every 5 steps and one where the decay began: 20 and 16 are kept. Given
    decay_steps 10 (a decay from step 10) none lies before the decay: it once went on from nothing
    (step 0, or the base) with warnings only, config.json rewritten. Now the preflight and the run
    folder refuse it in one line and config.json stays as it was; a decay from step 18, or a run
    trained to 30, goes on from step 16, and config.json is rewritten then. Fake checkpoints with
    the ranks' manifest fields: nothing trains."""
    from stoker.contracts.results import DataShards, ShardInfo
    from stoker.storage.checkpoints import commit_checkpoint, new_checkpoint_key, prune_checkpoints
    from stoker.storage.store import Store

    root = f"file://{tmp_path}/store"
    store = Store(root)
    store.write_bytes("shards/k/tokenizer.json", b"{}")
    shards = DataShards([ShardInfo("k", "shards/k", store.url("shards/k"), 1, 1, 384, "uint16", True)])

    def run(**train):
        return _cfg(root, "issue", **{**WSD, "max_steps": 20, "decay_steps": 4, **train})

    trained = run()
    pin_run_folder(store, trained, shards)
    for step in (5, 10, 15, 16, 20):
        key = new_checkpoint_key(store, "issue", step)
        store.write_bytes(join(key, ".metadata"), b"meta")
        meta = {"run_name": "issue", "model_hash": trained.model_hash(), "schedule": schedule.signature(trained.train)}
        commit_checkpoint(store, key, {"step": step, "world_size": 2, **meta})
    prune_checkpoints(store, "issue", keep_latest_k=2, train=trained.train)
    assert [c.step for c in list_checkpoints(store, "issue")] == [20, 16]
    pinned = store.read_bytes("runs/issue/config.json")
    earlier = run(decay_steps=10)
    for refuse in (lambda: preflight.check(earlier), lambda: pin_run_folder(store, earlier, shards)):
        with pytest.raises(ConfigError) as err:
            refuse()
        [line] = err.value.problems
        assert line == (
            "train.decay_steps: run 'issue' decays from step 10 under this config (decay_steps=10), and no "
            "checkpoint it kept (steps 20, 16) lies at or before that step outside a decay, so it would start "
            "over: start its decay at step 16 or later (its newest checkpoint before a decay), or branch from "
            "one of its checkpoints under a new run name (train.branch_from, or stoker run --branch-from URI)"
        )
        assert store.read_bytes("runs/issue/config.json") == pinned
    for later in (run(decay_steps=2), run(max_steps=30)):
        assert preflight.problems(later) == []
        pin_run_folder(store, later, shards)
        assert store.read_bytes("runs/issue/config.json") == later.to_json().encode()
        expected = {"run_name": "issue", "model_hash": later.model_hash()}
        assert find_latest_valid(store, "issue", expected, later.train).checkpoint.step == 16


def test_a_wsd_run_trained_longer_goes_on_from_before_its_decay_bitwise_even_killed(parent):
    cfg, store, shards, records, root = parent
    short = _cfg(root, "longer", max_steps=8, **WSD)  # stable until step 5, decays to 8
    url = pin_run_folder(store, short, shards)
    run_forked(url, shards.key, nproc=2)
    # the newest two are inside the decay; step 5, committed where it began, is kept beside them
    assert [c.step for c in list_checkpoints(store, "longer")] == [8, 6, 5]
    # a decay from step 3: no checkpoint to go on from, so it is refused in one line, writing nothing
    before = _bytes_of(store, "longer")
    earlier = _cfg(root, "longer", max_steps=8, **{**WSD, "decay_steps": 5})
    for refuse in (lambda: preflight.check(earlier), lambda: pin_run_folder(store, earlier, shards)):
        with pytest.raises(ConfigError) as err:
            refuse()
        [line] = err.value.problems
        assert line.startswith("train.decay_steps: run 'longer' decays from step 3 under this config (decay_steps=5)")
        assert "(steps 8, 6, 5)" in line and "start its decay at step 5 or later" in line and "--branch-from" in line
    assert _bytes_of(store, "longer") == before
    longer = _cfg(root, "longer", max_steps=12, **WSD)
    assert longer.resolved_run_name() == "longer"
    url = pin_run_folder(store, longer, shards)
    choice = find_latest_valid(store, "longer", {"run_name": "longer", "model_hash": longer.model_hash()}, longer.train)
    assert choice.checkpoint.step == 5  # steps 8 and 6 are inside the short run's decay
    assert [ref.step for ref, _ in choice.skipped] == [8, 6]
    why = choice.skipped[0][1]
    assert "a checkpoint inside a decay is kept and evaluated, never gone on from" in why
    killed = start_ranks(
        train_argv(url, shards.key, choice.checkpoint.key), 2, env={"STOKER_FAULT": "kill:rank=1:step=10"}
    )
    try:
        list(killed.lines(240))
        assert killed.returncode != 0
    finally:
        killed.close()
        killed.remove()
    again = run_forked(url, shards.key, env={"TORCHELASTIC_RESTART_COUNT": "1"})  # a restart round: its newest
    [resumed] = [r for r in again if r["event"] == "resumed"]
    # the extension's own newest (its step 9 may still have been uploading at the kill), never
    # the short run's step 6 or 8, taken inside its decay
    assert resumed["step"] in (6, 8, 9) and not resumed["checkpoint"].endswith(("/step-00000008", "/step-00000006"))
    assert all(loss == train_losses(records)[s] for s, loss in train_losses(again).items())
    _same(_model_tensors(store, _final(store, "parent").key), _model_tensors(store, _final(store, "longer").key))


def test_a_branch_with_the_parents_schedule_trains_bitwise_like_it_and_writes_nothing_of_it(parent):
    cfg, store, shards, records, root = parent
    before = _bytes_of(store, "parent")
    at6 = store.url("runs/parent/checkpoints/step-00000006")
    branch = preflight.check(_cfg(root, "same", max_steps=12, branch_from=at6, **WSD))
    assert (
        branch.train.branch_sha256
        == hashlib.sha256(store.read_bytes(f"runs/parent/checkpoints/step-00000006/{COMMIT_FILE}")).hexdigest()
    )
    got = run_forked(pin_run_folder(store, branch, shards), shards.key, nproc=2)  # no resume named: its branch point
    # its first step's loss is the parent's at the same world size, to the bit
    assert train_losses(got)[7] == train_losses(records)[7]
    _same(_model_tensors(store, _final(store, "parent").key), _model_tensors(store, _final(store, "same").key))
    assert _bytes_of(store, "parent") == before


def test_a_branch_that_decays_now_on_another_world_size_records_its_lineage(parent, tmp_path):
    from stoker.observe.inspect import list_runs
    from stoker.storage.branches import lineage_chain

    cfg, store, shards, records, root = parent
    before = _bytes_of(store, "parent")
    at6 = store.url("runs/parent/checkpoints/step-00000006")
    anneal = {**WSD, "decay_steps": 2, "lr": 1e-2}
    branch = preflight.check(_cfg(root, None, max_steps=8, branch_from=at6, **anneal))
    branch = branch.model_copy(update={"launch": branch.launch.model_copy(update={"nproc_per_node": 1})})
    got = run_forked(pin_run_folder(store, branch, shards), shards.key, nproc=1)
    [resumed] = [r for r in got if r["event"] == "resumed"]
    assert resumed["step"] == 6 and resumed["checkpoint"] == at6
    # its first step's loss is the parent's (the same weights, the same data position)
    assert train_losses(got)[7] == pytest.approx(train_losses(records)[7], rel=1e-5)
    assert _bytes_of(store, "parent") == before  # the parent is never written
    name = branch.resolved_run_name()
    [link] = lineage_chain(store, name)
    assert (link["parent"], link["step"], link["checkpoint"]) == ("parent", 6, at6)
    rows = {r["run"]: r for r in list_runs(root)}
    assert rows[name]["branch_of"] == "parent at step 6" and rows[name]["tree"] == f"└─ {name}"
    # the same branch again is the same run: its own newest checkpoint is its end, nothing to retrain
    again = preflight.check(_cfg(root, None, max_steps=8, branch_from=at6, **anneal))
    assert again.resolved_run_name() == name
    choice = find_latest_valid(store, name, {"run_name": name, "model_hash": again.model_hash()}, again.train)
    assert choice.checkpoint.step == 8
    # launched again (from where the resume task finds it), it trains nothing and writes no checkpoint
    folder = sorted(c.key for c in list_checkpoints(store, name))
    again = again.model_copy(update={"launch": again.launch.model_copy(update={"nproc_per_node": 1})})
    second = run_forked(pin_run_folder(store, again, shards), shards.key, resume=choice.checkpoint.key, nproc=1)
    assert not train_losses(second) and sorted(c.key for c in list_checkpoints(store, name)) == folder
    assert train_losses(got)  # the control: the first launch trained


def test_a_re_warmed_branch_warms_up_from_its_branch_point(parent):
    """train.rewarm: the branch's first steps after step 6 climb to lr again (1/3, 2/3 of it over
    warmup_steps 2), then its 'wsd' decay over the last 3 steps is the parent's."""
    cfg, store, shards, records, root = parent
    at6 = store.url("runs/parent/checkpoints/step-00000006")
    branch = preflight.check(_cfg(root, "rewarmed", max_steps=12, branch_from=at6, rewarm=True, **WSD))
    assert branch.train.branch_step == 6
    branch = branch.model_copy(update={"launch": branch.launch.model_copy(update={"nproc_per_node": 1})})
    got = run_forked(pin_run_folder(store, branch, shards), shards.key, nproc=1)
    logged = {r["step"]: r["lr"] for r in got if r["event"] == "train"}
    parent_lr = {r["step"]: r["lr"] for r in records if r["event"] == "train"}
    assert sorted(logged) == list(range(7, 13))
    assert [logged[s] for s in (7, 8, 9)] == pytest.approx([1e-2 / 3, 2e-2 / 3, 1e-2])
    assert [parent_lr[s] for s in (7, 8)] == [1e-2, 1e-2]  # the control: the parent did not warm there
    assert [logged[s] for s in (10, 11, 12)] == [parent_lr[s] for s in (10, 11, 12)]
    assert dict(schedule.curve(branch.train))[7] == logged[7]  # what the plan and the report draw


def test_a_bad_branch_point_is_one_line_before_any_compute(parent, tmp_path):
    cfg, store, shards, records, root = parent
    at6 = store.url("runs/parent/checkpoints/step-00000006")

    def refused(**train) -> str:
        with pytest.raises(ConfigError) as err:
            preflight.check(_cfg(root, "bad", **{**WSD, "max_steps": 12, **train}))
        [line] = err.value.problems
        return line

    assert "no such checkpoint" in refused(branch_from=store.url("runs/parent/checkpoints/step-00000005"))
    assert refused(branch_from=at6, max_steps=6).startswith("train.max_steps: 6 is not past the branch point (step 6")
    assert refused(branch_from=at6, max_steps=9, decay_steps=4).startswith(
        "train.decay_steps: 4 is longer than the 3 steps left after the branch point"
    )
    assert refused(branch_from=at6, max_steps=11, rewarm=True).startswith(
        "train.warmup_steps: 2 re-warm steps (train.rewarm) leave nothing after them: the branch point is step 6"
    )
    assert refused(branch_from=at6, branch_step=4).startswith("train.branch_step: 4 is not the branch point's step (6)")
    assert refused(branch_from=at6, seed=7).startswith("train.seed: 7 is not the parent's (1337); a branch goes on")
    assert refused(branch_from=at6, global_batch_size=16).startswith(
        "train.global_batch_size: 16 is not the parent's (8)"
    )
    other = tiny_dict(root, run_name="bad", model={"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32})
    other["train"].update(branch_from=at6, max_steps=12, **WSD)
    with pytest.raises(ConfigError) as err:
        preflight.check(load_config(other))
    assert "holds another model or tokenizer than this config's" in err.value.problems[0]
    # uncommitted, then damaged: a copy of step 6 without its commit manifest, and one with a flipped byte
    for name, damage in (("step-00000006.nocommit", "uncommit"), ("step-00000006.flipped", "flip")):
        key = f"runs/parent/checkpoints/{name}"
        src = store.local_path("runs/parent/checkpoints/step-00000006")
        import shutil

        shutil.copytree(src, store.local_path(key))
        if damage == "uncommit":
            os.remove(store.local_path(join(key, COMMIT_FILE)))
            assert "it is not committed" in refused(branch_from=store.url(key))
        else:
            manifest = json.loads(store.read_bytes(join(key, COMMIT_FILE)))
            victim = store.local_path(join(key, next(n for n in manifest["files"] if n != ".metadata")))
            data = bytearray(open(victim, "rb").read())
            data[len(data) // 2] ^= 0xFF
            open(victim, "wb").write(bytes(data))
            # the preflight reads its manifest (every file at its size), not every byte on the flow's
            # host; the ranks verify each sha256 as they read the bytes, and refuse it there
            assert preflight.check(_cfg(root, "bad", **{**WSD, "max_steps": 12, "branch_from": store.url(key)}))
            with pytest.raises(CheckpointInvalid, match="fails its sha256 checksum"):
                rehydrate(store, key, str(tmp_path / "cache"))
            data.append(0)  # a file of another size: refused before any compute
            open(victim, "wb").write(bytes(data))
            assert "is not intact" in refused(branch_from=store.url(key))
        shutil.rmtree(store.local_path(key))
    assert not store.exists("runs/bad")


def test_a_mixture_branch_goes_on_from_its_parents_data_position():
    """A branch that reweights its parent's sources at the branch point draws, from there, the
    very windows a run with that reweighting in its data.schedule draws: the parent's weights up to
    the branch point, its own after (storage.branches.lineage keeps the parent's mixture, a branch
    of a branch included)."""
    from stoker.arithmetic.mixture import Mixture
    from stoker.config import DataConfig

    def data(weights, schedule=()):
        return DataConfig.model_validate(
            {
                "sources": [{"name": n, "source": "builtin:stdlib", "weight": w} for n, w in weights.items()],
                "schedule": [{"at_step": s, "weights": w} for s, w in schedule],
            }
        )

    windows = {"domain": 500, "web": 3000}
    parent = {"domain": 0.3, "web": 0.7}
    history = {"step": 40, "weights": parent, "schedule": [[20, {"domain": 0.5, "web": 0.5}]]}
    branch = Mixture.of_config(data({"domain": 0.8, "web": 0.2}), 7, 16, windows, history)
    whole = Mixture.of_config(
        data(parent, [(20, {"domain": 0.5, "web": 0.5}), (40, {"domain": 0.8, "web": 0.2})]), 7, 16, windows
    )
    for step in (40, 41, 63):
        assert all(np.array_equal(a, b) for a, b in zip(branch.picks(step), whole.picks(step)))
    assert np.array_equal(branch.draws_before(40), whole.draws_before(40))
