"""The MLflow store as the tracker's worker, tools/mlflow_sync.py and evaluation runs use it (call Store's methods
from a thread that called :func:`bounded_http`): which store a run logs to (:func:`tracking_uri`), MLflow's HTTP
timeout and retries for one thread only, and the store operations (:class:`Store`). The design is in
pipeline/tracking/tracker.py's docstring."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

RUN_KEY_TAG = "pipeline.run_key"
# The MLflow 3 UI files an experiment without this tag under GenAI (traces, "Evaluation runs"); tagged as model
# development, its runs are listed as training runs with their metric charts.
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
BATCH_METRICS = 1000  # MLflow's log_batch limit
# Codes of errors a retry cannot fix: drop the item instead of retrying forever.
PERMANENT_CODES = {"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "INVALID_STATE", "RESOURCE_DOES_NOT_EXIST",
                   "RESOURCE_ALREADY_EXISTS"}


STORE_FILE = "mlflow.db"


def default_store(run_dir: Path) -> Path:
    """The sqlite file of a run directory when no store is configured: ``RUN_DIR/mlflow.db`` where it exists (a run
    started before the shared store keeps resuming into its own), else ``mlflow.db`` in the directory that holds the
    run directory (``runs/mlflow.db`` for ``runs/NAME``), so the runs of a checkout share one store and one UI. Beside
    the run directories rather than in the working directory: the same run resolves to the same store from any
    directory, and a test's runs under its tmp_path stay out of the checkout's store."""
    run_dir = Path(run_dir).resolve()
    own = run_dir / STORE_FILE
    return own if own.is_file() else run_dir.parent / STORE_FILE


def tracking_uri(cfg, run_dir: Path, *, existing: bool = False) -> str | None:
    """The run's store: ``MLFLOW_TRACKING_URI``, else ``tracking.tracking_uri``, else the sqlite file of
    :func:`default_store`. ``existing``: None instead of that default when that file does not exist (evaluation logs
    to the training run's store, never makes one)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or cfg.tracking.tracking_uri
    if uri:
        return uri
    db = default_store(run_dir)
    return None if existing and not db.is_file() else f"sqlite:///{db}"


def sqlite_file(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (relative or absolute), None for any other store."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


def artifact_location(uri: str, run_dir: Path) -> str:
    """Where a new experiment keeps its runs' artifacts: ``mlartifacts`` beside a sqlite store's file (a shared store
    must not keep one run's artifacts inside another's run directory), else ``RUN_DIR/mlartifacts``."""
    db = sqlite_file(uri)
    return ((db.resolve().parent if db else Path(run_dir).resolve()) / "mlartifacts").as_uri()


@contextlib.contextmanager
def _creation_lock(uri: str):
    """Held while a process opens a sqlite store: MLflow 3.17's tracking store creates and migrates a new database
    without a lock, and two trainings starting at once on a fresh shared file both fail half-way through its
    migrations (measured: three at once, all failed, the file left unusable). ``DB.lock`` beside the file."""
    db = sqlite_file(uri)
    if db is None:
        yield
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{db}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _warn(msg: str):
    print(f"tracking: {msg}", file=sys.stderr, flush=True)


def _short(e: BaseException) -> str:
    """One short line for an exception; connection failures reduced to their cause."""
    text = " ".join(str(e).split())
    for pattern, say in (("Connection refused", "connection refused"), ("timed out", "timed out"),
                         ("Name or service not known", "unknown host"), ("Temporary failure in name", "unknown host"),
                         ("RemoteDisconnected", "connection closed by the server"),
                         ("Connection reset", "connection reset"), ("Connection aborted", "connection aborted")):
        if pattern in text:
            return say
    return f"{type(e).__name__}: {text[:160]}"


def _code(e: BaseException) -> str | None:
    return getattr(e, "error_code", None)


# ----------------------------------------------------------------------------------------------------------------
# MLflow's HTTP timeout and retries, for one thread only
# ----------------------------------------------------------------------------------------------------------------
_HTTP_VARS = ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
              "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER")
_thread = threading.local()
_install_lock = threading.Lock()


def _install_http_overrides():
    """Wrap the ``get`` of MLflow's HTTP settings so that a thread that called ``bounded_http`` sees its own values.

    MLflow's REST client reads ``MLFLOW_HTTP_REQUEST_TIMEOUT.get()`` etc. on every request (mlflow 3.17,
    ``utils/rest_utils.http_request``); other threads, and the environment, are untouched. If a future mlflow drops one
    of these objects, that setting is simply not overridden (the worker thread still keeps training from waiting).
    """
    from mlflow import environment_variables as ev

    with _install_lock:
        for name in _HTTP_VARS:
            var = getattr(ev, name, None)
            if var is None or getattr(var, "_pipeline_scoped", False):
                continue
            original = var.get

            def get(_original=original, _name=name):
                over = getattr(_thread, "http", None)
                if over and _name in over:
                    return over[_name]
                return _original()

            var.get = get
            var._pipeline_scoped = True


def bounded_http(timeout_s: float, max_retries: int = 0, backoff_factor: float = 0):
    """MLflow HTTP requests made by the calling thread from now on: ``timeout_s`` per connect/read, ``max_retries``."""
    _install_http_overrides()
    _thread.http = {"MLFLOW_HTTP_REQUEST_TIMEOUT": float(timeout_s),
                    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": int(max_retries),
                    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": backoff_factor, "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": 0.0}


# ----------------------------------------------------------------------------------------------------------------
# Store operations
# ----------------------------------------------------------------------------------------------------------------
class NotInStore(Exception):
    pass


class Store:
    def __init__(self, uri: str):
        from mlflow.tracking import MlflowClient

        self.uri = uri
        with _creation_lock(uri):  # MlflowClient opens the store: creates and migrates a new sqlite file
            self.client = MlflowClient(tracking_uri=uri)

    def experiment_id(self, name: str, artifact_location: str | None) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is None:
            try:
                exp_id = self.client.create_experiment(name, artifact_location=artifact_location,
                                                       tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
            except Exception as e:
                if _code(e) != "RESOURCE_ALREADY_EXISTS":
                    raise
                exp = self.client.get_experiment_by_name(name)  # created meanwhile by another job
            else:
                return exp_id
        if EXPERIMENT_KIND_TAG not in exp.tags:  # an experiment made elsewhere: tagged once, a user's kind is kept
            self.client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return exp.experiment_id

    def exists(self, run_id: str) -> bool:
        try:
            self.client.get_run(run_id)
            return True
        except Exception as e:
            if _code(e) == "RESOURCE_DOES_NOT_EXIST":
                return False
            raise

    def find_by_key(self, exp_id: str, run_key: str) -> str | None:
        runs = self.client.search_runs([exp_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}'", max_results=1)
        return runs[0].info.run_id if runs else None

    def attach(self, state: dict, resume_id: str | None = None) -> tuple[str, bool]:
        """(run id, created) for the journal's run in this store: the journal's id for this URI, or ``resume_id``
        (a real id from a checkpoint), or the run tagged with the run key, or a new run with the journal's params.

        Raises NotInStore when ``resume_id`` is a real id this store does not have (pointed at the wrong store)."""
        known = state["runs"].get(self.uri)
        for rid in dict.fromkeys(r for r in (known, resume_id) if r):
            if self.exists(rid):
                return rid, False
        exp_id = self.experiment_id(state["experiment"], state.get("artifact_location"))
        rid = self.find_by_key(exp_id, state["run_key"])
        if rid:
            return rid, False
        if resume_id:
            raise NotInStore(f"tracking.tracking_uri: the checkpoint's MLflow run {resume_id} is not in the store "
                             f"{self.uri}; point tracking.tracking_uri (or MLFLOW_TRACKING_URI) at the store this "
                             "run was started with")
        tags = {**state.get("tags", {}), RUN_KEY_TAG: state["run_key"]}
        run = self.client.create_run(exp_id, run_name=state.get("run_name"), tags=tags)
        return run.info.run_id, True

    def log_params(self, run_id: str, params: dict):
        """The journal's params; re-logging the same value is accepted by MLflow, so this is safe to repeat."""
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow caps a batch at 100 params
            self.client.log_batch(run_id, params=items[i:i + 100])

    def config_tags(self, run_id: str, params_now: dict, at_step: int | None) -> list:
        """Tags ``config.<key>`` for the current config values that differ from the run's (immutable) params."""
        from mlflow.entities import RunTag

        run = self.client.get_run(run_id)
        logged = run.data.params
        changed = [k for k, v in params_now.items() if logged.get(k) != v]
        if not changed:
            return []
        tags = [RunTag(f"config.{k}", str(params_now[k])[:5000]) for k in changed]
        if at_step is not None:
            tags.append(RunTag(f"config.changed_at_step_{at_step}", ",".join(changed)[:5000]))
        for i in range(0, len(tags), 100):
            self.client.log_batch(run_id, tags=tags[i:i + 100])
        return changed

    def high_water(self, run_id: str, keys) -> int:
        """Highest step of the latest values of ``keys`` in the store (-1 if none)."""
        run = self.client.get_run(run_id)
        steps = [m.step for m in run.data.to_proto().metrics if m.key in set(keys)]
        return max(steps, default=-1)

    def present_steps(self, run_id: str, key: str) -> set:
        return {m.step for m in self.client.get_metric_history(run_id, key)}

    def log_dataset(self, run_id: str, entry: dict):
        """One data set as an MLflow dataset input of the run (the run page's Datasets, ``run.inputs``), from a
        journal entry (:meth:`Tracker.log_dataset`): name, source (a directory or URL), digest, context, profile.
        Logging the same one again adds nothing (MLflow keeps one input per name and digest)."""
        from mlflow.data.dataset_source_registry import resolve_dataset_source
        from mlflow.entities import Dataset, DatasetInput, InputTag
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        try:  # a local directory resolves to MLflow's "local" source, an http(s) pattern to "http"
            with warnings.catch_warnings():  # "can be interpreted in multiple ways": two equal local sources
                warnings.simplefilter("ignore", UserWarning)
                source = resolve_dataset_source(entry["source"])
            source_type, source_json = source._get_source_type(), source.to_json()
        except Exception:  # a scheme MLflow has no source for (pipe:, s3: without its extras): named as given
            source_type, source_json = "external", json.dumps({"uri": entry["source"]})
        dataset = Dataset(name=entry["name"], digest=entry["digest"], source_type=source_type, source=source_json,
                          profile=json.dumps(entry.get("profile") or {}))
        self.client.log_inputs(run_id, [DatasetInput(dataset, [InputTag(MLFLOW_DATASET_CONTEXT, entry["context"])])])

    def send(self, run_id: str, records: list, sent: Callable[[int], object] | None = None):
        """records: [(step, ts_ms, {key: value})], in step order; one log_batch per <= 1000 metrics, whole steps.
        ``sent(n)``, if given, after each log_batch that completes n steps (tools/mlflow_sync.py's progress)."""
        from mlflow.entities import Metric

        batch, steps = [], 0  # the steps whose metrics ``batch`` ends
        for step, ts, metrics in records:
            ms = [Metric(k, v, ts, step) for k, v in metrics.items()]
            if batch and len(batch) + len(ms) > BATCH_METRICS:
                self.client.log_batch(run_id, metrics=batch)
                if sent is not None:
                    sent(steps)
                batch, steps = [], 0
            batch.extend(ms)
            while len(batch) > BATCH_METRICS:  # one step with more keys than a batch takes
                self.client.log_batch(run_id, metrics=batch[:BATCH_METRICS])
                batch = batch[BATCH_METRICS:]
            steps += 1
        if batch:
            self.client.log_batch(run_id, metrics=batch)
            if sent is not None:
                sent(steps)
