"""MLflow tracking: one run per training job, created and written by rank 0 only.

The run id is broadcast so every rank knows it, stored in each checkpoint, and a resumed job re-attaches to it.
Default store: ``sqlite:///RUN_DIR/mlflow.db`` with artifacts under ``RUN_DIR/mlartifacts`` (no server needed);
``MLFLOW_TRACKING_URI`` or ``tracking.tracking_uri`` override it.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch.distributed as dist

from pipeline.config import ConfigError


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def broadcast_object(obj, src: int = 0):
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def tracking_uri(cfg, run_dir: Path) -> str:
    return (os.environ.get("MLFLOW_TRACKING_URI") or cfg.tracking.tracking_uri
            or f"sqlite:///{Path(run_dir).resolve()}/mlflow.db")


class Tracker:
    """``tags`` go on a new run (e.g. the parent run and checkpoint of a run started with --init-from)."""

    def __init__(self, cfg, run_dir: Path, rank: int, resume_run_id: str | None, resume_step: int | None,
                 tags: dict | None = None):
        self.rank, self.client, self.run_id = rank, None, None
        self.uri = tracking_uri(cfg, run_dir) if cfg.tracking.enabled else None
        run_id, error = None, None
        if rank == 0 and cfg.tracking.enabled:
            from mlflow.exceptions import MlflowException
            from mlflow.tracking import MlflowClient  # 1.5-3 s to import: rank 0 only

            run_dir = Path(run_dir).resolve()
            self.client = MlflowClient(tracking_uri=self.uri)
            exp = self.client.get_experiment_by_name(cfg.tracking.experiment)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(
                cfg.tracking.experiment, artifact_location=(run_dir / "mlartifacts").as_uri())
            if resume_run_id:
                run_id = resume_run_id
                try:
                    self.client.update_run(run_id, status="RUNNING")
                except MlflowException:
                    error = (f"tracking.tracking_uri: the checkpoint's MLflow run {run_id} is not in the store "
                             f"{self.uri}; point tracking.tracking_uri (or MLFLOW_TRACKING_URI) at the store this "
                             "run was started with")
                if error is None:
                    self.client.set_tag(run_id, f"resumed_at_step_{resume_step}", time.strftime("%Y-%m-%dT%H:%M:%S"))
            else:
                run = self.client.create_run(exp_id, run_name=cfg.tracking.run_name or run_dir.name,
                                             tags=dict(tags or {}))
                run_id = run.info.run_id
                params = {k: str(v) for k, v in _flatten(cfg.to_dict()).items()}
                from mlflow.entities import Param

                items = [Param(k, v) for k, v in params.items()]
                for i in range(0, len(items), 100):  # MLflow caps a batch at 100 params
                    self.client.log_batch(run_id, params=items[i:i + 100])
        # Every rank learns the run id, or the error, so that no rank waits on a peer that has given up.
        self.run_id, error = broadcast_object((run_id, error))
        if error:
            raise ConfigError(error)

    def log_metrics(self, metrics: dict, step: int):
        if self.client is None:
            return
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), ts, step) for k, v in metrics.items()])

    def log_artifact(self, path: str | Path, subdir: str | None = None):
        if self.client is not None:
            self.client.log_artifact(self.run_id, str(path), subdir)

    def finish(self, status: str = "FINISHED"):
        if self.client is not None:
            self.client.set_terminated(self.run_id, status=status)
