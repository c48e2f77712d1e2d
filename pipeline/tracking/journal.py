"""The tracking journal (``RUN_DIR/tracking_state.json``, pipeline/tracking/tracker.py's docstring, "Journal"): the run
key, the run id per store, the params of the first start and what was confirmed sent; and the run-key form of a
run id (``pending:<run key>``) that checkpoints hold until the run exists in the store."""
from __future__ import annotations

import json
import uuid
from pathlib import Path

from pipeline.outputs import write_atomic
from pipeline.tracking.store import _short, _warn

STATE_FILE = "tracking_state.json"
PENDING = "pending:"


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_params(cfg_dict: dict) -> dict:
    """The flattened config as MLflow params (strings)."""
    return {k: str(v) for k, v in _flatten(cfg_dict).items()}


def state_path(run_dir: Path) -> Path:
    return Path(run_dir) / STATE_FILE


def read_state(run_dir: Path) -> dict | None:
    p = state_path(run_dir)
    if not p.is_file():
        return None
    try:
        state = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        _warn(f"{p}: unreadable ({_short(e)}); starting a new journal")
        return None
    return state if isinstance(state, dict) and state.get("run_key") else None


def write_state(run_dir: Path, state: dict):
    write_atomic(state_path(run_dir), json.dumps(state, indent=1, sort_keys=True))


def new_state(run_key: str | None = None) -> dict:
    return {"version": 1, "run_key": run_key or uuid.uuid4().hex, "uri": None, "runs": {}, "params": {}, "tags": {},
            "experiment": None, "artifact_location": None, "run_name": None, "confirmed_step": {},
            "probe_keys": ["loss"], "artifacts": {}, "status": "RUNNING", "status_sent": {}, "anchors": []}


def resolve_run_id(run_dir: Path, run_id: str | None, uri: str | None = None) -> str | None:
    """The real MLflow run id for a checkpoint's ``mlflow_run_id`` (which may be ``pending:<run key>``), from the
    run directory's journal; None while the run has not been created in that store (run tools/mlflow_sync.py)."""
    if not run_id or not run_id.startswith(PENDING):
        return run_id
    state = read_state(run_dir)
    if not state or state.get("run_key") != run_id[len(PENDING):]:
        return None
    runs = state.get("runs", {})
    return runs.get(uri or state.get("uri")) or (next(iter(runs.values())) if uri is None and runs else None)


def probe_key(metrics: dict) -> str:
    return "loss" if "loss" in metrics else min(metrics)
