"""launchers/evaluate.py --task mlm: held-out masked-LM loss and perplexity of a protein masked LM, equal to what
transformers' own EsmForMaskedLM computes (its loss with labels) on the same held-out masks, for a dense ESM2
upcycled into a ProtLingo export (the same weights)."""
import gzip
import json
import math

import torch

from conftest import REPO
from tools import upcycle_esm2

SAMPLE = REPO / "data" / "samples" / "uniref90_clusters_sample.fasta.gz"


def test_mlm_perplexity_equals_transformers(tmp_path, capsys):
    from transformers import EsmConfig, EsmForMaskedLM

    import launchers.evaluate as evaluate
    from pipeline.checkpoint import load_trained_model
    from pipeline.data.batch import collate
    from pipeline.eval.reconstruction import heldout_samples
    from pipeline.families import get_family

    torch.manual_seed(0)
    hf = EsmForMaskedLM(EsmConfig(vocab_size=33, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, position_embedding_type="rotary", token_dropout=True,
                                  mask_token_id=32, pad_token_id=1, emb_layer_norm_before=False,
                                  max_position_embeddings=1026, layer_norm_eps=1e-5, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)).eval()
    hf.save_pretrained(str(tmp_path / "esm"))
    assert upcycle_esm2.main(["--esm", str(tmp_path / "esm"), "--out", str(tmp_path / "export"), "--moe-layers",
                              "none", "--memory-layers", "none"]) == 0
    fasta = tmp_path / "heldout.fasta"
    fasta.write_text(">" + ">".join(gzip.decompress(SAMPLE.read_bytes()).decode().split(">")[1:31]))
    out = tmp_path / "mlm.json"
    assert evaluate.main(["--checkpoint", str(tmp_path / "export"), "--task", "mlm", "--data", str(fasta),
                          "--output", str(out), "--no-mlflow", "--seed", "3"]) == 0
    got = json.loads(out.read_text())
    assert got["sequences"] == 30 and got["perplexity"] == math.exp(got["loss"])

    # transformers on the same held-out samples (the training transform, seed 3)
    trained = load_trained_model(tmp_path / "export")
    family = get_family("protlingo")
    samples = heldout_samples(evaluate.read_proteins(fasta), family.make_transform(trained.cfg), 3)
    ce, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(samples), 7):  # another batching than the evaluator's: the sum cannot depend on it
            b = collate(samples[i:i + 7], pad_id=family.pad_id)
            m = int((b.labels != -100).sum())
            ce += float(hf(input_ids=b.input_ids, attention_mask=b.attention_mask.long(), labels=b.labels).loss) * m
            n += m
    assert got["tokens"] == n
    assert abs(got["loss"] - ce / n) <= 1e-5, (got["loss"], ce / n)
    assert "perplexity" in capsys.readouterr().out
