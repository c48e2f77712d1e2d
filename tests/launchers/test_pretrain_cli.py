"""Bad input to the launcher: one clear error line, non-zero exit, no training step, nothing written."""
import sys

import pytest

from conftest import REPO, TINY, deepspeed_cmd, run_launch

PRETRAIN = str(REPO / "launchers" / "pretrain.py")


def launch(args, tmp_path):
    cmd = [sys.executable, PRETRAIN, "--ds_config", str(REPO / "ds_configs/zero2.json"),
           "--set", f"run_dir={tmp_path / 'run'}", *args]
    return run_launch(cmd, timeout=120)


def assert_one_error(proc, pattern, tmp_path):
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert pattern in lines[0], lines[0]
    assert not (tmp_path / "run").exists()  # no step ran, nothing written


def test_unknown_config_key(sample_shards, tmp_path):
    proc = launch(["--set", f"data.train_shards={sample_shards}", "--set", "optim.learning_rate=1"], tmp_path)
    assert_one_error(proc, "optim.learning_rate: unknown config key", tmp_path)


def test_unknown_key_in_config_file(sample_shards, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("family: eco_rna\nmodel:\n  d_model: 64\n  depth: 3\n")
    proc = launch(["--config", str(bad), "--set", f"data.train_shards={sample_shards}"], tmp_path)
    assert_one_error(proc, "bad.yaml: model.depth: unknown config key", tmp_path)


def test_bad_type(sample_shards, tmp_path):
    proc = launch(["--set", f"data.train_shards={sample_shards}", "--set", "train.max_steps=1.5"], tmp_path)
    assert_one_error(proc, "train.max_steps: expected an integer, got 1.5", tmp_path)


def test_missing_shard_directory(tmp_path):
    proc = launch(["--set", f"data.train_shards={tmp_path / 'nope'}"], tmp_path)
    assert_one_error(proc, f"shard directory {tmp_path / 'nope'} does not exist", tmp_path)


def test_missing_ds_config(sample_shards, tmp_path):
    cmd = [sys.executable, PRETRAIN, "--ds_config", "ds_configs/zero9.json", "--set", f"run_dir={tmp_path / 'run'}",
           "--set", f"data.train_shards={sample_shards}"]
    proc = run_launch(cmd, timeout=120)
    assert_one_error(proc, "ds_configs/zero9.json: ds_config file not found", tmp_path)


@pytest.mark.slow
def test_batch_arithmetic_mismatch_under_two_ranks(sample_shards, tmp_path):
    cmd = deepspeed_cmd(2, "ds_configs/zero2.json", [f"data.train_shards={sample_shards}", f"run_dir={tmp_path / 'run'}",
                                                     "train.global_batch_size=32", "train.micro_batch_size=8",
                                                     "train.grad_accum_steps=1", *TINY[:4]])
    proc = run_launch(cmd, timeout=300)
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert errors == ["error: train.global_batch_size: 32 != micro_batch_size 8 x grad_accum_steps 1 x world size 2 "
                      "= 16"], proc.stderr
    assert not (tmp_path / "run").exists()


def test_ds_config_takes_both_spellings():
    """--ds-config (as every other flag is spelled) is --ds_config (DeepSpeed's spelling, kept)."""
    from launchers.pretrain import parse_args

    assert parse_args(["--ds-config", "ds_configs/zero2.json"]).ds_config == "ds_configs/zero2.json"
    assert parse_args(["--ds_config", "ds_configs/zero1.json"]).ds_config == "ds_configs/zero1.json"


def test_config_takes_a_name_of_launchers_configs(tmp_path):
    """--config eco_rna_demo is launchers/configs/eco_rna_demo.yaml, as in tools/params.py: the run gets as far as
    its data (a missing shard directory, not a missing config); an unknown name lists the known ones."""
    proc = launch(["--config", "eco_rna_demo", "--set", f"data.train_shards={tmp_path / 'nope'}"], tmp_path)
    assert_one_error(proc, f"shard directory {tmp_path / 'nope'} does not exist", tmp_path)
    proc = launch(["--config", "no_such_config"], tmp_path)
    assert_one_error(proc, "--config no_such_config: no such file, nor a config name of launchers/configs", tmp_path)
