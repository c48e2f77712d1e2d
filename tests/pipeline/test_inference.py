"""pipeline.inference on tiny exports: batching by length, the evaluators' scoring, masked predictions, depth."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from checkpoint_factory import CONFIGS, tiny_config, write_export  # noqa: E402
from conftest import SHARED_DATA  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.data.tokenizer import NucleotideTokenizer  # noqa: E402
from pipeline.eval import rnagym  # noqa: E402
from pipeline.eval.reconstruction import state_table  # noqa: E402
from pipeline.inference import Adaptive, Inference  # noqa: E402
from pipeline.models.eco_rna import initial_state  # noqa: E402

TOME = SHARED_DATA / "eval" / "rnagym" / "Tome_2014_GFP_aptamer.csv"
SEQS = ["ACGUAGCAAGUCC", "GGCUA", "ACGUAGCAAGUACGUAGCAAGUAA", "UUAGC", "CCGGAAUU", "A"]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inference")
    return write_export(tmp / "export", tiny_config(tmp), seed=3)


@pytest.fixture(scope="module")
def inf(export):
    return Inference.from_pretrained(export)


def reference_logits(inf, ids, k: int) -> torch.Tensor:
    """The evaluators' forward: framed ids [n] alone, the seed-0 state table, ``logits_at_depths`` -> [n, V]."""
    tokens = torch.as_tensor(ids).long()[None]
    mask = torch.ones_like(tokens, dtype=torch.bool)
    table = state_table(inf.cfg.model, inf.cfg.data.context_length, 0)
    with torch.no_grad():
        return inf.model.logits_at_depths(tokens, mask, [k], initial_state(inf.cfg.model, mask, table=table))[k][0]


def test_embed_batches_by_length_and_restores_the_order(inf):
    small = Inference(inf.model, inf.tokenizer, inf.cfg, config=type(inf.config)(max_tokens=30))  # 1-2 rows/batch
    seen = []
    handle = small.model.prelude_norm.register_forward_hook(lambda m, a, o: seen.append(tuple(o.shape[:2])))
    try:
        many = small.embed(SEQS, depth=2, per_token=True)
    finally:
        handle.remove()
    assert len(seen) > 1 and all(b * L <= 30 for b, L in seen)  # several batches within the token budget
    assert [L for _, L in seen] == sorted((L for _, L in seen), reverse=True)  # longest first
    assert many.pooled.shape == (len(SEQS), inf.cfg.model.d_model) and many.depths == [2] * len(SEQS)
    for i, s in enumerate(SEQS):
        alone = inf.embed([s], depth=2, per_token=True)
        assert many.per_token[i].shape == (len(s), inf.cfg.model.d_model)
        torch.testing.assert_close(many.per_token[i], alone.per_token[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(many.pooled[i], many.per_token[i].mean(0), rtol=0, atol=1e-6)


@pytest.mark.skipif(not TOME.is_file(), reason="needs ../shared/data (an RNAGym assay)")
def test_score_variants_is_the_rnagym_evaluators_score(inf):
    assay = rnagym.load_assay(TOME)
    mutants = list(assay.mutants[:40])

    def forward(ids):  # launchers/evaluate.py run_rnagym's forward at depth 2
        return torch.log_softmax(reference_logits(inf, ids, 2).float(), -1).numpy()

    want = rnagym.score_variants(assay, rnagym.wildtype_logprobs(assay.wt_ids(), forward,
                                                                 inf.cfg.data.context_length))[:40]
    got = inf.score_variants(assay.wt, mutants, depth=2)
    np.testing.assert_allclose(got.scores, want, rtol=0, atol=1e-9)
    assert np.ptp(got.scores) > 0 and got.depths == [2]
    with pytest.raises(ValueError, match="wild-type base at position 3 is U, not A"):
        inf.score_variants(assay.wt, ["A3C"], depth=2)


def test_predict_masked_top_k_is_the_softmax_at_the_mask(inf):
    seq = "ACG<mask>AGCAA<mask>U"
    out = inf.predict_masked([seq, "GGCUA"], depth=3, top_k=4)
    first, none = out.predictions
    assert [p.position for p in first] == [3, 9] and none == []
    ids = NucleotideTokenizer("rna").encode(seq.replace("<mask>", "N"), add_special=True)
    ids[[4, 10]] = NucleotideTokenizer.mask_id  # framed positions of the two masks
    ref = torch.softmax(reference_logits(inf, ids, 3), -1)  # [n, V]
    for p, at in zip(first, (4, 10)):
        residue = ref[at, 6:]  # residue tokens only (the specials are never predicted)
        top = residue.topk(4)
        assert p.tokens == [NucleotideTokenizer.vocab[6 + int(i)] for i in top.indices]
        np.testing.assert_allclose(p.probs, top.values.numpy(), rtol=1e-5)
        assert p.probs == sorted(p.probs, reverse=True)


def test_adaptive_depth_reports_depths_and_row_iterations(inf):
    fixed = inf.embed(SEQS, depth=Adaptive(tol=0.0, max_depth=5))
    assert fixed.depths == [5] * len(SEQS) and fixed.row_iterations == 5 * len(SEQS)
    torch.testing.assert_close(fixed.pooled, inf.embed(SEQS, depth=5).pooled, rtol=0, atol=1e-6)
    loose = inf.embed(SEQS, depth=Adaptive(tol=1e-3, max_depth=5))
    assert loose.row_iterations == sum(loose.depths) < fixed.row_iterations


def test_default_depth_is_the_exports_task_depth_else_the_training_mean(export, tmp_path):
    assert Inference.from_pretrained(export).default_depth("rnagym") == 3  # eco_rna_demo.yaml: mu_k 3
    chosen = tmp_path / "chosen"
    chosen.mkdir()
    for f in export.iterdir():
        (chosen / f.name).write_bytes(f.read_bytes())
    (chosen / "export.json").write_text(json.dumps({"task_depths": {"rnagym": 5}}))
    inf5 = Inference.from_pretrained(chosen)
    assert inf5.default_depth("rnagym") == 5 and inf5.default_depth("embed") == 3
    assert inf5.score_variants("ACGUAGC", ["A1G"]).depths == [5]


@pytest.mark.parametrize("kw,msg", [({"depth": 0}, "depth: must be an integer >= 1"),
                                    ({"depth": 10_000}, "depth '10000': depth 10000 is above the maximum"),
                                    ({"depth": Adaptive(tol=1e-3, max_depth=10_000)}, "above the maximum")])
def test_bad_depths(inf, kw, msg):
    with pytest.raises(ValueError, match=msg):
        inf.embed(["ACGU"], **kw)


def test_bad_sequences(inf):
    with pytest.raises(ValueError, match="sequence 1: character 'J' at position 3"):
        inf.embed(["ACGU", "ACJ"])
    with pytest.raises(ValueError, match="sequence 0: 200 residues; the model takes at most 126"):
        inf.embed(["A" * 200])
    with pytest.raises(ValueError, match="Adaptive.tol"):
        Adaptive(tol=-1.0)


def test_one_depth_families_refuse_a_depth_and_causal_lms_are_refused(tmp_path):
    cfg = load_config(CONFIGS / "protlingo_demo.yaml",
                      ["model.d_model=32", "model.n_heads=2", "model.n_layers=2", "model.d_ff=64",
                       "model.moe_layers=[1]", "model.moe_shared_hidden=32", "model.memory_layers=[0]",
                       f"run_dir={tmp_path / 'run'}", f"data.train_shards={tmp_path / 'no_shards'}"])
    prot = Inference.from_pretrained(write_export(tmp_path / "prot", cfg))
    with pytest.raises(ValueError, match="protlingo has one depth"):
        prot.embed(["MKTAYIAK"], depth=2)
    emb = prot.embed(["MKTAYIAK", "MKT"], per_token=True)
    assert emb.depths is None and [t.shape[0] for t in emb.per_token] == [8, 3]
    scores = prot.score_variants("MKTAYIAK", ["M1A", "K2R:T3S"]).scores  # ProteinGym's masked marginals
    from pipeline.data.protein_tokenizer import MASK_ID, VOCAB, ProteinTokenizer

    ids = torch.from_numpy(ProteinTokenizer().encode("MKTAYIAK", add_special=True)).long()
    ids[1] = MASK_ID  # residue 1 masked alone in the wild-type context
    with torch.no_grad():
        lp = torch.log_softmax(prot.model(ids[None], torch.ones(1, len(ids), dtype=torch.bool)).logits[0, 1], -1)
    assert scores[0] == pytest.approx(float(lp[VOCAB.index("A")] - lp[VOCAB.index("M")]), abs=1e-5)
    assert np.isfinite(scores).all()
    with pytest.raises(ValueError, match="inference supports the masked LMs"):
        Inference.from_pretrained(write_export(tmp_path / "gpt", tiny_config(tmp_path, "recursive_gpt")))
