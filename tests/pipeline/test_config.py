from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.engine import resolve_ds_config, load_ds_config
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
