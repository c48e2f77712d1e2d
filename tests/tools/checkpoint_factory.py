"""Tiny checkpoint directories for the evaluate / convert tests, built in-process in milliseconds (no training):
an export (model.safetensors + config.yaml of a tiny model), and a DeepSpeed-like tag dir (config.yaml,
client_state.json, ``latest``) whose model-state file is a crafted pickle that creates a marker file when unpickled,
or bytes that are no checkpoint at all."""
from __future__ import annotations

import json
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "launchers" / "configs"

TINY_MODELS = {
    "eco_rna": ("eco_rna_demo.yaml", ["model.d_model=16", "model.n_heads=2", "model.n_kv_heads=1", "model.d_ff=32"]),
    "recursive_gpt": ("recursive_gpt_demo.yaml", ["model.vocab_size=320", "model.d_model=16", "model.embed_dim=8",
                                                  "model.n_heads=2", "model.recurrence=2"]),
}


def tiny_config(tmp: Path, family: str = "eco_rna"):
    """A tiny RunConfig of ``family`` whose run dir and training shards are under ``tmp`` (the shards do not
    exist)."""
    from pipeline.config import load_config

    name, overrides = TINY_MODELS[family]
    return load_config(CONFIGS / name, [*overrides, f"run_dir={tmp / 'run'}",
                                        f"data.train_shards={tmp / 'no_shards'}"])


def write_export(directory: Path, cfg, seed: int = 0) -> Path:
    """``directory`` holding model.safetensors + config.yaml of a freshly built ``cfg`` model."""
    from safetensors.torch import save_file

    from pipeline.config import dump_yaml
    from pipeline.families import get_family

    directory.mkdir(parents=True)
    torch.manual_seed(seed)
    save_file(get_family(cfg.family).build_model(cfg.model).state_dict(), str(directory / "model.safetensors"))
    (directory / "config.yaml").write_text(dump_yaml(cfg))
    return directory


class Payload:
    """Unpickling this runs ``open(marker, 'w').close()``: what a crafted checkpoint could do with os.system."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def write_deepspeed_like(run_dir: Path, cfg, marker: Path | None = None, step: int = 3) -> Path:
    """A run dir whose ``checkpoints/latest`` names a tag dir that looks like a DeepSpeed checkpoint; its
    mp_rank_00_model_states.pt is a torch.save'd dict holding a :class:`Payload` for ``marker``, or (without a
    marker) bytes that no loader can read. Returns the tag dir."""
    from pipeline.config import dump_yaml

    tag = run_dir / "checkpoints" / f"step{step:08d}"
    tag.mkdir(parents=True)
    (tag / "config.yaml").write_text(dump_yaml(cfg))
    (tag / "client_state.json").write_text(json.dumps({"step": step, "world_size": 1}))
    (tag.parent / "latest").write_text(tag.name)
    states = tag / "mp_rank_00_model_states.pt"
    if marker is not None:
        torch.save({"module": Payload(marker), "buffer_names": []}, states)
    else:
        states.write_bytes(b"PK\x03\x04 this is not a checkpoint" * 4)
    return tag
