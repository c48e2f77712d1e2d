"""Training: RunPlan (resolve and check, nothing started), Trainer (setup, fit) and its callbacks, the step, the
optimizer groups and lr schedule, stop requests, and the dry run. docs/architecture.md draws the whole."""
from pipeline.checkpoint.io import CheckpointWriteError
from pipeline.distributed import exit_process, init_distributed, shutdown_distributed
from pipeline.train.callbacks import Callback
from pipeline.train.dry_run import dry_run
from pipeline.train.optim import lr_factor, lr_lambda, param_groups, schedule_horizon
from pipeline.train.plan import RunPlan
from pipeline.train.step import train_step
from pipeline.train.stop import LoaderFailed, PeerLost, TrainingStopped
from pipeline.train.trainer import Trainer, run

__all__ = ["Callback", "CheckpointWriteError", "LoaderFailed", "PeerLost", "RunPlan", "Trainer", "TrainingStopped",
           "dry_run", "exit_process", "init_distributed", "lr_factor", "lr_lambda", "param_groups", "run",
           "schedule_horizon", "shutdown_distributed", "train_step"]
