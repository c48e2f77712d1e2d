import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.eval.blimp import (describe_skipped, evaluate_blimp, evaluate_pairs, from_text_logprob, make_pairs,
                                 model_score_fn, read_records, select_pairs, split_tokens)

SHARED = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "eval" / "blimp"


def write(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_hand_made_pair_with_known_logprobs(tmp_path):
    """A fake model with fixed sentence log-probabilities: accuracy per phenomenon and macro average by hand."""
    known = {"The cat sleeps.": -10.0, "The cat sleep.": -12.5,  # good wins
             "Dogs bark.": -7.0, "Dogs barks.": -6.0,  # bad wins
             "She saw herself.": -9.0, "She saw himself.": -9.0}  # tie: goes to the good sentence, as both harnesses
    f = write(tmp_path / "p.jsonl", [
        {"sentence_good": "The cat sleeps.", "sentence_bad": "The cat sleep.", "UID": "agreement", "field": "m"},
        {"sentence_good": "Dogs bark.", "sentence_bad": "Dogs barks.", "UID": "agreement", "field": "m"},
        {"sentence_good": "She saw herself.", "sentence_bad": "She saw himself.", "UID": "anaphor", "field": "m"},
    ])
    calls = []

    def logprob_fn(texts):
        calls.append(list(texts))
        return [known[t] for t in texts]

    res = evaluate_blimp(f, from_text_logprob(logprob_fn))
    assert res["per_phenomenon"]["agreement"]["accuracy"] == 0.5
    assert res["per_phenomenon"]["anaphor"]["accuracy"] == 1.0
    assert res["macro_accuracy"] == 0.75 and res["micro_accuracy"] == pytest.approx(2 / 3) and res["n_pairs"] == 3
    assert [p["pred"] for p in res["predictions"]["agreement"]["predictions"]] == ["The cat sleeps.", "Dogs barks."]
    assert len(calls) == 1  # full sentences need no context scores


def test_prefix_methods_use_conditional_scores(tmp_path):
    rec = {"sentence_good": "a b", "sentence_bad": "a c", "one_prefix_prefix": "Susan revealed",
           "one_prefix_word_good": "herself", "one_prefix_word_bad": "themselves", "one_prefix_method": True,
           "two_prefix_prefix_good": "Who did", "two_prefix_prefix_bad": "Who", "two_prefix_word": "you see",
           "two_prefix_method": True, "UID": "x"}
    f = write(tmp_path / "x.jsonl", [rec])
    # log P(text) for joined texts and for contexts: conditional = difference
    known = {"Susan revealed herself": -20.0, "Susan revealed themselves": -21.0, "Susan revealed": -15.0,
             "Who did you see": -8.0, "Who you see": -7.0, "Who did": -5.0, "Who": -1.0}
    score = from_text_logprob(lambda ts: [known[t] for t in ts])
    assert score([("Susan revealed", "herself"), ("", "Susan revealed")]) == [-5.0, -15.0]
    one = evaluate_blimp(f, score, "one_prefix")
    assert one["per_phenomenon"]["x"]["accuracy"] == 1.0  # -5 > -6
    two = evaluate_blimp(f, score, "two_prefix")
    # the joint texts favour the bad item (-8 < -7), the word given its prefix favours the good one (-3 > -6)
    assert two["per_phenomenon"]["x"]["accuracy"] == 1.0


def test_flags_skip_and_missing_fields_error(tmp_path):
    f = write(tmp_path / "y.jsonl", [{"sentence_good": "a", "sentence_bad": "b", "UID": "y",
                                      "two_prefix_method": False}])
    assert make_pairs(read_records(f), "two_prefix") == []
    g = write(tmp_path / "z.jsonl", [{"sentence_good": "a", "UID": "z"}])
    with pytest.raises(ValueError, match=r"z.jsonl:1: field 'sentence_bad'"):
        make_pairs(read_records(g))


def test_model_score_fn_sums_token_logprobs():
    """A fake causal LM whose next-token distribution is fixed: log P = sum over the continuation's tokens."""
    V = 6
    table = torch.log_softmax(torch.arange(V, dtype=torch.float32), -1)  # same distribution at every position

    class Fake(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

        def forward(self, ids, mask, depth=None):
            return table.expand(*ids.shape, V).clone()

    vocab = {"a": 4, "b": 5, "c": 3}
    encode = lambda s: [vocab[w] for w in s.split()]  # noqa: E731
    score = model_score_fn(Fake(), encode, batch_size=1)
    got = score([("", "a b"), ("a", "c"), ("a b", "a")])
    np.testing.assert_allclose(got, [table[4] + table[5], table[3], table[4]], rtol=1e-6)
    assert split_tokens(encode, "a b", "c") == ([4, 5], [3])


def test_split_tokens_falls_back_when_prefix_tokenization_changes():
    encode = lambda s: [len(s)]  # noqa: E731  a "tokenizer" whose first token depends on the whole text
    assert split_tokens(encode, "ab", "cd") == ([2], [2])


@pytest.mark.skipif(not SHARED.is_dir(), reason="needs ../shared/data")
def test_real_blimp_files_with_fake_scorer():
    """Runs over every shared phenomenon; a length-penalizing fake scorer (shorter sentence = more probable)."""
    recs = read_records(SHARED)
    res = evaluate_pairs(make_pairs(recs), lambda items: [-len(c + w) for c, w in items])
    uids = {r["UID"] for _, r in recs}
    assert set(res["per_phenomenon"]) == uids and len(uids) == len(list(SHARED.glob("*.jsonl")))
    assert res["n_pairs"] == len(recs)
    assert all(0 <= d["accuracy"] <= 1 for d in res["per_phenomenon"].values())
    assert math.isclose(res["macro_accuracy"], np.mean([d["accuracy"] for d in res["per_phenomenon"].values()]))
    for method in ("one_prefix", "two_prefix"):  # the prefix variants parse wherever the files offer them
        make_pairs(recs, method)


def test_skipped_records_are_counted_per_paradigm_with_the_reason(tmp_path):
    """Issue 11: a prefix method skips the paradigms it does not apply to; select_pairs says how many and why."""
    pair = {"sentence_good": "a b", "sentence_bad": "b a"}
    one = {"one_prefix_prefix": "a", "one_prefix_word_good": "b", "one_prefix_word_bad": "c"}
    write(tmp_path / "p1.jsonl", [{**pair, **one, "UID": "p1", "one_prefix_method": True}] * 3)
    write(tmp_path / "p2.jsonl", [{**pair, "UID": "p2", "one_prefix_method": False}] * 2)
    write(tmp_path / "p3.jsonl", [{**pair, "UID": "p3"}] * 4)  # no flag, no fields: an older file
    write(tmp_path / "p4.jsonl", [{**pair, **one, "UID": "p4"}, {**pair, "UID": "p4", "one_prefix_method": False}])
    recs = read_records(tmp_path)
    pairs, rep = select_pairs(recs, "one_prefix")
    assert pairs == make_pairs(recs, "one_prefix") and len(pairs) == 4
    assert (rep["records"], rep["paradigms"], rep["of_paradigms"]) == (7, 2, 4)
    assert rep["per_paradigm"] == {"p2": {"records": 2, "of": 2, "reason": {"flag_false": 2}},
                                   "p3": {"records": 4, "of": 4, "reason": {"no_fields": 4}},
                                   "p4": {"records": 1, "of": 2, "reason": {"flag_false": 1}}}
    line = describe_skipped(rep)
    assert line.startswith("skipped: --blimp-method one_prefix skips 2 of 4 paradigms, 7 records: p2, p3; "
                           "partly: p4 (1 of 2)")
    assert "3 records: one_prefix_method is false" in line and "4 records: neither one_prefix_method" in line
    full, rep_full = select_pairs(recs, "full")
    assert len(full) == 11 and rep_full["records"] == 0 and rep_full["per_paradigm"] == {}


@pytest.mark.skipif(not SHARED.is_dir(), reason="needs ../shared/data")
def test_shared_blimp_skips_by_method():
    recs = read_records(SHARED)
    _, one = select_pairs(recs, "one_prefix")
    _, two = select_pairs(recs, "two_prefix")
    assert (one["paradigms"], one["of_paradigms"], one["records"]) == (3, 6, 3000)
    assert (two["paradigms"], two["of_paradigms"], two["records"]) == (5, 6, 5000)
    assert "skips 5 of 6 paradigms" in describe_skipped(two)
