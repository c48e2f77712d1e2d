import numpy as np
import pytest

from pipeline.data.tokenizer import NucleotideTokenizer as Tok
from pipeline.objectives.masking import IGNORE_INDEX, corrupt, select_spans, target_count


def framed(n, rng):
    return np.concatenate([[Tok.cls_id], rng.integers(6, 10, n), [Tok.eos_id]])


def run(tokens, kind, rng, **kw):
    args = dict(kind=kind, select_prob=0.15, span_mean=3.0, mask_prob=0.8, random_prob=0.1, mask_id=Tok.mask_id,
                num_special=Tok.num_special, random_pool=Tok.residue_ids("rna"))
    args.update(kw)
    return corrupt(tokens, rng, **args)


@pytest.mark.parametrize("kind", ["token", "span"])
def test_exact_count_unique_and_never_special(kind):
    rng = np.random.default_rng(0)
    for n in (0, 1, 2, 5, 37, 200):
        tokens = framed(n, rng)
        inputs, labels = run(tokens, kind, rng)
        sup = labels != IGNORE_INDEX
        assert sup.sum() == target_count(n, 0.15)  # q = max(1, min(floor(p|U|), |U|)), 0 if U empty
        assert not sup[0] and not sup[-1]  # <cls>, <eos> never selected
        assert np.array_equal(labels[sup], tokens[sup]) and np.array_equal(inputs[~sup], tokens[~sup])


def test_target_count_formula():
    assert [target_count(n, 0.15) for n in (0, 1, 6, 7, 100)] == [0, 1, 1, 1, 15]
    assert target_count(3, 1.0) == 3


def test_spans_are_contiguous_runs_with_exponential_lengths():
    """With few targets per row, runs are mostly single spans: their mean length tracks mu_span (clipped, floored)."""
    rng = np.random.default_rng(1)
    runs = []
    for _ in range(3000):
        idx = select_spans(400, 4, 6.0, rng)
        breaks = np.flatnonzero(np.diff(idx) != 1)
        runs += np.diff(np.concatenate([[0], breaks + 1, [len(idx)]])).tolist()
    # span length max(1, floor(Y)), Y ~ Exp(mean 6), truncated at the 4 targets: spans are much longer than 1
    assert np.mean(runs) > 2.0
    token_runs = []
    for _ in range(3000):
        idx = np.sort(rng.choice(400, 4, replace=False))
        token_runs += [len(idx) / (1 + np.sum(np.diff(idx) != 1))]
    assert np.mean(token_runs) < 1.1


def test_span_boundary_clipping_and_mean_length():
    rng = np.random.default_rng(2)
    lengths = [len(select_spans(10_000, 10_000, 3.0, rng)) for _ in range(3)]
    assert lengths == [10_000] * 3  # asking for every position terminates and is exact
    idx = select_spans(5, 2, 50.0, np.random.default_rng(3))
    assert len(idx) == 2 and idx.max() < 5


def test_replacement_rule_frequencies():
    rng = np.random.default_rng(4)
    mask = rand = keep = 0
    for _ in range(300):
        tokens = framed(300, rng)
        inputs, labels = run(tokens, "span", rng)
        sup = labels != IGNORE_INDEX
        mask += np.sum(inputs[sup] == Tok.mask_id)
        same = inputs[sup] == tokens[sup]
        keep += np.sum(same)
        rand += np.sum(~same & (inputs[sup] != Tok.mask_id))
    total = mask + rand + keep
    assert abs(mask / total - 0.8) < 0.02
    # a random base equal to the original counts as kept: expected keep 0.1 + 0.1/4
    assert abs(keep / total - 0.125) < 0.02 and abs(rand / total - 0.075) < 0.02


def test_last_segment_supervises_exactly_the_answer_and_masks_it():
    """kind last_segment (the synthetic depth task): the residues after the last <sep>, all of them, always <mask>
    with mask_prob 1; nothing else is touched."""
    rng = np.random.default_rng(2)
    body = rng.integers(6, 22, 13)
    tokens = np.concatenate([[Tok.cls_id], body, [Tok.sep_id], [7, 8], [Tok.sep_id], [9, 6], [Tok.eos_id]])
    inputs, labels = run(tokens, "last_segment", rng, mask_prob=1.0, random_prob=0.0, sep_id=Tok.sep_id)
    sup = np.flatnonzero(labels != IGNORE_INDEX)
    assert sup.tolist() == [len(tokens) - 3, len(tokens) - 2]  # after the last <sep>, not <eos>
    assert labels[sup].tolist() == [9, 6] and (inputs[sup] == Tok.mask_id).all()
    keep = np.ones(len(tokens), bool)
    keep[sup] = False
    assert np.array_equal(inputs[keep], tokens[keep])


def test_last_segment_refuses_a_record_without_sep_or_longer_than_the_context():
    from pipeline.config import MaskingConfig
    from pipeline.objectives.masking import make_mlm_transform

    rng = np.random.default_rng(3)
    with pytest.raises(ValueError, match="last_segment: a record of 7 tokens has no <sep>"):
        run(framed(5, rng), "last_segment", rng, sep_id=Tok.sep_id)
    transform = make_mlm_transform(8, MaskingConfig(kind="last_segment"), cls_id=Tok.cls_id, eos_id=Tok.eos_id,
                                   mask_id=Tok.mask_id, num_special=Tok.num_special,
                                   random_pool=Tok.residue_ids("rna"), sep_id=Tok.sep_id)
    assert transform(np.array([6, 7, 8, Tok.sep_id, 9]), rng)["labels"].tolist().count(IGNORE_INDEX) == 6
    with pytest.raises(ValueError, match="does not fit data.context_length 8"):
        transform(np.array([6, 7, 8, 9, 6, 7, Tok.sep_id, 9]), rng)
