"""A real base on the first try: `model.init_from` alone, from the default recipe, the notebook
API and a deployment's parameters, with a base that has a real chat base's quirks
(scripts/make_tiny_base.py --style chat, SmolLM2-like: a byte-level vocabulary that lacks 21 byte
values (13 of them never in UTF-8), the chat end of turn <|im_end|> as its eos beside <|endoftext|>, no bos, many added
tokens, grouped-query attention 6/2 with an explicit head_dim). What only a user wrote is
checked against the base; every refusal is one line, before any compute, with nothing written."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest

from stoker import preflight
from stoker.config import ConfigError, RunConfig, build_config, load_config
from stoker.storage.bases import document_end_note, resolve_base
from tests.bases import copy_base, tiny_base

CHAT_EOS, TEXT_END = "<|im_end|>", "<|endoftext|>"


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return tiny_base(tmp_path_factory, "chat")


def _text(tmp_path, name="text", docs=("The court held that the clause binds both parties.",)) -> str:
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    for i, doc in enumerate(docs):
        (folder / f"doc{i}.txt").write_text(doc)
    return str(folder)


def _sets(tmp_path, base, **more) -> dict:
    return {"model.init_from": base, "data.source": _text(tmp_path), "storage.root": f"file://{tmp_path}/store", **more}


def _is_the_chat_base(cfg: RunConfig) -> None:
    m = cfg.model
    assert (m.family, m.n_layer, m.n_head, m.n_kv_head, m.n_embd, m.head_dim) == ("llama", 2, 6, 2, 96, 24)
    assert m.block_size == 128  # the recipe's training context: the run's choice, within the base's 256
    assert m.attention == "document" and cfg.tokenizer.eot_token == TEXT_END
    assert m.base_sha256 and cfg.tokenizer.path.endswith("/tokenizer.json")


def test_the_default_recipe_gives_way_to_the_base_wherever_a_config_is_made(tmp_path, chat):
    from stoker.cli.arguments import checked_config
    from stoker.flows.deploy import deployment_specs

    sets = _sets(tmp_path, chat)
    # the CLI: `stoker run --set model.init_from=./base --set data.source=./text`
    _is_the_chat_base(checked_config("tiny-cpu", [f"{k}={v}" for k, v in sets.items()]))
    # a notebook: load_config("tiny-cpu", **{"model.init_from": ...})
    _is_the_chat_base(preflight.check(load_config("tiny-cpu", **sets)))
    # a deployment's parameters (the UI's form holds them, with the recipe's name), init_from added
    params = json.loads(json.dumps(deployment_specs()[0]["parameters"]["config"]))
    params["model"]["init_from"] = chat
    params["storage"] = {"root": sets["storage.root"]}
    params["data"]["source"] = sets["data.source"]
    _is_the_chat_base(preflight.check(RunConfig.model_validate(params)))
    assert not (tmp_path / "store" / "runs").exists()  # checked, nothing written


def test_a_value_the_user_wrote_is_checked_against_the_base(tmp_path, chat):
    # --set model.n_layer=4 equals the default recipe's 4, and the user wrote it: refused
    with pytest.raises(ConfigError) as err:
        preflight.check(build_config("tiny-cpu", **_sets(tmp_path, chat, **{"model.n_layer": 4})))
    assert err.value.problems == [
        "model.n_layer: 4 contradicts the base's config.json (2); leave it out (or null) to take the base's "
        "value, or start from another base"
    ]
    # a recipe file of the user's own: its model fields are theirs
    mine = tmp_path / "mine.yaml"
    mine.write_text("model:\n  n_layer: 4\n  n_head: 6\n")
    with pytest.raises(ConfigError) as err:
        preflight.check(build_config(str(mine), **_sets(tmp_path, chat)))
    assert [p.split(":")[0] for p in err.value.problems] == ["model.n_layer"]


def test_the_document_end_is_the_bases_end_of_text_and_the_users_choice(tmp_path, chat):
    cfg = resolve_base(build_config("tiny-cpu", **_sets(tmp_path, chat)))
    assert cfg.tokenizer.eot_token == TEXT_END and cfg.tokenizer.document_end is None
    assert document_end_note(cfg) == (
        f"documents end with {TEXT_END!r}, the base's end-of-text: its eos {CHAT_EOS!r} ends a chat turn "
        "(tokenizer.document_end chooses another token)"
    )
    chosen = resolve_base(build_config("tiny-cpu", **_sets(tmp_path, chat, **{"tokenizer.document_end": CHAT_EOS})))
    assert chosen.tokenizer.eot_token == CHAT_EOS and chosen.resolved_run_name() != cfg.resolved_run_name()
    with pytest.raises(ConfigError) as err:
        resolve_base(build_config("tiny-cpu", **_sets(tmp_path, chat, **{"tokenizer.document_end": "<|nope|>"})))
    assert err.value.problems == [
        "tokenizer.document_end: '<|nope|>' is not a token of the base's vocabulary; give one of its tokens, "
        f"e.g. {TEXT_END!r}, or leave it empty for the base's end-of-text"
    ]


def test_a_base_with_a_tokenizer_json_alone_or_no_eos(tmp_path, chat):
    alone = copy_base(chat, tmp_path / "alone")
    os.remove(os.path.join(alone, "tokenizer_config.json"))  # the eos from config.json's eos_token_id
    cfg = resolve_base(build_config("tiny-cpu", **_sets(tmp_path, alone)))
    assert cfg.tokenizer.eot_token == TEXT_END
    hf = json.load(open(os.path.join(alone, "config.json")))
    hf["eos_token_id"] = None
    json.dump(hf, open(os.path.join(alone, "config.json"), "w"))
    with pytest.raises(ConfigError) as err:  # nothing names an end: model.attention 'document' needs one
        resolve_base(build_config("tiny-cpu", **_sets(tmp_path, alone, **{"data.source": "builtin:stdlib"})))
    [problem] = err.value.problems
    assert "names no end-of-sequence token" in problem and "set tokenizer.document_end" in problem
    fixed = build_config("tiny-cpu", **_sets(tmp_path, alone, **{"tokenizer.document_end": TEXT_END}))
    assert resolve_base(fixed).tokenizer.eot_token == TEXT_END


def test_a_vocabulary_that_lacks_bytes_refuses_bits_per_byte_only_where_the_text_holds_them(tmp_path, chat):
    from tokenizers import Tokenizer

    from stoker.arithmetic.token_bytes import NEVER_IN_UTF8, bits_per_byte_problem, lacking_bytes, token_byte_counts
    from stoker.data.sharding import UNENCODABLE, tokenize_docs

    tok = Tokenizer.from_file(os.path.join(chat, "tokenizer.json"))
    # 21 lacking in all: the 13 that UTF-8 never holds are no loss; 8 control bytes are
    assert lacking_bytes(tok) == [*range(0x00, 0x07), 0x7F] and len(NEVER_IN_UTF8) == 13
    assert token_byte_counts(tok, 576).shape == (576,)  # counted, not refused
    docs = ["clean text", "a form feed is fine \x0c but a NUL is not \x00, nor a DEL \x7f."]
    files = {s: (io.BytesIO(), io.BytesIO()) for s in ("train", "val")}
    counts = tokenize_docs(docs, tok, tok.token_to_id(TEXT_END), np.dtype("<u2"), 0.0, files)
    assert counts[UNENCODABLE][0] == 2 and counts[UNENCODABLE][1].startswith("byte 0x00 in ")
    tokenizer_json = open(os.path.join(chat, "tokenizer.json"), "rb").read()
    assert bits_per_byte_problem(tokenizer_json, 576, {"legal": (0, "")}) is None
    problem = bits_per_byte_problem(tokenizer_json, 576, {"legal": tuple(counts[UNENCODABLE])})
    assert problem.startswith("eval.sets: bits per byte would count text the tokenizer drops: 2 byte(s) in source ")
    assert "(first: byte 0x00 in " in problem and problem.endswith(
        "remove 'bpb' from eval.sets, or clean those bytes from the data"
    )


def test_the_data_stage_counts_the_bytes_a_source_loses(tmp_path, chat):
    from tests.conftest import prepare_shards

    docs = [f"The parties agree, {i} times. " * 40 for i in range(5)] + [
        f"A stray NUL \x00 in filing {i}. " * 10 for i in range(3)
    ]
    cfg = resolve_base(
        build_config(
            "tiny-cpu",
            **_sets(tmp_path, chat, **{"data.source": _text(tmp_path, "lossy", docs), "data.val_fraction": 0.3}),
        )
    )
    _, shards = prepare_shards(cfg)
    assert (shards.sets[0].unencodable_bytes, shards.sets[0].unencodable_example[:13]) == (30, "byte 0x00 in ")


def test_an_empty_source_of_a_mixture_is_refused_before_anything_is_downloaded(tmp_path):
    (tmp_path / "empty").mkdir()
    sources = [
        {"name": "general", "source": "builtin:stdlib", "weight": 1.0},
        {"name": "legal", "source": str(tmp_path / "empty"), "weight": 1.0},
    ]
    with pytest.raises(ConfigError) as err:
        load_config("tiny-cpu", **{"data.sources": sources, "storage.root": f"file://{tmp_path}/store"})
    assert err.value.problems == [
        f"data.sources[legal].source: no file matches {str(tmp_path / 'empty')!r}; give an existing file, folder "
        "or glob holding text, or use 'builtin:stdlib'."
    ]
    assert not (tmp_path / "store").exists()
