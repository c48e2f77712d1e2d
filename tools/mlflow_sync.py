"""python tools/mlflow_sync.py RUN_DIR [--tracking-uri URI] [--all-steps] [--status STATUS] [--timeout S]

Replays into MLflow what a training run's store missed (an outage, a server down at start, a job killed before
it could flush): params, config changes of later resumes (tags ``config.<key>``), the metrics of
RUN_DIR/metrics.jsonl the store does not have, the artifacts and dataset inputs the tracker could not send, and the
final status.
Reads RUN_DIR/tracking_state.json (the tracker's journal, see pipeline/tracking/tracker.py), RUN_DIR/metrics.jsonl and
RUN_DIR/config.yaml; works without the journal too (a run from before it: params from config.yaml, run id from the
latest checkpoint).

The run is the journal's run in that store, else the one tagged ``pipeline.run_key`` with the journal's key, else a
new one (so ``--tracking-uri`` may name another store than the training's). A step is sent only if the store has no
value of its probe key (``loss``) at that step, so running it twice sends nothing the second time. Steps sent are
those the engine logs (every tracking.every-th, train.max_steps and the last), all of them with --all-steps.
Run it when the training is not running (a live tracker sends the same steps itself).

Prints one line (the progress of the steps sent goes to stderr); exit status 0, or 1 with one ``error:`` line
(store unreachable, unreadable run directory).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from pipeline.eval.cli import progress  # noqa: E402
from pipeline.tracking.journal import PENDING, config_params, new_state, read_state, write_state  # noqa: E402
from pipeline.tracking.replay import logged_cadence, read_metrics_jsonl, replay  # noqa: E402
from pipeline.tracking.store import Store, _short, artifact_location, bounded_http, default_store  # noqa: E402


class SyncError(Exception):
    pass


def read_config(run_dir: Path) -> dict:
    p = run_dir / "config.yaml"
    if not p.is_file():
        return {}
    try:
        data = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SyncError(f"{p}: unreadable ({e.__class__.__name__})") from None
    return data if isinstance(data, dict) else {}


def latest_client_state(run_dir: Path) -> dict:
    """The client state of the checkpoint a resume would take (pipeline/checkpoint/layout.py), {} when there is none."""
    from pipeline.config import ConfigError
    from pipeline.checkpoint.layout import read_client, resume_tag

    try:
        tag, _ = resume_tag(run_dir / "checkpoints")
    except ConfigError:  # checkpoints, none complete: no run id to learn from them
        return {}
    return (read_client(run_dir / "checkpoints" / tag) or {}) if tag else {}


def state_for(run_dir: Path, config: dict) -> dict:
    """The journal, or one rebuilt from config.yaml and the latest checkpoint (a run from before journals)."""
    state = read_state(run_dir)
    if state is not None:
        return state
    client = latest_client_state(run_dir)
    rid, uri = client.get("mlflow_run_id"), client.get("mlflow_tracking_uri")
    state = new_state(rid[len(PENDING):] if rid and rid.startswith(PENDING) else None)
    tracking = config.get("tracking") or {}
    state.update(params=config_params(config), experiment=tracking.get("experiment") or "default",
                 run_name=tracking.get("run_name") or run_dir.name, uri=uri)
    if rid and uri and not rid.startswith(PENDING):
        state["runs"][uri] = rid
    return state


def default_uri(run_dir: Path, state: dict, config: dict) -> str:
    return (state.get("uri") or os.environ.get("MLFLOW_TRACKING_URI") or (config.get("tracking") or {}).get(
        "tracking_uri") or f"sqlite:///{default_store(run_dir)}")


def sync(run_dir: Path, uri: str | None = None, all_steps: bool = False, status: str | None = None,
         timeout_s: float = 10.0, bar=None) -> dict:
    """``bar``: see replay (main passes a tqdm bar on stderr)."""
    run_dir = Path(run_dir).resolve()
    if not run_dir.is_dir():
        raise SyncError(f"{run_dir}: not a directory")
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file() and not (run_dir / "tracking_state.json").is_file():
        raise SyncError(f"{run_dir}: no metrics.jsonl or tracking_state.json (not a training run directory)")
    config = read_config(run_dir)
    state = state_for(run_dir, config)
    uri = uri or default_uri(run_dir, state, config)
    state["artifact_location"] = state.get("artifact_location") or artifact_location(uri, run_dir)
    bounded_http(timeout_s, max_retries=2, backoff_factor=1)
    try:
        store = Store(uri)
        run_id, created = store.attach(state)
    except Exception as e:
        raise SyncError(f"cannot reach the MLflow store {uri}: {_short(e)}") from None
    state["runs"][uri] = run_id
    try:
        params = state.get("params") or config_params(config)
        if created or not state.get("params_sent", {}).get(uri):
            store.log_params(run_id, params)
            state.setdefault("params_sent", {})[uri] = True
        changed = store.config_tags(run_id, config_params(config), None) if config else []

        records = read_metrics_jsonl(metrics_path)
        if not all_steps:
            train, tracking = config.get("train") or {}, config.get("tracking") or {}
            every = tracking.get("every") or train.get("log_every") or 1  # before tracking.every: the console's
            records = logged_cadence(records, int(every), train.get("max_steps"))
        sent, there = replay(store, run_id, records, state.get("anchors", []), bar=bar)
        if sent:
            cs = state.setdefault("confirmed_step", {})
            cs[uri] = max(cs.get(uri, -1), max(sent))

        artifacts = 0
        for entry in state.get("artifacts", {}).values():
            if uri in entry.get("sent", []):
                continue
            spool = entry.get("spool")
            src = spool if spool and Path(spool).is_file() else entry.get("src")
            if src and Path(src).is_file():
                store.client.log_artifact(run_id, src, entry.get("subdir"))
                artifacts += 1
            entry.setdefault("sent", []).append(uri)
        datasets = 0
        for entry in state.get("datasets", {}).values():  # the dataset inputs the tracker could not send
            if uri not in entry.get("sent", []):
                store.log_dataset(run_id, entry)
                datasets += 1
                entry.setdefault("sent", []).append(uri)

        final = status or state.get("status")
        if final and final != "RUNNING" and state.get("status_sent", {}).get(uri) != final:
            store.client.set_terminated(run_id, status=final)
            state.setdefault("status_sent", {})[uri] = final
        else:
            final = store.client.get_run(run_id).info.status
    except SyncError:
        raise
    except Exception as e:
        raise SyncError(f"MLflow store {uri}, run {run_id}: {_short(e)}") from None
    finally:
        write_state(run_dir, state)
    return {"run_id": run_id, "uri": uri, "created": created, "sent": sent, "there": there, "artifacts": artifacts,
            "datasets": datasets, "status": final, "changed": changed}


def summary(res: dict) -> str:
    sent = res["sent"]
    span = f" (steps {min(sent)}-{max(sent)})" if sent else ""
    return (f"mlflow_sync: run {res['run_id']} ({'created' if res['created'] else 'existing'}) in {res['uri']}: "
            f"{len(sent)} steps sent{span}, {res['there']} already there, {res['artifacts']} artifacts, "
            f"{len(res['changed'])} config tags, status {res['status']}")


def build_parser() -> argparse.ArgumentParser:
    """main's command line, apart from main: tests parse the documented commands with it without running them."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="the training's run directory (holds metrics.jsonl)")
    p.add_argument("--tracking-uri", help="MLflow store (default: the one the training used)")
    p.add_argument("--all-steps", action="store_true", help="send every step of metrics.jsonl, not only logged ones")
    p.add_argument("--status", choices=["FINISHED", "FAILED", "KILLED"], help="set the run's status (default: the "
                   "journal's; a run whose job was killed stays RUNNING unless given)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per HTTP request (default 10)")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        res = sync(args.run_dir, args.tracking_uri, args.all_steps, args.status, args.timeout,
                   bar=lambda total: progress(total=total, desc="mlflow_sync", unit="step"))
    except SyncError as e:
        print(f"mlflow_sync: error: {e}", file=sys.stderr)
        return 1
    print(f"{summary(res)} ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
