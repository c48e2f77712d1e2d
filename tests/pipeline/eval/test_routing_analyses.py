"""The analyses of paper 002's Figure 4 and Table 4 (pipeline/eval/annotations.py, routing.py, memory_motifs.py; the
launcher's --task expert_specialization, expert_intervention, memory_motifs) on their input formats
(tests/fixtures/annotations: real Swiss-Prot entries, a real hmmscan --domtblout of a Pfam scan, secondary
structure as FASTA-aligned labels, PROSITE-pattern occurrences) and a tiny random ProtLingo: every reader against the
file's own lines, every matching (same protein, amino acid, position bin; composition-matched windows; identical
substitutions) against a brute-force search, and each reported number recomputed from the model's own forward."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from launchers import evaluate
from pipeline.eval import annotations as ann
from pipeline.eval import memory_motifs as mm
from pipeline.eval import routing

sys.path.insert(0, str(Path(__file__).parent))
from protein_models import FIXTURES, write_protlingo_export  # noqa: E402

A = FIXTURES / "annotations"


@pytest.fixture(scope="module")
def proteins():
    seqs, aliases = ann.read_proteins(A / "proteins.fasta")
    return seqs, aliases, ann.by_name(seqs, aliases)


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from pipeline.checkpoint import load_trained_model

    path = write_protlingo_export(tmp_path_factory.mktemp("pl") / "export", seed=5)
    return path, load_trained_model(path).model


def test_readers_on_the_real_files(proteins, tmp_path):
    seqs, aliases, names = proteins
    assert len(seqs) == 11 and aliases["P62258"] == "sp|P62258|1433E_HUMAN"
    uni, skipped = ann.read_uniprot(A / "uniprot_sample.dat.gz", names)
    uni = ann.canonical(uni, aliases)
    # O95832: FT DISULFID 54..64 bonds two cysteines (not the 11 residues between); O23729: ACT_SITE 165
    assert uni["sp|O95832|CLD1_HUMAN"]["UniProt/DISULFID"] == {53, 63}
    assert seqs["sp|O95832|CLD1_HUMAN"][53] == seqs["sp|O95832|CLD1_HUMAN"][63] == "C"
    assert uni["sp|O23729|CHS3_BROFI"]["UniProt/ACT_SITE"] == {164}
    assert set(range(233, 255)) <= uni["sp|P62258|1433E_HUMAN"]["UniProt/REGION"]  # REGION 234..255
    assert skipped == {"not_in_set": 0, "uncertain": 0}
    pf, skipped = ann.read_domtblout(A / "pfam_sample.domtblout", names)
    # RIFIN PF02009.17 on PFB0035c, i-Evalue 5.1e-130, envelope 37..375; Stevor's first domain (1e-05) kept, the
    # p-values above 1e-5 of the weak-filter scan dropped
    assert pf["PFB0035c"]["Pfam/PF02009"] == set(range(36, 375))
    assert pf["PFB0035c"]["Pfam/PF17410"] == set(range(25, 147)) | set(range(270, 374))
    assert "Pfam/PF00528" not in pf["PFB0035c"] and skipped["evalue"] > 10
    ss, _ = ann.read_secondary_structure(A / "ss_from_uniprot.fasta", names)
    text = (A / "ss_from_uniprot.fasta").read_text().split(">sp|P62258|1433E_HUMAN\n")[1].split(">")[0]
    labels = text.replace("\n", "")
    assert ss["sp|P62258|1433E_HUMAN"]["SS3/H"] == {i for i, c in enumerate(labels) if c == "H"}
    assert ss["sp|P62258|1433E_HUMAN"]["SS8/T"] == {i for i, c in enumerate(labels) if c == "T"}
    bad = tmp_path / "ss.fasta"
    bad.write_text(">PFI0965w\nHHHEEC\n")
    with pytest.raises(ValueError, match=r"ss.fasta:1: PFI0965w: 6 labels for its 242 residues"):
        ann.read_secondary_structure(bad, names)
    bad.write_text(">PFI0965w\n" + "X" * 242 + "\n")
    with pytest.raises(ValueError, match=r"ss.fasta:1: PFI0965w: label 'X' is not a DSSP state"):
        ann.read_secondary_structure(bad, names)


def test_matched_background_pairs_same_protein_amino_acid_and_bin(proteins):
    seqs, aliases, names = proteins
    uni = ann.canonical(ann.read_uniprot(A / "uniprot_sample.dat.gz", names)[0], aliases)
    cats, _ = routing.categories(uni, 5)
    for c, (cat, positions) in enumerate(cats.items()):
        pairs, unmatched = ann.matched_background(positions, seqs, 10, np.random.default_rng([0, c]))
        for p, i, j in pairs:
            seq = seqs[p]
            assert i in positions[p] and j not in positions[p], cat
            assert seq[i] == seq[j] and ann.position_bin(i, len(seq), 10) == ann.position_bin(j, len(seq), 10)
            assert int(10 * i / len(seq)) == int(10 * j / len(seq))  # the bin by hand
        # an annotated residue is unmatched only when no candidate exists (brute force)
        paired = {(p, i) for p, i, _ in pairs}
        for p, pos in positions.items():
            seq = seqs[p]
            for i in pos - {i for q, i in paired if q == p}:
                assert not any(seq[j] == seq[i] and int(10 * j / len(seq)) == int(10 * i / len(seq))
                               for j in range(len(seq)) if j not in pos), (cat, p, i)
        assert len(pairs) + unmatched == sum(map(len, positions.values()))


def test_expert_specialization_equals_the_forward_and_the_pairs(export, proteins, tmp_path):
    path, model = export
    seqs, aliases, names = proteins
    out = tmp_path / "spec.json"
    assert evaluate.main(["--checkpoint", str(path), "--task", "expert_specialization", "--data",
                          str(A / "proteins.fasta"), "--uniprot", str(A / "uniprot_sample.dat.gz"), "--ss",
                          str(A / "ss_from_uniprot.fasta"), "--seed", "3", "--output", str(out), "--no-mlflow"]) == 0
    res = json.loads(out.read_text())
    assert res["moe_blocks"] == [0, 2] and out.with_suffix(".png").stat().st_size > 10_000
    from pipeline.models.protlingo import token_experts

    experts = {}  # the model's own forward, one protein at a time
    for p, s in seqs.items():
        ids = torch.tensor([[0, *(ann_vocab(c) for c in s), 2]])
        with torch.no_grad():
            o = model(ids, torch.ones_like(ids, dtype=torch.bool))
        experts[p] = {b: token_experts(r, torch.ones_like(ids, dtype=torch.bool))[0, 1:-1].numpy()
                      for b, r in o.routing.items()}
    uni = ann.canonical(ann.read_uniprot(A / "uniprot_sample.dat.gz", names)[0], aliases)
    ss = ann.canonical(ann.read_secondary_structure(A / "ss_from_uniprot.fasta", names)[0], aliases)
    cats, _ = routing.categories(ann.merge(uni, ss), 20)
    assert list(res["categories"]) == list(cats)
    for c, (cat, positions) in enumerate(cats.items()):
        pairs, _ = ann.matched_background(positions, seqs, 10, np.random.default_rng([3, c]))
        for b in (0, 2):
            chosen = np.concatenate([experts[p][b][sorted(pos)] for p, pos in positions.items()])
            share = np.bincount(chosen, minlength=4) / len(chosen)
            got = res["categories"][cat]["blocks"][str(b)]
            assert got["expert_share"] == pytest.approx(share.tolist()) and got["top_expert"] == share.argmax()
            fa = np.mean([experts[p][b][i] == share.argmax() for p, i, _ in pairs])
            fb = np.mean([experts[p][b][j] == share.argmax() for p, _, j in pairs])
            assert got["annotated_share"] == pytest.approx(fa) and got["background_share"] == pytest.approx(fb)
            assert got["enrichment"] == pytest.approx(fa / fb) if fb > 0 else np.isnan(got["enrichment"])


def ann_vocab(c):
    from pipeline.data.protein_tokenizer import VOCAB

    return VOCAB.index(c)


def test_expert_intervention_recomputed_by_hand(export, proteins, tmp_path):
    path, model = export
    seqs, aliases, names = proteins
    out = tmp_path / "int.json"
    assert evaluate.main(["--checkpoint", str(path), "--task", "expert_intervention", "--data",
                          str(A / "proteins.fasta"), "--ss", str(A / "ss_from_uniprot.fasta"), "--max-categories", "1",
                          "--intervene-blocks", "2", "--seed", "1", "--output", str(out), "--no-mlflow"]) == 0
    res = json.loads(out.read_text())
    (cat, got), = res["categories"].items()
    assert cat == "SS3/C" and res["intervened_blocks"] == [2]
    ss = ann.canonical(ann.read_secondary_structure(A / "ss_from_uniprot.fasta", names)[0], aliases)
    cats, _ = routing.categories(ss, 20)
    rng = np.random.default_rng(1)
    masked = {p: routing.masked_positions(len(s), 0.15, rng) for p, s in sorted(seqs.items())}
    pairs, _ = ann.matched_background(cats[cat], seqs, 10, np.random.default_rng([1, 0]))

    def ce(p, targets):
        """Masked-LM cross-entropy at the masked residues of ``p``, block 2's top-1 replaced by the router's second
        choice at ``targets`` (the second choice read from block 2's input on the unmodified masked forward)."""
        s = seqs[p]
        ids = torch.tensor([[0, *(32 if i in masked[p] else ann_vocab(c) for i, c in enumerate(s)), 2]])
        mask = torch.ones_like(ids, dtype=torch.bool)
        seen = {}
        h = model.layers[2].ffn.register_forward_hook(lambda m, a, o: seen.update(x=a[0]))
        with torch.no_grad():
            model(ids, mask)
        h.remove()
        second = (seen["x"][0].float() @ model.layers[2].ffn.router.weight.float().T).topk(2, -1).indices[:, 1]
        forced = torch.full_like(ids, -1)
        for i in targets:
            forced[0, i + 1] = second[i + 1]
        with torch.no_grad():
            lp = torch.log_softmax(model(ids, mask, route_override={2: forced}).logits[0].double(), -1)
            lp0 = torch.log_softmax(model(ids, mask).logits[0].double(), -1)
        return {i: (-float(lp0[i + 1, ann_vocab(s[i])]), -float(lp[i + 1, ann_vocab(s[i])])) for i in masked[p]}

    for name, targets in (("annotated", cats[cat]), ("control", None)):
        if targets is None:
            targets = {}
            for p, _, j in pairs:
                targets.setdefault(p, set()).add(j)
        vals = []
        for p, pos in targets.items():
            table = ce(p, pos)
            vals += [table[i] for i in sorted(pos) if i in masked[p]]
        base, new = np.array(vals).T
        assert got[name]["n_masked"] == len(vals)
        assert got[name]["ce"] == pytest.approx(base.mean()) and got[name]["delta"] == pytest.approx(
            (new - base).mean(), abs=1e-9)
    assert got["effect"] == pytest.approx(got["annotated"]["delta"] - got["control"]["delta"])


def test_memory_motif_controls_are_matched(proteins):
    seqs, aliases, _ = proteins
    occ = mm.read_motifs(A / "prosite_motifs.tsv", seqs, aliases)
    assert len(occ) == 97 and {o.family for o in occ} == {"PS00001_ASN_GLYCOSYLATION", "PS00006_CK2_PHOSPHO_SITE",
                                                           "PS00008_MYRISTYL"}
    covered = {p: np.zeros(len(s), dtype=bool) for p, s in seqs.items()}
    for o in occ:
        covered[o.protein][o.start:o.end] = True
    comp = lambda s: np.array([s.count(a) for a in mm.AMINO])  # noqa: E731
    for o in occ[::7]:
        seq, n = seqs[o.protein], o.end - o.start
        s = mm.control_window(o, seq, covered[o.protein])
        clear = [t for t in range(len(seq) - n + 1) if not covered[o.protein][t:t + n].any()]
        best = min(int(np.abs(comp(seq[t:t + n]) - comp(seq[o.start:o.end])).sum()) for t in clear)
        assert s in clear and int(np.abs(comp(seq[s:s + n]) - comp(seq[o.start:o.end])).sum()) == best
        for i in range(o.start, o.end):
            j = mm.outside_control(seq, i, covered[o.protein])
            assert j is not None and seq[j] == seq[i] and not covered[o.protein][j]
    assert mm.conservative_pair("I") == ("V", "G") and mm.conservative_pair("W") == ("Y", "D")  # BLOSUM62 by hand


def test_memory_motifs_recomputed_from_the_memory_layer(export, proteins, tmp_path):
    path, model = export
    seqs, aliases, _ = proteins
    rows = (A / "prosite_motifs.tsv").read_text().splitlines()
    small = tmp_path / "motifs.tsv"
    keep = [r for r in rows[1:] if r.split("\t")[0] in ("PFI0965w", "PF11_0025")]
    small.write_text("\n".join([rows[0], *keep]) + "\n")
    out = tmp_path / "mem.json"
    assert evaluate.main(["--checkpoint", str(path), "--task", "memory_motifs", "--data", str(A / "proteins.fasta"),
                          "--motifs", str(small), "--min-residues", "2", "--output", str(out), "--no-mlflow"]) == 0
    res = json.loads(out.read_text())
    occ = [o for o in mm.read_motifs(small, seqs, aliases) if o.family in res["kept"]]
    mem = model.memory["1"]
    readout = {}
    for p in {o.protein for o in occ}:  # the memory's residual: its output minus its input, by a hook
        ids = torch.tensor([[0, *(ann_vocab(c) for c in seqs[p]), 2]])
        got = {}
        h = mem.register_forward_hook(lambda m, a, o: got.update(r=(o[0] - a[0])[0, 1:-1].double()))
        with torch.no_grad():
            model(ids, torch.ones_like(ids, dtype=torch.bool))
        h.remove()
        readout[p] = got["r"].numpy()
    vec = np.stack([readout[o.protein][o.start:o.end].mean(0) for o in occ])
    within, between = [], []
    for a in range(len(occ)):
        for b in range(a + 1, len(occ)):
            cos = vec[a] @ vec[b] / np.linalg.norm(vec[a]) / np.linalg.norm(vec[b])
            (within if occ[a].family == occ[b].family else between).append(cos)
    assert res["cosine"]["within"] == pytest.approx(np.mean(within)) and res["cosine"]["between"] == pytest.approx(
        np.mean(between))
    assert all(c["protein"] in ("sp|PFI0965w", "PFI0965w", "PF11_0025") for c in res["controls"])
    assert res["substitution"]["n"]["motif"] == res["substitution"]["n"]["outside"] > 0
    assert out.with_suffix(".png").stat().st_size > 10_000
