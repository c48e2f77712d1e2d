"""A tiny RecursiveGPT export built in this process in about a second (no training, no DeepSpeed): a sentencepiece
model trained on the shipped BabyLM-style sample (data_prep train-spm), a freshly initialized model and
tools/convert_checkpoint.write_export, the function the export tool itself writes with. For the BabyLM task tests,
which compare launchers/evaluate.py's scoring with plain transformers on the export."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
FIXTURES = REPO / "tests" / "fixtures" / "babylm_eval"
SAMPLES = [REPO / "data" / "samples" / "babylm_alice_train_sample.txt.gz",
           REPO / "data" / "samples" / "babylm_shakespeare_train_sample.txt.gz"]
SMALL = ["model.vocab_size=1024", "model.d_model=32", "model.embed_dim=16", "model.n_heads=2", "model.recurrence=2",
         "data.context_length=64"]


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name.replace("/", "_"), REPO / name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sentencepiece(tmp: Path) -> Path:
    """tmp/shards/tokenizer.model: a 1,024-piece model of data_prep train-spm on the shipped sample (where a run's
    shards keep it)."""
    out = tmp / "shards"
    out.mkdir(parents=True)
    proc = subprocess.run([sys.executable, "-m", "data_prep", "train-spm", "--input", *map(str, SAMPLES), "--output",
                           str(tmp / "spm" / "m"), "--vocab-size", "1024"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    (out / "tokenizer.model").write_bytes((tmp / "spm" / "m.model").read_bytes())
    return out / "tokenizer.model"


def make_export(tmp: Path, spm: Path, overrides=(), seed: int = 0, name: str = "export") -> Path:
    """tmp/NAME: the export of a fresh tiny RecursiveGPT (SMALL + ``overrides``) whose training shards are
    ``spm``'s folder."""
    from pipeline.config import load_config
    from pipeline.families import get_family

    cfg = load_config(REPO / "launchers" / "configs" / "recursive_gpt_demo.yaml",
                      [*SMALL, *overrides, f"run_dir={tmp / 'run'}", f"data.train_shards={spm.parent}",
                       "tracking.enabled=false"])
    torch.manual_seed(seed)
    model = get_family(cfg.family).build_model(cfg.model).eval()
    out = tmp / name
    out.mkdir()
    tool = load_tool("tools/convert_checkpoint.py")
    spm_path, tokenizer = tool.find_tokenizer(cfg, None, False)
    tool.write_export(out, model, cfg, tag_dir=tmp / "run" / "checkpoints" / "step00000000", meta={"step": 0},
                      spm=spm_path, tokenizer=tokenizer)
    return out
