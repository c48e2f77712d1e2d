"""Replay of metrics.jsonl into a store that misses steps (a resumed job's tracker and tools/mlflow_sync.py): only
the steps the store does not have are sent, so no step is logged twice (pipeline/tracking/tracker.py's docstring,
"No duplicated steps")."""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from pipeline.tracking.journal import probe_key
from pipeline.tracking.store import Store


# MLflow's UI (3.17, run page and run comparison) draws a section per key prefix (up to the last "/") in alphabetical
# order, then the unprefixed keys ("Model metrics", charts by key), then system/... last. Kept as they are, loss, lr and
# val/... come first: val/ is the one prefixed section, loss and lr open "Model metrics"; every other key of the step
# record goes there after them, as train.<key> with "/" made "." (a "/" would make a section ahead of loss).
# metrics.jsonl keeps the record's own names.
MLFLOW_AS_IS = ("loss", "lr")


def mlflow_key(key: str) -> str:
    """The MLflow name of a step record's key: loss, lr and val/... as they are, the rest train.<key> ('/' -> '.')."""
    return key if key in MLFLOW_AS_IS or key.startswith("val/") else "train." + key.replace("/", ".")


def numeric(metrics: dict) -> tuple[dict, int | None]:
    """(float metrics under their MLflow names, timestamp in ms from a ``time`` key or None); non-numeric values are
    left out."""
    out, ts = {}, None
    for k, v in metrics.items():
        if k == "step":
            continue
        if k == "time":
            try:
                ts = int(float(v) * 1000)
            except (TypeError, ValueError):
                pass
            continue
        try:
            out[mlflow_key(k)] = float(v)
        except (TypeError, ValueError):
            continue
    return out, ts


def read_metrics_jsonl(path: Path) -> list:
    """Records of a metrics.jsonl; a torn last line (a killed writer) is ignored."""
    out = []
    if not Path(path).is_file():
        return out
    for ln in Path(path).read_text().splitlines():
        try:
            rec = json.loads(ln)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            out.append(rec)
    return out


def estimate_times(records: list, anchors: list) -> dict:
    """step -> ms for records without ``time``: the latest start anchor [step, ms] before the step plus the step
    times in between (data loading and checkpoints not counted)."""
    anchors = sorted((int(s), int(ms)) for s, ms in anchors) or [(0, int(time.time() * 1000))]
    out, acc, current = {}, 0.0, None
    for rec in sorted(records, key=lambda r: r["step"]):
        s = rec["step"]
        a = max((x for x in anchors if x[0] < s), default=anchors[0])
        if a != current:
            current, acc = a, 0.0
        acc += float(rec.get("step_time") or 0.0)
        out[s] = current[1] + int(acc * 1000)
    return out


def replay(store: Store, run_id: str, records: list, anchors: list, skip_steps: set = frozenset(),
           bar: Callable | None = None) -> tuple:
    """Send the records whose step the store misses. Returns (steps sent, steps already there). ``bar(total)``, if
    given, makes a progress bar (a context manager with ``update(n)``) for the steps to send."""
    todo = [r for r in records if r["step"] not in skip_steps]
    probes = {}
    for r in todo:
        m, _ = numeric(r)
        if m:
            probes.setdefault(probe_key(m), []).append(r)
    times = estimate_times(records, anchors)
    missing, there = [], 0
    for key, recs in probes.items():
        have = store.present_steps(run_id, key)
        for r in recs:
            if r["step"] in have:
                there += 1
            else:
                m, ts = numeric(r)
                missing.append((r["step"], ts if ts is not None else times[r["step"]], m))
    missing.sort(key=lambda x: x[0])
    if bar is None or not missing:
        store.send(run_id, missing)
    else:
        with bar(len(missing)) as b:
            store.send(run_id, missing, b.update)
    return [s for s, _, _ in missing], there


def logged_cadence(records: list, log_every: int, max_steps: int | None) -> list:
    """The records the engine passes to log_metrics: every tracking.every-th step (runs from before that key:
    train.log_every), train.max_steps, the last one and every step with a validation."""
    if not records:
        return []
    last = max(r["step"] for r in records)
    return [r for r in records if r["step"] % max(1, log_every) == 0 or r["step"] in (max_steps, last)
            or any(k.startswith("val/") for k in r)]  # and every validation
