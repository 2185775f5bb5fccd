"""Evaluation sets beyond the validation loss (training.scoring): bits per byte of held-out
text and multiple-choice scoring over the vendored, checksummed set. The numbers of a real
evaluation process, on a checkpoint trained by a real (forked) rank, equal those transformers'
GPT-2 computes on the same checkpoint exported with `python -m stoker.training.export`."""

import hashlib
import json
import math
import os
import subprocess
import sys
import sysconfig

import pytest
import torch
import torch.nn.functional as F

from stoker.contracts import events
from stoker.failures import DataError
from stoker.families.gpt2.model import GPT
from stoker.families.layers import padded_vocab
from stoker.training.checkpoint import load_checkpoint
from stoker.training.data import TokenStream, eval_offsets, get_batch
from stoker.training.scoring import (
    MULTIPLE_CHOICE_FILE,
    ChoiceItem,
    ChoiceRows,
    encode_items,
    load_multiple_choice,
    score_choices,
    token_byte_counts,
)
from tests.conftest import ROOT, one_rank_run

CHECKPOINT = "runs/scoring/checkpoints/step-00000008"
MAX_WINDOWS = 24
NUM_ITEMS = 40


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run folder as the flow pins it and a checkpoint one real rank committed after 8
    steps. 300 tokenizer ids: the embedding is padded to 384 rows, which the scores leave out."""
    cfg, store, shards, config_url = one_rank_run(
        tmp_path_factory,
        "scoring",
        train={"max_steps": 8},
        checkpoint={"interval_steps": 8},
        eval={"interval_steps": 8, "multiple_choice_items": NUM_ITEMS},
    )
    assert cfg.eval.sets == ["loss", "bpb", "multiple_choice"]  # the default: every set
    assert shards.vocab_size == 300 and padded_vocab(300, cfg.model.vocab_pad_multiple) == 384
    return cfg, store, shards, config_url


def _run(*args, timeout=300):
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def _hf_byte_counts(tok) -> torch.Tensor:
    """Bytes per id, from transformers' own GPT-2 byte alphabet; 0 for its special tokens."""
    try:  # transformers 5
        from transformers.convert_slow_tokenizer import bytes_to_unicode
    except ImportError:  # transformers 4
        from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    counts = []
    for i, piece in enumerate(tok.convert_ids_to_tokens(list(range(len(tok))))):
        counts.append(0 if i in tok.all_special_ids else len(bytes(byte_of[c] for c in piece)))
    return torch.tensor(counts)


def test_evaluation_equals_transformers_gpt2_on_the_exported_checkpoint(trained, tmp_path):
    """A real evaluation process's loss, bits per byte and multiple-choice accuracies; our
    scorer's per-ending log-likelihoods: all equal to transformers' on the exported folder."""
    from transformers import AutoTokenizer, GPT2LMHeadModel

    cfg, store, shards, config_url = trained
    # as if data.decontaminate had found items 3 and 7 in the training data (300 KB of it holds
    # none of the first 40): the evaluation scores the other 38 apart, as the clean subset
    pinned = f"runs/{cfg.resolved_run_name()}/shards.json"
    record = store.read_json(pinned)
    assert record["dedup"][0]["decontaminate"] and not record["dedup"][0]["items"]
    store.write_json(
        pinned, {**record, "dedup": [{**record["dedup"][0], "items": {"stoker_mc:3": 1, "stoker_mc:7": 2}}]}
    )
    said = _run(
        "-m",
        "stoker.training.evaluation_main",
        *("--config", config_url, "--checkpoint", CHECKPOINT, "--shards", shards.key),
        *("--max-windows", str(MAX_WINDOWS), "--device", "cpu", "--cache-dir", str(tmp_path / "cache")),
    )
    [evaluated] = [e for e in map(events.decode, said.splitlines()) if isinstance(e, events.Evaluated)]
    assert evaluated.windows == MAX_WINDOWS and evaluated.num_mc_items == NUM_ITEMS
    _run("-m", "stoker.training.export", store.url(CHECKPOINT), str(tmp_path / "hf"))
    hf = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))

    # held-out text: the same windows, transformers' per-token losses, bytes from its own alphabet
    T = cfg.model.block_size
    val = TokenStream(store.local_path(shards.key), "val")
    x, y = get_batch(val, T, eval_offsets(val.num_tokens, T, MAX_WINDOWS))
    with torch.no_grad():
        nll = F.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten(), reduction="none").double()
    nbytes = _hf_byte_counts(tok)[y.flatten()]
    bpb = float((nll * (nbytes > 0)).sum()) / (math.log(2) * int(nbytes.sum()))
    assert evaluated.val_loss == pytest.approx(float(nll.mean()), rel=1e-5)
    assert evaluated.bits_per_byte == pytest.approx(bpb, rel=1e-5)

    # multiple choice: the same ids (transformers' tokenizer), transformers' log-likelihoods
    from tokenizers import Tokenizer

    items = load_multiple_choice(limit=NUM_ITEMS)
    rows = encode_items(Tokenizer.from_file(os.path.join(store.local_path(shards.key), "tokenizer.json")), items, T)
    ours_model = GPT(cfg.model, shards.vocab_size, seed=None)
    load_checkpoint(store.local_path(CHECKPOINT), model=ours_model)
    ours = score_choices(ours_model.eval(), rows, torch.device("cpu"), items_per_batch=7)
    theirs = torch.zeros(NUM_ITEMS, 4, dtype=torch.float64)
    for n, (item, encoded) in enumerate(zip(items, rows)):
        ctx = tok(item.context)["input_ids"]
        for k, ending in enumerate(item.endings):
            end = tok(ending)["input_ids"][:T]  # at most T ids, after at least one of the context
            ids = ctx[max(0, len(ctx) - (T + 1 - len(end))) :] + end  # the context cut from the left
            assert ids == encoded.rows[k] and len(end) == encoded.num_ending[k]
            with torch.no_grad():
                logprobs = F.log_softmax(hf(torch.tensor([ids[:-1]])).logits[0], dim=-1)
            theirs[n, k] = float(logprobs[-len(end) :].gather(1, torch.tensor(ids[-len(end) :])[:, None]).sum())
    torch.testing.assert_close(ours.logprob, theirs, rtol=1e-5, atol=1e-5)
    lengths = torch.tensor([encoded.num_ending for encoded in rows])
    assert torch.equal(ours.predictions, theirs.argmax(1))
    assert torch.equal(ours.predictions_norm, (theirs / lengths).argmax(1))
    assert evaluated.mc_accuracy == pytest.approx(ours.accuracy, abs=1e-12)
    assert evaluated.mc_accuracy_norm == pytest.approx(ours.accuracy_norm, abs=1e-12)
    # and on the clean subset: the items data.decontaminate did not find in the training data
    store.write_json(pinned, record)
    clean = torch.tensor([it.id not in (3, 7) for it in items])
    assert evaluated.num_mc_items_clean == int(clean.sum()) == NUM_ITEMS - 2
    assert evaluated.mc_accuracy_clean == pytest.approx(ours.subset(clean).accuracy, abs=1e-12)
    assert evaluated.mc_accuracy_norm_clean == pytest.approx(ours.subset(clean).accuracy_norm, abs=1e-12)
    print(
        f"loss {evaluated.val_loss:.4f}, {evaluated.bits_per_byte:.4f} bits per byte, "
        f"acc {ours.accuracy:.3f}, acc_norm {ours.accuracy_norm:.3f} ({NUM_ITEMS} items)"
    )


def test_byte_counts_of_a_texts_tokens_add_up_to_its_utf8_length(trained):
    """Tokens that hold part of a character count the bytes they hold; the end-of-text none."""
    from tokenizers import Tokenizer

    cfg, store, shards, _ = trained
    tok = Tokenizer.from_file(os.path.join(store.local_path(shards.key), "tokenizer.json"))
    counts = token_byte_counts(tok, shards.vocab_size)
    eot = tok.token_to_id(cfg.tokenizer.eot_token)
    assert counts[eot] == 0
    text = "naïve café — 日本語のテキスト 😀\n    return x  # ≥ 0"
    ids = tok.encode(text + cfg.tokenizer.eot_token + text).ids
    assert eot in ids and any(len(tok.decode([i]).encode()) != counts[i] for i in ids)  # split characters
    assert int(counts[ids].sum()) == 2 * len(text.encode("utf-8"))


class _Bigram(torch.nn.Module):
    """A model whose next-token logits depend on the last token only: 4 for its successor
    (i + 1 mod V), 0 for the others."""

    V = 6

    def __init__(self):
        super().__init__()
        self.table = torch.zeros(self.V, self.V)
        self.table[torch.arange(self.V), (torch.arange(self.V) + 1) % self.V] = 4.0

    def forward(self, idx):
        return self.table[idx], None  # (B, T, V)


def test_the_scorer_picks_the_likeliest_ending_and_acc_norm_the_lowest_mean_loss():
    items = [
        # the chain continued: both picks are right
        ChoiceRows([[0, 1, 2, 3], [0, 1, 5, 5], [0, 1, 4, 0], [0, 1, 3, 3]], [2, 2, 2, 2], label=0),
        # one unlikely token (sum -4.09) against seven likely ones and one unlikely (sum -4.70,
        # mean -0.59): the sum picks the short one, the mean the long one, which is right
        ChoiceRows([[0, 3], [0, 1, 2, 3, 4, 5, 0, 1, 5], [0, 5, 5, 5], [0, 2, 2]], [1, 8, 3, 2], label=1),
    ]
    scores = score_choices(_Bigram(), items, torch.device("cpu"), items_per_batch=1)
    likely, unlikely = F.log_softmax(torch.tensor([4.0, 0, 0, 0, 0, 0]), 0)[:2].double()
    expected = torch.tensor(
        [
            [2 * likely, 2 * unlikely, 2 * unlikely, 2 * unlikely],
            [unlikely, 7 * likely + unlikely, 3 * unlikely, 2 * unlikely],
        ]
    )
    torch.testing.assert_close(scores.logprob, expected, rtol=1e-6, atol=1e-6)
    assert scores.predictions.tolist() == [0, 0] and scores.predictions_norm.tolist() == [0, 1]
    assert (scores.accuracy, scores.accuracy_norm) == (0.5, 1.0)
    # the same scores batched together (right padding changes nothing) and in one batch
    together = score_choices(_Bigram(), items, torch.device("cpu"), items_per_batch=2)
    torch.testing.assert_close(together.logprob, scores.logprob, rtol=0, atol=1e-12)


def test_long_contexts_are_cut_from_the_left_to_fit_the_model(trained):
    from tokenizers import Tokenizer

    _, store, shards, _ = trained
    tok = Tokenizer.from_file(os.path.join(store.local_path(shards.key), "tokenizer.json"))
    item = ChoiceItem("x = 1\n" * 40, ("    return x", "y", "z = [i for i in range(10)]", "pass"), label=0)
    [rows] = encode_items(tok, [item], block_size=16)
    ctx = tok.encode(item.context).ids
    cut = 0
    for row, n, ending in zip(rows.rows, rows.num_ending, item.endings):
        end = tok.encode(ending).ids
        assert len(row) == 17 and n == min(len(end), 16) and row == ctx[-(17 - n) :] + end[:n]
        cut += len(end) > 16  # an ending longer than the model's context keeps its first ids
    assert cut == 1


def test_the_vendored_set_loads_and_the_length_of_an_ending_does_not_give_it_away():
    items = load_multiple_choice()
    assert len(items) == 500 and all(len(i.endings) == 4 and 0 <= i.label < 4 for i in items)
    assert all(i.context.strip() and len(set(i.endings)) == 4 for i in items)
    longest = sum(max(range(4), key=lambda k: len(i.endings[k])) == i.label for i in items) / len(items)
    shortest = sum(min(range(4), key=lambda k: len(i.endings[k])) == i.label for i in items) / len(items)
    assert longest < 0.3 and shortest < 0.3, (longest, shortest)  # chance is 0.25
    assert len(load_multiple_choice(limit=7)) == 7


def test_a_multiple_choice_set_with_another_checksum_is_refused_in_one_error(tmp_path):
    damaged = tmp_path / "set.jsonl"
    data = bytearray(open(MULTIPLE_CHOICE_FILE, "rb").read())
    data[-10] ^= 1  # one bit of the last item
    damaged.write_bytes(bytes(data))
    with pytest.raises(DataError, match="sha256 .* not the .* this stoker ships") as err:
        load_multiple_choice(str(damaged))
    assert str(damaged) in str(err.value) and "build_evalset.py" in str(err.value)
    assert "\n" not in str(err.value)


def test_the_build_script_reproduces_the_vendored_set_byte_for_byte(tmp_path):
    with open(MULTIPLE_CHOICE_FILE) as f:
        meta = json.loads(f.readline())["meta"]
    stdlib = sysconfig.get_paths()["stdlib"]
    for name, digest in meta["files"].items():
        path = os.path.join(stdlib, name)
        if not os.path.isfile(path) or hashlib.sha256(open(path, "rb").read()).hexdigest() != digest:
            pytest.skip(f"built from Python {meta['python']}'s {name}; this Python's differs")
    _run(os.path.join("scripts", "build_evalset.py"), "--out", str(tmp_path / "rebuilt.jsonl"))
    assert (tmp_path / "rebuilt.jsonl").read_bytes() == open(MULTIPLE_CHOICE_FILE, "rb").read()
