"""ProteinGym masked-marginal scoring: a hand-computed example, the official ESM/ProteinGym loop re-implemented here
on a tiny random transformers.EsmForMaskedLM, the official optimal-window rule, metrics as ProteinGym computes them,
one clear error per bad input, and the real BLAT_ECOLX assay."""
import csv
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.metrics import matthews_corrcoef, roc_auc_score

from pipeline.data.protein_tokenizer import VOCAB
from pipeline.eval import proteingym as pg

SHARED = Path(__file__).resolve().parents[3].parent / "shared" / "data"
PG = SHARED / "eval" / "proteingym"
BLAT = PG / "BLAT_ECOLX_Jacquier_2013.csv"
REF = PG / "DMS_substitutions.csv"
needs_data = pytest.mark.skipif(not PG.exists(), reason="needs ../shared/data/eval/proteingym")
ID = {t: i for i, t in enumerate(VOCAB)}


# ----------------------------------------------------------------------------------------------- helpers

def write_assay(path, wt, rows, with_seq=True):
    """rows: (mutant, DMS_score, DMS_score_bin); mutated_sequence built from ``wt``."""
    fields = ["mutant", "mutated_sequence", "DMS_score", "DMS_score_bin"] if with_seq else \
        ["mutant", "DMS_score", "DMS_score_bin"]
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(fields)
        for mutant, score, b in rows:
            seq = list(wt)
            for m in mutant.split(":"):
                seq[int(m[1:-1]) - 1] = m[-1]
            w.writerow([mutant, "".join(seq), score, b] if with_seq else [mutant, score, b])
    return path


def hand_logits_fn(tokens, attention_mask):
    """Logits known by construction: at the masked token j (index inside the window) 0 everywhere except
    l[A] += j and l[next token] += 2 (the right neighbour in the input, so the context matters); every unmasked
    token gets a decoy 100 on its own id (reading an unmasked row would show)."""
    b, n = tokens.shape
    out = torch.zeros(b, n, len(VOCAB))
    for r in range(b):
        for j in range(n):
            if tokens[r, j] == ID["<mask>"]:
                out[r, j, ID["A"]] += j
                if j + 1 < n:
                    out[r, j, tokens[r, j + 1]] += 2
            else:
                out[r, j, tokens[r, j]] = 100.0
    return out


def hf_vocab(tmp_path):
    f = tmp_path / "vocab.txt"
    f.write_text("\n".join(VOCAB) + "\n")  # HF EsmTokenizer's vocab.txt: one token a line, in id order
    return f


def tiny_esm(seed=0):
    """A random ESM-2-shaped EsmForMaskedLM: rotary positions, token dropout, no embedding LayerNorm (as ESM-2)."""
    from transformers import EsmConfig, EsmForMaskedLM

    cfg = EsmConfig(vocab_size=33, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=64, max_position_embeddings=1026, position_embedding_type="rotary",
                    token_dropout=True, emb_layer_norm_before=False, mask_token_id=32, pad_token_id=1)
    torch.manual_seed(seed)
    return EsmForMaskedLM(cfg).eval()


def hf_logits_fn(model):
    return lambda tokens, mask: model(tokens, mask.long()).logits


# The official code, re-implemented line by line (ProteinGym @ bb685245): proteingym/utils/scoring_utils.py
# get_optimal_window and proteingym/baselines/esm/compute_fitness.py masked-marginals + label_row, with ESM's
# Alphabet replaced by HF EsmTokenizer (same ids).
def official_get_optimal_window(mutation_position_relative, seq_len_wo_special, model_window):
    half_model_window = model_window // 2
    if seq_len_wo_special <= model_window:
        return [0, seq_len_wo_special]
    elif mutation_position_relative < half_model_window:
        return [0, model_window]
    elif mutation_position_relative >= seq_len_wo_special - half_model_window:
        return [seq_len_wo_special - model_window, seq_len_wo_special]
    else:
        return [max(0, mutation_position_relative - half_model_window),
                min(seq_len_wo_special, mutation_position_relative + half_model_window)]


def official_label_row(row, sequence, token_probs, tokenizer, offset_idx):
    score = 0
    for mutation in row.split(":"):
        wt, idx, mt = mutation[0], int(mutation[1:-1]) - offset_idx, mutation[-1]
        assert sequence[idx] == wt, "The listed wildtype does not match the provided sequence"
        wt_encoded, mt_encoded = tokenizer.convert_tokens_to_ids(wt), tokenizer.convert_tokens_to_ids(mt)
        score += (token_probs[0, 1 + idx, mt_encoded] - token_probs[0, 1 + idx, wt_encoded]).item()
    return score


def official_masked_marginals(model, tokenizer, sequence, mutants, model_window=1024):
    batch_tokens = tokenizer([sequence], return_tensors="pt")["input_ids"]
    all_token_probs = []
    for i in range(batch_tokens.size(1)):
        batch_tokens_masked = batch_tokens.clone()
        batch_tokens_masked[0, i] = tokenizer.mask_token_id
        if batch_tokens.size(1) > model_window:
            large_batch_tokens_masked = batch_tokens_masked.clone()
            start, end = official_get_optimal_window(mutation_position_relative=i,
                                                     seq_len_wo_special=len(sequence) + 2, model_window=model_window)
            batch_tokens_masked = large_batch_tokens_masked[:, start:end]
        else:
            start = 0
        with torch.no_grad():
            token_probs = torch.log_softmax(model(batch_tokens_masked)["logits"], dim=-1)
        all_token_probs.append(token_probs[:, i - start])
    token_probs = torch.cat(all_token_probs, dim=0).unsqueeze(0)
    return [official_label_row(m, sequence, token_probs, tokenizer, 1) for m in mutants]


def ours(wt, mutants, logits_fn, **kw):
    subs = [pg.parse_mutant(m) for m in mutants]
    for s, m in zip(subs, mutants):
        pg.check_mutant(s, wt, m)
    lp, _ = pg.masked_marginals(wt, {x.pos for s in subs for x in s}, logits_fn, **kw)
    return pg.score_mutants(subs, lp)


# ------------------------------------------------------------------------------------------ the alphabet

def test_alphabet_is_esm2s():
    """ESM-2's Alphabet.from_architecture('ESM-1b') (the vendored esm/data.py): prepend, the 27 proteinseq_toks,
    <null_> padding to a multiple of 8, then <mask>; and <cls> WT <eos> framing."""
    toks = ["L", "A", "G", "V", "S", "E", "R", "T", "I", "D", "P", "K", "Q", "N", "F", "Y", "M", "H", "W", "C",
            "X", "B", "U", "Z", "O", ".", "-"]
    all_toks = ["<cls>", "<pad>", "<eos>", "<unk>", *toks]
    all_toks += [f"<null_{i + 1}>" for i in range((8 - len(all_toks) % 8) % 8)] + ["<mask>"]
    assert tuple(all_toks) == VOCAB
    assert (ID["<cls>"], ID["<pad>"], ID["<eos>"], ID["<mask>"]) == (0, 1, 2, 32)
    assert pg.framed_ids("MKV").tolist() == [0, ID["M"], ID["K"], ID["V"], 2]


def test_framing_matches_hf_tokenizer(tmp_path):
    from transformers import EsmTokenizer

    tok = EsmTokenizer(str(hf_vocab(tmp_path)))
    seq = "MSIQHFRVALIPFFAAFCLPVFAHPETLVKVKDAEDQ"
    assert pg.framed_ids(seq).tolist() == tok(seq)["input_ids"]


# ------------------------------------------------------------------------------------------- hand example

WT8 = "MKTAYIAK"  # framed: 0 <cls>, 1 M, 2 K, 3 T, 4 A, 5 Y, 6 I, 7 A, 8 K, 9 <eos>
# score = l_j[mt] - l_j[wt] at the masked j = p (log_softmax differences at one position are logit differences):
HAND = {
    "M1A": 1,              # j=1: l[A]=1, l[K]=2 (next K); A - M = 1 - 0
    "K2T": 2,              # j=2: l[A]=2, l[T]=2 (next T); T - K = 2 - 0
    "A4K": -4,             # j=4: l[A]=4, l[Y]=2;          K - A = 0 - 4
    "Y5I": 2,              # j=5: l[A]=5, l[I]=2;          I - Y = 2 - 0
    "M1A:Y5I": 3,          # 1 + 2
    "T3A:A7M": -2,         # j=3: l[A]=3+2 (next A): A - T = 5; j=7: l[A]=7, l[K]=2: M - A = -7
    "K2T:T3A": 7,          # wild-type context: at j=2 the next token is T (2), not the mutant's A; + 5
    "K8A": 8,              # j=8: l[A]=8, l[<eos>]=2;       A - K = 8
}


def test_hand_computed_scores():
    got = ours(WT8, list(HAND), hand_logits_fn)
    assert got == pytest.approx(list(HAND.values()), abs=1e-5)


def test_hand_computed_scores_batching_does_not_matter():
    for bs in (1, 3, 100):
        assert ours(WT8, list(HAND), hand_logits_fn, batch_size=bs) == pytest.approx(list(HAND.values()), abs=1e-5)


def test_hand_assay_through_csv(tmp_path):
    rows = [(m, float(i), int(i % 2)) for i, m in enumerate(HAND)]
    assay = pg.load_assay(write_assay(tmp_path / "HAND_TEST.csv", WT8, rows))
    assert assay.wt == WT8 and assay.wt_source == "assay" and assay.dms_id == "HAND_TEST"
    res = pg.evaluate_assays([assay], hand_logits_fn)
    assert res["scores"]["HAND_TEST"] == pytest.approx(list(HAND.values()), abs=1e-5)
    m = res["per_assay"]["HAND_TEST"]
    assert m["n"] == 8 and m["n_multi"] == 3 and m["windows"] == 1 and m["positions"] == 7


def test_hand_computed_windows():
    """12 residues, window 8: framed length 14 > 8, so each masked position gets its own optimal window and the
    logits see window-relative indices (l[A] = j inside the window); the middle windows hold no <cls>/<eos>."""
    wt = "MKTAYIAKQRSW"  # framed 0 <cls>, 1..12, 13 <eos>
    # p=2: i=2 < 4 -> [0, 8], j=2; l[A]=2, next framed 3 = T: l[T]=2; K2T: T - K = 2
    # p=6: 4 <= 6 < 10 -> [2, 10], j=4; l[A]=4, next framed 7 = A -> l[A]=6; I6A: A - I = 6
    # p=7: [3, 11], j=4; l[A]=4, next framed 8 = K: l[K]=2; A7K: K - A = 2 - 4 = -2
    # p=11: i=11 >= 10 -> [6, 14], j=5; l[A]=5, next framed 12 = W: l[W]=2; S11A: A - S = 5
    # p=12: [6, 14], j=6; l[A]=6, next framed 13 = <eos>; W12A: 6 - 0 = 6
    mutants = {"K2T": 2, "I6A": 6, "A7K": -2, "S11A": 5, "W12A": 6, "K2T:S11A": 7}
    assert ours(wt, list(mutants), hand_logits_fn, window=8) == pytest.approx(list(mutants.values()), abs=1e-5)
    _, spans = pg.masked_marginals(wt, [2, 6, 7, 11, 12], hand_logits_fn, window=8)
    assert spans == {2: (0, 8), 6: (2, 10), 7: (3, 11), 11: (6, 14), 12: (6, 14)}


# ---------------------------------------------------------------------------------------- official rule

@pytest.mark.parametrize("window", [8, 9, 32, 1024])
def test_optimal_window_is_the_official_rule(window):
    lengths = range(2, 3 * window) if window < 100 else [2, 500, 1023, 1024, 1025, 1026, 1500, 2049, 3423]
    for n in lengths:  # 3423: the longest ProteinGym substitution wild type
        for i in range(n):
            assert list(pg.optimal_window(i, n, window)) == official_get_optimal_window(i, n, window), (n, i)


def test_matches_official_loop_short(tmp_path):
    """A wild type shorter than the window: batched, only the needed positions vs the script's one-at-a-time loop."""
    from transformers import EsmTokenizer

    tok = EsmTokenizer(str(hf_vocab(tmp_path)))
    model = tiny_esm(1)
    wt = "MSIQHFRVALIPFFAAFCLPVFAHPETLVKVKDAEDQLGARVGYIELDLNSGK"
    mutants = ["M1A", "H5Y", "F17W", "P20G", "K53D", "S2C:K53R", "A16P:L19G:T27Q", "L38K"]
    expect = official_masked_marginals(model, tok, wt, mutants)
    got = ours(wt, mutants, hf_logits_fn(model), batch_size=4)
    assert got == pytest.approx(expect, abs=1e-5)
    assert np.ptp(got) > 0.01  # not trivially equal (a degenerate model would pass anything)


def test_matches_official_loop_windowed(tmp_path):
    """60 residues, window 32 (framed 62 > 32): every position read from its own optimal window; a double mutant
    with positions in different windows (3 in [0, 32], 55 in [30, 62]) sums terms from both, as the script does."""
    from transformers import EsmTokenizer

    tok = EsmTokenizer(str(hf_vocab(tmp_path)))
    model = tiny_esm(2)
    wt = "MSIQHFRVALIPFFAAFCLPVFAHPETLVKVKDAEDQLGARVGYIELDLNSGKILESFRP"
    assert len(wt) == 60
    mutants = ["I3V", "F14A", "V31G", "E35N", "L55T", "P60K", "I3V:L55T", "P12G:E26D:L47M"]
    expect = official_masked_marginals(model, tok, wt, mutants, model_window=32)
    got = ours(wt, mutants, hf_logits_fn(model), window=32, batch_size=5)
    assert got == pytest.approx(expect, abs=1e-5)
    # and the window matters: the full-context scores differ
    assert not np.allclose(got, ours(wt, mutants, hf_logits_fn(model), window=1024), atol=1e-4)
    _, spans = pg.masked_marginals(wt, [3, 55], hf_logits_fn(model), window=32)
    assert spans == {3: (0, 32), 55: (30, 62)}


# ---------------------------------------------------------------------------------------------- metrics

def test_metrics_as_proteingym():
    rng = np.random.default_rng(0)
    dms = rng.normal(size=40)
    score = dms + rng.normal(size=40)
    b = (dms > 0).astype(int)
    m = pg.assay_metrics(score, dms, b)
    # Spearman from ranks by hand (no ties in continuous draws)
    r1, r2 = np.argsort(np.argsort(dms)), np.argsort(np.argsort(score))
    assert m["spearman"] == pytest.approx(np.corrcoef(r1, r2)[0, 1])
    # AUC = P(score of a positive > score of a negative)
    pos, neg = score[b == 1], score[b == 0]
    assert m["auc"] == pytest.approx(np.mean(pos[:, None] > neg[None, :]))
    pred = (score >= np.median(score)).astype(int)
    tp, tn = np.sum((pred == 1) & (b == 1)), np.sum((pred == 0) & (b == 0))
    fp, fn = np.sum((pred == 1) & (b == 0)), np.sum((pred == 0) & (b == 1))
    assert m["mcc"] == pytest.approx((tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn)))
    assert m["n"] == 40


def test_auc_is_not_folded_and_mcc_ties_go_up():
    dms = np.array([0.0, 1.0, 2.0, 3.0])
    b = np.array([0, 0, 1, 1])
    m = pg.assay_metrics(-dms, dms, b)  # a model that ranks fitness upside down
    assert m["auc"] == 0.0 and m["spearman"] == pytest.approx(-1.0) and m["mcc"] == pytest.approx(-1.0)
    # median split: score >= median -> 1 (ProteinGym's map), so ties at the median are predicted fit
    score = np.array([0.0, 1.0, 1.0, 1.0])
    assert pg.assay_metrics(score, dms, b)["mcc"] == pytest.approx(matthews_corrcoef(b, [0, 1, 1, 1]))
    one_class = pg.assay_metrics(dms, dms, np.ones(4, int))
    assert math.isnan(one_class["auc"])


def test_aggregate_mean_over_assays():
    per = {"a": {"spearman": 0.2, "auc": 0.6, "mcc": 0.1, "n": 10},
           "b": {"spearman": 0.4, "auc": math.nan, "mcc": 0.3, "n": 5}}
    agg = pg.aggregate(per)
    assert agg["n"] == 2 and agg["n_mutants"] == 15
    assert agg["spearman"] == pytest.approx(0.3) and agg["auc"] == pytest.approx(0.6) and agg["n_nan_auc"] == 1
    assert agg["mcc"] == pytest.approx(0.2)


# ----------------------------------------------------------------------------------------------- errors

@pytest.mark.parametrize("mutant,msg", [
    ("K1A", "the wild type has 'M' at position 1, the mutant says 'K'"),
    ("M9A", "position 9 is outside the wild type (1..8)"),
    ("M1B", "target 'B' is not one of the 20 standard amino acids"),
    ("M1A:M1C", "position 1 is substituted twice"),
])
def test_invalid_mutants_named(tmp_path, mutant, msg):
    path = tmp_path / "X.csv"
    path.write_text(f"mutant,DMS_score,DMS_score_bin\nM1A,0.1,0\n{mutant},0.2,1\n")
    with pytest.raises(ValueError) as e:
        pg.load_assay(path, {"dms_id": "X", "target_seq": WT8})
    assert f"{path}:3: mutant {mutant!r}: {msg}" in str(e.value)


@pytest.mark.parametrize("mutant", ["", "m1A", "M1A,K2T", "M0A", "MA", "M1", "1A", "M1A:"])
def test_malformed_mutants_named(tmp_path, mutant):
    path = tmp_path / "X.csv"
    path.write_text(f'mutant,DMS_score,DMS_score_bin\nM1A,0.1,0\n"{mutant}",0.2,1\n')  # quoted: may hold ','
    with pytest.raises(ValueError, match=r"X\.csv:3: mutant .*is not a substitution like 'A42G'"):
        pg.load_assay(path, {"dms_id": "X", "target_seq": WT8})


@pytest.mark.parametrize("field,value,msg", [
    ("DMS_score", "nan", "DMS_score 'nan' is not a finite number"),
    ("DMS_score", "", "DMS_score '' is not a finite number"),
    ("DMS_score_bin", "2", "DMS_score_bin '2' is not 0 or 1"),
])
def test_bad_values_named(tmp_path, field, value, msg):
    vals = {"DMS_score": "0.3", "DMS_score_bin": "1", field: value}
    path = tmp_path / "X.csv"
    path.write_text(f"mutant,DMS_score,DMS_score_bin\nM1A,0.1,0\nK2T,{vals['DMS_score']},{vals['DMS_score_bin']}\n")
    with pytest.raises(ValueError, match=rf"X\.csv:3: mutant 'K2T': {msg}"):
        pg.load_assay(path, {"dms_id": "X", "target_seq": WT8})


def test_missing_column_and_no_wild_type(tmp_path):
    p = tmp_path / "X.csv"
    p.write_text("mutant,DMS_score\nM1A,0.1\n")
    with pytest.raises(ValueError, match="required column 'DMS_score_bin' is missing"):
        pg.load_assay(p)
    p.write_text("mutant,DMS_score,DMS_score_bin\nM1A,0.1,0\n")
    with pytest.raises(ValueError, match=r"X\.csv:2: mutant 'M1A' has no mutated_sequence .*--reference"):
        pg.load_assay(p)


def test_inconsistent_mutated_sequences_named(tmp_path):
    p = write_assay(tmp_path / "X.csv", WT8, [("M1A", 0.1, 0), ("K2T", 0.2, 1)])
    text = p.read_text().replace("MTTAYIAK", "MTTAYIAQ")  # row 3 implies another wild type (K8 -> Q8)
    p.write_text(text)
    with pytest.raises(ValueError, match=r"X\.csv:3: mutant 'K2T' implies a wild type different from line 2's "
                                         r"\(length 8 vs 8, first difference at position 8\)"):
        pg.load_assay(p)
    # with a reference the same row is a mutated_sequence that does not carry its mutant
    with pytest.raises(ValueError, match=r"X\.csv:3: mutant 'K2T': mutated_sequence is not the wild type"):
        pg.load_assay(p, {"dms_id": "X", "target_seq": WT8})
    p.write_text(text.replace("MTTAYIAQ", "MKTAYIAK"))  # K2T whose sequence still has K at 2
    with pytest.raises(ValueError, match=r"X\.csv:3: mutant 'K2T': mutated_sequence has 'K' at position 2, not 'T'"):
        pg.load_assay(p)


def test_reference_rows_named(tmp_path):
    head = "DMS_id,DMS_filename,target_seq,seq_len\r\n"
    ref = tmp_path / "ref.csv"
    ref.write_text(head + "A,A.csv,MKT,3\r\nB,B.csv,,0\r\n")
    with pytest.raises(ValueError, match=r"ref\.csv:3: empty target_seq"):
        pg.load_reference(ref)
    ref.write_text(head + "A,A.csv,MKT,3\r\nB,B.csv,MKJ,3\r\n")
    with pytest.raises(ValueError, match=r"ref\.csv:3 \(B\): wild type has 'J' at position 3"):
        pg.load_reference(ref)
    ref.write_text(head + "A,A.csv,MKT,4\r\n")
    with pytest.raises(ValueError, match=r"ref\.csv:2 \(A\): target_seq has 3 residues, seq_len says 4"):
        pg.load_reference(ref)
    ref.write_text(head + "A,A.csv,MKT,3\r\nA,C.csv,MKT,3\r\n")
    with pytest.raises(ValueError, match=r"ref\.csv:3: A / C\.csv already listed at line 2"):
        pg.load_reference(ref)
    ref.write_text(head + "A,A.csv,mkt,3\r\n")
    assert pg.load_reference(ref)["A.csv"]["target_seq"] == "MKT"  # upper-cased, as the script does
    with pytest.raises(ValueError, match=r"Z\.csv: not listed in .*ref\.csv"):
        pg.reference_entry(pg.load_reference(ref), tmp_path / "Z.csv", ref)


def test_unscorable_mutant_named(tmp_path):
    """A model that returns NaN at one position: the first mutant touching it is named, the run fails."""
    def nan_at_4(tokens, mask):
        out = hand_logits_fn(tokens, mask)
        out[tokens[:, 4] == ID["<mask>"]] = math.nan
        return out

    path = write_assay(tmp_path / "X.csv", WT8, [("M1A", 0.1, 0), ("A4K", 0.2, 1), ("M1A:A4G", 0.3, 1)])
    with pytest.raises(ValueError, match=r"X\.csv:3: mutant 'A4K' cannot be scored: .* \(2 mutants in all\)"):
        pg.evaluate_assays([pg.load_assay(path)], nan_at_4)


def test_wrong_vocabulary_refused():
    with pytest.raises(ValueError, match=r"logits_fn returned shape \(1, 10, 23\).*33-token ESM-2 alphabet"):
        ours(WT8, ["M1A"], lambda t, m: torch.zeros(t.shape[0], t.shape[1], 23))


# -------------------------------------------------------------------------------------------- real data

@needs_data
def test_blat_ecolx_reference_and_reconstruction_agree():
    ref = pg.load_reference(REF)
    assert len(ref) == 217
    entry = pg.reference_entry(ref, BLAT, REF)
    a, b = pg.load_assay(BLAT, entry), pg.load_assay(BLAT)
    assert a.wt == b.wt == entry["target_seq"] and len(a.wt) == 286
    assert a.dms_id == b.dms_id == "BLAT_ECOLX_Jacquier_2013" and len(a.mutants) == 989
    assert int(a.dms_score_bin.sum()) == 501


@needs_data
def test_blat_ecolx_random_tiny_esm(tmp_path):
    """989 mutants scored through the library with a random tiny ESM, equal to the official loop, metrics finite
    and near zero (a random backbone knows nothing about beta-lactamase fitness)."""
    from transformers import EsmTokenizer

    model = tiny_esm(0)
    assay = pg.load_assay(BLAT, pg.reference_entry(pg.load_reference(REF), BLAT, REF))
    res = pg.evaluate_assays([assay], hf_logits_fn(model), batch_size=64)
    m = res["per_assay"]["BLAT_ECOLX_Jacquier_2013"]
    scores = res["scores"]["BLAT_ECOLX_Jacquier_2013"]
    assert m["n"] == 989 and len(scores) == 989 and np.isfinite(scores).all() and m["windows"] == 1
    assert all(np.isfinite(m[k]) for k in pg.METRICS)
    assert abs(m["spearman"]) < 0.2 and abs(m["auc"] - 0.5) < 0.1 and abs(m["mcc"]) < 0.1
    assert m["auc"] == pytest.approx(roc_auc_score(assay.dms_score_bin, scores))
    tok = EsmTokenizer(str(hf_vocab(tmp_path)))
    expect = official_masked_marginals(model, tok, assay.wt, assay.mutants)
    assert scores == pytest.approx(expect, abs=1e-5)
