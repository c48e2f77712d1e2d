"""pipeline/ds_config.py: strict ds_config loading (issue 11) and resolution against the run config."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import ds_config
from pipeline.config import ConfigError, load_config
from pipeline.ds_config import check_ds_config, load_ds_config, resolve_ds_config

REPO = Path(__file__).resolve().parents[2]
DS_CONFIGS = sorted((REPO / "ds_configs").glob("*.json"))


def _write(tmp_path, text, name="ds.json"):
    f = tmp_path / name
    f.write_text(text if isinstance(text, str) else json.dumps(text))
    return str(f)


@pytest.mark.parametrize("path", DS_CONFIGS, ids=lambda p: p.name)
def test_every_repo_ds_config_loads_and_resolves(path):
    cfg = load_config(None)
    raw = load_ds_config(str(path))
    for cuda in (False, True):
        ds = resolve_ds_config(raw, cfg, 2, str(path), cuda=cuda)
        assert ds["train_batch_size"] == cfg.train.micro_batch_size * cfg.train.grad_accum_steps * 2
        assert ds["bf16"]["enabled"] is cuda and "fp16" not in ds
    assert DS_CONFIGS, "no ds_configs/*.json found"


@pytest.mark.parametrize("raw, match", [
    ({"zero_optimisation": {"stage": 2}}, r"ds.json: zero_optimisation: unknown DeepSpeed config key "
                                          r"\(did you mean zero_optimization\?\)"),
    ({"gradient_cliping": 1.0}, r"ds.json: gradient_cliping: unknown DeepSpeed config key \(did you mean "
                                r"gradient_clipping\?\)"),
    ({"foo_bar_baz": 1}, r"ds.json: foo_bar_baz: unknown DeepSpeed config key$"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}},
     r"ds.json: optimizer: not allowed here: the engine builds its own AdamW .* optim.lr, optim.betas, optim.eps"),
    ({"scheduler": {"type": "WarmupLR"}},
     r"ds.json: scheduler: not allowed here: .* optim.warmup_steps, optim.schedule_steps and optim.min_lr_ratio"),
    ({"bfloat16": {"enabled": True}}, r"ds.json: bfloat16: not allowed here: the old name of bf16"),
    ({"elasticity": {"enabled": True}}, r"ds.json: elasticity: removed from DeepSpeed"),
    ({"zero_optimization": {"stage": 2, "overlap_com": True}},
     r"ds.json: zero_optimization.overlap_com: unknown ZeRO config key \(did you mean overlap_comm\?\)"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"devcie": "cpu"}}},
     r"ds.json: zero_optimization.offload_param.devcie: unknown config key \(did you mean device\?\)"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": "cpu"}},
     r"ds.json: zero_optimization.offload_optimizer: expected an object, got \"cpu\""),
    ({"zero_optimization": {"stage": 1, "mics_shard_size": 2}}, r"zero_optimization.mics_shard_size: removed"),
    ({"zero_optimization": {"stage": True}}, r"ds.json: zero_optimization.stage: must be 0, 1, 2 or 3, got true"),
    ({"zero_optimization": {"stage": 4}}, r"ds.json: zero_optimization.stage: must be 0, 1, 2 or 3, got 4"),
    ({"zero_optimization": {"stage": "2"}}, r"zero_optimization.stage: must be 0, 1, 2 or 3, got \"2\""),
    ({"zero_optimization": {"stage": 2.0}}, r"zero_optimization.stage: must be 0, 1, 2 or 3, got 2.0"),
    ({"zero_optimization": True}, r"ds.json: zero_optimization: expected an object, got true"),
    ({"fp16": True}, r"ds.json: fp16: expected an object, got true"),
    ([{"zero_optimization": {"stage": 1}}], r"ds.json: top level must be an object"),
], ids=["top-typo", "clip-typo", "unknown", "optimizer", "scheduler", "bfloat16", "removed", "zero-typo",
        "offload-typo", "offload-not-object", "zero-removed", "stage-true", "stage-4", "stage-str", "stage-float",
        "zero-bool", "fp16-bool", "list"])
def test_bad_ds_configs_are_refused_naming_file_and_key(tmp_path, raw, match):
    path = _write(tmp_path, raw)
    with pytest.raises(ConfigError, match=match) as e:
        load_ds_config(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text, match", [
    ('{\n  "zero_optimization": {\n    "stage": 2,\n    "stage": 3\n  }\n}',
     r"ds.json: zero_optimization.stage: duplicate key \(in the object opened at line 2\)"),
    ('{"steps_per_print": 1,\n "steps_per_print": 2}', r"ds.json: steps_per_print: duplicate key \(in the object "
                                                        r"opened at line 1\)"),
    ('{"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "device": "nvme"}}}',
     r"ds.json: zero_optimization.offload_param.device: duplicate key"),
    ('{"gradient_clipping": NaN}', r"ds.json: gradient_clipping: expected a finite number, got nan"),
    ('{"zero_optimization": {"stage": 2, "reduce_bucket_size": 1e999}}',
     r"ds.json: zero_optimization.reduce_bucket_size: expected a finite number, got inf"),
    ('{"zero_optimization": {"stage": 2},,}', r"ds.json:1:36: invalid JSON: Expecting property name"),
    ('{\n  "zero_optimization": {"stage": 2}\n  "steps_per_print": 1\n}', r"ds.json:3:3: invalid JSON: Expecting ','"),
    ("", r"ds.json:1:1: invalid JSON: Expecting value"),
])
def test_bad_json_is_one_line_with_key_or_line(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_ds_config(_write(tmp_path, text))
    assert "\n" not in str(e.value)


def test_missing_and_binary_files(tmp_path):
    with pytest.raises(ConfigError, match=r"nope.json: ds_config file not found"):
        load_ds_config(str(tmp_path / "nope.json"))
    f = tmp_path / "bin.json"
    f.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ConfigError, match=r"bin.json: not UTF-8 text"):
        load_ds_config(str(f))


def test_known_deepspeed_keys_load():
    """Keys DeepSpeed reads, its ZeRO field aliases and nested offload keys all pass."""
    raw = {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 10, "overlap_comm": False,
                                 "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                 "offload_param": None},
           "bf16": {"enabled": "auto"}, "wall_clock_breakdown": False, "communication_data_type": "fp32",
           "activation_checkpointing": {}, "flops_profiler": {"enabled": False}, "tensorboard": {"enabled": False},
           "sequence_parallel_size": 1}
    assert check_ds_config(raw, "x.json") is raw


def test_stored_key_tables_match_the_installed_deepspeed():
    """The tables in pipeline/ds_config.py are what DeepSpeed itself reads (regenerate: python -m pipeline.ds_config)."""
    live = ds_config.read_deepspeed_keys()
    if live["version"] != ds_config.DEEPSPEED_VERSION:
        assert ds_config.known_keys() == live  # another DeepSpeed: the live tables are used
        pytest.skip(f"tables stored for deepspeed {ds_config.DEEPSPEED_VERSION}, installed {live['version']}")
    assert ds_config._stored_tables() == live
    assert {"zero_optimization", "optimizer", "scheduler", "bf16", "train_batch_size"} <= live["top"]
    assert "zero_optimisation" not in live["top"] and "stage" in live["zero"]
    assert not set(ds_config.ENGINE_OWNED) - live["top"]  # refused on purpose, though DeepSpeed knows them


def test_loading_does_not_import_deepspeed():
    """Config errors must surface without DeepSpeed's start-up cost (the stored tables serve the pinned version)."""
    code = ("import sys; from pipeline.ds_config import load_ds_config; load_ds_config('ds_configs/zero3.json'); "
            "assert 'deepspeed' not in sys.modules, 'deepspeed imported'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_resolve_fills_and_checks_against_the_run_config():
    cfg = load_config(None, ["train.micro_batch_size=8", "train.grad_accum_steps=2", "optim.grad_clip=0.5"])
    ds = resolve_ds_config({"zero_optimization": {"stage": 2}}, cfg, 2, "x.json", cuda=False)
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == \
        (8, 2, 32)
    assert ds["gradient_clipping"] == 0.5 and ds["bf16"] == {"enabled": False} and ds["steps_per_print"] == 10**9
    with pytest.raises(ConfigError, match=r"x.json: train_batch_size is 64 but the run config gives 32 "
                                          r"\(train.micro_batch_size 8 x train.grad_accum_steps 2 x world size 2"):
        resolve_ds_config({"train_batch_size": 64}, cfg, 2, "x.json", cuda=False)
    with pytest.raises(ConfigError, match=r"x.json: gradient_clipping is 1.0 but the run config gives 0.5"):
        resolve_ds_config({"gradient_clipping": 1.0}, cfg, 2, "x.json", cuda=False)
    one = load_config(None, ["train.micro_batch_size=1", "train.grad_accum_steps=1"])
    with pytest.raises(ConfigError, match=r"x.json: train_batch_size is true but the run config gives 1"):
        resolve_ds_config({"train_batch_size": True}, one, 1, "x.json", cuda=False)
    assert resolve_ds_config({"train_batch_size": 1}, one, 1, "x.json", cuda=False)["train_batch_size"] == 1


def test_resolve_precision():
    cfg = load_config(None)
    with pytest.raises(ConfigError, match=r"x.json: fp16.enabled is true but train.precision resolves to fp32"):
        resolve_ds_config({"fp16": {"enabled": True}}, cfg, 1, "x.json", cuda=False)
    with pytest.raises(ConfigError, match=r"x.json: bf16.enabled is true but train.precision resolves to fp32"):
        resolve_ds_config({"bf16": {"enabled": True}}, cfg, 1, "x.json", cuda=False)
    ds = resolve_ds_config({"bf16": {"enabled": "auto", "immediate_grad_update": True}}, cfg, 1, "x.json", cuda=True)
    assert ds["bf16"] == {"enabled": True, "immediate_grad_update": True}
    fp32 = load_config(None, ["train.precision=fp32"])
    assert resolve_ds_config({}, fp32, 1, "x.json", cuda=True)["bf16"]["enabled"] is False
