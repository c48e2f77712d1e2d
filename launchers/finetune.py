#!/usr/bin/env python
r"""Supervised adaptation entry point: a pretrained Eco-RNA and a task head, trained on the pretraining's engine.

    deepspeed --num_gpus 8 launchers/finetune.py --ds_config ds_configs/zero2.json \
        --config launchers/configs/finetune_nrc_demo.yaml --init-from runs/eco_rna_demo [--set key.path=value ...]
        [--resume auto|never|CHECKPOINT_DIR] [--dry-run]

This is launchers/pretrain.py (the same DeepSpeed engine, checkpoints and exact resume, MLflow run, console, --dry-run
and exit codes; docs/training.md) with a run config whose ``task:`` section names the task (pipeline/tasks: nrc, ssp,
reactivity) and its head. The command is the same on one CPU and on 8 GPUs. What this launcher adds: the task config
need not repeat the backbone. When it has no ``model:`` section, the family, ``model:``, ``objective:`` (the depth
law the backbone trains at) and ``data.molecule`` / ``data.context_length`` come from the checkpoint it starts from
(--init-from, or train.init_from), or, once the run has checkpoints of its own, from its latest; anything the task
config gives wins. The head starts from the run's seed, the backbone from the checkpoint's weights (or an earlier
adaptation to the same task: head too). docs/adaptation.md has the tasks, their data (tools/prepare_task.py), the
depth setting and the sweeps.
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from launchers import pretrain  # noqa: E402

# What a task config takes from the checkpoint it starts from when it has no model: section.
BACKBONE_DATA = ("molecule", "context_length")


def build_parser():
    return pretrain.build_parser(__doc__, config_help="the task's run config YAML (with a task: section), or the "
                                                      "name of one in launchers/configs (finetune_nrc_demo)")


def parse_args(argv=None):
    return pretrain.parse_args(argv, build_parser())


def backbone_source(raw: dict) -> Path | None:
    """The checkpoint or export whose config holds the backbone: the run's latest checkpoint once it has one, else
    train.init_from (None when neither)."""
    from pipeline.checkpoint.layout import resume_tag

    run_dir = Path(raw.get("run_dir") or "runs/eco_rna_demo")
    if (run_dir / "checkpoints").is_dir():
        tag, _ = resume_tag(run_dir / "checkpoints")
        if tag:
            return run_dir / "checkpoints" / tag
    source = (raw.get("train") or {}).get("init_from")
    return Path(source) if source else None


def task_config(config: str, overrides: list[str]):
    """The run config of a task YAML and --set: the backbone's sections from its source (module docstring)."""
    from pipeline.config import ConfigError, build_config
    from pipeline.config_files import _merge, apply_overrides, load_yaml, resolve_config

    path = resolve_config(config)
    raw = apply_overrides(load_yaml(path), list(overrides))
    if raw.get("task") is None:
        raise ConfigError(f"{path}: task: missing (a fine-tuning config names its task; launchers/pretrain.py "
                          "trains without one)")
    if "model" not in raw:
        source = backbone_source(raw)
        if source is None:
            raise ConfigError(f"{path}: no model: section and nothing to take it from: pass --init-from (a "
                              "pretraining run, checkpoint or export)")
        from pipeline.checkpoint.read import resolve_tag_dir

        try:
            src_cfg = load_yaml(resolve_tag_dir(source) / "config.yaml")
        except (ConfigError, FileNotFoundError) as e:
            raise ConfigError(f"train.init_from: {e}") from None
        base = {k: src_cfg[k] for k in ("family", "model", "objective") if k in src_cfg}
        base["data"] = {k: src_cfg.get("data", {})[k] for k in BACKBONE_DATA if k in src_cfg.get("data", {})}
        raw = _merge(base, raw)
    try:
        return build_config(raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def main(argv=None) -> int:
    return pretrain.main(argv, parse=parse_args, load=task_config)


if __name__ == "__main__":
    import faulthandler

    faulthandler.enable(all_threads=True)
    code = main()
    if code != 0:
        sys.exit(code)
    from pipeline.train import exit_process

    exit_process(0)
