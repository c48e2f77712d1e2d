"""bench/depth_study.py: the split, the seed list, the multi-seed evaluation against a direct sweep, and one tiny
end-to-end run of both trainings through the real launcher."""
import gzip
import json
import statistics
import sys

import pytest

from bench import depth_study
from conftest import HELDOUT_FASTA, REPO
from launchers.evaluate import read_sequences
from pipeline.eval.reconstruction import heldout_samples, reconstruction_sweep
from pipeline.families import get_family

sys.path.insert(0, str(REPO / "tests" / "tools"))
from checkpoint_factory import tiny_config, write_export  # noqa: E402


def test_split_is_byte_exact_and_disjoint(tmp_path):
    src = depth_study.SAMPLE_TRAIN
    train, held = tmp_path / "train.fasta", tmp_path / "held.fasta"
    n_train, n_held = depth_study.split_fasta(src, 10, train, held)
    records = gzip.open(src, "rb").read().split(b"\n>")
    assert n_train + n_held == len(records) == 2107 and n_held == 211
    train_b, held_b = train.read_bytes(), held.read_bytes()
    assert b"\r\n" in train_b  # CRLF kept
    head = lambda b: {ln for ln in b.split(b"\n") if ln.startswith(b">")}  # noqa: E731
    assert not head(train_b) & head(held_b) and len(head(held_b)) == n_held
    assert sorted(head(train_b) | head(held_b)) == sorted(head(gzip.open(src, "rb").read()))
    assert len(train_b) + len(held_b) == len(gzip.open(src, "rb").read())


def test_split_rejects_text_before_the_first_header(tmp_path):
    bad = tmp_path / "bad.fasta"
    bad.write_text("ACGU\n>r1\nACGU\n")
    with pytest.raises(ValueError, match=r"bad.fasta:1: sequence text before the first '>' header"):
        depth_study.split_fasta(bad, 2, tmp_path / "t", tmp_path / "h")


def test_seeds_parse_and_bad_flags_exit_2(tmp_path, capsys):
    assert depth_study.parse_seeds("0-2,7") == [0, 1, 2, 7]
    with pytest.raises(ValueError, match="--seeds"):
        depth_study.parse_seeds("a")
    assert depth_study.main(["--out", str(tmp_path), "--seeds", "3"]) == 2
    assert "at least two evaluation seeds" in capsys.readouterr().err
    assert depth_study.main(["--out", str(tmp_path), "--depths", "1-3"]) == 2
    assert depth_study.main(["--out", str(tmp_path), "--checkpoint", str(tmp_path)]) == 2
    assert "not a checkpoint" in capsys.readouterr().err


def test_checkpoint_mode_reports_the_sweep_of_every_seed(tmp_path, capsys):
    cfg = tiny_config(tmp_path)
    export = write_export(tmp_path / "export", cfg, seed=3)
    out = tmp_path / "study"
    rc = depth_study.main(["--checkpoint", str(export), "--heldout", str(HELDOUT_FASTA), "--out", str(out),
                           "--seeds", "0,5", "--depths", "1-4"])
    res = json.loads((out / "depth_study.json").read_text())
    assert rc == (0 if res["shown"] else 1)
    losses = res["runs"]["eco_rna"]["heldout_loss"]
    from pipeline.checkpoint import load_trained_model

    trained = load_trained_model(export)
    seqs = read_sequences(HELDOUT_FASTA, "rna")
    transform = get_family(cfg.family).make_transform(trained.cfg)
    for i, seed in enumerate([0, 5]):  # each seed is launchers/evaluate.py's sweep with --seed
        direct = reconstruction_sweep(trained.model, trained.cfg, heldout_samples(seqs, transform, seed), [1, 4],
                                      seed=seed)
        assert losses["1"][i] == direct[1]["loss"] and losses["4"][i] == direct[4]["loss"]
    diffs = [a - b for a, b in zip(losses["1"], losses["4"])]
    assert res["diff_per_seed"] == diffs and res["diff_k1_k4"] == pytest.approx(statistics.mean(diffs))
    assert res["spread"] == max(statistics.stdev(losses["1"]), statistics.stdev(losses["4"]),
                                statistics.stdev(diffs))
    assert losses["1"][0] != losses["1"][1]  # seeds differ in masks and initial states
    assert "K=1 -> K=4" in capsys.readouterr().out


def test_a_checkpoint_that_would_run_code_needs_trust(tmp_path, capsys):
    from checkpoint_factory import tiny_config, write_deepspeed_like

    write_deepspeed_like(tmp_path / "run", tiny_config(tmp_path), tmp_path / "PWNED")
    assert depth_study.main(["--checkpoint", str(tmp_path / "run"), "--heldout", str(HELDOUT_FASTA),
                             "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "would call builtins.exec" in err and "--trust-checkpoint" in err and not (tmp_path / "PWNED").exists()


def test_tiny_study_trains_both_models_with_the_real_launcher(tmp_path, capsys):
    tiny = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.d_ff=64", "data.context_length=48",
            "train.micro_batch_size=4", "train.grad_accum_steps=1", "optim.warmup_steps=1"]
    args = ["--out", str(tmp_path / "s"), "--data", str(HELDOUT_FASTA), "--heldout-every", "5", "--steps", "2",
            "--nproc", "1", "--seeds", "0-1", "--depths", "1-4"]
    for s in tiny:
        args += ["--set", s]
    rc = depth_study.main(args)
    res = json.loads((tmp_path / "s" / "depth_study.json").read_text())
    assert rc in (0, 1) and rc == (0 if res["shown"] else 1)
    assert (res["train_records"], res["heldout_records"]) == (168, 43)
    for name in ("eco_rna", "control"):
        run = res["runs"][name]
        assert run["steps"] == 2 and run["train_seconds"] > 0 and len(run["heldout_loss"]["1"]) == 2
    assert list(res["runs"]["control"]["heldout_loss"]) == ["1"]
    assert "control (fixed depth, same budget)" in capsys.readouterr().out


def test_a_failed_training_exits_2_naming_its_log(tmp_path, capsys):
    rc = depth_study.main(["--out", str(tmp_path / "s"), "--steps", "1", "--nproc", "1", "--set", "model.d_modle=8"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "exited" in err and str(tmp_path / "s" / "eco_rna.log") in err
    assert "model.d_modle" in (tmp_path / "s" / "eco_rna.log").read_text()
    assert not (tmp_path / "s" / "depth_study.json").exists()
