"""MLflow tracking: one run per training job, written by rank 0 in a background thread; training never waits on it.

Store. Default ``mlflow.db`` beside the run directory (``runs/mlflow.db``: every run of a checkout in one store, one
UI) with artifacts in ``mlartifacts`` beside it, no server needed; a run directory that has its own ``mlflow.db`` (from
before) keeps it (``store.default_store``). ``MLFLOW_TRACKING_URI`` or ``tracking.tracking_uri`` override it. Several
trainings write the one sqlite file at once: its creation is serialized by a file lock (``DB.lock``), writes wait on
sqlite's own lock (5 s), and a write that still fails is retried like an outage.

Threading. ``Tracker`` is built on every rank; only rank 0 talks to MLflow, from one daemon worker thread.
``log_metrics``, ``log_artifact`` and ``finish`` put an item on an in-memory queue and return (microseconds; an
artifact of up to 8 MiB is first copied into ``RUN_DIR/tracking_spool/``, so that what is sent later is what was
logged). The worker imports mlflow, opens the store, creates or re-attaches the run, then sends the queue in order.
When the store fails (refused, timed out, 5xx), the worker prints one ``tracking:`` line, keeps the queue (at most
``MAX_PENDING`` metric records; older ones are dropped from memory, never from metrics.jsonl) and retries with
exponential backoff (``retry_s`` doubling up to ``max_retry_s``); when it succeeds again it prints one more line and
catches up. Errors the store will never accept (a bad value, an unknown run) drop that item with one line per error
code.

Timeouts. Every HTTP request of the worker runs with ``tracking.timeout_s`` (default 10 s, per connect and per read)
and no MLflow-level retry (``MLFLOW_HTTP_REQUEST_TIMEOUT`` = timeout_s, ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` = 0,
backoff 0); MLflow's defaults (120 s, 7 retries with backoff) are what made one call block for ~4 minutes. These
values apply to the tracker's thread only: MLflow reads them through ``mlflow.environment_variables.<NAME>.get()`` on
every request, and ``bounded_http`` wraps those getters with a thread-local override, so ``os.environ`` and every other
thread in the process keep the user's settings.

Start. The constructor waits for the worker to know the run id: at most the mlflow import (local, 2-4 s) plus
``timeout_s``, and not at all beyond the first failed attempt. Rank 0 then broadcasts the id to every rank.

Run id when the store is unreachable. MLflow run ids are made by the store, so a run that could not be created has
none yet. Each run directory has a run key (a uuid4 hex, kept in the journal); the MLflow run carries it as tag
``pipeline.run_key``. Until the run exists, ``Tracker.run_id`` is ``pending:<run key>``: that is what checkpoints
saved meanwhile hold. Whoever reaches the store first (the worker later in this job, a resumed job, or
``tools/mlflow_sync.py``) looks the run up by that tag and creates it (with the params of the job's first start) only
if it is not there, and records the real id in the journal; ``resolve_run_id`` maps a checkpoint's id to it. On rank 0
``run_id`` becomes the real id as soon as the worker has it, so later checkpoints hold the real id; other ranks keep
the broadcast value.

Journal (``RUN_DIR/tracking_state.json``, written atomically by rank 0's tracker and by mlflow_sync): the run key;
the tracking URI; the run id per store URI; the flattened config of the first start (the params); creation tags;
experiment, run name and artifact location; the highest step confirmed in each store; the artifacts (source, spool
copy, stores they reached); the last status and the stores that have it; wall-clock anchors ``[step, ms]`` of each
start (to date replayed steps when metrics.jsonl has no ``time``).

No duplicated steps. MLflow has no API to delete a metric value, so duplicates are prevented by design. Every step's
metrics go in one ``log_batch`` (one store transaction for the metrics), in step order. Before sending after every
(re)connection the worker reads the store's high-water mark H: the step of the latest value of the probe key
(``loss``, or the first key of a record without it). Records with step <= H are not sent: they are in the store,
either committed by a request whose response was lost, or logged by an earlier attempt of this run that was killed
after its last checkpoint (resume at step R < H). Guarantee: each key has at most one value per step in the store for
the steps this tracker and mlflow_sync send; for steps R+1..H of a resume the store keeps the values of the attempt
that first ran them (identical where resume is bit-exact, as on CPU; possibly not bit-identical with nondeterministic
GPU kernels), metrics.jsonl holds the re-run's, and the run gets tag ``resumed_at_step_<R>.kept_steps`` = ``R+1-H``.
A resumed job also replays from metrics.jsonl the steps <= R that the store misses (what mlflow_sync does) when the
journal says some may be missing, so one outage is repaired by the next resume. Limits: a step with more than 1000
metrics takes two batches; mlflow_sync run while a live tracker of the same run sends can duplicate the steps both
send (run it after the job). A ``time`` key in a record (seconds since the epoch) is used as the metric
timestamp and not logged as a metric.

Params on resume. MLflow params are immutable: the params stay the config of the run's first start. On each later
start the tracker compares the current config with them and sets tag ``config.<key>`` = current value for every key
that differs or is new (tags are mutable, so ``config.train.max_steps`` says 600 after a 100-step run was resumed to
600), and tag ``config.changed_at_step_<R>`` lists the keys.

Finish. ``finish(status)`` queues the status and waits at most ``flush_timeout_s`` (default 2 x timeout_s) for the
queue to drain; with the store down it gives up after the first failed attempt. What is left is in the journal and
metrics.jsonl for ``python tools/mlflow_sync.py RUN_DIR``, and one line says so.
"""
from __future__ import annotations

import collections
import errno
import getpass
import hashlib
import json
import logging
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from pipeline import commands
from pipeline.config import ConfigError
from pipeline.data.shards import data_fingerprint
from pipeline.distributed import broadcast_object
from pipeline.outputs import write_atomic
from pipeline.tracking.journal import PENDING, config_params, new_state, probe_key, read_state, state_path
from pipeline.tracking.replay import logged_cadence, numeric, read_metrics_jsonl, replay
from pipeline.tracking.store import (BATCH_METRICS, PERMANENT_CODES, NotInStore, Store, _code, _short, _warn,
                                     artifact_location, bounded_http, tracking_uri)

SPOOL_DIR = "tracking_spool"
SPOOL_MAX_BYTES = 8 << 20
MAX_PENDING = 10_000  # metric records held in memory while the store is down (metrics.jsonl keeps every step)
CHECKOUT = Path(__file__).resolve().parents[2]  # the code that runs: its commit, not the working directory's


def source_tags() -> dict:
    """What a run was started from, as tags: MLflow's own source tags (the UI's Source, Version and User columns),
    whether the checkout had uncommitted changes (``pipeline.git.dirty``) and this process's command line
    (``pipeline.command``). No git, or no checkout: no git tags."""
    tags = {"mlflow.source.type": "LOCAL", "mlflow.source.name": sys.argv[0] if sys.argv else "",
            "pipeline.command": shlex.join(sys.argv)[:5000]}
    try:
        tags["mlflow.user"] = getpass.getuser()
    except Exception:  # no USER and no passwd entry (some containers)
        pass

    def git(*args) -> str | None:
        try:  # no shell: the checkout path is passed as an argument, never parsed
            r = subprocess.run(["git", "-C", str(CHECKOUT), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout if r.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit:
        tags["mlflow.source.git.commit"] = commit.strip()
        status = git("status", "--porcelain")
        if status is not None:
            tags["pipeline.git.dirty"] = "true" if status.strip() else "false"
    return tags


class Tracker:
    """``tags`` go on a new run (e.g. the parent run and checkpoint of a run started with --init-from).

    ``flush_timeout_s`` bounds ``finish`` (default 2 x tracking.timeout_s); ``retry_s`` / ``max_retry_s`` the backoff
    between attempts while the store is down.
    """

    def __init__(self, cfg, run_dir: Path, rank: int, resume_run_id: str | None, resume_step: int | None,
                 tags: dict | None = None, *, params: dict | None = None, flush_timeout_s: float | None = None,
                 retry_s: float = 1.0, max_retry_s: float = 60.0):
        self.rank, self.run_dir = rank, Path(run_dir).resolve()
        self.enabled = bool(cfg.tracking.enabled)
        self.uri = tracking_uri(cfg, run_dir) if self.enabled else None
        self.timeout_s = float(getattr(cfg.tracking, "timeout_s", 10.0))
        self.system_metrics_s = float(getattr(cfg.tracking, "system_metrics_s", 0.0))
        self._monitor = None
        self.flush_timeout_s = 2 * self.timeout_s if flush_timeout_s is None else float(flush_timeout_s)
        self.retry_s, self.max_retry_s = float(retry_s), float(max_retry_s)
        self._run_id = self._real_id = self._worker = None
        self._is_offline = False
        self.failed_attempts = 0  # store calls that failed (rank 0), for tests and diagnostics
        error = None
        if rank == 0 and self.enabled:
            try:
                error = self._start(cfg, resume_run_id, resume_step, tags, params or {})
            except Exception as e:  # e.g. a journal that cannot be written: tracking off, training on
                _warn(f"disabled ({_short(e)}); metrics stay in {self.run_dir / 'metrics.jsonl'}")
                self._stop_worker()
                self._worker = None
        # Every rank learns the run id, or the error, so that no rank waits on a peer that has given up.
        self._run_id, error = broadcast_object((self._run_id, error))
        if error:
            self._stop_worker()
            raise ConfigError(error)

    # -- main-thread side --------------------------------------------------------------------------------------------
    @property
    def run_id(self) -> str | None:
        """The MLflow run id; ``pending:<run key>`` while the run could not be created (see the module docstring)."""
        return self._real_id or self._run_id

    @property
    def offline(self) -> bool:
        """True while the store is known to be unreachable (rank 0)."""
        return self._is_offline

    @property
    def pending(self) -> int:
        """Items (metric steps, artifacts, status) not yet sent (rank 0)."""
        if self._worker is None:
            return 0
        with self._cv:
            return len(self._queue) + len(self._inflight)

    def _start(self, cfg, resume_run_id, resume_step, tags, params: dict) -> str | None:
        run_dir = self.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        state = read_state(run_dir)
        # the config, and what it resolved to on this machine (``params``: layout, kernels, microbatch)
        params_now = {**config_params(cfg.to_dict()), **{k: str(v) for k, v in params.items()}}
        pending_key = resume_run_id[len(PENDING):] if resume_run_id and resume_run_id.startswith(PENDING) else None
        resume_real = resume_run_id if resume_run_id and pending_key is None else None
        if resume_run_id and state is not None:
            if not (pending_key == state["run_key"] or resume_run_id in state.get("runs", {}).values()):
                state = None  # another run's journal: start a new one for the checkpoint's run
        if resume_run_id is None or state is None:  # a new run; or a resumed run from before journals
            state = new_state(pending_key)
            state["params"] = params_now if resume_run_id is None else {}
            state["tags"] = {**source_tags(), **{k: str(v) for k, v in (tags or {}).items()}}
        state.update(uri=self.uri, experiment=cfg.tracking.experiment, status="RUNNING", status_sent={},
                     run_name=state.get("run_name") or cfg.tracking.run_name or run_dir.name,
                     artifact_location=state.get("artifact_location") or artifact_location(self.uri, run_dir))
        if resume_real:
            state["runs"].setdefault(self.uri, resume_real)
        state["anchors"] = (state.get("anchors", []) + [[int(resume_step or 0), int(time.time() * 1000)]])[-1000:]
        self._state, self._params_now = state, params_now
        self._resume_real, self._resume_step = resume_real, resume_step
        self._run_id = state["runs"].get(self.uri) or PENDING + state["run_key"]

        self._cv = threading.Condition()
        self._file_lock = threading.Lock()
        self._queue = collections.deque()
        self._n_metrics = 0
        self._inflight = []
        self._busy = self._stop = self._finishing = self._gave_up = self._quiet = False
        self._constructed = self._connected = False
        self._store = self._start_error = None
        self._skip_upto = -1
        self._resume_done = resume_step is None
        self._warned = set()
        self._seq = self._written_seq = 0
        self._last_write = 0.0
        self._imported, self._first_attempt = threading.Event(), threading.Event()
        with self._cv:
            for art, entry in state["artifacts"].items():  # what an earlier attempt could not send
                if self.uri not in entry.get("sent", []):
                    self._queue.append(("a", art))
            for key, entry in state.get("datasets", {}).items():
                if self.uri not in entry.get("sent", []):
                    self._queue.append(("d", key))
            snap = self._snapshot(force=True)
        self._write(snap)
        self._worker = threading.Thread(target=self._work, name="mlflow-tracker", daemon=True)
        self._worker.start()
        self._imported.wait(120)  # importing mlflow is local work (2-4 s); the store gets timeout_s from here
        self._first_attempt.wait(self.timeout_s)
        with self._cv:
            self._constructed = True
            return self._start_error

    def log_metrics(self, metrics: dict, step: int):
        if self._worker is None:
            return
        try:
            with self._cv:
                if self._stop:
                    return
                self._queue.append(("m", int(step), time.time(), dict(metrics)))
                self._n_metrics += 1
                if self._n_metrics > MAX_PENDING:
                    for i, it in enumerate(self._queue):
                        if it[0] == "m":
                            del self._queue[i]
                            self._n_metrics -= 1
                            break
                    if not self._state.get("dropped"):
                        self._state["dropped"] = True
                        _warn(f"more than {MAX_PENDING} steps waiting for {self.uri}: dropping the oldest from "
                              "memory (metrics.jsonl keeps them; tools/mlflow_sync.py replays them)")
                self._cv.notify_all()
        except Exception as e:  # never into training
            self._warn_once("log", f"log_metrics: {_short(e)}")

    def log_artifact(self, path: str | Path, subdir: str | None = None):
        if self._worker is None or self._stop:
            return
        try:
            src = Path(path)
            if not src.is_file():
                self._warn_once(f"missing:{src}", f"log_artifact: {src} is not a file; skipped")
                return
            art = f"{subdir}/{src.name}" if subdir else src.name
            spool = None
            if src.stat().st_size <= SPOOL_MAX_BYTES:  # send what was logged, even if the file changes later
                spool = self.run_dir / SPOOL_DIR / (subdir or "") / src.name
                spool.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, spool)
            self._enqueue("a", "artifacts", art, {"src": str(src.resolve()), "subdir": subdir,
                                                  "spool": str(spool) if spool else None, "sent": []})
        except Exception as e:
            self._warn_once("artifact", f"log_artifact {path}: {_short(e)}")

    def log_run_inputs(self, run_dir: Path, train: list, val: list):
        """A new run's config.yaml, ds_config.json and local training manifests as artifacts, its training and
        validation shard sets as dataset inputs. ``train``: (the mixture source's name or None, shard set) pairs;
        ``val``: shard sets. A set is named by its source, else by its directory (shard_set_name)."""
        from pipeline.data.remote import is_remote
        from pipeline.data.streams import is_url_pattern

        self.log_artifact(run_dir / "config.yaml")
        self.log_artifact(run_dir / "ds_config.json")
        for name, spec in train:
            if not is_url_pattern(spec) and not is_remote(spec):
                self.log_artifact(Path(spec) / "manifest.json", f"data/{name}" if name else "data")
            self.log_dataset(name or shard_set_name(spec), spec, "training")
        for d in val:
            self.log_dataset(shard_set_name(d), d, "validation")

    def log_dataset(self, name: str, spec: str | Path, context: str):
        """A shard directory (or URL pattern) as an MLflow dataset input of the run, ``context`` "training" or
        "validation": the source is the directory, the digest the first 16 hex digits of its manifest.json's sha256
        (of the pattern for a URL pattern, which has no manifest), the profile the full sha256 and the shard and
        sample counts. Journaled like an artifact, so a store that was down gets it later."""
        if self._worker is None or self._stop:
            return
        try:
            spec = str(spec)
            fp = data_fingerprint(spec)
            local = fp is not None or Path(spec).is_dir()
            source = str(Path(spec).resolve()) if local else spec
            digest = (fp or {}).get("sha256") or hashlib.sha256(source.encode()).hexdigest()
            entry = {"name": name, "source": source, "digest": digest[:16], "context": context,
                     "profile": {"manifest_sha256": fp["sha256"], "shards": fp["shards"], "samples": fp["samples"]}
                     if fp else {}, "sent": []}
            self._enqueue("d", "datasets", f"{context}:{name}", entry)
        except Exception as e:
            self._warn_once("dataset", f"log_dataset {spec}: {_short(e)}")

    def _enqueue(self, kind: str, table: str, key: str, entry: dict):
        """Journal ``entry`` under state[table][key] and queue it for the worker (kind "a" artifact, "d" dataset);
        the journal is written before this returns, so a crash right after still knows what was not sent."""
        with self._cv:
            self._state.setdefault(table, {})[key] = entry
            self._queue.append((kind, key))
            self._cv.notify_all()
            snap = self._snapshot(force=True)
        self._write(snap)

    def finish(self, status: str = "FINISHED"):
        """Queue the run's status, wait at most flush_timeout_s for everything to be sent, then stop the worker."""
        if self._worker is None or self._stop:
            return
        deadline = time.monotonic() + self.flush_timeout_s
        with self._cv:
            self._state["status"] = status
            self._queue.append(("f", status))
            self._finishing = True
            self._cv.notify_all()
            snap = self._snapshot(force=True)
        self._write(snap)
        with self._cv:
            while ((self._queue or self._busy) and not self._gave_up and self._worker.is_alive()
                   and time.monotonic() < deadline):
                self._cv.wait(max(0.0, min(0.5, deadline - time.monotonic())))
            left = list(self._inflight) + list(self._queue)
            self._stop = self._quiet = True
            self._cv.notify_all()
        if left:
            steps = sum(1 for it in left if it[0] == "m")
            arts = sum(1 for it in left if it[0] == "a")
            what = ", ".join(x for x in (f"{steps} logged step{'s' * (steps != 1)}" if steps else "",
                                         f"{arts} artifact{'s' * (arts != 1)}" if arts else "", f"status {status}")
                             if x)
            _warn(f"{what} not sent to {self.uri} (gave up after the first failed attempt or "
                  f"{self.flush_timeout_s:g} s); run `{commands.python()} tools/mlflow_sync.py {self.run_dir}` when it is reachable")

    def close(self):
        """Stop the worker without sending a status (``finish`` does this itself), and the system-metrics monitor
        (from a thread of its own: its last send is bounded by timeout_s, not waited for)."""
        self._stop_worker()
        monitor, self._monitor = self._monitor, False
        if monitor:
            threading.Thread(target=lambda: (bounded_http(self.timeout_s, max_retries=0), monitor.finish()),
                             name="mlflow-monitor-stop", daemon=True).start()

    def _stop_worker(self):
        if getattr(self, "_worker", None) is not None:
            with self._cv:
                self._stop = self._quiet = True
                self._cv.notify_all()

    def _warn_once(self, key: str, msg: str):
        if key not in self._warned and not self._quiet:
            self._warned.add(key)
            _warn(msg)

    def _snapshot(self, force: bool = False):
        """The journal's text, numbered (caller holds self._cv); None when written less than 0.5 s ago."""
        now = time.monotonic()
        if not force and now - self._last_write < 0.5:
            return None
        self._last_write = now
        self._seq += 1
        return self._seq, json.dumps(self._state, indent=1, sort_keys=True)

    def _write(self, snap):
        """Write a snapshot outside self._cv (a slow disk must not hold up log_metrics); never an older one."""
        if snap is None:
            return
        seq, text = snap
        with self._file_lock:
            if seq <= self._written_seq:
                return
            write_atomic(state_path(self.run_dir), text)
            self._written_seq = seq

    # -- worker thread ----------------------------------------------------------------------------------------------
    def _work(self):
        try:
            try:
                import mlflow.tracking  # noqa: F401  (1.5-3 s; off the training thread)

                bounded_http(self.timeout_s, max_retries=0)
            except Exception as e:
                _warn(f"mlflow does not import ({_short(e)}); tracking off, metrics stay in metrics.jsonl")
                with self._cv:
                    self._stop = True
                return
            finally:
                self._imported.set()
            delay = self.retry_s
            while True:
                with self._cv:
                    while not self._stop and self._connected and not self._queue:
                        self._cv.wait()
                    if self._stop:
                        return
                try:
                    if not self._connected:
                        self._connect()
                    self._drain()
                    delay = self.retry_s
                except NotInStore as e:
                    with self._cv:
                        self._start_error, late = str(e), self._constructed
                        self._stop = True
                    if late:
                        _warn(f"{e}; not tracking this job (every step stays in metrics.jsonl)")
                    return
                except Exception as e:
                    self._failed(e)
                    self._first_attempt.set()
                    with self._cv:
                        if self._finishing or self._stop:
                            self._gave_up = True
                            return
                        # Back off; new items do not cut it short (they would make it retry every step), finish()
                        # does, for one last attempt.
                        until = time.monotonic() + delay
                        while not (self._finishing or self._stop) and time.monotonic() < until:
                            self._cv.wait(until - time.monotonic())
                    delay = min(delay * 2, self.max_retry_s)
        except BaseException as e:  # a bug here must not take training down
            if not self._quiet:
                _warn(f"worker stopped ({_short(e)}); tools/mlflow_sync.py replays what the store misses")
        finally:
            self._first_attempt.set()
            with self._cv:
                self._busy = False
                self._gave_up = True
                self._cv.notify_all()

    def _failed(self, e: BaseException):
        with self._cv:
            self.failed_attempts += 1
            self._connected = self._busy = False
            was, self._is_offline = self._is_offline, True
            self._cv.notify_all()
        if not was and not self._quiet:
            text = str(e).lower()  # a read-only store (a mount, a permission, sqlite's own check) is not an outage
            state = ("not writable" if getattr(e, "errno", None) in (errno.EROFS, errno.EACCES, errno.EPERM)
                     or "readonly" in text or "read-only" in text else "unreachable")
            _warn(f"{self.uri} {state} ({_short(e)}); training goes on, retrying with backoff; every step is in "
                  f"metrics.jsonl, `{commands.python()} tools/mlflow_sync.py {self.run_dir}` replays what the store "
                  "misses")

    def _save(self, force: bool = False):
        with self._cv:
            snap = self._snapshot(force)
        self._write(snap)

    def _connect(self):
        if self._store is None:
            self._store = Store(self.uri)
        store, state = self._store, self._state
        run_id, created = store.attach(state, self._resume_real)
        with self._cv:
            state["runs"][self.uri] = run_id
            self._real_id = run_id
        self._save(force=True)
        self._first_attempt.set()
        if created or not state.get("params_sent", {}).get(self.uri):
            if state.get("params"):
                self._guarded(lambda: store.log_params(run_id, state["params"]), "params")
            with self._cv:
                state.setdefault("params_sent", {})[self.uri] = True
            self._save(force=True)
        if not self._resume_done:
            self._on_resume(run_id)
            self._resume_done = True
        if self._monitor is None and self.system_metrics_s > 0 and not self._finishing:
            self._start_monitor(run_id)
        high = store.high_water(run_id, state.get("probe_keys", ["loss"]))
        with self._cv:
            self._skip_upto = max(self._skip_upto, high)
            self._connected = True
            was, self._is_offline = self._is_offline, False
        if was and not self._quiet:
            _warn(f"{self.uri} reachable again; sending what it missed")

    def _start_monitor(self, run_id: str):
        """MLflow's system-metrics monitor on this host (rank 0's), every tracking.system_metrics_s, in a thread of its
        own whose requests are bounded like the worker's; it stops by itself when the run is no longer RUNNING or the
        store fails (system metrics are not replayed), and at finish."""
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
        except Exception as e:  # psutil missing
            self._monitor = False
            self._warn_once("sysmetrics", f"no system metrics ({_short(e)}; `pip install psutil`)")
            return
        # its INFO lines (started, stopped, "Skip logging GPU metrics") would reach every console and train.log
        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
        timeout_s = self.timeout_s

        class Monitor(SystemMetricsMonitor):
            def monitor(self):
                bounded_http(timeout_s, max_retries=0)  # MLflow's defaults: 2 min and 7 retries per request
                super().monitor()

        try:  # resume_logging: a resumed job continues the run's system/... steps, not over step 0, 1, ...
            monitor = Monitor(run_id, sampling_interval=self.system_metrics_s, tracking_uri=self.uri,
                              resume_logging=self._resume_step is not None)
            monitor.start()
        except Exception as e:  # a failing probe of the host must not read as a store outage and be retried
            self._monitor = False
            self._warn_once("sysmetrics", f"no system metrics ({_short(e)})")
            return
        self._monitor = monitor

    def _stop_monitor(self):
        """Stop the monitor and send what it sampled (called by the worker before the run's status)."""
        monitor, self._monitor = self._monitor, False
        if monitor:
            monitor.finish()

    def _on_resume(self, run_id: str):
        store, r = self._store, int(self._resume_step)
        self._guarded(lambda: store.client.update_run(run_id, status="RUNNING"), "status")
        self._guarded(lambda: store.client.set_tag(run_id, f"resumed_at_step_{r}", time.strftime("%Y-%m-%dT%H:%M:%S")),
                      "tags")
        self._guarded(lambda: store.config_tags(run_id, self._params_now, r), "tags")
        # The code and command of this attempt (the run's own source tags are those of its first start)
        src = source_tags()
        now = {f"resumed_at_step_{r}.{k.removeprefix('mlflow.source.').removeprefix('pipeline.')}": src[k]
               for k in ("mlflow.source.git.commit", "pipeline.git.dirty", "pipeline.command") if k in src}
        for k, v in now.items():
            self._guarded(lambda k=k, v=v: store.client.set_tag(run_id, k, v), "tags")
        high = store.high_water(run_id, self._state.get("probe_keys", ["loss"]))
        if high > r:
            self._guarded(lambda: store.client.set_tag(run_id, f"resumed_at_step_{r}.kept_steps", f"{r + 1}-{high}"),
                          "tags")
        # Steps <= r an earlier attempt could not send are in metrics.jsonl (the engine truncated it to <= r).
        records = [x for x in read_metrics_jsonl(self.run_dir / "metrics.jsonl") if x["step"] <= r]
        every = int(self._params_now.get("tracking.every") or self._params_now.get("train.log_every") or 1)
        max_steps = self._params_now.get("train.max_steps", "")
        records = logged_cadence(records, every, int(max_steps) if max_steps.isdigit() else None)
        confirmed = self._state.get("confirmed_step", {}).get(self.uri, -1)
        if records and (self._state.get("dropped") or confirmed < max(x["step"] for x in records)):
            sent = []
            self._guarded(lambda: sent.extend(replay(store, run_id, records, self._state.get("anchors", []))[0]),
                          "metrics")
            if sent and not self._quiet:
                _warn(f"sent {len(sent)} steps (<= {r}) that {self.uri} had missed")

    def _drain(self):
        """Send the queue in order. Items leave the queue while in flight (log_metrics may drop the oldest meanwhile)
        and go back to its front if the store fails."""
        store = self._store
        while True:
            with self._cv:
                if not self._queue:
                    self._busy = False
                    self._cv.notify_all()
                    # Throttled: a drained queue after every logged step must not rewrite the journal each time
                    # (a stale confirmed_step only costs the idempotent present-steps check on resume).
                    snap = self._snapshot(force=self._finishing)
                    break
                self._busy = True
                items = [self._queue.popleft()]
                if items[0][0] == "m":
                    n = len(items[0][3])
                    while self._queue and self._queue[0][0] == "m" and n + len(self._queue[0][3]) <= BATCH_METRICS:
                        n += len(self._queue[0][3])
                        items.append(self._queue.popleft())
                    self._n_metrics -= len(items)
                self._inflight = items
            try:
                snap = self._send(store, items)
            except BaseException:
                with self._cv:
                    self._queue.extendleft(reversed(items))
                    self._n_metrics += sum(1 for it in items if it[0] == "m")
                    self._inflight = []
                raise
            self._write(snap)
        self._write(snap)

    def _send(self, store, items: list):
        run_id, head = self._real_id, items[0]
        if head[0] == "m":
            records = []
            for _, step, t, metrics in items:
                m, ts = numeric(metrics)
                if step <= self._skip_upto or not m:
                    continue  # already in the store (see the module docstring)
                records.append((step, ts if ts is not None else int(t * 1000), m))
            if records:
                self._guarded(lambda: store.send(run_id, records), "metrics")
            with self._cv:
                self._inflight = []
                for _, _, m in records:
                    if probe_key(m) not in self._state["probe_keys"]:
                        self._state["probe_keys"].append(probe_key(m))
                if records:
                    top = records[-1][0]
                    self._skip_upto = max(self._skip_upto, top)
                    cs = self._state.setdefault("confirmed_step", {})
                    cs[self.uri] = max(cs.get(self.uri, -1), top)
                return self._snapshot()
        if head[0] == "a":
            entry = self._state["artifacts"].get(head[1])
            if entry is not None:
                spool = entry.get("spool")
                src = spool if spool and Path(spool).is_file() else entry["src"]
                if Path(src).is_file():
                    self._guarded(lambda: store.client.log_artifact(run_id, src, entry.get("subdir")), "artifact")
                else:
                    self._warn_once(f"gone:{src}", f"artifact {src} is gone; skipped")
            with self._cv:
                self._inflight = []
                if entry is not None and self.uri not in entry["sent"]:
                    entry["sent"].append(self.uri)
                return self._snapshot(force=True)
        if head[0] == "d":
            entry = self._state.get("datasets", {}).get(head[1])
            if entry is not None:
                self._guarded(lambda: store.log_dataset(run_id, entry), "dataset")
            with self._cv:
                self._inflight = []
                if entry is not None and self.uri not in entry["sent"]:
                    entry["sent"].append(self.uri)
                return self._snapshot(force=True)
        status = head[1]
        self._stop_monitor()  # its last samples go in before the run ends (the monitor stops on a finished run)
        self._guarded(lambda: store.client.set_terminated(run_id, status=status), "status")
        with self._cv:
            self._inflight = []
            self._state["status_sent"][self.uri] = status
            return self._snapshot(force=True)

    def _guarded(self, fn, what: str):
        """One store call; an error a retry cannot fix drops the item (one line per kind), others propagate."""
        try:
            fn()
        except Exception as e:
            if _code(e) in PERMANENT_CODES:
                self._warn_once(f"{what}:{_code(e)}", f"{self.uri} refused {what} ({_short(e)}); dropped")
                return
            raise


def shard_set_name(spec: str) -> str:
    """A data set's name for MLflow: the shard directory's name, with its parent's for the train/ and val/ that
    ``data_prep --val-fraction`` writes (``rfam/train``, not ``train``); the last path part of a URL or pattern."""
    p = Path(str(spec).rstrip("/"))
    return f"{p.parent.name}/{p.name}" if p.name in ("train", "val") and p.parent.name else p.name
