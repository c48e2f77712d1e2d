"""Bad run configs and ds_configs through the real CLI: ``python launchers/pretrain.py --ds_config X --config Y``.

Each must fail before DeepSpeed starts with one ``error:`` line naming the file and the key (or line), a non-zero exit
and no traceback (tests/reliability/bad_input.py). Every run points the data at a directory that does not exist and
the run directory into tmp_path, so a bad input that slipped through could never train or write into the repository.
"""
from __future__ import annotations

import json

import pytest

from bad_input import REPO, assert_one_line_error, run_cli

PRETRAIN = REPO / "launchers" / "pretrain.py"
GOOD_DS = REPO / "ds_configs" / "zero2.json"


def pretrain(tmp_path, *, config=None, ds=GOOD_DS, overrides=()):
    args = [PRETRAIN, "--ds_config", ds]
    if config is not None:
        args += ["--config", config]
    args += ["--set", f"run_dir={json.dumps(str(tmp_path / 'run'))}",
             "--set", f"data.train_shards={json.dumps(str(tmp_path / 'no_shards'))}"]
    for o in overrides:
        args += ["--set", o]
    return run_cli(args)


# ---- run config YAML: (name, family, YAML body, [strings the error line must name], extra overrides) -----------------
# "{f}" in a must-name string is replaced by the config file's path.
YAML_CASES = [
    ("duplicate-top-level-key", "train:\n  max_steps: 3\ntrain:\n  log_every: 2\n",
     ["{f}:3", "train", "duplicate key", "line 1"]),
    ("duplicate-nested-key", "data:\n  masking:\n    kind: token\n    kind: span\n",
     ["{f}:4", "data.masking.kind", "duplicate key"]),
    ("malformed-flow-list", "train:\n  max_steps: [1, 2\n  log_every: 3\n", ["{f}:3:12", "invalid YAML", "line 2"]),
    ("nan-value", "optim:\n  lr: .nan\n", ["{f}", "optim.lr", "finite"]),
    ("bool-as-int", "train:\n  max_steps: true\n", ["{f}", "train.max_steps", "integer"]),
    ("heads-not-dividing-width", "model:\n  d_model: 64\n  n_heads: 5\n", ["{f}", "model.n_heads", "divisible"]),
    ("negative-width-recursive-gpt", "family: recursive_gpt\nmodel:\n  d_model: -64\n", ["{f}", "model.d_model"]),
    ("moe-layer-out-of-range", "family: protlingo\nmodel:\n  n_layers: 4\n  moe_layers: [7]\n",
     ["{f}", "model.moe_layers"]),
    ("unknown-model-key", "model:\n  d_modle: 64\n", ["{f}", "model.d_modle", "unknown config key"]),
    ("section-not-a-mapping", "model: 5\n", ["{f}", "model", "expected a mapping"]),
    ("max-nonfinite-steps-zero", "train:\n  max_nonfinite_steps: 0\n", ["{f}", "train.max_nonfinite_steps"]),
    ("max-hours-negative", "train:\n  max_hours: -1\n", ["{f}", "train.max_hours"]),
    ("verify-not-bool", "data:\n  verify: maybe\n", ["{f}", "data.verify", "true/false"]),
    ("loader-streams-zero", "data:\n  loader_streams: 0\n", ["{f}", "data.loader_streams", ">= 1"]),
    ("workers-not-dividing-streams", "data:\n  loader_streams: 2\n  num_workers: 3\n",
     ["data.num_workers", "3 workers", "divides 2"]),
]


@pytest.mark.parametrize("name, text, must_name", YAML_CASES, ids=[c[0] for c in YAML_CASES])
def test_bad_run_config_is_one_error_line(tmp_path, name, text, must_name):
    f = tmp_path / f"{name}.yaml"
    f.write_text(text)
    line = assert_one_line_error(pretrain(tmp_path, config=f), *[s.format(f=f) for s in must_name])
    assert line.count("error:") == 1


def test_non_utf8_config(tmp_path):
    f = tmp_path / "binary.yaml"
    f.write_bytes(b"train:\n  max_steps: \xff\n")
    assert_one_line_error(pretrain(tmp_path, config=f), str(f), "UTF-8")


def test_missing_config_file(tmp_path):
    f = tmp_path / "missing.yaml"
    assert_one_line_error(pretrain(tmp_path, config=f), str(f), "no such file, nor a config name of launchers/configs")


def test_non_finite_override(tmp_path):
    assert_one_line_error(pretrain(tmp_path, overrides=["objective.mu_k=.inf"]), "objective.mu_k", "finite")


@pytest.mark.parametrize("override, error", [
    ("optim.betas=[0.9,abc]", "optim.betas[1]: expected a number, got 'abc'"),
    ("eval.depths=[1,x]", "eval.depths[1]: expected an integer, got 'x'"),
])
def test_a_bad_list_element_is_blamed_on_its_set(tmp_path, override, error):
    """Campaign case: a bad element of a list given by --set was blamed on the default YAML the user never passed."""
    line = assert_one_line_error(pretrain(tmp_path, overrides=[override]), f"--set {override}: {error}")
    assert "eco_rna_demo.yaml" not in line, line


# ---- ds_config JSON: (name, JSON text, [strings the error line must name]) ------------------------------------------
DS_CASES = [
    ("invalid-json", '{"zero_optimization": {"stage": 2},,}', ["invalid JSON"]),
    ("stage-out-of-range", '{"zero_optimization": {"stage": 5}}', ["zero_optimization.stage"]),
    ("batch-size-disagrees", '{"train_batch_size": 1000}', ["train_batch_size", "train.micro_batch_size"]),
    ("zero-section-typo", '{"zero_optimisation": {"stage": 2}}', ["zero_optimisation", "zero_optimization"]),
    ("optimizer-block", '{"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}', ["optimizer", "optim.lr"]),
    ("scheduler-block", '{"scheduler": {"type": "WarmupLR"}}', ["scheduler", "optim.warmup_steps"]),
    ("zero-key-typo", '{"zero_optimization": {"stage": 2, "overlap_com": false}}',
     ["zero_optimization.overlap_com", "overlap_comm"]),
    ("duplicate-json-key", '{\n "zero_optimization": {\n  "stage": 2,\n  "stage": 3\n }\n}',
     ["zero_optimization.stage", "duplicate key", "line 2"]),
    ("stage-true", '{"zero_optimization": {"stage": true}}', ["zero_optimization.stage", "got true"]),
    ("nan-clipping", '{"gradient_clipping": NaN}', ["gradient_clipping", "finite"]),
]


@pytest.mark.parametrize("name, text, must_name", DS_CASES, ids=[c[0] for c in DS_CASES])
def test_bad_ds_config_is_one_error_line(tmp_path, name, text, must_name):
    f = tmp_path / f"{name}.json"
    f.write_text(text)
    assert_one_line_error(pretrain(tmp_path, ds=f), str(f), *must_name)


def test_missing_ds_config(tmp_path):
    f = tmp_path / "missing.json"
    assert_one_line_error(pretrain(tmp_path, ds=f), str(f), "not found")
