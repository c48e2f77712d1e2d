"""The contact head trained per frozen encoder (pipeline/eval/contacts.py, pipeline/eval/structures.py,
launchers/evaluate.py --task contacts) on the shipped real structures (data/samples/structures: 23 training and 16
held-out monomers): the reader against a hand parse of the files (C-alpha for glycine, SEQRES alignment, unobserved
residues masked), the features against transformers' EsmForMaskedLM attentions, and every held-out P@L against an
independent computation from the coordinates (a hand parse, numpy distances, the saved head on transformers'
attentions, a plain sort); the shipped ESM2 head against transformers' predict_contacts."""
import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO
from launchers import evaluate
from pipeline.eval import contacts as ct
from pipeline.eval.structures import read_structure, structure_files

sys.path.insert(0, str(Path(__file__).parent))
from protein_models import FIXTURES, hf_esm, write_hf_esm  # noqa: E402

STRUCTURES = REPO / "data" / "samples" / "structures"
THREE = {"ALA": "A", "ARG": "R", "ASN": "N", "ASP": "D", "CYS": "C", "GLN": "Q", "GLU": "E", "GLY": "G", "HIS": "H",
         "ILE": "I", "LEU": "L", "LYS": "K", "MET": "M", "PHE": "F", "PRO": "P", "SER": "S", "THR": "T", "TRP": "W",
         "TYR": "Y", "VAL": "V", "MSE": "M"}


def cif_loop(lines: list[str], prefix: str) -> tuple[list[str], list[list[str]]]:
    """(columns, rows) of the mmCIF loop whose items start with ``prefix`` (rows of whitespace-separated values)."""
    i = next(n for n, line in enumerate(lines) if line.startswith(prefix))
    cols = []
    while lines[i].startswith(prefix):
        cols.append(lines[i].strip()[len(prefix):])
        i += 1
    rows = []
    while not lines[i].startswith(("#", "loop_", "_")):
        rows.append(lines[i].split())
        i += 1
    return cols, rows


def hand_parse(path: Path) -> tuple[str, np.ndarray]:
    """(sequence, coords [L, 3]) by hand: a PDB file's chain A ATOM records (residues in file order, C-beta or
    C-alpha for glycine, the first alternate location), or an mmCIF's atom_site rows placed on its entity_poly_seq
    by label_seq_id (model 1, chain A)."""
    text = gzip.decompress(path.read_bytes()).decode()
    if ".pdb" in path.name:
        order, atoms = [], {}
        for line in text.splitlines():
            if line.startswith("ATOM") and line[21] == "A":
                key = (int(line[22:26]), line[26])
                if key not in atoms:
                    order.append(key)
                    atoms[key] = {"name": line[17:20]}
                atoms[key].setdefault(line[12:16].strip(), [float(line[30:38]), float(line[38:46]), float(line[46:54])])
        seq = "".join(THREE[atoms[k]["name"]] for k in order)
        want = [atoms[k].get("CA" if atoms[k]["name"] == "GLY" else "CB", [np.nan] * 3) for k in order]
        return seq, np.array(want, dtype=float)
    lines = text.splitlines()
    cols, rows = cif_loop(lines, "_entity_poly_seq.")
    seq = {int(r[cols.index("num")]): r[cols.index("mon_id")] for r in rows if r[cols.index("entity_id")] == "1"}
    cols, rows = cif_loop(lines, "_atom_site.")
    c = {k: cols.index(k) for k in ("label_atom_id", "label_comp_id", "label_asym_id", "label_seq_id",
                                    "pdbx_PDB_model_num", "Cartn_x", "Cartn_y", "Cartn_z")}
    coords = np.full((max(seq), 3), np.nan)
    for r in rows:
        if r[c["label_asym_id"]] != "A" or r[c["pdbx_PDB_model_num"]] != "1" or r[c["label_seq_id"]] == ".":
            continue
        i = int(r[c["label_seq_id"]]) - 1
        if r[c["label_atom_id"]] == ("CA" if r[c["label_comp_id"]] == "GLY" else "CB") and np.isnan(coords[i, 0]):
            coords[i] = [float(r[c["Cartn_x"]]), float(r[c["Cartn_y"]]), float(r[c["Cartn_z"]])]
    return "".join(THREE[seq[k]] for k in sorted(seq)), coords


def hand_features(model, sequence: str) -> np.ndarray:
    """[L, L, layers x heads] from transformers' attentions: drop <cls> / <eos>, A + A^T, A - a_i a_j / a."""
    from pipeline.data.protein_tokenizer import VOCAB

    ids = torch.tensor([[0, *(VOCAB.index(c) for c in sequence), 2]])
    with torch.no_grad():
        att = model(ids, attention_mask=torch.ones_like(ids), output_attentions=True).attentions
    a = torch.stack(att, 1)[0, :, :, 1:-1, 1:-1].double().numpy()  # [layers, heads, L, L]
    a = a.reshape(-1, *a.shape[-2:])
    a = a + a.transpose(0, 2, 1)
    a = a - a.sum(2, keepdims=True) * a.sum(1, keepdims=True) / a.sum((1, 2), keepdims=True)
    return a.transpose(1, 2, 0)


def hand_precision(probs: np.ndarray, coords: np.ndarray) -> dict:
    """P@L, P@L/2, P@L/5 by hand: pairs j - i >= 24 with both atoms known, sorted by probability (ties by position),
    a contact when the atoms are closer than 8 angstrom."""
    L = len(coords)
    ranked = []
    for i in range(L):
        for j in range(i + 24, L):
            d = float(np.sqrt(((coords[i] - coords[j]) ** 2).sum()))
            if np.isfinite(d):
                ranked.append((-probs[i, j], i, j, d < 8.0))
    ranked.sort(key=lambda t: (t[0], t[1], t[2]))
    return {name: float(np.mean([t[3] for t in ranked[:min(L // k, len(ranked))]]))
            for name, k in (("P@L", 1), ("P@L/2", 2), ("P@L/5", 5))}


def test_the_reader_equals_a_hand_parse_of_every_shipped_structure():
    files = structure_files(STRUCTURES / "train") + structure_files(STRUCTURES / "test")
    assert len(files) == 40 and len(structure_files(STRUCTURES / "train")) == 23
    glycines = 0
    for f in files:
        s = read_structure(f)
        seq, coords = hand_parse(f)
        assert s.sequence == seq, f
        np.testing.assert_allclose(s.coords, coords, rtol=0, atol=1e-3, equal_nan=True, err_msg=str(f))
        glycines += seq.count("G")
    assert glycines > 250  # C-alpha stands for every glycine's missing C-beta (300 glycines)
    # the same entry as PDB (SEQRES aligned by gemmi) and as mmCIF: the 8 unobserved N-terminal residues masked
    pdb, cif = read_structure(FIXTURES / "structures" / "1o1z.pdb.gz"), read_structure(STRUCTURES / "test" /
                                                                                       "1o1z.cif.gz")
    assert pdb.sequence == cif.sequence and pdb.length == 234 and pdb.aligned_by == cif.aligned_by == "seqres"
    assert np.array_equal(pdb.observed, cif.observed) and not pdb.observed[:8].any() and pdb.observed[8:].all()
    np.testing.assert_allclose(pdb.coords, cif.coords, rtol=0, atol=1e-3, equal_nan=True)
    contacts, known = ct_map(pdb.coords)
    assert not known[:8].any() and not contacts[:8].any() and known[8:, 8:].all()


def ct_map(coords):
    from pipeline.eval.structures import contact_map

    return contact_map(coords)


def test_an_internal_gap_is_masked_and_a_break_without_seqres_refused(tmp_path):
    """Residues 50-52 of 1o1z removed from the mmCIF's atom_site: they stay in the sequence, masked, and the others
    keep their coordinates; a domain file without SEQRES whose chain breaks is an error naming it."""
    text = gzip.decompress((STRUCTURES / "test" / "1o1z.cif.gz").read_bytes()).decode().splitlines()
    cols, _ = cif_loop(text, "_atom_site.")
    seq_col = cols.index("label_seq_id")
    kept = [line for line in text if not (line.startswith(("ATOM", "HETATM")) and line.split()[seq_col] in
                                          ("50", "51", "52"))]
    gap = tmp_path / "1o1z_gap.cif"
    gap.write_text("\n".join(kept) + "\n")
    full, cut = read_structure(STRUCTURES / "test" / "1o1z.cif.gz"), read_structure(gap)
    assert cut.sequence == full.sequence
    assert np.flatnonzero(full.observed & ~cut.observed).tolist() == [49, 50, 51]
    np.testing.assert_array_equal(cut.coords[52:], full.coords[52:])
    with pytest.raises(ValueError, match=r"3GQS_A.pdb.gz: chain A: residues ALA 11 and ALA 13 are not bonded"):
        read_structure(FIXTURES / "structures" / "3GQS_A.pdb.gz")


def test_features_equal_transformers_attentions(tmp_path):
    from pipeline.checkpoint import load_foreign_model

    esm_dir = write_hf_esm(tmp_path / "esm", seed=3, init=0.5)
    model = load_foreign_model(esm_dir).model
    seq = read_structure(STRUCTURES / "test" / "1BXY_A.pdb.gz").sequence
    got = ct.protein_features(model, seq)
    want = hand_features(hf_esm(esm_dir), seq)
    assert got.shape == (60, 60, 8)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert np.abs(want).max() > 1e-3  # APC leaves more than round-off


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A tiny random ESM2 directory, the head fitted on the 23 training structures and scored on the 16 held out."""
    tmp = tmp_path_factory.mktemp("contacts")
    esm_dir = write_hf_esm(tmp / "esm", seed=4, init=0.5)
    out = tmp / "c.json"
    assert evaluate.main(["--checkpoint", str(esm_dir), "--task", "contacts", "--data", str(STRUCTURES / "test"),
                          "--contact-train", str(STRUCTURES / "train"), "--contact-C", "1", "--output", str(out),
                          "--no-mlflow"]) == 0
    return esm_dir, out, json.loads(out.read_text())


def test_held_out_precision_equals_an_independent_computation(fitted):
    esm_dir, out, res = fitted
    head = esm_dir / "contact_head.safetensors"  # saved beside the checkpoint it was fitted on
    assert res["head_file"] == str(head) and res["fitted_now"] and res["train"]["n_structures"] == 23
    w, b, meta = ct.load_head(head, 8)
    assert meta["checkpoint"] == str(esm_dir) and meta["structures"] == res["train"]["structures"]
    assert (w != 0).sum() > 0 and out.with_suffix(".png").stat().st_size > 10_000
    hf = hf_esm(esm_dir)
    from pipeline.data.protein_tokenizer import VOCAB

    means = {"fitted": [], "shipped": []}
    for f in structure_files(STRUCTURES / "test"):
        seq, coords = hand_parse(f)
        name = read_structure(f).name
        feats = hand_features(hf, seq)
        probs = 1 / (1 + np.exp(-(feats @ w + b)))
        want = hand_precision(probs, coords)
        assert res["heads"]["fitted"]["per_structure"][name] == pytest.approx({
            **want, **{k: v for k, v in res["heads"]["fitted"]["per_structure"][name].items() if "@" not in k}}), name
        means["fitted"].append(want["P@L"])
        # the ESM2 directory's own head, scored on the same structures: transformers' predict_contacts
        ids = torch.tensor([[0, *(VOCAB.index(c) for c in seq), 2]])
        with torch.no_grad():
            shipped = hf.predict_contacts(ids, torch.ones_like(ids))[0].double().numpy()
        assert res["heads"]["shipped"]["per_structure"][name]["P@L"] == pytest.approx(
            hand_precision(shipped, coords)["P@L"]), name
    assert res["heads"]["fitted"]["mean"]["P@L"] == pytest.approx(np.mean(means["fitted"]))
    assert [r[0] for r in res["table"]] == ["fitted", "shipped"]


def test_the_saved_head_is_read_back_and_held_out_is_enforced(fitted, tmp_path, capsys):
    esm_dir, _, res = fitted
    again = tmp_path / "again.json"
    assert evaluate.main(["--checkpoint", str(esm_dir), "--task", "contacts", "--data", str(STRUCTURES / "test"),
                          "--output", str(again), "--no-mlflow"]) == 0
    second = json.loads(again.read_text())
    assert not second["fitted_now"] and second["heads"]["fitted"] == res["heads"]["fitted"]
    capsys.readouterr()
    assert evaluate.main(["--checkpoint", str(esm_dir), "--task", "contacts", "--data", str(STRUCTURES / "train"),
                          "--contact-train", str(STRUCTURES / "train"), "--contact-head", str(tmp_path / "h"),
                          "--no-mlflow"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "its chain is also in the training set" in err[0]
    other = write_hf_esm(tmp_path / "other", layers=3)
    capsys.readouterr()
    assert evaluate.main(["--checkpoint", str(other), "--task", "contacts", "--data", str(STRUCTURES / "test"),
                          "--contact-head", str(esm_dir / "contact_head.safetensors"), "--no-mlflow"]) == 2
    assert "a head of 8 channels; this model's attention has 12" in capsys.readouterr().err
