"""A text model's export carries its tokenizer: a tiny RecursiveGPT trained here on sentencepiece shards, converted
by tools/convert_checkpoint.py (tokenizer.model checked against the shards' manifest), then BLiMP on the export after
the shards are gone gives the same numbers; --blimp-method one_prefix says what it skips."""
import json
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import REPO, launch_env, run_launch

pytestmark = pytest.mark.slow
WORDS = "the cat dog sat ran on a mat log red big small fox jumped over lazy river".split()
TRUST = "--trust-checkpoint"


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """(run dir, shard dir, BLiMP dir): random sentences -> data_prep train-spm + babylm -> 2 training steps."""
    tmp = tmp_path_factory.mktemp("textrun")
    g = torch.Generator().manual_seed(0)
    lines = [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (8,), generator=g).tolist()) for _ in range(300)]
    (tmp / "text.train").write_text("\n".join(lines) + "\n")
    spm, shards = tmp / "spm" / "tiny", tmp / "shards"
    for cmd in (["train-spm", "--input", str(tmp / "text.train"), "--output", str(spm), "--vocab-size", "320"],
                ["babylm", "--spm", f"{spm}.model", "--input", str(tmp / "text.train"), "--output", str(shards)]):
        proc = subprocess.run([sys.executable, "-m", "data_prep", *cmd], cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    run_dir = tmp / "run"
    cmd = [sys.executable, str(REPO / "launchers/pretrain.py"), "--ds_config", str(REPO / "ds_configs/zero1.json"),
           "--config", str(REPO / "launchers/configs/recursive_gpt_demo.yaml")]
    for o in [f"run_dir={run_dir}", f"data.train_shards={shards}", "model.vocab_size=320", "model.d_model=16",
              "model.embed_dim=8", "model.n_heads=2", "model.recurrence=2", "data.context_length=32",
              "train.micro_batch_size=4", "train.max_steps=2", "train.log_every=1", "checkpoint.every_steps=1000",
              "tracking.enabled=false"]:
        cmd += ["--set", o]
    proc = run_launch(cmd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    blimp = tmp / "blimp"
    blimp.mkdir()
    one = [{"sentence_good": "the cat sat on a mat", "sentence_bad": "the cat sat on a mat mat",
            "one_prefix_prefix": "the cat sat on", "one_prefix_word_good": "a mat", "one_prefix_word_bad": "mat a",
            "UID": "with_prefix", "one_prefix_method": True, "two_prefix_method": False}] * 3
    two = [{"sentence_good": "a big dog ran", "sentence_bad": "a dog big ran", "UID": "full_only",
            "one_prefix_method": False, "two_prefix_method": False}] * 2
    (blimp / "with_prefix.jsonl").write_text("".join(json.dumps(r) + "\n" for r in one))
    (blimp / "full_only.jsonl").write_text("".join(json.dumps(r) + "\n" for r in two))
    return run_dir, shards, blimp


def tool(name, *args):
    return subprocess.run([sys.executable, str(REPO / name), *map(str, args)], cwd=REPO, env=launch_env(),
                          capture_output=True, text=True, timeout=300)


def blimp(checkpoint, data, out, *extra):
    proc = tool("launchers/evaluate.py", "--checkpoint", checkpoint, "--task", "blimp", "--data", data, "--depths",
                "1,2", "--output", out, "--no-mlflow", *extra)
    return proc, (json.loads(out.read_text()) if proc.returncode == 0 else None)


def test_export_holds_the_tokenizer_and_blimp_runs_without_the_shards(text_run, tmp_path):
    from pipeline.data.shards import sha256_file

    run_dir, shards, data = text_run
    export = tmp_path / "export"
    proc = tool("tools/convert_checkpoint.py", "--checkpoint", run_dir, "--output", export, TRUST)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("parameters, fp32, pipeline names, tokenizer.model)")
    assert sorted(p.name for p in export.iterdir()) == [
        ".written-by.json", "README.md", "attention_ops.py", "config.json", "config.yaml", "export.json", "hf_base.py",
        "layers.py", "model.safetensors", "modeling_gpt.py", "norm_op.py", "recursive_gpt.py", "tokenizer.json",
        "tokenizer.model", "tokenizer_config.json"]
    manifest = json.loads((shards / "manifest.json").read_text())["tokenizer"]
    meta = json.loads((export / "export.json").read_text())
    assert meta["tokenizer"]["sha256"] == manifest["sha256"] == sha256_file(export / "tokenizer.model")
    assert meta["tokenizer"]["name"] == "sentencepiece" and meta["step"] == 2

    with_shards, ref = blimp(run_dir, data, tmp_path / "ckpt.json", TRUST)
    assert with_shards.returncode == 0, with_shards.stderr
    moved = shards.with_name("shards-gone")
    shards.rename(moved)
    try:
        proc, res = blimp(export, data, tmp_path / "export.json")
        assert proc.returncode == 0, proc.stderr
        assert res["per_depth"] == ref["per_depth"] and res["n_pairs"] == 5
        assert "blimp K=2: 100%" in proc.stderr  # progress on stderr
        # the DeepSpeed checkpoint itself has no tokenizer once the shards are gone: one line naming the path
        gone, _ = blimp(run_dir, data, tmp_path / "gone.json", TRUST)
        assert gone.returncode == 2 and gone.stderr.strip().splitlines()[-1].startswith(
            f"error: {shards / 'tokenizer.model'}: sentencepiece model not found (pass --spm")
        # converting again now needs the model named (the shards held it)
        again = tool("tools/convert_checkpoint.py", "--checkpoint", run_dir, "--output", tmp_path / "e2", TRUST)
        assert again.returncode == 2 and "--spm MODEL" in again.stderr and not (tmp_path / "e2").exists()
        third = tool("tools/convert_checkpoint.py", "--checkpoint", run_dir, "--output", tmp_path / "e3", TRUST,
                     "--spm", export / "tokenizer.model")
        assert third.returncode == 0, third.stderr
        assert sha256_file(tmp_path / "e3" / "tokenizer.model") == manifest["sha256"]
    finally:
        moved.rename(shards)


def test_a_tokenizer_other_than_the_shards_is_refused(text_run, tmp_path):
    run_dir, shards, _ = text_run
    other = tmp_path / "other.model"
    shutil.copy(shards / "tokenizer.model", other)
    with open(other, "ab") as fh:
        fh.write(b"\0")
    proc = tool("tools/convert_checkpoint.py", "--checkpoint", run_dir, "--output", tmp_path / "x", TRUST,
                "--spm", other)
    assert proc.returncode == 2 and not (tmp_path / "x").exists()
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {other}: sha256 ")
    assert "not the tokenizer the shards were made with" in proc.stderr


def test_blimp_one_prefix_reports_what_it_skips(text_run, tmp_path):
    run_dir, _, data = text_run
    proc, res = blimp(run_dir, data, tmp_path / "one.json", TRUST, "--blimp-method", "one_prefix")
    assert proc.returncode == 0, proc.stderr
    line = ("skipped: --blimp-method one_prefix skips 1 of 2 paradigms, 2 records: full_only "
            "(2 records: one_prefix_method is false)")
    assert line in proc.stdout.splitlines()
    assert res["n_pairs"] == 3 and res["skipped_line"] == line
    assert res["skipped"]["per_paradigm"] == {"full_only": {"records": 2, "of": 2, "reason": {"flag_false": 2}}}
    assert res["columns"] == ["K", "macro_accuracy", "with_prefix"]
    proc, _ = blimp(run_dir, data, tmp_path / "two.json", TRUST, "--blimp-method", "two_prefix")
    assert proc.returncode == 2 and "no record supports --blimp-method two_prefix" in proc.stderr
    assert f"{data}:" in proc.stderr and not (tmp_path / "two.json").exists()
