"""model.init_from, before any compute: the base's config.json fills the model section, its
tokenizer becomes the run's, its content hash pins the run; what no family expresses exactly,
or what contradicts the base, is refused in one line each."""

import json
import os

import pytest

from stoker.config import ConfigError, build_config
from stoker.storage.bases import BY_SOURCE, resolve_base
from stoker.storage.store import Store
from tests.bases import copy_base, tiny_base


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_base(tmp_path_factory, "llama")


def _cfg(tmp_path, base, **sets):
    return build_config(None, **{"storage.root": f"file://{tmp_path}/store", "model.init_from": base, **sets})


def _edit_config(folder, **changes):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        hf = json.load(f)
    for key, value in changes.items():
        if value is None:
            hf.pop(key, None)
        else:
            hf[key] = value
    with open(path, "w") as f:
        json.dump(hf, f)
    return hf


def test_a_base_fills_the_model_and_tokenizer_sections_from_its_files(tmp_path, base):
    cfg = resolve_base(_cfg(tmp_path, base, **{"model.block_size": 64}))
    m, tok = cfg.model, cfg.tokenizer
    assert m.family == "llama" and m.init_from == "file://" + os.path.abspath(base)
    assert (m.n_layer, m.n_head, m.n_kv_head, m.n_embd, m.intermediate_size, m.head_dim) == (2, 4, 2, 64, 160, 16)
    assert (m.rope_type, m.rope_factor, m.rope_low_freq_factor, m.rope_high_freq_factor) == ("llama3", 32, 1, 4)
    assert (m.rope_original_context, m.rope_theta, m.norm_eps) == (64, 500000.0, 1e-5)
    assert m.tie_embeddings is True and m.qkv_bias is False and m.max_position_embeddings == 256
    assert m.block_size == 64  # the run's choice
    # the base's tokenizer, its own end-of-sequence token, the model's rows as the vocabulary
    assert tok.path == m.init_from + "/tokenizer.json" and tok.eot_token == "<|end_of_text|>"
    assert tok.vocab_size == m.vocab_size == json.load(open(os.path.join(base, "config.json")))["vocab_size"]
    assert len(m.base_sha256) == 64
    assert resolve_base(cfg) == cfg  # resolving again changes nothing


def test_the_transformers_v4_rope_layout_reads_the_same(tmp_path, base):
    """config.json from transformers 4 keeps rope_theta beside rope_scaling; 5 keeps both in
    rope_parameters: the same model section either way."""
    v4 = copy_base(base, tmp_path / "v4")
    hf = json.load(open(os.path.join(v4, "config.json")))
    rope = dict(hf["rope_parameters"])
    theta = rope.pop("rope_theta")
    _edit_config(v4, rope_parameters=None, rope_theta=theta, rope_scaling=rope)
    a = resolve_base(_cfg(tmp_path, base)).model.model_dump(exclude={"init_from", "base_sha256"})
    b = resolve_base(_cfg(tmp_path, v4)).model.model_dump(exclude={"init_from", "base_sha256"})
    assert a == b


def test_an_explicit_field_that_contradicts_the_base_is_one_problem_naming_both_values(tmp_path, base):
    with pytest.raises(ConfigError) as err:
        resolve_base(_cfg(tmp_path, base, **{"model.family": "llama", "model.n_kv_head": 4, "model.norm_eps": 1e-5}))
    assert err.value.problems == [
        "model.n_kv_head: 4 contradicts the base's config.json (2); leave it out (or null) to take the base's value, "
        "or start from another base"
    ]  # an explicit value equal to the base's is no problem
    with pytest.raises(ConfigError) as err:
        resolve_base(_cfg(tmp_path, base, **{"model.block_size": 512}))
    assert err.value.problems == [
        "model.block_size: 512 is beyond the base's max_position_embeddings (256); use at most 256"
    ]


@pytest.mark.parametrize(
    "changes, says",
    [
        ({"num_local_experts": 8}, "a mixture of experts (num_local_experts: 8)"),
        # mixtures the qwen3_moe and mixtral families do not express: a shared expert, a window
        (
            {
                "model_type": "qwen3_moe",
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 64,
            },
            "a shared expert (shared_expert_intermediate_size: 64), which the qwen3_moe family cannot express",
        ),
        (
            {
                "model_type": "mixtral",
                "num_local_experts": 4,
                "sliding_window": 32,
                "rope_scaling": None,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
            },
            "sliding window of 32 tokens, shorter than model.block_size 64",
        ),
        ({"model_type": "gemma2"}, "model_type 'gemma2' is not of a family stoker has"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type 'yarn'"),
        (
            {"model_type": "mistral", "sliding_window": 32},
            "sliding window of 32 tokens, shorter than model.block_size 64",
        ),
    ],
)
def test_an_architecture_no_family_expresses_exactly_is_refused_by_name(tmp_path, base, changes, says):
    folder = copy_base(base, tmp_path / "odd")
    _edit_config(folder, **changes)
    with pytest.raises(ConfigError) as err:
        resolve_base(_cfg(tmp_path, folder, **{"model.block_size": 64}))
    assert len(err.value.problems) == 1 and says in err.value.problems[0], err.value.problems


def test_a_missing_or_incomplete_base_is_one_problem(tmp_path, base):
    with pytest.raises(ConfigError) as err:
        resolve_base(_cfg(tmp_path, str(tmp_path / "nowhere")))
    assert err.value.problems == [
        f"model.init_from: no Hugging Face model at {str(tmp_path / 'nowhere')!r}; give a folder or URL holding "
        "config.json, model.safetensors and tokenizer.json"
    ]
    folder = copy_base(base, tmp_path / "no-tokenizer")
    os.remove(os.path.join(folder, "tokenizer.json"))
    with pytest.raises(ConfigError) as err:
        resolve_base(_cfg(tmp_path, folder))
    assert "has no tokenizer.json" in err.value.problems[0]


def test_the_base_is_hashed_once_and_a_changed_base_gets_another_hash(tmp_path, base, monkeypatch):
    folder = copy_base(base, tmp_path / "mine")
    first = resolve_base(_cfg(tmp_path, folder)).model.base_sha256
    store = Store(f"file://{tmp_path}/store")
    assert len(store.listdir(BY_SOURCE)) == 1  # the record, keyed by the files' names, sizes, mtimes

    def no_hashing(self, key):
        raise AssertionError(f"hashed {key} again")

    with monkeypatch.context() as m:
        m.setattr(Store, "sha256", no_hashing)
        assert resolve_base(_cfg(tmp_path, folder)).model.base_sha256 == first
    shard = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))[-1]
    with open(os.path.join(folder, shard), "r+b") as f:  # one byte of the weights changed
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    assert resolve_base(_cfg(tmp_path, folder)).model.base_sha256 != first


def test_another_base_under_the_same_run_name_is_refused(tmp_path, base, tmp_path_factory):
    from stoker.contracts.results import DataShards, ShardInfo
    from stoker.storage.runs import pin_run_folder

    other = tiny_base(tmp_path_factory, "llama", seed=1)
    shards = DataShards([ShardInfo("k", "shards/k", "file:///x", 1, 1, 500, "<u2", False)])
    store = Store(f"file://{tmp_path}/store")
    store.write_bytes("shards/k/tokenizer.json", b"{}")
    pin_run_folder(store, resolve_base(_cfg(tmp_path, base, run_name="pinned")), shards)
    assert store.exists("runs/pinned/base/config.json")  # what an export needs, kept with the run
    with pytest.raises(ConfigError) as err:
        pin_run_folder(store, resolve_base(_cfg(tmp_path, other, run_name="pinned")), shards)
    [line] = err.value.problems
    assert (
        line.startswith("model.init_from: run 'pinned' started from base file://") and "choose a new run_name" in line
    )


def test_a_base_in_object_storage_is_fetched_to_the_host_cache_and_checked(s3_root, tmp_path, base):
    """An s3:// base: read for the config like a folder, pinned by the same hash as the same
    files on disk, fetched once into the host cache with every file hashed as it lands; a base
    whose bytes change after the run pinned it is refused, never loaded."""
    import s3fs

    from stoker.storage.bases import materialize_base

    root, options = s3_root
    fs = s3fs.S3FileSystem(**options)
    url = root.rsplit("/", 1)[0] + "/bases/tiny"
    fs.put(base + "/", url.removeprefix("s3://") + "/", recursive=True)
    cfg = resolve_base(
        build_config(None, **{"storage.root": root, "storage.storage_options": options, "model.init_from": url})
    )
    assert cfg.model.init_from == url and cfg.tokenizer.path == url + "/tokenizer.json"
    assert cfg.model.base_sha256 == resolve_base(_cfg(tmp_path, base)).model.base_sha256  # the same bytes
    store = Store(root, options)
    folder = materialize_base(url, cfg.model.base_sha256, store, str(tmp_path / "cache"), options)
    assert folder.startswith(str(tmp_path / "cache"))
    for name in os.listdir(base):
        assert open(os.path.join(folder, name), "rb").read() == open(os.path.join(base, name), "rb").read(), name
    assert materialize_base(url, cfg.model.base_sha256, store, str(tmp_path / "cache"), options) == folder
    key = url.removeprefix("s3://") + "/config.json"
    fs.pipe(key, fs.cat(key) + b" ")  # the base changed in the store
    with pytest.raises(ConfigError) as err:
        materialize_base(url, cfg.model.base_sha256, store, str(tmp_path / "other-cache"), options)
    assert "changed since this run pinned it" in err.value.problems[0]


def test_the_preflight_reads_a_base_once_for_its_checks_the_plan_and_the_config_it_returns(tmp_path, base, monkeypatch):
    from stoker import preflight

    calls = []
    real = preflight.resolve_base
    monkeypatch.setattr(preflight, "resolve_base", lambda config: calls.append(config) or real(config))
    cfg = preflight.check(_cfg(tmp_path, base))
    assert cfg.model.n_layer == 2 and len(cfg.model.base_sha256) == 64 and len(calls) == 1
