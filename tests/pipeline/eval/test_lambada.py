import json

import numpy as np
import pytest
import torch

from pipeline.eval.lambada import evaluate_lambada, model_logprobs_fn, read_passages, split_passage

VOCAB = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>", "the", "cat", "sat", "on", "mat", "ma", "t",
                                     "dog", "rug"])}


def encode(text):
    """A toy tokenizer: words, except "mat" is two tokens ("ma", "t") and unknown words are <unk>."""
    out = []
    for w in text.split():
        out.extend([VOCAB["ma"], VOCAB["t"]] if w == "mat" else [VOCAB.get(w, 3)])
    return out


class Oracle(torch.nn.Module):
    """A fake causal LM that puts the true next token of a fixed sentence at a chosen rank."""

    def __init__(self, rank_of_next: dict):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.rank_of_next = rank_of_next  # position -> rank the true next token gets (default 0)

    def forward(self, ids, mask, depth=None):
        B, L = ids.shape
        V = len(VOCAB)
        logits = torch.zeros(B, L, V)
        for b in range(B):
            for p in range(L - 1):
                nxt = int(ids[b, p + 1])
                rank = self.rank_of_next.get(p, 0)
                order = [v for v in range(V) if v != nxt]
                ranked = order[:rank] + [nxt] + order[rank:]
                logits[b, p, ranked] = torch.arange(V, 0, -1, dtype=torch.float32)  # descending scores
        return logits


def test_pass_at_5_every_target_token_must_be_in_top5():
    text = "the cat sat on the mat"  # <s> the cat sat on the ma t: positions 0..7; target "ma" at 6, "t" at 7
    assert split_passage(text) == ("the cat sat on the", "mat")
    # both target tokens ranked 0: passes at k = 1 and 5
    r = evaluate_lambada([text], encode, model_logprobs_fn(Oracle({})))
    assert r["pass_at_k"] == 1.0 and r["accuracy"] == 1.0 and r["mean_target_tokens"] == 2
    # second token at rank 4 (5th most likely): passes @5, not @1
    r = evaluate_lambada([text], encode, model_logprobs_fn(Oracle({6: 4})))
    assert r["pass_at_k"] == 1.0 and r["accuracy"] == 0.0
    # first token at rank 5: fails @5 although the second token is top-1 (gold prefix keeps scoring it)
    r = evaluate_lambada([text], encode, model_logprobs_fn(Oracle({5: 5})))
    assert r["pass_at_k"] == 0.0 and r["per_passage"][0]["rank_max"] == 5
    # context mistakes do not matter: only the target's tokens are checked
    r = evaluate_lambada([text], encode, model_logprobs_fn(Oracle({0: 9, 2: 9})))
    assert r["pass_at_k"] == 1.0


def test_mixed_batch_and_k(tmp_path):
    texts = ["the cat sat on the mat", "the dog sat on the rug"]
    fn = lambda seqs: [np.log(np.full((len(s), len(VOCAB)), 1 / len(VOCAB))) for s in seqs]  # noqa: E731 uniform
    r = evaluate_lambada(texts, encode, fn, k=1)
    assert r["pass_at_k"] == 1.0 and r["n"] == 2  # all tied: ties count for the passage


def test_read_plain_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("the cat sat on the mat\n\nthe dog sat on the rug\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "the cat sat on the mat"}) + "\n")
    assert read_passages(tmp_path / "a.txt") == ["the cat sat on the mat", "the dog sat on the rug"]
    assert read_passages(tmp_path / "b.jsonl") == ["the cat sat on the mat"]
    (tmp_path / "c.jsonl").write_text(json.dumps({"passage": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"c.jsonl:1: expected an object with a string 'text'"):
        read_passages(tmp_path / "c.jsonl")
    with pytest.raises(ValueError, match="no context"):
        split_passage("word")
