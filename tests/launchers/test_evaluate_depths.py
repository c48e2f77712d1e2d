"""launchers/evaluate.py without --depths: a RecursiveGPT at its trained recurrence R, the other families as before."""
import json

import pytest
import torch

from conftest import REPO
from launchers import evaluate
from pipeline.config import dump_yaml, load_config
from pipeline.families import get_family

CONFIGS = REPO / "launchers" / "configs"


@pytest.mark.parametrize("name,depths", [("recursive_gpt_10m.yaml", [16]), ("recursive_gpt_100m.yaml", [24]),
                                         ("recursive_gpt_large.yaml", [24]), ("standard_h384.yaml", [12]),
                                         ("eco_rna_80m.yaml", list(range(1, 9)))])
def test_default_depths(name, depths):
    assert evaluate.default_depths(load_config(CONFIGS / name)) == depths


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    """A tiny RecursiveGPT (R = 3) exported as model.safetensors + config.yaml, a sentencepiece model, passages."""
    from safetensors.torch import save_file

    from data_prep.spm import train_spm

    tmp = tmp_path_factory.mktemp("depths")
    words = "the cat dog sat ran on a mat log red big small fox jumped over lazy river".split()
    g = torch.Generator().manual_seed(0)
    lines = [" ".join(words[i] for i in torch.randint(0, len(words), (8,), generator=g).tolist()) for _ in range(300)]
    (tmp / "text.train").write_text("\n".join(lines) + "\n")
    spm = train_spm([tmp / "text.train"], tmp / "spm" / "tiny", vocab_size=320)
    (tmp / "passages.txt").write_text("\n".join(lines[:4]) + "\n")
    cfg = load_config(CONFIGS / "recursive_gpt_demo.yaml",
                      ["model.vocab_size=320", "model.d_model=16", "model.embed_dim=8", "model.n_heads=2",
                       "model.recurrence=3", f"run_dir={tmp / 'run'}", f"data.train_shards={tmp / 'shards'}"])
    torch.manual_seed(0)
    model = get_family(cfg.family).build_model(cfg.model)
    export = tmp / "export"
    export.mkdir()
    save_file(model.state_dict(), str(export / "model.safetensors"))
    (export / "config.yaml").write_text(dump_yaml(cfg))
    return export, spm, tmp / "passages.txt"


def run(tiny_export, tmp_path, *extra):
    export, spm, passages = tiny_export
    out = tmp_path / f"lambada{len(extra)}.json"
    rc = evaluate.main(["--checkpoint", str(export), "--task", "lambada", "--data", str(passages), "--spm", str(spm),
                        "--output", str(out), "--no-mlflow", *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_recursive_gpt_is_evaluated_at_its_trained_recurrence(tiny_export, tmp_path):
    res = run(tiny_export, tmp_path)
    assert res["depths"] == [3] and list(res["per_depth"]) == ["3"] and [row[0] for row in res["table"]] == [3]
    explicit = run(tiny_export, tmp_path, "--depths", "1,3")
    assert explicit["depths"] == [1, 3] and list(explicit["per_depth"]) == ["1", "3"]
    assert explicit["per_depth"]["3"] == res["per_depth"]["3"]  # the default is R itself, not another depth
