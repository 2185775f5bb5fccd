"""Base models (``model.init_from``): a Hugging Face folder, local or in an object store.

- ``base_record``: the base's files with each one's size and sha256, and their combined
  ``sha256`` that pins a run to those bytes. Computed once and kept in the run's store under
  ``bases/by-source/{stamp}.json``, keyed by what the source says of its files without reading
  them (each file's name, size and mtime, or ETag/VersionId on an object store): the same bytes
  are hashed once, as a dataset's fingerprint is.
- ``resolve_base``: the config with its model section filled from the base's config.json (a
  field given explicitly that contradicts it is one problem naming both values), the base's
  tokenizer as the run's tokenizer, ``model.base_sha256`` set, and, where the config writes no
  learning rate (train.lr_from_base), the rate made for the base's width
  (``arithmetic.learning_rate``). An architecture no family expresses exactly is refused by name.
- ``materialize_base``: a local folder with the base's bytes, checked on the host that uses
  them (a remote base is fetched into the host cache and hashed as it lands; a local one is
  hashed in place once per host, then trusted while its stamp holds: ``storage.cache``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from typing import Any

from pydantic import ValidationError

from stoker.arithmetic.learning_rate import with_base_lr
from stoker.config import ConfigError, RunConfig
from stoker.config.problems import problem_lines
from stoker.config.run import base_location
from stoker.families import FAMILIES, UnsupportedArchitecture, family_of_model_type
from stoker.storage.cache import checked_in_place, host_lock, verified_copy
from stoker.storage.store import Store, expand_url, join

log = logging.getLogger("stoker.bases")

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# the files of a base that a run uses (weights: every *.safetensors)
SIDE_FILES = (CONFIG, INDEX, TOKENIZER, TOKENIZER_CONFIG, "special_tokens_map.json", "generation_config.json")
RECORD = "base.json"  # the record's name inside a host-cache copy (written last)
BY_SOURCE = "bases/by-source"


def _url(init_from: str) -> str:
    return base_location(init_from)


def _listing(init_from: str, options: dict) -> dict[str, dict]:
    """{file name: info} of the base's files that a run uses; ConfigError when the folder is
    missing or lacks config.json, its weights or its tokenizer."""
    url = _url(init_from)
    try:
        found = expand_url(url, **options)
    except (FileNotFoundError, NotADirectoryError):
        found = []
    files = {u[len(url) :].lstrip("/"): info for u, info in found}
    files = {n: i for n, i in files.items() if "/" not in n and (n in SIDE_FILES or n.endswith(".safetensors"))}
    missing = [n for n in (CONFIG, TOKENIZER) if n not in files]
    if not any(n.endswith(".safetensors") for n in files):
        missing.append("model.safetensors (or shards with model.safetensors.index.json)")
    if not files:
        raise ConfigError(
            [
                f"model.init_from: no Hugging Face model at {init_from!r}; give a folder or URL holding config.json, "
                "model.safetensors and tokenizer.json"
            ]
        )
    if missing:
        raise ConfigError(
            [
                f"model.init_from: {init_from!r} has no {', '.join(missing)}; give the folder of a Hugging Face model "
                "saved with save_pretrained (safetensors) and its tokenizer"
            ]
        )
    return files


def _stamp(name: str, info: dict) -> list:
    """What a listing says of a file without reading it: changes whenever its bytes may have."""
    return [
        name,
        int(info.get("size") or 0),
        str(info.get("mtime") or info.get("ETag") or info.get("etag") or ""),
        str(info.get("VersionId") or info.get("created") or ""),
    ]


def base_store(init_from: str, options: dict) -> Store:
    """The base's folder as a Store (its files are keys under it)."""
    return Store(_url(init_from), options)


def base_record(init_from: str, options: dict, store: Store, keep: bool = True) -> dict:
    """{"sha256", "files": {name: {"size", "sha256"}}, "source", "key"} of the base at
    init_from, hashed once per change of its files and kept in `store` at "key" (keep=False:
    not yet; ``keep_record`` writes it once the config that names the base is accepted)."""
    files = _listing(init_from, options)
    stamp = hashlib.sha256(
        json.dumps([_url(init_from), sorted(_stamp(n, i) for n, i in files.items())]).encode()
    ).hexdigest()[:32]
    key = join(BY_SOURCE, f"{stamp}.json")
    if store.exists(key):
        try:
            return store.read_json(key)
        except (OSError, ValueError):
            pass  # a damaged record: hash again
    base = base_store(init_from, options)
    entries = {name: {"size": base.size(name), "sha256": base.sha256(name)} for name in sorted(files)}
    record = {"sha256": combined_sha256(entries), "files": entries, "source": init_from, "key": key}
    if keep:
        keep_record(store, record)
    return record


def keep_record(store: Store, record: dict) -> None:
    if not store.exists(record["key"]):
        store.write_json(record["key"], record)


def combined_sha256(entries: dict[str, dict]) -> str:
    """One digest over every file's name and sha256 (the base's content identity)."""
    lines = "".join(f"{name}\t{entries[name]['sha256']}\n" for name in sorted(entries))
    return hashlib.sha256(lines.encode()).hexdigest()


def read_base_json(init_from: str, name: str, options: dict) -> dict:
    base = base_store(init_from, options)
    try:
        return json.loads(base.read_bytes(name))
    except FileNotFoundError:
        return {}
    except ValueError as err:
        raise ConfigError([f"model.init_from: {name} of {init_from!r} is not JSON ({err})"]) from None


def eos_token(tokenizer_config: dict, hf_config: dict, tokenizer_json: dict) -> str | None:
    """The base's own end-of-sequence token, read from its files: tokenizer_config.json's
    eos_token, else config.json's eos_token_id looked up in tokenizer.json."""
    eos = tokenizer_config.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if isinstance(eos, str) and eos:
        return eos
    eos_id = hf_config.get("eos_token_id")
    eos_id = eos_id[0] if isinstance(eos_id, list) and eos_id else eos_id
    if isinstance(eos_id, int):
        for added in tokenizer_json.get("added_tokens", []):
            if added.get("id") == eos_id:
                return added.get("content")
        vocab = (tokenizer_json.get("model") or {}).get("vocab") or {}
        if isinstance(vocab, dict):
            return next((tok for tok, i in vocab.items() if i == eos_id), None)
    return None


def resolve_base(cfg: RunConfig) -> RunConfig:
    """`cfg` with its model section filled from its base (model.init_from), the base's
    tokenizer as the run's, and model.base_sha256 set; `cfg` itself when it names no base.
    One ConfigError with every problem (a missing base, a contradicting field, an
    architecture no family expresses) before any compute."""
    model = cfg.model
    if not model.init_from:
        return cfg
    options = cfg.storage.storage_options
    store = Store(cfg.storage.root, options)
    record = base_record(model.init_from, options, store, keep=False)  # kept once the config holds
    hf = read_base_json(model.init_from, CONFIG, options)
    problems: list[str] = []
    family_name = family_of_model_type(hf.get("model_type"))
    if family_name is None:
        raise ConfigError(
            [
                f"model.init_from: the base's model_type {hf.get('model_type')!r} is not of a family stoker has "
                f"({', '.join(t for f in FAMILIES.values() for t in f.HF_MODEL_TYPES)}); use a base of one of them"
            ]
        )
    section = model.model_dump()
    if family_name != model.family and "family" not in model.model_fields_set:
        # the family left to the base: what the config sets of its own is checked against it
        base_fields = FAMILIES[family_name].model_fields
        own = [n for n in model.model_fields_set if n not in _SHARED and section.get(n) is not None]
        problems += [
            f"model.{n}: is no field of the {family_name} family, which the base is (model_type "
            f"{hf.get('model_type')!r}); leave it out"
            for n in sorted(own)
            if n not in base_fields
        ]
        section = {k: v for k, v in section.items() if k in _SHARED or (k in own and k in base_fields)}
    elif family_name != model.family:
        explicit = [n for n in type(model).FROM_BASE if section.get(n) is not None]
        if explicit:
            raise ConfigError(
                [
                    f"model.family: {model.family!r} contradicts the base's config.json (model_type "
                    f"{hf.get('model_type')!r} is family {family_name!r}), and the config sets "
                    f"{', '.join('model.' + n for n in explicit)} of its own; set model.family: {family_name} "
                    "and leave the model's size to the base (a recipe without one, e.g. tiny-llama-cpu)"
                ]
            )
        section = {k: v for k, v in section.items() if k not in type(model).model_fields or k in _SHARED}
    family = FAMILIES[family_name]
    try:
        fields = family.from_hf_config(hf)
        limits = family.hf_limits(hf)
    except UnsupportedArchitecture as err:
        raise ConfigError(
            [
                f"model.init_from: the base's architecture has {err}, which the {family_name} family cannot "
                "express exactly; stoker refuses it rather than approximate it"
            ]
        ) from None
    except KeyError as err:
        raise ConfigError([f"model.init_from: the base's config.json has no {err.args[0]!r}"]) from None
    for name, value in fields.items():
        given = section.get(name)
        if name in _OVERRIDDEN or given is None or given == value:
            continue
        problems.append(
            f"model.{name}: {given!r} contradicts the base's config.json ({value!r}); leave it out (or null) to take "
            "the base's value, or start from another base"
        )
    block, most = section.get("block_size"), limits.get("max_positions")
    if most and block > most:
        problems.append(
            f"model.block_size: {block} is beyond the base's max_position_embeddings ({most}); use at most {most}"
        )
    window = limits.get("sliding_window")
    if window and window < block:
        problems.append(
            f"model.init_from: the base attends within a sliding window of {window} tokens, shorter than "
            f"model.block_size {block}, which the {family_name} family cannot express exactly; use "
            f"model.block_size <= {window}"
        )
    if section.get("base_sha256") not in (None, record["sha256"]):
        problems.append(
            f"model.base_sha256: the base at {model.init_from!r} now hashes to {record['sha256'][:16]}..., not "
            f"{section['base_sha256'][:16]}... (its files changed); start a new run_name for the new base"
        )
    tokenizer = _tokenizer_of(cfg, family, hf, limits["vocab_rows"], problems)
    if problems:
        raise ConfigError(problems)
    # a local folder as an absolute file:// URL: the ranks (another working directory, another
    # host reading a shared file system) find the same files
    if section.get("router_aux_loss_coef") is not None:  # the run's own choice over the base's
        fields.pop("router_aux_loss_coef", None)
    section.update(fields, family=family_name, base_sha256=record["sha256"], init_from=_url(model.init_from))
    data = cfg.model_dump()
    data["model"], data["tokenizer"] = section, tokenizer
    try:  # train.lr made for the base's width, where the config writes none (train.lr_from_base)
        resolved = with_base_lr(RunConfig.model_validate(data))
    except ValidationError as err:  # the filled section broke a rule: told as the config's problems
        raise ConfigError(problem_lines(err, RunConfig)) from None
    keep_record(store, record)
    return resolved


_SHARED = ("init_from", "base_sha256", "block_size", "dropout", "vocab_pad_multiple")
# fields a config may set against its base's config.json: the padding (a base keeps its own
# rows whatever it is) and a mixture's router loss coefficient (a training choice; the base's
# router_aux_loss_coef when left empty)
_OVERRIDDEN = ("vocab_pad_multiple", "router_aux_loss_coef")


def _tokenizer_of(cfg: RunConfig, family: type, hf: dict, vocab_rows: int, problems: list[str]) -> dict:
    """The tokenizer section of a run on a base: the base's tokenizer.json, its own eos token,
    and the model's rows as the vocabulary's size."""
    model, tok = cfg.model, cfg.tokenizer.model_dump()
    options = cfg.storage.storage_options
    path = join(_url(model.init_from), TOKENIZER)
    if tok.get("path") and tok["path"] != path:
        problems.append(
            f"tokenizer.path: {tok['path']!r} with model.init_from: a base's tokenizer is the run's tokenizer "
            f"({path}); leave tokenizer.path empty"
        )
        return tok
    tokenizer_json = read_base_json(model.init_from, TOKENIZER, options)
    eos = eos_token(read_base_json(model.init_from, TOKENIZER_CONFIG, options), hf, tokenizer_json)
    end, problem = document_end(eos, tokenizer_json, tok.get("document_end"))
    if problem:
        problems.append(problem.replace("{base}", repr(model.init_from)))
        return tok
    ids = tokenizer_size(tokenizer_json)
    if ids > vocab_rows:
        problems.append(
            f"model.init_from: the base's tokenizer has {ids} ids and its embedding {vocab_rows} rows; a base "
            "whose tokenizer does not fit its model cannot be trained"
        )
    elif ids != vocab_rows and family.ROWS_ARE_THE_TOKENIZERS:
        problems.append(
            f"model.init_from: the base's embedding has {vocab_rows} rows for its tokenizer's {ids} ids, and the "
            f"{family.model_fields['family'].default} family keeps one row per id; use a base whose vocab_size is "
            "its tokenizer's"
        )
    tok.update(path=path, eot_token=end, vocab_size=vocab_rows)
    return tok


# a chat model's end of turn, and the end-of-text tokens that end a document in its pretraining
CHAT_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>", "<|eot|>")
END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


def vocabulary(tokenizer_json: dict) -> set[str]:
    """Every token of a tokenizer.json: its model's vocabulary and its added tokens."""
    vocab = (tokenizer_json.get("model") or {}).get("vocab") or {}
    tokens = set(vocab) if isinstance(vocab, dict) else {v[0] for v in vocab if isinstance(v, list) and v}
    return tokens | {t.get("content") for t in tokenizer_json.get("added_tokens", []) if t.get("content")}


def document_end(eos: str | None, tokenizer_json: dict, chosen: str | None) -> tuple[str | None, str | None]:
    """(the token that ends each document of a run on this base, None) or (None, the problem).

    `chosen` (tokenizer.document_end) when set, if the vocabulary has it; else the base's eos,
    unless that ends a chat turn (a chat model's <|im_end|>, <|eot_id|>) and the vocabulary has
    an end-of-text token, which is what ends a document in pretraining text."""
    vocab = vocabulary(tokenizer_json)
    if chosen:
        if chosen not in vocab:
            near = [t for t in (*END_OF_TEXT, eos) if t and t in vocab]
            return None, (
                f"tokenizer.document_end: {chosen!r} is not a token of the base's vocabulary; give one of its "
                f"tokens{', e.g. ' + repr(near[0]) if near else ''}, or leave it empty for the base's end-of-text"
            )
        return chosen, None
    if eos in CHAT_END_OF_TURN:
        text_end = next((t for t in END_OF_TEXT if t in vocab), None)
        if text_end:
            return text_end, None
    if not eos:
        return None, (
            "model.init_from: {base} names no end-of-sequence token (tokenizer_config.json's eos_token or "
            "config.json's eos_token_id), so no token ends a document (model.attention 'document' masks at it); "
            "set tokenizer.document_end to a token of its vocabulary"
        )
    return eos, None


def document_end_note(cfg: RunConfig) -> str | None:
    """What ends the documents of a run on a base, and why, in one line (the flow says it before
    launch); None without a base."""
    model = cfg.model
    if not getattr(model, "init_from", None):
        return None
    options = cfg.storage.storage_options
    end = cfg.tokenizer.eot_token
    if cfg.tokenizer.document_end:
        return f"documents end with {end!r} (tokenizer.document_end)"
    eos = eos_token(
        read_base_json(model.init_from, TOKENIZER_CONFIG, options),
        read_base_json(model.init_from, CONFIG, options),
        read_base_json(model.init_from, TOKENIZER, options),
    )
    if eos and eos != end:
        return (
            f"documents end with {end!r}, the base's end-of-text: its eos {eos!r} ends a chat turn "
            "(tokenizer.document_end chooses another token)"
        )
    return f"documents end with {end!r}, the base's eos (tokenizer.document_end chooses another token)"


def tokenizer_size(tokenizer_json: dict) -> int:
    """The ids of a tokenizer.json: its model's vocabulary and its added tokens (the largest id + 1)."""
    vocab = (tokenizer_json.get("model") or {}).get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
    ids += [t.get("id", -1) for t in tokenizer_json.get("added_tokens", [])]
    return max(ids, default=-1) + 1


def materialize_base(init_from: str, base_sha256: str, store: Store, cache_dir: str, options: dict) -> str:
    """A local folder holding the base's files, fully checked on this host against the record
    of base_sha256 (DataError-like ConfigError when its bytes changed since the run pinned it)."""
    record = base_record(init_from, options, store)
    if record["sha256"] != base_sha256:
        raise ConfigError(
            [
                f"model.init_from: the base at {init_from!r} changed since this run pinned it (sha256 "
                f"{record['sha256'][:16]}..., the run has {base_sha256[:16]}...); start a new run_name for it"
            ]
        )
    manifest = {"files": record["files"], "sha256": base_sha256}
    url = _url(init_from)
    local = os.path.join(cache_dir, "bases", base_sha256[:32])
    damaged = functools.partial(_damaged, init_from)
    with host_lock(local):
        if url.startswith("file://"):
            folder = url[len("file://") :]
            checked_in_place(folder, manifest, local + ".verified.json", damaged)
            return folder
        base = Store(url, options)
        return verified_copy(
            local,
            manifest,
            RECORD,
            f"base {init_from}",
            fetch=lambda name, path: base.get_file(name, path),
            damaged=damaged,
        )


def _damaged(init_from: str, problem: str) -> None:
    raise ConfigError([f"model.init_from: the base at {init_from!r} is damaged or changed: {problem}"])


def base_summary(cfg: Any) -> str:
    """'<init_from> (sha256 <12 hex>)' of a run's model section, or '' for random weights."""
    model = getattr(cfg, "model", cfg)
    if not getattr(model, "init_from", None):
        return ""
    return f"{model.init_from} (sha256 {(model.base_sha256 or '?')[:12]})"
