"""Evaluation runs: the metrics of one evaluation (task x data set) go to a run nested under the checkpoint's training
run, in the training run's store (launchers/evaluate.py)."""
from __future__ import annotations

import os
from pathlib import Path

from pipeline.tracking.store import BATCH_METRICS, tracking_uri


def mlflow_target(trained) -> tuple[str | None, str | None]:
    """(run id, tracking URI) of the checkpoint's training run; None where it cannot be reached: no run id, or no
    store configured and no ``mlflow.db`` in the checkpoint's run directory."""
    run_id = os.environ.get("MLFLOW_RUN_ID") or trained.client_state.get("mlflow_run_id")
    uri = tracking_uri(trained.cfg, trained.tag_dir.parent.parent, existing=True)
    return (run_id, uri) if run_id and uri else (None, None)


def start_eval_run(client, parent_id: str, trained, task: str, data: Path) -> str:
    """A run nested under the training run ``parent_id`` for one evaluation (task x data set), tagged with what was
    evaluated: two data sets evaluated on one training run get two runs, whose metrics and plots stay apart."""
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

    parent = client.get_run(parent_id)
    name = f"eval {task} {data.name}"
    tags = {MLFLOW_PARENT_RUN_ID: parent_id, MLFLOW_RUN_NAME: name, "eval.task": task,
            "eval.data": str(data.resolve()), "eval.checkpoint": str(trained.tag_dir),
            "eval.step": str(int(trained.client_state.get("step", 0)))}
    return client.create_run(parent.info.experiment_id, tags=tags, run_name=name).info.run_id


def log_metric_batches(client, run_id: str, metrics: list):
    """``metrics`` (mlflow.entities.Metric) in order, in as few log_batch calls as MLflow's limit allows."""
    for b in range(0, len(metrics), BATCH_METRICS):
        client.log_batch(run_id, metrics=metrics[b:b + BATCH_METRICS])
