import re
from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.config_files import resolve_config
from pipeline.ds_config import load_ds_config, resolve_ds_config
from pipeline.models.eco_rna import EcoRNAConfig

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "launchers" / "configs").glob("*.yaml"))
DS_CONFIGS = sorted((REPO / "ds_configs").glob("*.json"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_repo_config_loads(path):
    cfg = load_config(path)
    assert cfg.model.num_params() > 0


@pytest.mark.parametrize("path", DS_CONFIGS, ids=lambda p: p.name)
def test_every_ds_config_resolves_for_cpu_and_gpu(path):
    cfg = load_config(None)
    for cuda in (False, True):
        ds = resolve_ds_config(load_ds_config(str(path)), cfg, 2, str(path), cuda=cuda)
        assert ds["train_batch_size"] == cfg.train.micro_batch_size * cfg.train.grad_accum_steps * 2
        assert ds["bf16"]["enabled"] is cuda


def test_unknown_key_names_key_and_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("family: eco_rna\nmodel:\n  d_modle: 64\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: model.d_modle: unknown config key"):
        load_config(f)


def test_unknown_section_and_nested_key():
    with pytest.raises(ConfigError, match=r"^trian: unknown config key"):
        load_config(None, ["trian.max_steps=3"])
    with pytest.raises(ConfigError, match=r"^data.masking.prob: unknown config key"):
        load_config(None, ["data.masking.prob=0.2"])


def test_wrong_type_names_key():
    with pytest.raises(ConfigError, match=r"^train.max_steps: expected an integer, got 'ten'"):
        load_config(None, ["train.max_steps=ten"])
    with pytest.raises(ConfigError, match=r"^optim.lr: expected a number"):
        load_config(None, ["optim.lr=true"])


def test_validation_names_field():
    with pytest.raises(ValueError, match=r"model.n_kv_heads"):
        EcoRNAConfig(n_heads=12, n_kv_heads=5)
    with pytest.raises(ConfigError, match=r"train.micro_batch_size: must be >= 1"):
        load_config(None, ["train.micro_batch_size=0"])


def test_overrides_parse_yaml_values():
    cfg = load_config(None, ["train.max_steps=7", "optim.betas=[0.8, 0.9]", "tracking.run_name=null", "optim.lr=3e-4"])
    assert cfg.train.max_steps == 7 and cfg.optim.betas == [0.8, 0.9] and cfg.tracking.run_name is None
    assert cfg.optim.lr == 3e-4  # YAML 1.1 reads 3e-4 as a string; float fields accept it


def test_batch_arithmetic():
    cfg = load_config(None, ["train.global_batch_size=48", "train.micro_batch_size=8", "train.grad_accum_steps=2"])
    with pytest.raises(ConfigError, match=r"train.global_batch_size: 48 != micro_batch_size 8 x grad_accum_steps 2 "
                                          r"x world size 2 = 32"):
        cfg.check_world_size(2)
    cfg.check_world_size(3)
    ds = {"train_batch_size": 64, "zero_optimization": {"stage": 2}}
    with pytest.raises(ConfigError, match=r"x.json: train_batch_size is 64 but the run config gives 32"):
        resolve_ds_config(ds, load_config(None, ["train.micro_batch_size=8", "train.grad_accum_steps=2"]), 2,
                          "x.json", cuda=False)


def test_precision_conflict():
    with pytest.raises(ConfigError, match=r"fp16.enabled is true but train.precision resolves to fp32"):
        resolve_ds_config({"fp16": {"enabled": True}}, load_config(None), 1, "x.json", cuda=False)


def test_inherit_merges_mappings_and_replaces_lists(tmp_path):
    (tmp_path / "base.yaml").write_text("family: eco_rna\nmodel: {d_model: 64, n_heads: 4, n_kv_heads: 2}\n"
                                        "optim: {lr: 0.001, betas: [0.9, 0.95]}\ntrain: {max_steps: 5}\n")
    (tmp_path / "child.yaml").write_text("inherit: base.yaml\nmodel: {d_ff: 96}\noptim: {betas: [0.8, 0.9]}\n")
    cfg = load_config(tmp_path / "child.yaml")
    assert (cfg.model.d_model, cfg.model.n_heads, cfg.model.d_ff) == (64, 4, 96)  # merged key by key
    assert cfg.optim.lr == 0.001 and cfg.optim.betas == [0.8, 0.9] and cfg.train.max_steps == 5  # list replaced


def test_inherit_cycle_and_bad_value_name_the_file(tmp_path):
    (tmp_path / "a.yaml").write_text("inherit: b.yaml\n")
    (tmp_path / "b.yaml").write_text("inherit: a.yaml\n")
    with pytest.raises(ConfigError, match=r"inherit: a.yaml forms a cycle"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("inherit: [x]\n")
    with pytest.raises(ConfigError, match=r"c.yaml: inherit: expected a file path"):
        load_config(tmp_path / "c.yaml")
    (tmp_path / "d.yaml").write_text("inherit: missing.yaml\n")
    with pytest.raises(ConfigError, match=r"missing.yaml: config file not found"):
        load_config(tmp_path / "d.yaml")


def test_pack_is_refused_for_masked_lms_only():
    for family in ("eco_rna", "eco_rna_control"):
        with pytest.raises(ConfigError, match=r"^data.pack: family .* is a masked LM"):
            load_config(None, [f"family={family}", "data.pack=true"])
    assert load_config(REPO / "launchers" / "configs" / "recursive_gpt_demo.yaml", ["data.pack=true"]).data.pack


def test_init_from_optimizer_needs_init_from():
    with pytest.raises(ConfigError, match=r"^train.init_from_optimizer: needs train.init_from"):
        load_config(None, ["train.init_from_optimizer=true"])
    with pytest.raises(ConfigError, match=r"^checkpoint.at_steps: steps must be >= 1"):
        load_config(None, ["checkpoint.at_steps=[0, 5]"])


def test_eco_rna_identity_maps_are_not_decayed():
    from pipeline.train import param_groups
    from pipeline.families import get_family

    cfg = load_config(None)
    model = get_family("eco_rna").build_model(cfg.model)
    groups = {g["name"]: g for g in param_groups(model, cfg.optim)}
    assert sorted(groups) == ["decay", "no_decay"]
    decay, no_decay = groups["decay"], groups["no_decay"]
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    undecayed = {names[id(p)] for p in no_decay["params"]}
    assert {"core.inject.B.weight", "readout.W_o.weight", "core.inject.a", "core.inject.b"} <= undecayed
    assert all(p.ndim >= 2 for p in decay["params"]) and "embed.weight" not in undecayed
    assert len(decay["params"]) + len(no_decay["params"]) == len(names)


@pytest.mark.parametrize("stage,n_blocks", [("stage_a", 9), ("stage_b", 9), ("demo", 1)])
def test_fixed_depth_control_matches_eco_rna_stage(stage, n_blocks):
    """A.6: the control matches the recurrent model's parameter count, block count, data and training schedule."""
    eco = load_config(REPO / "launchers" / "configs" / f"eco_rna_{stage}.yaml")
    ctl = load_config(REPO / "launchers" / "configs" / f"eco_rna_control_{stage}.yaml")
    assert (eco.family, ctl.family) == ("eco_rna", "eco_rna_control")
    assert eco.data == ctl.data and eco.optim == ctl.optim and eco.checkpoint == ctl.checkpoint
    assert ctl.train.max_steps == eco.train.max_steps and ctl.train.micro_batch_size == eco.train.micro_batch_size
    blocks = lambda m: m.n_prelude + m.n_core + m.n_coda  # noqa: E731
    assert blocks(eco.model) == blocks(ctl.model) == n_blocks
    assert abs(ctl.model.num_params() / eco.model.num_params() - 1) < 0.001
    assert ctl.objective.depth_law == "fixed" and ctl.objective.lambda_fp == ctl.objective.lambda_anchor == 0
    if stage == "stage_b":  # each starts from its own Stage A's final checkpoint
        assert eco.train.init_from.startswith("runs/eco_rna_stage_a/") and eco.train.init_from.endswith("step00300000")
        assert ctl.train.init_from.startswith("runs/eco_rna_control_stage_a/")


def test_stage_a_keeps_the_checkpoints_table_1_reads():
    cfg = load_config(REPO / "launchers" / "configs" / "eco_rna_stage_a.yaml")
    assert cfg.train.max_steps == 300_000
    assert {50_000, 300_000} <= set(cfg.checkpoint.at_steps) and max(cfg.checkpoint.at_steps) <= cfg.train.max_steps


def test_lr_scale_names_a_models_group():
    from pipeline.train import param_groups
    from pipeline.families import get_family

    cfg = load_config(None, ["optim.lr_scale={memory_tables: 10}"])
    with pytest.raises(ConfigError, match=r"^optim.lr_scale.memory_tables: the model has no such parameter group"):
        param_groups(get_family("eco_rna").build_model(cfg.model), cfg.optim)
    with pytest.raises(ConfigError, match=r"^optim.lr_scale: expected \{group: number > 0\}"):
        load_config(None, ["optim.lr_scale={memory_tables: 0}"])


def test_reliability_fields_defaults_and_bounds():
    cfg = load_config(None)
    assert cfg.train.max_nonfinite_steps == 20 and cfg.train.max_hours is None
    assert cfg.data.verify is True and cfg.tracking.timeout_s == 10.0 and cfg.tracking.system_metrics_s == 5.0
    assert load_config(None, ["tracking.system_metrics_s=0"]).tracking.system_metrics_s == 0  # 0 = off
    cfg = load_config(None, ["train.max_hours=1.5", "train.max_nonfinite_steps=1", "data.verify=false",
                             "tracking.timeout_s=0.5"])
    assert (cfg.train.max_hours, cfg.train.max_nonfinite_steps, cfg.data.verify, cfg.tracking.timeout_s) == \
        (1.5, 1, False, 0.5)
    for override, key in [("train.max_nonfinite_steps=0", "train.max_nonfinite_steps"),
                          ("train.max_hours=0", "train.max_hours"), ("train.max_hours=-2", "train.max_hours"),
                          ("data.verify=1", "data.verify"), ("tracking.timeout_s=0", "tracking.timeout_s"),
                          ("tracking.timeout_s=-1", "tracking.timeout_s"),
                          ("tracking.system_metrics_s=-1", "tracking.system_metrics_s"),
                          ("tracking.system_metrics_s=.nan", "tracking.system_metrics_s")]:
        with pytest.raises(ConfigError, match=rf"^{key}: "):
            load_config(None, [override])


# ---- strict loading (issue 11) --------------------------------------------------------------------------------------
def _write(tmp_path, text, name="c.yaml"):
    f = tmp_path / name
    f.write_text(text)
    return f


@pytest.mark.parametrize("text, match", [
    ("train:\n  max_steps: 3\ntrain:\n  log_every: 2\n", r"c.yaml:3: train: duplicate key \(first given at line 1\)"),
    ("train:\n  max_steps: 3\n  log_every: 2\n  max_steps: 4\n",
     r"c.yaml:4: train.max_steps: duplicate key \(first given at line 2\)"),
    ("data:\n  masking:\n    kind: token\n    kind: span\n", r"c.yaml:4: data.masking.kind: duplicate key"),
    ("data:\n  sources:\n    - {name: a, shards: x, name: b}\n", r"c.yaml:3: data.sources\[0\].name: duplicate key"),
], ids=["top", "nested", "deep", "in-list"])
def test_duplicate_yaml_keys_are_refused_with_key_file_and_line(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        load_config(_write(tmp_path, text))


def test_yaml_anchors_and_merge_keys_are_not_duplicates(tmp_path):
    f = _write(tmp_path, "optim: &o {lr: 0.002, warmup_steps: 3}\ntrain: {max_steps: 4}\n"
                         "checkpoint: {every_steps: 2}\ntracking: {experiment: x}\n")
    assert load_config(f).optim.lr == 0.002
    (tmp_path / "m.yaml").write_text("train: &t {max_steps: 4, log_every: 2}\n"
                                     "checkpoint: {every_steps: 2}\noptim: {<<: {lr: 0.1, warmup_steps: 1}, lr: 0.3}\n")
    cfg = load_config(tmp_path / "m.yaml")
    assert cfg.optim.lr == 0.3 and cfg.optim.warmup_steps == 1  # an explicit key overrides a merged one


@pytest.mark.parametrize("text, match", [
    ("train:\n  max_steps: [1, 2\n  log_every: 3\n", r"c.yaml:3:12: invalid YAML: expected ',' or '\]'.*line 2"),
    ("train:\n\tmax_steps: 3\n", r"c.yaml:2:1: invalid YAML: found character '\\t'"),
    ("a: 1\n---\nb: 2\n", r"c.yaml:2:1: invalid YAML: .*single document"),
    ('run_dir: "x\n', r"c.yaml:2:1: invalid YAML: found unexpected end of stream"),
])
def test_malformed_yaml_keeps_its_line_on_one_line(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(_write(tmp_path, text))
    assert "\n" not in str(e.value)


def test_non_utf8_config_is_one_error(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_bytes(b"train:\n  max_steps: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"c.yaml: not UTF-8 text"):
        load_config(f)


@pytest.mark.parametrize("text, match", [
    ("optim:\n  lr: .nan\n", r"c.yaml: optim.lr: expected a finite number, got nan"),
    ("optim:\n  lr: .inf\n", r"c.yaml: optim.lr: expected a finite number, got inf"),
    ("optim:\n  lr: nan\n", r"c.yaml: optim.lr: expected a finite number"),  # a string a float field would accept
    ("train:\n  max_hours: -.inf\n", r"c.yaml: train.max_hours: expected a finite number"),
    ("optim:\n  lr_scale: {memory_tables: .inf}\n", r"c.yaml: optim.lr_scale.memory_tables: expected a finite"),
    ("optim:\n  betas: [0.9, .nan]\n", r"c.yaml: optim.betas\[1\]: expected a finite number"),
])
def test_non_finite_values_are_refused_naming_the_key(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        load_config(_write(tmp_path, text))


def test_non_finite_override_is_refused():
    with pytest.raises(ConfigError, match=r"^objective.mu_k: expected a finite number, got inf"):
        load_config(None, ["objective.mu_k=.inf"])
    with pytest.raises(ConfigError, match=r"^model.sigma_init: expected a finite number, got nan"):
        load_config(None, ["model.sigma_init=.nan"])


@pytest.mark.parametrize("override, match", [
    ("train.max_steps=true", r"^train.max_steps: expected an integer, got True"),
    ("seed=false", r"^seed: expected an integer"),
    ("optim.lr=true", r"^optim.lr: expected a number"),
    ("optim.betas=[false, 0.9]", r"^optim.betas\[0\]: expected a number, got False"),
    ("checkpoint.at_steps=[true]", r"^checkpoint.at_steps\[0\]: expected an integer"),
    ("checkpoint.at_words=[true]", r"^checkpoint.at_words\[0\]: expected an integer"),
    ("train.expert_parallel_size=true", r"^train.expert_parallel_size: expected an integer"),
    ("model.n_heads=true", r"^model.n_heads: expected an integer"),
    ("data.verify=1", r"^data.verify: expected true/false, got 1"),
])
def test_bools_are_not_numbers_and_numbers_are_not_bools(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


@pytest.mark.parametrize("family, override, key", [
    ("eco_rna", "model.n_heads=5", "model.n_heads"),  # 768 / 5
    ("eco_rna", "model.n_kv_heads=5", "model.n_kv_heads"),
    ("eco_rna", "model.d_ff=-3", "model.d_ff"),
    ("eco_rna", "model.n_prelude=-1", "model.n_prelude"),
    ("eco_rna", "model.norm_eps=0", "model.norm_eps"),
    ("eco_rna", "model.alpha_max=1.5", "model.alpha_min"),
    ("eco_rna_control", "model.d_model=0", "model.d_model"),
    ("recursive_gpt", "model.n_heads=7", "model.n_heads"),
    ("recursive_gpt", "model.recurrence=0", "model.recurrence"),
    ("recursive_gpt", "model.embed_dim=-1", "model.embed_dim"),
    ("recursive_gpt", "model.mlp_ratio=-2", "model.mlp_ratio"),
    ("standard_gpt", "model.n_layers=0", "model.n_layers"),
    ("protlingo", "model.n_heads=3", "model.n_heads"),
    ("protlingo", "model.vocab_size=10", "model.mask_token_id"),
    ("protlingo", "model.memory_dim=0", "model.memory_dim"),
    ("protlingo", "model.moe_layers=[40]", "model.moe_layers"),
    ("protlingo", "model.router_init_std=-1", "model.router_init_std"),
])
def test_model_shape_errors_are_config_errors_naming_key_and_source(tmp_path, family, override, key):
    """The error names the key and where its value came from: the --set that gave it, else the file."""
    f = _write(tmp_path, f"family: {family}\n")
    source = f"--set {re.escape(override)}" if override.startswith(key + "=") else re.escape(str(f))
    with pytest.raises(ConfigError, match=rf"^{source}: {key}: ") as e:
        load_config(f, [override])
    assert "\n" not in str(e.value)


def test_a_value_from_the_file_is_blamed_on_the_file_even_beside_overrides(tmp_path):
    f = _write(tmp_path, "model:\n  d_model: -4\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(f))}: model.d_model: must be >= 1, got -4"):
        load_config(f, ["train.max_steps=5", "model.n_heads=2"])
    with pytest.raises(ConfigError, match=r"^--set model=3: model: expected a mapping, got 3"):
        load_config(f, ["model=3"])


def test_sections_must_be_mappings_with_name_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"c.yaml: model: expected a mapping, got 5"):
        load_config(_write(tmp_path, "model: 5\n"))
    with pytest.raises(ConfigError, match=r"c.yaml: train: expected a mapping"):
        load_config(_write(tmp_path, "train: [1]\n"))
    with pytest.raises(ConfigError, match=r"c.yaml: 1: config keys must be names"):
        load_config(_write(tmp_path, "1: 2\n"))
    with pytest.raises(ConfigError, match=r"c.yaml: top level must be a mapping"):
        load_config(_write(tmp_path, "- 1\n"))


def test_seed_run_dir_and_word_milestones():
    with pytest.raises(ConfigError, match=r"^seed: must be an integer in \[0, 2\^63\)"):
        load_config(None, ["seed=-1"])
    with pytest.raises(ConfigError, match=r"^run_dir: must be a non-empty path"):
        load_config(None, ["run_dir=''"])
    with pytest.raises(ConfigError, match=r"^checkpoint.at_words: word totals must be >= 1"):
        load_config(None, ["checkpoint.at_words=[0]"])
    assert load_config(None, ["checkpoint.at_words=[10_000_000]"]).checkpoint.at_words == [10_000_000]


def test_resolve_config(tmp_path):
    assert resolve_config("standard_h384") == REPO / "launchers" / "configs" / "standard_h384.yaml"
    f = tmp_path / "mine.yaml"
    f.write_text("family: eco_rna\n")
    assert resolve_config(str(f)) == f
    with pytest.raises(ConfigError, match=r"^--config standard_h38: no such file, nor a config name .*standard_h384"):
        resolve_config("standard_h38")
    with pytest.raises(ConfigError, match="^--config nope/standard_h384: no such file"):
        resolve_config("nope/standard_h384")
