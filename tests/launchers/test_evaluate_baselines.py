"""The dense baselines through the same commands (issue: ESM2 150M / 650M evaluated as ProtLingo is): a Hugging Face
ESM2 directory and a fair-esm ``.pt`` are read by launchers/evaluate.py as they are (pipeline.checkpoint
load_foreign_model: Family.from_foreign + import_weights), computing what transformers' EsmForMaskedLM and fair-esm's
ESM2 compute, for every protein task; anything else is refused in one line."""
import argparse
import csv
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from launchers import evaluate
from pipeline.checkpoint import load_foreign_model
from pipeline.eval import proteingym as pg

sys.path.insert(0, str(Path(__file__).parents[1] / "pipeline" / "eval"))
from protein_models import hf_esm, write_hf_esm  # noqa: E402

WT = "MSIQHFRVALIPFFAAFCLPVFAHPETLVKVKDAEDQLGARVGYIELDLNSGK"
MUTANTS = ["M1A", "H5Y", "F17W", "P20G", "K53D", "S2C:K53R", "A16P:L19G:T27Q", "L38K", "E26D", "S51A"]


def main(*args):
    return evaluate.main(list(map(str, args)))


def write_assay(path: Path) -> Path:
    rng = np.random.default_rng(0)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["mutant", "mutated_sequence", "DMS_score", "DMS_score_bin"])
        for m in MUTANTS:
            s = list(WT)
            for sub in m.split(":"):
                s[int(sub[1:-1]) - 1] = sub[-1]
            score = float(rng.normal())
            w.writerow([m, "".join(s), score, int(score > 0)])
    return path


def test_a_hugging_face_esm2_directory_is_evaluated_as_it_is(tmp_path):
    esm_dir = write_hf_esm(tmp_path / "esm2", seed=2)
    trained = load_foreign_model(esm_dir)
    assert trained.cfg.family == "protlingo" and not trained.cfg.model.moe_layers and not trained.cfg.model.memory_layers
    assert trained.client_state == {"foreign_checkpoint": str(esm_dir), "format": "huggingface"}
    hf = hf_esm(esm_dir)
    ids = torch.tensor([[0, 5, 9, 14, 8, 32, 11, 2, 1, 1], [0, 20, 7, 7, 4, 4, 13, 15, 6, 2]])
    mask = ids != 1
    with torch.no_grad():
        torch.testing.assert_close(trained.model(ids, mask).logits, hf(ids, attention_mask=mask.long()).logits,
                                   rtol=0, atol=1e-5)
    assay = write_assay(tmp_path / "ASSAY_TEST.csv")
    out = tmp_path / "pg.json"
    assert main("--checkpoint", esm_dir, "--task", "proteingym", "--data", assay, "--output", out, "--no-mlflow") == 0
    got = [float(r["score"]) for r in csv.DictReader(open(tmp_path / "pg-scores" / "ASSAY_TEST.csv"))]
    a = pg.load_assay(assay)
    want = pg.evaluate_assays([a], lambda t, m: hf(t, attention_mask=m.long()).logits)["scores"]["ASSAY_TEST"]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    fasta = tmp_path / "p.fa"
    fasta.write_text(f">a\n{WT}\n>b\n{WT[5:40]}\n")
    assert main("--checkpoint", esm_dir, "--task", "mlm", "--data", fasta, "--output", tmp_path / "m.json",
                "--no-mlflow") == 0
    assert json.loads((tmp_path / "m.json").read_text())["tokens"] > 0
    # the default output goes beside the checkpoint, as for an export
    assert main("--checkpoint", esm_dir, "--task", "proteingym", "--data", assay, "--no-mlflow") == 0
    assert (esm_dir / "eval-proteingym.json").is_file()


def test_a_fair_esm_file_is_evaluated_as_it_is(tmp_path):
    esm = pytest.importorskip("esm", reason="the fair-esm package (a dev dependency) is the reference")
    from esm.model.esm2 import ESM2

    torch.manual_seed(0)
    ref = ESM2(num_layers=2, embed_dim=32, attention_heads=4, alphabet="ESM-1b", token_dropout=True).eval()
    cfg = argparse.Namespace(encoder_layers=2, encoder_embed_dim=32, encoder_attention_heads=4, token_dropout=True)
    path = tmp_path / "esm2_t2_32_test.pt"
    torch.save({"cfg": {"model": cfg}, "model": {f"encoder.sentence_encoder.{k}": v
                                                  for k, v in ref.state_dict().items()}}, path)
    trained = load_foreign_model(path)
    assert trained.client_state["format"] == "fair-esm"
    _, _, tokens = esm.Alphabet.from_architecture("ESM-1b").get_batch_converter()([("a", WT), ("b", WT[:30])])
    with torch.no_grad():
        torch.testing.assert_close(trained.model(tokens, tokens != 1).logits, ref(tokens)["logits"], rtol=1e-5,
                                   atol=1e-5)
    assay = write_assay(tmp_path / "ASSAY_TEST.csv")
    assert main("--checkpoint", path, "--task", "proteingym", "--data", assay, "--no-mlflow") == 0
    assert (tmp_path / "eval-proteingym.json").is_file()  # beside the .pt


def test_foreign_checkpoints_are_refused_in_one_line(tmp_path, capsys):
    esm_dir = write_hf_esm(tmp_path / "esm2")
    capsys.readouterr()  # save_pretrained's bar
    assert main("--checkpoint", esm_dir, "--task", "blimp", "--data", tmp_path) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a foreign checkpoint (Hugging Face directory or fair-esm .pt) is evaluated on " \
        "proteingym, mlm, flip" in err[0] and err[0].endswith("not --task blimp")
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8, "vocab_size": 30}))
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(1)}, str(bert / "model.safetensors"))
    assert main("--checkpoint", bert, "--task", "proteingym", "--data", write_assay(tmp_path / "A.csv")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {bert}: no model family reads this checkpoint (protlingo:")
