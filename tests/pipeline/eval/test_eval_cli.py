"""pipeline/eval/cli.py: the --depths parser and cap shared by evaluate.py and flops.py, locating a
checkpoint with named errors, the pickle rule, progress bars."""
import pickle
import sys

import pytest
import torch

from conftest import REPO
from pipeline.config import ConfigError, load_config
from pipeline.eval import cli

sys.path.insert(0, str(REPO / "tests" / "tools"))
from checkpoint_factory import tiny_config, write_deepspeed_like, write_export  # noqa: E402

CONFIGS = REPO / "launchers" / "configs"


@pytest.mark.parametrize("text,want", [("1-8", list(range(1, 9))), ("4", [4]), ("1,2,4,8", [1, 2, 4, 8]),
                                       ("1-3,8,2", [1, 2, 3, 8]), (" 2 - 3 , 5", [2, 3, 5])])
def test_parse_depths(text, want):
    assert cli.parse_depths(text) == want


@pytest.mark.parametrize("text,msg", [("3-1", "ranges must be positive and increasing"),
                                      ("0-4", "ranges must be positive and increasing"),
                                      ("a", "'a' is neither a depth nor a range"),
                                      ("1,,2", "'' is neither"), ("-3", "'-3' is neither"),
                                      ("1-2-3", "'1-2-3' is neither"),
                                      ("1-100000000", "depth 100000000 is above the maximum 4096")])
def test_parse_depths_refuses_with_the_flag_named(text, msg):
    with pytest.raises(ValueError, match="^--depths ") as e:
        cli.parse_depths(text)
    assert msg in str(e.value)


@pytest.mark.parametrize("name,trained,cap", [("eco_rna_80m", 32, 128), ("eco_rna_demo", 8, 32),
                                              ("eco_rna_control_stage_a", 1, 8), ("recursive_gpt_10m", 16, 64),
                                              ("recursive_gpt_100m", 24, 96), ("recursive_gpt_demo", 4, 16),
                                              ("standard_h384", 12, 48), ("protlingo_150m", 30, 120)])
def test_depth_cap_is_four_times_the_deepest_training_depth(name, trained, cap):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    assert cli.trained_depth(cfg)[0] == trained and cli.max_depth(cfg)[0] == cap
    cli.check_depths(list(range(1, cap + 1)), cfg, "x.yaml")  # the cap itself is allowed
    with pytest.raises(ValueError, match=rf"depth {cap + 1} is above the maximum {cap} for x.yaml"):
        cli.check_depths([1, cap + 1], cfg, "x.yaml")


def test_depth_cap_follows_the_objective():
    fixed = load_config(CONFIGS / "eco_rna_demo.yaml", ["objective.depth_law=fixed", "objective.train_depth=5"])
    assert cli.max_depth(fixed)[0] == 20
    uncapped = load_config(CONFIGS / "eco_rna_demo.yaml", ["objective.k_cap=null", "objective.mu_k=3"])
    assert cli.trained_depth(uncapped) == (24, "8 x objective.mu_k 3.0 (no k_cap)")
    assert cli.max_depth(load_config(CONFIGS / "recursive_gpt_demo.yaml", ["objective.train_depth=6"]))[0] == 24
    for cfg in (fixed, uncapped):  # the default sweep 1-8 always fits
        cli.check_depths(list(range(1, 9)), cfg, "x")


def tiny_dirs(tmp_path):
    """(export dir, DeepSpeed-like tag dir) of a tiny Eco-RNA; the tag dir's model-state file is a pickle whose
    loading would create tmp_path/PWNED."""
    cfg = tiny_config(tmp_path)
    return write_export(tmp_path / "export", cfg), write_deepspeed_like(tmp_path / "run", cfg, tmp_path / "PWNED")


def test_locate_and_the_pickle_rule(tmp_path, capsys):
    export, tag = tiny_dirs(tmp_path)
    marker = tmp_path / "PWNED"
    for where in (tmp_path / "run", tmp_path / "run" / "checkpoints", tag):
        found, cfg, meta = cli.locate_checkpoint(where)
        assert found == tag and cfg.family == "eco_rna" and meta == {"step": 3, "world_size": 1}
    with pytest.raises(ConfigError, match=f"^{tag}/mp_rank_00_model_states.pt: loading it would call builtins.exec.*"
                                          "pass --trust-checkpoint"):
        cli.require_trust(tag, False)
    assert not marker.exists()
    cli.require_trust(tag, True)
    assert capsys.readouterr().err.count("\n") == 1  # one warning line
    cli.require_trust(export, False)  # an export needs nothing, says nothing
    assert capsys.readouterr().err == ""
    assert cli.locate_checkpoint(export)[2] == {}  # a hand-made export has no export.json
    with pytest.raises(pickle.UnpicklingError):  # the payload is live: only the rule kept it from running
        torch.load(tag / "mp_rank_00_model_states.pt", weights_only=True)


def test_locate_names_what_is_wrong(tmp_path):
    export, tag = tiny_dirs(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"^{tmp_path / 'nope'}: no such checkpoint directory"):
        cli.locate_checkpoint(tmp_path / "nope")
    with pytest.raises(ConfigError, match=f"^{export / 'config.yaml'}: not a directory"):
        cli.locate_checkpoint(export / "config.yaml")
    (tag / "client_state.json").write_text('{"step": 3, "world')
    with pytest.raises(ConfigError, match=rf"^{tag / 'client_state.json'}: not valid JSON .*truncated"):
        cli.locate_checkpoint(tag)
    (tag / "client_state.json").write_text('{"step": 3}')
    (tag / "config.yaml").write_text("family: eco_rna\nmodel: {d_model: -1}\n")
    with pytest.raises(ConfigError, match=rf"^{tag / 'config.yaml'}: model.d_model"):
        cli.locate_checkpoint(tag)
    (export / "export.json").write_text("{}")
    (export / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=rf"^{export / 'model.safetensors'}: missing \(an incomplete export\)"):
        cli.locate_checkpoint(export)


def test_progress_goes_to_stderr(capsys):
    assert sum(cli.progress(range(5), desc="work", unit="batch")) == 10
    out, err = capsys.readouterr()
    assert out == "" and "work: 100%" in err and "5/5" in err and "batch/s" in err
