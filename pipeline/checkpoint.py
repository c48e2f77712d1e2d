"""Finding and loading trained weights outside the training engine (evaluation, export).

A checkpoint argument may name a run directory, its ``checkpoints/`` directory (the ``latest`` tag is used), a tag
directory ``checkpoints/stepNNNNNNNN``, or an exported directory (``model.safetensors`` + ``config.yaml``).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.config import ConfigError, RunConfig, build_config, load_yaml
from pipeline.families import get_family

EXPORTED_WEIGHTS = "model.safetensors"


@dataclass
class TrainedModel:
    cfg: RunConfig
    model: torch.nn.Module
    tag_dir: Path  # the checkpoint it came from
    client_state: dict  # step, mlflow_run_id, ... ({} for an export)


LATEST = "latest"  # RUN_DIR/checkpoints/latest names the newest complete checkpoint (written by the engine)


def latest_tag(ckpt_dir: Path) -> str | None:
    f = ckpt_dir / LATEST
    return f.read_text().strip() if f.is_file() else None


def resolve_tag_dir(path: str | Path) -> Path:
    p = Path(path)
    if (p / EXPORTED_WEIGHTS).is_file() or (p / "client_state.json").is_file():
        return p
    for ckpts in (p, p / "checkpoints"):
        tag = latest_tag(ckpts)
        if tag:
            return ckpts / tag
    raise ConfigError(f"{path}: not a checkpoint (no latest, client_state.json or {EXPORTED_WEIGHTS})")


def load_trained_model(path: str | Path) -> TrainedModel:
    tag_dir = resolve_tag_dir(path)
    cfg = build_config(load_yaml(tag_dir / "config.yaml"))
    model = get_family(cfg.family).build_model(cfg.model)
    if (tag_dir / EXPORTED_WEIGHTS).is_file():
        from safetensors.torch import load_file

        state, client = load_file(str(tag_dir / EXPORTED_WEIGHTS)), {}
    else:
        if not torch.cuda.is_available():  # no device work here; spare the user DeepSpeed's "no GPU found" warning
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with contextlib.redirect_stdout(sys.stderr):  # it reports progress on stdout; keep stdout for results
            state = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
        client = json.loads((tag_dir / "client_state.json").read_text())
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConfigError(f"{tag_dir}: weights do not fit the config (missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]})")
    model.eval()
    return TrainedModel(cfg, model, tag_dir, client)
