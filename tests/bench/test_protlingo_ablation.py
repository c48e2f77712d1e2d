"""bench/protlingo_ablation.py's four configs are the demo with exactly the ablated part removed (the same data,
optimizer, schedule and backbone), and a bad flag exits 2 before any work."""
import dataclasses

import pytest

from bench import protlingo_ablation
from conftest import REPO
from pipeline.config import load_config

CONFIGS = REPO / "launchers" / "configs"


@pytest.mark.parametrize("variant, moe, memory", [("full", True, True), ("no_moe", False, True),
                                                  ("no_memory", True, False), ("dense", False, False)])
def test_each_variant_removes_only_its_part(variant, moe, memory):
    demo = load_config(CONFIGS / "protlingo_demo.yaml")
    cfg = load_config(CONFIGS / f"protlingo_ablation_{variant}.yaml")
    assert bool(cfg.model.moe_layers) == moe and bool(cfg.model.memory_layers) == memory
    kept = dataclasses.replace(cfg.model, moe_layers=demo.model.moe_layers, memory_layers=demo.model.memory_layers)
    assert kept == demo.model
    for section in ("data", "objective", "optim", "train"):
        assert getattr(cfg, section) == getattr(demo, section), section


def test_bad_seeds_exit_2(tmp_path, capsys):
    assert protlingo_ablation.main(["--out", str(tmp_path), "--seeds", "a,b"]) == 2
    assert "--seeds 'a,b'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("variants", ["dense", "full,nope"])
def test_bad_variants_exit_2(tmp_path, capsys, variants):
    assert protlingo_ablation.main(["--out", str(tmp_path), "--variants", variants]) == 2
    assert f"--variants {variants!r}" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_a_missing_source_exits_2(tmp_path, capsys):
    assert protlingo_ablation.main(["--out", str(tmp_path), "--source", str(tmp_path / "none.fasta")]) == 2
    assert "--source" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
