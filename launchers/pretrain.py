#!/usr/bin/env python
r"""Pretraining entry point.

    deepspeed --num_gpus 2 launchers/pretrain.py --ds_config ds_configs/zero2.json \
        [--config launchers/configs/NAME.yaml | NAME] [--set key.path=value ...] [--resume auto|never|CHECKPOINT_DIR]
        [--init-from CHECKPOINT_OR_EXPORT] [--allow-config-change] [--allow-data-change]
        [--trust-checkpoint]
        [--dry-run [--world-size N --nproc-per-node M]]

Several nodes: the same arguments under `deepspeed --hostfile`, torchrun or SLURM (launchers/slurm/pretrain.sbatch);
docs/multinode.md.

Without --config it trains the small Eco-RNA demo on the sample shards that scripts/quickstart.sh builds.
--resume continues this same run; --init-from starts a new run (own run_dir, step 0, own schedule, new MLflow run
tagged with its parent) from another run's checkpoint or an export, e.g. Stage B from Stage A.

--dry-run resolves everything and starts nothing (no process group, no DeepSpeed engine, nothing written, not even
the run directory): it prints the world size and its nodes, the batch arithmetic, the budget, what the run would
resume from, the resolved ds_config, the expert-parallel layout, and for every rank its loader streams and the shards
each reads in epoch 0. It goes through the training's own checks, so what would fail at start fails here, with the
same line and exit 2. Under a launcher only rank 0 prints (the others exit 0); from a login node,
`python launchers/pretrain.py --dry-run --world-size 64 --nproc-per-node 8 ...` plans 8 nodes of 8 ranks (flags
override the launcher's WORLD_SIZE and LOCAL_WORLD_SIZE / LOCAL_SIZE).

Exit status: 0 when the run finished, reached its budget, or stopped on SIGTERM/SIGUSR1 or train.max_hours (after
writing a checkpoint, or, when the step outlasts the stop request by 2 s, abandoning that step unsaved); 2 for a bad
input (config, ds_config, data, checkpoint); 3 when training diverged (train.max_nonfinite_steps); 1 for anything
else. Every rank's output also goes to RUN_DIR/train.log.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DEFAULT_CONFIG = REPO / "launchers" / "configs" / "eco_rna_demo.yaml"


def parse_args(argv=None, parser: argparse.ArgumentParser | None = None):
    p = parser or build_parser()
    args = p.parse_args(argv)
    if not args.dry_run and (args.world_size is not None or args.nproc_per_node is not None):
        p.error("--world-size and --nproc-per-node plan a run: they go with --dry-run (a training takes its world "
                "size from the launcher)")
    return args


def build_parser(description: str = __doc__, config_help: str | None = None) -> argparse.ArgumentParser:
    """The training command line (``config_help``: a --config that is required, with this help, as
    launchers/finetune.py has it)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ds_config", "--ds-config", dest="ds_config", required=True,
                   help="DeepSpeed JSON config (ds_configs/zero{1,2,3}.json)")
    if config_help is None:
        p.add_argument("--config", default=str(DEFAULT_CONFIG),
                       help="run config YAML, or the name of one in launchers/configs (eco_rna_80m) as the tools take "
                            "it (default: the Eco-RNA demo)")
    else:
        p.add_argument("--config", required=True, help=config_help)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.max_steps=200 (repeatable)")
    p.add_argument("--resume", default="auto",
                   help="auto: continue from RUN_DIR/checkpoints/latest (or the newest complete checkpoint) if any; "
                        "never: start fresh; or a checkpoint tag directory of this run (a rollback)")
    p.add_argument("--init-from", dest="init_from", default=None, metavar="DIR",
                   help="start a new run from another run's weights: a run dir, checkpoint tag dir or export "
                        "(sets train.init_from; train.init_from_optimizer: true also loads the AdamW moments)")
    p.add_argument("--allow-config-change", action="store_true",
                   help="resume even though the config differs from the checkpoint's beyond budgets, cadences, tracking and "
                        "validation (the optimizer, objective, seed, batch or data spec; never the model); each "
                        "change is written to train.log")
    p.add_argument("--allow-data-change", dest="allow_data_change", action="store_true",
                   help="resume although the shard directories were rebuilt since the checkpoint (their manifests "
                        "differ): the loader starts the new data from its beginning")
    p.add_argument("--trust-checkpoint", dest="trust_checkpoint", action="store_true",
                   help="resume or start from a DeepSpeed checkpoint whose files need more than tensors and "
                        "DeepSpeed's own classes, with torch.load(weights_only=False), which runs any code they "
                        "hold; checkpoints this pipeline writes need nothing (read with weights_only=True)")
    p.add_argument("--dry-run", dest="dry_run", action="store_true",
                   help="resolve and check everything, print the plan (world, batch, resume, ds_config, data per "
                        "rank) and start nothing; writes nothing")
    p.add_argument("--world-size", dest="world_size", type=_positive, default=None, metavar="N",
                   help="with --dry-run: plan for N ranks (default: WORLD_SIZE from the launcher, else 1)")
    p.add_argument("--nproc-per-node", dest="nproc_per_node", type=_positive, default=None, metavar="M",
                   help="with --dry-run: M ranks per node (default: LOCAL_WORLD_SIZE or LOCAL_SIZE from the launcher, "
                        "else all ranks on one node)")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    return p


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def planned_world(world_size: int | None, nproc_per_node: int | None, env=os.environ) -> tuple[int, int, str]:
    """(world size, ranks per node, where they came from) for --dry-run: the flags, else what a launcher set
    (WORLD_SIZE; LOCAL_WORLD_SIZE from torchrun or these launchers' srun mapping, LOCAL_SIZE from DeepSpeed's),
    else one rank; without a per-node count every rank is on one node."""
    env_local = env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE")
    world = world_size or int(env.get("WORLD_SIZE") or 0) or nproc_per_node or 1
    local = nproc_per_node or (int(env_local) if env_local and world_size is None else world)
    flags = [f for f, v in (("--world-size", world_size), ("--nproc-per-node", nproc_per_node)) if v is not None]
    if not flags and "WORLD_SIZE" not in env:
        return world, local, "no launcher: one rank"
    return world, local, ", ".join(flags) if flags else "from the launcher's environment"


def run_config(config: str, overrides: list[str]):
    """The run config of --config (a path, or a name of launchers/configs) with --set overrides applied."""
    from pipeline.config import load_config
    from pipeline.config_files import resolve_config

    return load_config(resolve_config(config), overrides)


def main(argv=None, *, parse=None, load=None) -> int:
    """The training command; launchers/finetune.py is this with its own ``parse`` (command line) and ``load`` (how
    --config and --set become the run config: the backbone's sections from the checkpoint it starts from)."""
    rank = int(os.environ.get("RANK", "0"))
    from pipeline import run_log

    run_log.install(rank)  # before DeepSpeed's loggers capture the streams: everything reaches train.log
    from pipeline.distributed import name_cpu_accelerator

    name_cpu_accelerator()  # before DeepSpeed is imported: no "Setting accelerator to CPU" line per rank on CPU
    args = (parse or parse_args)(argv)
    if args.dry_run and rank != 0:
        return 0  # under a launcher rank 0 alone plans, for every rank; the others would print the same
    from pipeline.config import ConfigError
    from pipeline.data.shards import ShardError

    try:
        # --init-from is train.init_from (validated with the rest); JSON quoting keeps any path a YAML string.
        extra = [f"train.init_from={json.dumps(args.init_from)}"] if args.init_from is not None else []
        cfg = (load or run_config)(args.config, [*args.overrides, *extra])
        from pipeline import train

        if args.dry_run:
            world, local, origin = planned_world(args.world_size, args.nproc_per_node)
            print(train.dry_run(cfg, args.ds_config, args.resume, args.allow_config_change, world, local, origin,
                                trust_checkpoint=args.trust_checkpoint, allow_data_change=args.allow_data_change),
                  flush=True)
            return 0
        train.run(cfg, args.ds_config, args.resume, args.allow_config_change, trust_checkpoint=args.trust_checkpoint,
                  allow_data_change=args.allow_data_change)
    except (ConfigError, ShardError, FileNotFoundError) as e:
        run_log.report_fatal(rank, str(e), rank_specific=_distributed())
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the stop handlers are installed, or a second one during a step
        run_log.report_fatal(rank, "interrupted (Ctrl-C): the step in progress is not saved; the same command "
                                   "resumes from the last complete checkpoint", rank_specific=False)
        return 130
    except Exception as e:  # noqa: BLE001 - every rank's fatal error reaches the console, one line each
        from pipeline.data.loader import WorkerDied
        from pipeline.train import CheckpointWriteError, LoaderFailed, PeerLost, TrainingStopped

        # their line says what happened and what to do
        explained = isinstance(e, (CheckpointWriteError, TrainingStopped, PeerLost, LoaderFailed, WorkerDied))
        if not explained:
            traceback.print_exc()  # a bug: the stack matters
        message = str(e) if explained else f"{type(e).__name__}: {e}"
        run_log.report_fatal(rank, message.strip().splitlines()[0] if message.strip() else type(e).__name__,
                             rank_specific=True)
        return 3 if isinstance(e, TrainingStopped) else 1
    return 0


def _distributed() -> bool:
    """Whether the ranks had started working together (their errors may differ) when the error was raised."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


if __name__ == "__main__":
    faulthandler.enable(all_threads=True)  # a fatal signal (SIGSEGV, SIGABRT) prints every thread's Python stack
    code = main()
    if code != 0:
        sys.exit(code)  # a failed rank exits normally: its error line must get out (pipeline.distributed.exit_process)
    from pipeline.train import exit_process

    exit_process(0)
