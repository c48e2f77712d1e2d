"""MLflow tracking of training runs, in parts: the tracker that rank 0's training loop logs through
(:mod:`pipeline.tracking.tracker`, whose docstring holds the design), its journal (:mod:`~pipeline.tracking.journal`),
the store and its HTTP bounds (:mod:`~pipeline.tracking.store`), the replay of metrics.jsonl into a store that missed
steps (:mod:`~pipeline.tracking.replay`, also tools/mlflow_sync.py) and the runs evaluation nests under a training run
(:mod:`~pipeline.tracking.eval_runs`, launchers/evaluate.py)."""
