"""ESM's contact head on ProtLingo (pipeline/eval/contacts.py): equal to Hugging Face's
``EsmForMaskedLM.predict_contacts`` on a dense model built from the same weights, and the P@L / P@L/2 / P@L/5
metric on hand-made contact maps whose answer is known."""
import gzip

import pytest
import torch

from conftest import REPO
from pipeline.data.protein_tokenizer import ProteinTokenizer
from pipeline.eval.contacts import attention_maps, contact_probs, contacts_from_coordinates, precision_at_l
from pipeline.models.protlingo import ProtLingo, config_from_hf, hf_to_protlingo

SAMPLE = REPO / "data" / "samples" / "uniref90_clusters_sample.fasta.gz"


def proteins(n=4, length=70):
    seqs = [r.split("\n", 1)[1].replace("\n", "") for r in gzip.decompress(SAMPLE.read_bytes()).decode().split(">")[1:]]
    tok = ProteinTokenizer()
    rows = [[tok.cls_id, *tok.encode(s[:length - 7 * i]).tolist(), tok.eos_id] for i, s in enumerate(seqs[:n])]
    width = max(map(len, rows))
    ids = torch.full((n, width), tok.pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
    return ids, ids != tok.pad_id


def test_contact_head_equals_hugging_face_predict_contacts():
    from transformers import EsmConfig, EsmForMaskedLM

    hf_cfg = EsmConfig(vocab_size=33, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                       intermediate_size=128, position_embedding_type="rotary", token_dropout=True, mask_token_id=32,
                       pad_token_id=1, emb_layer_norm_before=False, max_position_embeddings=1026,
                       layer_norm_eps=1e-5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                       attn_implementation="eager")
    torch.manual_seed(0)
    hf = EsmForMaskedLM(hf_cfg).eval()
    with torch.no_grad():  # a random regression (ESM2's trained one is not available here), strong enough that the
        # near-uniform attention of a random model gives probabilities that vary: a wrong map cannot hide
        hf.esm.contact_head.regression.weight.normal_(0, 300.0)
        hf.esm.contact_head.regression.bias.fill_(-0.5)
    model = ProtLingo(config_from_hf(hf_cfg.to_dict(), attn_backend="sdpa")).eval()
    model.load_state_dict(hf_to_protlingo(hf.state_dict(), 3), strict=True)
    ids, mask = proteins()
    with torch.no_grad():
        want = hf.predict_contacts(ids, mask.long())
    head = hf.esm.contact_head.regression
    with torch.no_grad():
        got = contact_probs(attention_maps(model, ids, mask), ids, mask, head.weight, head.bias)
    assert got.shape == want.shape == (4, ids.shape[1] - 2, ids.shape[1] - 2)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert got.std() > 0.05  # not a constant map


def test_precision_at_l_on_a_hand_made_map():
    """L = 60: the 666 pairs with |i - j| >= 24 are ranked by probability. The first 20 are true contacts, the next
    40 false, then 10 more true; short-range pairs (|i - j| < 24) score highest of all and must be ignored. So the
    top 60 hold 20 contacts (P@L = 1/3), the top 30 hold 20 (2/3), the top 12 hold 12 (1)."""
    L = 60
    i, j = torch.triu_indices(L, L, offset=24)
    assert i.numel() == 666
    probs = torch.zeros(L, L)
    contacts = torch.zeros(L, L, dtype=torch.bool)
    score = torch.linspace(0.9, 0.1, 70)
    for rank in range(70):
        probs[i[rank], j[rank]] = score[rank]
        if rank < 20 or rank >= 60:
            contacts[i[rank], j[rank]] = True
    near = torch.triu_indices(L, L, offset=1)
    short = (near[1] - near[0]) < 24
    probs[near[0][short], near[1][short]] = 0.99  # short range: outranks everything, never counted
    contacts[near[0][short], near[1][short]] = False
    assert precision_at_l(probs, contacts) == {"P@L": pytest.approx(1 / 3), "P@L/2": pytest.approx(2 / 3),
                                               "P@L/5": 1.0}
    assert precision_at_l(probs, contacts, min_separation=1)["P@L/5"] == 0.0  # the short pairs, all false


def test_contacts_from_coordinates():
    """Three atoms on a line 5 angstrom apart and one missing: contacts within 8 angstrom, none with the missing."""
    cb = torch.tensor([[0.0, 0, 0], [5.0, 0, 0], [10.0, 0, 0], [float("nan")] * 3])
    c = contacts_from_coordinates(cb)
    assert c[0, 1] and c[1, 2] and not c[0, 2] and not c[3].any() and not c[:, 3].any()
