"""Tracker: an unreachable or frozen store never stalls the caller; a store that dies and comes back is caught up
without duplicated steps; resume keeps one value per step and tags config changes; tools/mlflow_sync.py replays
what the store missed, idempotently. Single process (torch.distributed not initialized)."""
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO, free_port, sqlite_uri

from pipeline.config import ConfigError, dump_yaml, load_config
from pipeline.tracking.journal import PENDING, STATE_FILE, read_state, resolve_run_id
from pipeline.tracking.replay import mlflow_key
from pipeline.tracking import store as store_mod
from pipeline.tracking.store import RUN_KEY_TAG, bounded_http, tracking_uri
from pipeline.tracking.tracker import Tracker

sys.path.insert(0, str(REPO / "tools"))
import mlflow_sync  # noqa: E402


@pytest.fixture(autouse=True)
def _no_env_uri(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    import mlflow.tracking  # noqa: F401  (imported once here, so that timings below measure the tracker alone)


def make_cfg(run_dir: Path, uri: str | None, timeout_s: float = 10.0, *more):
    cfg = load_config(None, [f"run_dir={run_dir}", "train.log_every=1", "tracking.experiment=test-tracking",
                             *([f"tracking.tracking_uri={uri}"] if uri else []), *more])
    cfg.tracking.timeout_s = timeout_s
    return cfg


def closed_port_uri() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there: connections are refused at once


def engine_step(tracker: Tracker, run_dir: Path, step: int, log: bool = True):
    """What the engine does each step on rank 0: a metrics.jsonl line, and (every log_every) a log_metrics call."""
    rec = {"step": step, "loss": 10.0 / step, "lr": 1e-3, "step_time": 0.01, "tokens": 256}
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(rec) + "\n")
    if log:
        t0 = time.perf_counter()
        tracker.log_metrics({k: v for k, v in rec.items() if k != "step"}, step)
        return time.perf_counter() - t0
    return 0.0


def wait_for(pred, timeout: float = 30.0, what: str = "condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def loss_steps(uri: str, run_id: str) -> list:
    return sorted(m.step for m in client(uri).get_metric_history(run_id, "loss"))


# ---------------------------------------------------------------------------------------------------------------
def test_unreachable_store_costs_nothing(tmp_path, capfd):
    run_dir = tmp_path / "run"
    cfg = make_cfg(run_dir, closed_port_uri())
    t0 = time.perf_counter()
    tracker = Tracker(cfg, run_dir, 0, None, None)
    construct = time.perf_counter() - t0
    assert construct < 2.0, construct
    assert tracker.run_id.startswith(PENDING)
    calls = []
    for s in range(1, 101):
        calls.append(engine_step(tracker, run_dir, s))
        time.sleep(0.005)
    assert sum(calls) < 0.1 and max(calls) < 0.02, (sum(calls), max(calls))
    assert tracker.failed_attempts <= 2  # backoff (1 s, then 2 s), not one attempt per step
    tracker.log_artifact(run_dir / "metrics.jsonl")
    wait_for(lambda: tracker.offline, what="the tracker to notice the outage")
    t0 = time.perf_counter()
    tracker.finish("FINISHED")
    assert time.perf_counter() - t0 < 2.0
    err = capfd.readouterr().err
    assert err.count(" unreachable (") == 1, err  # one line for the outage, not one per step
    assert "not sent" in err and "mlflow_sync" in err
    state = read_state(run_dir)
    assert PENDING + state["run_key"] == tracker.run_id and state["status"] == "FINISHED"
    assert state["runs"] == {} and state["params"]["train.log_every"] == "1"
    assert (run_dir / "tracking_spool" / "metrics.jsonl").is_file()


def test_frozen_store_is_bounded_by_the_timeout(tmp_path):
    """A server that accepts connections and never answers (the case that froze training for minutes per call)."""
    frozen = socket.create_server(("127.0.0.1", 0), backlog=64)
    try:
        run_dir = tmp_path / "run"
        cfg = make_cfg(run_dir, f"http://127.0.0.1:{frozen.getsockname()[1]}", timeout_s=1.0)
        t0 = time.perf_counter()
        tracker = Tracker(cfg, run_dir, 0, None, None)
        assert time.perf_counter() - t0 < 3.0
        assert tracker.run_id.startswith(PENDING)
        calls = [engine_step(tracker, run_dir, s) for s in range(1, 101)]
        assert max(calls) < 0.02, max(calls)
        t0 = time.perf_counter()
        tracker.finish("FINISHED")
        assert time.perf_counter() - t0 < 2 * 1.0 + 0.5  # flush_timeout_s = 2 x timeout_s
    finally:
        frozen.close()


def test_http_settings_apply_to_the_tracker_thread_only(monkeypatch):
    from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_REQUEST_TIMEOUT

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "77")
    seen = {}

    def worker():
        bounded_http(3.0, max_retries=0)
        seen["timeout"], seen["retries"] = MLFLOW_HTTP_REQUEST_TIMEOUT.get(), MLFLOW_HTTP_REQUEST_MAX_RETRIES.get()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == {"timeout": 3.0, "retries": 0}
    assert MLFLOW_HTTP_REQUEST_TIMEOUT.get() == 77 and os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "77"
    assert MLFLOW_HTTP_REQUEST_MAX_RETRIES.get() == 7  # mlflow's default, for every other thread


# ---------------------------------------------------------------------------------------------------------------
def test_resume_keeps_one_value_per_step_and_tags_config_changes(tmp_path):
    run_dir, uri = tmp_path / "run", sqlite_uri(tmp_path / "mlflow.db")
    # 60 s to reach the store: creating a new SQLite store's tables took over 10 s on a loaded 2-core host, and the
    # run then started pending (another test's subject)
    first = Tracker(make_cfg(run_dir, uri, 60.0, "train.max_steps=100"), run_dir, 0, None, None)
    run_id = first.run_id
    assert not run_id.startswith(PENDING)
    for s in range(1, 11):
        engine_step(first, run_dir, s)
    wait_for(lambda: first.pending == 0, what="steps 1-10 in the store")
    first.close()  # SIGKILLed at step 10; its last checkpoint is step 8

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()[:8]  # the engine truncates to the checkpoint
    (run_dir / "metrics.jsonl").write_text("".join(ln + "\n" for ln in lines))
    again = Tracker(make_cfg(run_dir, uri, 60.0, "train.max_steps=600"), run_dir, 0, run_id, 8)
    assert again.run_id == run_id
    for s in range(9, 15):
        engine_step(again, run_dir, s)
    again.finish("FINISHED")

    assert loss_steps(uri, run_id) == list(range(1, 15))  # 9 and 10 once, not twice
    run = client(uri).get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.max_steps"] == "100"  # params: the first start's config (immutable)
    assert run.data.tags["config.train.max_steps"] == "600"  # tags: what it is now
    assert run.data.tags["config.changed_at_step_8"] == "train.max_steps"
    assert run.data.tags["resumed_at_step_8.kept_steps"] == "9-10"
    assert len(client(uri).search_runs([run.info.experiment_id])) == 1
    # the MLflow 3 UI lists the experiment's runs as model-training runs, not under GenAI's "Evaluation runs"
    assert client(uri).get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == \
        "custom_model_development"


def test_pending_run_is_created_by_the_resumed_job(tmp_path):
    """Started while the store was down: checkpoints hold pending:<key>; the resumed job finds or creates that run,
    with the first start's params, and fills in the steps the first job could not send."""
    run_dir = tmp_path / "run"
    first = Tracker(make_cfg(run_dir, closed_port_uri(), 10.0, "optim.lr=0.01"), run_dir, 0, None, None)
    pending = first.run_id
    assert pending.startswith(PENDING)
    for s in range(1, 7):
        engine_step(first, run_dir, s)
    first.finish("FAILED")

    uri = sqlite_uri(tmp_path / "mlflow.db")  # the store is back (here: another URI)
    again = Tracker(make_cfg(run_dir, uri, 10.0, "optim.lr=0.02"), run_dir, 0, pending, 6)
    real = again.run_id
    assert not real.startswith(PENDING)
    for s in (7, 8):
        engine_step(again, run_dir, s)
    again.finish("FINISHED")
    assert resolve_run_id(run_dir, pending, uri) == real
    assert loss_steps(uri, real) == list(range(1, 9))
    run = client(uri).get_run(real)
    assert run.data.params["optim.lr"] == "0.01" and run.data.tags["config.optim.lr"] == "0.02"
    assert run.data.tags[RUN_KEY_TAG] == pending[len(PENDING):]
    assert run.info.status == "FINISHED"


def test_resume_in_a_store_without_the_run_is_a_config_error(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match="not in the store"):
        Tracker(make_cfg(run_dir, sqlite_uri(tmp_path / "empty.db")), run_dir, 0, "0123456789abcdef0123456789abcdef", 4)


# ---------------------------------------------------------------------------------------------------------------
def test_default_store_is_shared_by_the_run_dirs_beside_it_and_an_old_run_dir_keeps_its_own(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    cfg = make_cfg(runs / "a", None)
    shared = sqlite_uri(runs / "mlflow.db")
    assert tracking_uri(cfg, runs / "a") == tracking_uri(cfg, runs / "b") == shared
    assert tracking_uri(cfg, runs / "a", existing=True) is None  # evaluation never makes a store
    old = runs / "old"  # a run started before the shared store: resumes into RUN_DIR/mlflow.db
    old.mkdir(parents=True)
    (old / "mlflow.db").touch()
    assert tracking_uri(cfg, old) == tracking_uri(cfg, old, existing=True) == sqlite_uri(old / "mlflow.db")
    assert tracking_uri(make_cfg(runs / "a", sqlite_uri(tmp_path / "cfg.db")), runs / "a") == sqlite_uri(
        tmp_path / "cfg.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", sqlite_uri(tmp_path / "env.db"))
    assert tracking_uri(make_cfg(runs / "a", sqlite_uri(tmp_path / "cfg.db")), runs / "a") == sqlite_uri(
        tmp_path / "env.db")


def test_trackers_of_two_run_dirs_log_to_one_store_with_artifacts_beside_it(tmp_path):
    runs = tmp_path / "runs"
    trackers = [Tracker(make_cfg(runs / n, None), runs / n, 0, None, None) for n in ("a", "b")]
    for s in (1, 2, 3):
        for t in trackers:
            engine_step(t, t.run_dir, s)
    for t in trackers:
        t.log_artifact(t.run_dir / "metrics.jsonl")
        t.finish("FINISHED")
    uri = sqlite_uri(runs / "mlflow.db")
    assert {t.uri for t in trackers} == {uri} and not (runs / "a" / "mlflow.db").exists()
    for t in trackers:
        assert loss_steps(uri, t.run_id) == [1, 2, 3]
        run = client(uri).get_run(t.run_id)
        assert run.info.run_name == t.run_dir.name
        # one run directory removed must not take the other's artifacts with it
        assert run.info.artifact_uri.startswith((runs / "mlartifacts").as_uri())
    assert (runs / "mlartifacts").is_dir() and not (runs / "a" / "mlartifacts").exists()


def test_two_processes_opening_a_new_sqlite_store_at_once_both_succeed(tmp_path):
    """MLflow creates and migrates a new sqlite file without a lock: without Store's, processes that open a fresh
    shared store together fail half-way through the migrations (two trainings started at once in a new checkout)."""
    uri = sqlite_uri(tmp_path / "mlflow.db")
    code = ("import sys; from pipeline.tracking.store import Store; s = Store(sys.argv[1]); "
            "e = s.experiment_id('x', None); r = s.client.create_run(e).info.run_id; "
            "s.send(r, [(i, 0, {'loss': 1.0}) for i in range(5)]); print('ok')")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", code, uri], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-600:] for _, err in outs]
    (exp,) = [e for e in client(uri).search_experiments() if e.name == "x"]
    assert len(client(uri).search_runs([exp.experiment_id])) == 3


def test_mlflow_names_put_loss_lr_and_validation_first():
    """MLflow's UI orders key prefixes alphabetically ahead of the unprefixed "Model metrics" (pipeline/tracking/
    replay.py): val/ stays the one prefixed section, and every diagnostic sorts after loss and lr in Model metrics."""
    rec = ["loss", "lr", "val/loss_K4", "grad_norm", "epochs", "mix/weight/rfam", "total/tokens", "step_time"]
    names = [mlflow_key(k) for k in rec]
    assert names[:3] == ["loss", "lr", "val/loss_K4"]
    assert names[3:] == ["train.grad_norm", "train.epochs", "train.mix.weight.rfam", "train.total.tokens",
                         "train.step_time"]
    unprefixed = sorted(n for n in names if "/" not in n)
    assert unprefixed[:2] == ["loss", "lr"] and [n for n in names if "/" in n] == ["val/loss_K4"]


def test_run_records_its_code_command_data_and_system_metrics(tmp_path, sample_shards):
    from pipeline.tracking.tracker import source_tags

    run_dir, uri = tmp_path / "run", sqlite_uri(tmp_path / "mlflow.db")
    tracker = Tracker(make_cfg(run_dir, uri, 10.0, "tracking.system_metrics_s=0.2"), run_dir, 0, None, None)
    tracker.log_dataset("rfam", sample_shards, "training")
    tracker.log_dataset("rfam/val", sample_shards, "validation")
    for s in range(1, 4):
        engine_step(tracker, run_dir, s)
    wait_for(lambda: client(uri).get_metric_history(tracker.run_id, "system/cpu_utilization_percentage"),
             what="a system-metrics sample")
    tracker.finish("FINISHED")
    run = client(uri).get_run(tracker.run_id)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert run.data.tags["mlflow.source.git.commit"] == head
    assert run.data.tags["pipeline.git.dirty"] in ("true", "false")
    assert run.data.tags["pipeline.command"] == source_tags()["pipeline.command"]
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(run.data.metrics)
    assert "train.step_time" in run.data.metrics and "step_time" not in run.data.metrics
    digest = hashlib.sha256((sample_shards / "manifest.json").read_bytes()).hexdigest()
    inputs = {d.tags[0].value: d.dataset for d in run.inputs.dataset_inputs}
    assert set(inputs) == {"training", "validation"}
    ds = inputs["training"]
    assert (ds.name, ds.digest, ds.source_type) == ("rfam", digest[:16], "local")
    assert json.loads(ds.source)["uri"] == str(sample_shards.resolve())
    assert json.loads(ds.profile) == {"manifest_sha256": digest, "shards": 8, "samples": 2107}


def test_source_tags_without_git(monkeypatch):
    from pipeline.tracking import tracker as tracker_mod

    monkeypatch.setattr(tracker_mod.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(FileNotFoundError()))
    tags = tracker_mod.source_tags()
    assert "mlflow.source.git.commit" not in tags and "pipeline.git.dirty" not in tags and tags["pipeline.command"]


# ---------------------------------------------------------------------------------------------------------------
def test_mlflow_sync_replays_an_offline_run_idempotently(tmp_path, sample_shards, monkeypatch):
    run_dir = tmp_path / "run"
    cfg = make_cfg(run_dir, closed_port_uri(), 10.0, "tracking.every=5", "train.max_steps=12")
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    tracker = Tracker(cfg, run_dir, 0, None, None)
    tracker.log_artifact(run_dir / "config.yaml")
    tracker.log_dataset("rfam", sample_shards, "training")
    for s in range(1, 13):
        engine_step(tracker, run_dir, s, log=(s % 5 == 0 or s == 12))
    tracker.finish("FINISHED")

    uri = sqlite_uri(tmp_path / "synced.db")
    res = mlflow_sync.sync(run_dir, uri)
    assert res["created"] and res["sent"] == [5, 10, 12] and res["artifacts"] == 1 and res["status"] == "FINISHED"
    synced = client(uri).get_run(res["run_id"]).inputs.dataset_inputs  # logged while the store was down
    assert res["datasets"] == 1 and [d.dataset.name for d in synced] == ["rfam"]
    assert res["changed"] == []  # config.yaml is the config the params came from
    run = client(uri).get_run(res["run_id"])
    assert run.data.params["tracking.every"] == "5" and run.info.status == "FINISHED"
    assert [a.path for a in client(uri).list_artifacts(res["run_id"])] == ["config.yaml"]
    again = mlflow_sync.sync(run_dir, uri)
    assert (again["run_id"], again["created"], again["sent"], again["there"]) == (res["run_id"], False, [], 3)
    assert again["datasets"] == 0
    updates = []

    class Bar:  # what main's tqdm bar gives replay: a context manager with update(steps)
        def __init__(self, total):
            self.total = total

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n):
            updates.append((self.total, n))
    # batches of whole steps: two steps' metrics and then some, so that batches end on both sides of a step's end
    per_step = len(mlflow_sync.read_metrics_jsonl(run_dir / "metrics.jsonl")[0]) - 1  # its keys less "step"
    monkeypatch.setattr(store_mod, "BATCH_METRICS", 2 * per_step + 1)
    every = mlflow_sync.sync(run_dir, uri, all_steps=True, bar=Bar)
    assert every["sent"] == [1, 2, 3, 4, 6, 7, 8, 9, 11] and every["there"] == 3
    assert len(updates) > 1 and {t for t, _ in updates} == {9} and sum(n for _, n in updates) == 9, updates
    assert loss_steps(uri, res["run_id"]) == list(range(1, 13))
    assert resolve_run_id(run_dir, tracker.run_id, uri) == res["run_id"]

    proc = subprocess.run([sys.executable, str(REPO / "tools" / "mlflow_sync.py"), str(run_dir), "--tracking-uri",
                           uri], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("mlflow_sync:")]
    assert "0 steps sent" in line and res["run_id"] in line


def test_mlflow_sync_errors_are_one_line(tmp_path):
    script = str(REPO / "tools" / "mlflow_sync.py")
    proc = subprocess.run([sys.executable, script, str(tmp_path / "nope")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and proc.stderr.strip().startswith("mlflow_sync: error:") and "nope" in proc.stderr
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    proc = subprocess.run([sys.executable, script, str(run_dir), "--tracking-uri", closed_port_uri()],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "cannot reach" in proc.stderr.strip().splitlines()[-1]


# ---------------------------------------------------------------------------------------------------------------
class Proxy:
    """A TCP proxy in front of the MLflow server: ``down()`` makes it look dead (refused, connections reset),
    ``up()`` brings it back on the same port, ``swallow_next()`` drops the next response (a request the server
    committed whose answer is lost)."""

    def __init__(self, upstream: int):
        self.upstream, self.port = upstream, free_port()
        self.conns, self.lock, self.swallow = set(), threading.Lock(), False
        self.listener = None
        self.up()

    def up(self):
        self.listener = socket.create_server(("127.0.0.1", self.port))
        self.listener.settimeout(0.1)
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def down(self):
        self.listener.close()
        with self.lock:
            for c in list(self.conns):
                self._close(c)
            self.conns.clear()

    def swallow_next(self):
        self.swallow = True

    def _close(self, s):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()

    def _accept(self, listener):
        while listener.fileno() != -1:
            try:
                c, _ = listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            try:
                u = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:  # the server behind it is dead: so is this connection
                self._close(c)
                continue
            with self.lock:
                self.conns.update((c, u))
            threading.Thread(target=self._pump, args=(c, u, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(u, c, True), daemon=True).start()

    def _pump(self, src, dst, response: bool):
        try:
            while data := src.recv(65536):
                if response and self.swallow:
                    self.swallow = False
                    break
                dst.sendall(data)
        except OSError:
            pass
        self._close(src)
        self._close(dst)


def test_server_dies_mid_run_then_catch_up_and_sync(tmp_path, mlflow_server, capfd):
    server, port, db = mlflow_server
    proxy = Proxy(port)
    run_dir, uri = tmp_path / "run", f"http://127.0.0.1:{proxy.port}"
    tracker = Tracker(make_cfg(run_dir, uri, 2.0), run_dir, 0, None, None, retry_s=0.1, max_retry_s=0.3)
    run_id = tracker.run_id
    assert not run_id.startswith(PENDING)
    for s in range(1, 11):
        engine_step(tracker, run_dir, s)
    wait_for(lambda: tracker.pending == 0, what="steps 1-10 sent")

    proxy.swallow_next()  # step 11 is committed, its response lost: the tracker must not send it twice
    engine_step(tracker, run_dir, 11)
    wait_for(lambda: not tracker.offline and tracker.pending == 0, what="reconnection")

    proxy.down()  # the server "dies": refused
    calls = [engine_step(tracker, run_dir, s) for s in range(12, 21)]
    assert max(calls) < 0.02, max(calls)
    wait_for(lambda: tracker.offline, what="the outage")
    proxy.up()  # back: the tracker catches up by itself
    for s in range(21, 26):
        engine_step(tracker, run_dir, s)
    wait_for(lambda: not tracker.offline and tracker.pending == 0, 60, what="catch-up")
    assert loss_steps(uri, run_id) == list(range(1, 26))

    os.killpg(server.pid, signal.SIGKILL)  # now it really dies, for good
    server.wait()
    calls = [engine_step(tracker, run_dir, s) for s in range(26, 31)]
    assert max(calls) < 0.02, max(calls)
    t0 = time.perf_counter()
    tracker.finish("FINISHED")
    assert time.perf_counter() - t0 < 2 * 2.0 + 0.5
    proxy.down()
    err = capfd.readouterr().err
    assert err.count(" unreachable (") == 3 and err.count("reachable again") == 2, err  # lost answer, outage, death

    res = mlflow_sync.sync(run_dir, sqlite_uri(db))  # the dead server's own store
    assert res["run_id"] == run_id and not res["created"]
    assert res["sent"] == list(range(26, 31)) and res["there"] == 25 and res["status"] == "FINISHED"
    again = mlflow_sync.sync(run_dir, sqlite_uri(db))
    assert again["sent"] == [] and again["there"] == 30
    store = sqlite_uri(db)
    assert loss_steps(store, run_id) == list(range(1, 31))  # every step once
    assert client(store).get_run(run_id).info.status == "FINISHED"
    assert (run_dir / STATE_FILE).is_file()
