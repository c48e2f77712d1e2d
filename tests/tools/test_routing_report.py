"""tools/routing_report.py on the committed ProtLingo checkpoint (2 MoE blocks, a memory before block 1) exported,
over real UniRef90 members: the per-block expert counts equal what the model's own forward reports (RoutingInfo, an
independent tally), the entropy and effective experts follow from them, every amino acid's usage row is a
distribution, and the JSON and PNG are written."""
import gzip
import json
import math
import re

import pytest
import torch

from conftest import REPO
from golden.cases import unpack_checkpoint
from tools import convert_checkpoint, routing_report

SAMPLE = REPO / "data" / "samples" / "uniref90_clusters_sample.fasta.gz"


def test_routing_report_of_an_export(tmp_path, capsys):
    run = tmp_path / "run"
    unpack_checkpoint("protlingo_zero2", run / "checkpoints")
    export = tmp_path / "export"
    assert convert_checkpoint.main(["--checkpoint", str(run), "--output", str(export)]) == 0
    fasta = tmp_path / "p.fa"
    fasta.write_text(">" + ">".join(gzip.decompress(SAMPLE.read_bytes()).decode().split(">")[1:41]))
    out = tmp_path / "report"
    assert routing_report.main(["--checkpoint", str(export), "--fasta", str(fasta), "--out", str(out)]) == 0
    doc = json.loads((out / "routing_report.json").read_text())
    assert (out / "routing_report.png").stat().st_size > 10_000
    assert doc["records"] == 40 and sorted(doc["moe_layers"]) == ["0", "1"] and sorted(doc["memory_layers"]) == ["1"]

    # the independent tally: the model's own RoutingInfo counts over the same windows (residues only)
    from pipeline.checkpoint import load_trained_model
    from pipeline.data.protein_tokenizer import ProteinTokenizer

    trained = load_trained_model(export)
    tok = ProteinTokenizer()
    from data_prep.fasta import iter_fasta

    records = [tok.encode(r.seq) for r in iter_fasta(fasta)]
    totals = {0: torch.zeros(4), 1: torch.zeros(4)}
    specials = 0
    with torch.no_grad():
        for ids, mask in routing_report.batches(records, trained.cfg.data.context_length, 16):
            out_ = trained.model(ids, mask)
            for b, info in out_.routing.items():
                totals[b] += info.counts
            specials += int(((ids == 0) | (ids == 2)).sum())
    for b in (0, 1):
        layer = doc["moe_layers"][str(b)]
        per_expert = torch.tensor(layer["fraction_per_expert"]) * layer["residues"]
        # the report leaves <cls>/<eos> out; the model routes them too: equal after removing them from the total
        assert layer["residues"] == int(totals[b].sum()) - specials == doc["residues"]
        f = torch.tensor(layer["fraction_per_expert"])
        h = -float((f[f > 0] * f[f > 0].log()).sum())
        assert layer["normalized_entropy"] == pytest.approx(h / math.log(4))
        assert layer["effective_experts"] == pytest.approx(math.exp(h))
        assert per_expert.sum() == pytest.approx(layer["residues"])
        for acid, row in layer["usage_by_amino_acid"].items():
            assert abs(sum(row) - 1) < 1e-9, acid
    # the paper's across-layer summary: the mean of the per-block normalized entropies, and E to that power
    mean = (doc["moe_layers"]["0"]["normalized_entropy"] + doc["moe_layers"]["1"]["normalized_entropy"]) / 2
    assert doc["mean_normalized_entropy"] == pytest.approx(mean) and doc["mean_effective_experts"] == pytest.approx(
        math.exp(mean * math.log(4)))
    mem = doc["memory_layers"]["1"]
    assert 0 < mem["rows_addressed"] <= mem["table_rows"] and mem["exact_addresses"] in (True, False)
    captured = capsys.readouterr()
    assert "MoE block 0: normalized entropy" in captured.out and "mean over 2 MoE blocks:" in captured.out
    # the forwards' bar on stderr, complete: every residue of the 40 proteins counted once
    n = doc["residues"]
    assert "routing report: 100%" in captured.err and f" {n}/{n} " in captured.err, captured.err[-500:]
    # convert_checkpoint's bar (the export above) keeps one total from its first frame to its last (its 5 steps)
    frames = re.findall(r"convert:\s+\d+%\|[^|]*\| (\d+)/(\d+)", captured.err)
    assert len(frames) >= 2 and {total for _, total in frames} == {"5"} and frames[-1] == ("5", "5"), frames
