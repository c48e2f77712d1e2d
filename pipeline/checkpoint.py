"""Finding and loading trained weights: evaluation, export, and the engine's ``--init-from``.

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


def is_export(tag_dir: Path) -> bool:
    return (tag_dir / EXPORTED_WEIGHTS).is_file()


def read_client_state(tag_dir: Path) -> dict:
    """A DeepSpeed checkpoint's client_state.json (step, world size, MLflow run, ...); {} for an export, whose
    export.json holds the same provenance."""
    f = tag_dir / ("export.json" if is_export(tag_dir) else "client_state.json")
    return json.loads(f.read_text()) if f.is_file() else {}


def check_same_model(saved: dict, cfg: RunConfig, source: Path):
    """ConfigError unless ``saved`` (a checkpoint's config as a dict) has this run's family and model layout.

    Every model field but the kernel choices fixes the parameter layout; the first differing key is named.
    """
    kernels = ("attn_backend", "moe_backend")
    ours = {k: v for k, v in cfg.to_dict()["model"].items() if k not in kernels}
    diff = [k for k, v in ours.items() if saved["model"].get(k) != v]
    if saved.get("family") != cfg.family:
        raise ConfigError(f"family: {cfg.family} differs from {saved.get('family')} of checkpoint {source}")
    if diff:
        raise ConfigError(f"model.{diff[0]}: {ours[diff[0]]!r} differs from {saved['model'].get(diff[0])!r} "
                          f"of checkpoint {source}")


def load_state_dict(tag_dir: Path) -> dict[str, torch.Tensor]:
    """The full fp32 state dict of an export or of a ZeRO stage 1-3 checkpoint, whatever world size wrote it."""
    if is_export(tag_dir):
        from safetensors.torch import load_file

        return load_file(str(tag_dir / EXPORTED_WEIGHTS))
    if not torch.cuda.is_available():  # no device work here; spare the user DeepSpeed's "no GPU found" warning
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(sys.stderr):  # it reports progress on stdout; keep stdout for results
        return get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)


def load_weights_into(model: torch.nn.Module, state: dict, source: Path):
    """``model.load_state_dict(state)`` that names the first missing and unexpected keys in one ConfigError."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConfigError(f"{source}: weights do not fit the config (missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]})")


def load_trained_model(path: str | Path) -> TrainedModel:
    tag_dir = resolve_tag_dir(path)
    cfg = build_config(load_yaml(tag_dir / "config.yaml"))
    model = get_family(cfg.family).build_model(cfg.model)
    load_weights_into(model, load_state_dict(tag_dir), tag_dir)
    model.eval()
    return TrainedModel(cfg, model, tag_dir, {} if is_export(tag_dir) else read_client_state(tag_dir))


def load_hf_directory(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json as a dict, state dict) of a local Hugging Face model directory, e.g. facebook/esm2_t30_150M_UR50D
    saved with ``save_pretrained`` or cloned from the hub: ``model.safetensors`` (or its sharded index), else
    ``pytorch_model.bin`` read with ``weights_only=True``."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ConfigError(f"{p}: not a Hugging Face model directory (no config.json)")
    hf_config = json.loads((p / "config.json").read_text())
    from safetensors.torch import load_file

    if (p / "model.safetensors").is_file():
        return hf_config, load_file(str(p / "model.safetensors"))
    index = p / "model.safetensors.index.json"
    if index.is_file():
        state = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            state.update(load_file(str(p / shard)))
        return hf_config, state
    if (p / "pytorch_model.bin").is_file():
        return hf_config, torch.load(p / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ConfigError(f"{p}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")
