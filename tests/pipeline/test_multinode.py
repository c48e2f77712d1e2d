"""Two nodes on one machine: two DeepSpeed launcher invocations (``--hostfile`` of two hosts with one slot each,
``--no_ssh --node_rank 0|1 --master_addr 127.0.0.1``), one rank each, as a user starts them on two hosts.

A killed node makes its peer exit by itself; both nodes started again with ``--resume auto`` continue on the
trajectory and the samples of an uninterrupted single-launch run of world size 2, with one train.log, one
metrics.jsonl and one MLflow run for the whole job. Nodes started with different configs, or on run directories
that are not one shared directory, fail together before training (Trainer._check_ranks_agree)."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (REPO, TINY, free_port, launch_env, losses, mlflow_runs, mlflow_store, read_jsonl, run_torchrun,
                      samples_per_step)

sys.path.insert(0, str(REPO / "tests" / "pipeline" / "parallel"))
import test_expert_parallel  # noqa: E402

protein_shards, protlingo_yaml = test_expert_parallel.protein_shards, test_expert_parallel.protlingo_yaml  # fixtures

STEPS, EVERY, KILL_AFTER = 4, 2, 3  # checkpoints at steps 2 and 4; node 1 dies during step 4


def sets(shards, run_dir, *more, tiny=True):
    return [f"data.train_shards={shards}", f"run_dir={run_dir}", f"train.max_steps={STEPS}",
            f"checkpoint.every_steps={EVERY}", "train.log_samples=true", *(TINY if tiny else []), *more]


def node_cmd(node: int, port: int, hostfile: Path, ds_config: str, overrides: list, config=None) -> list:
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--no_ssh",
           "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port),
           str(REPO / "launchers" / "pretrain.py"), "--ds_config", str(REPO / ds_config)]
    cmd += ["--config", str(config)] if config else []
    return cmd + [a for o in overrides for a in ("--set", o)]


class Nodes:
    """Both nodes' launchers, each in a process group of its own (a node's processes die together), their output
    in files (two pipes read one after the other could fill up and stall a node)."""

    def __init__(self, tmp: Path, name: str, ds_config: str, overrides: list, node1_overrides=(), config=None,
                 launcher=True):
        hostfile = tmp / "hostfile"
        hostfile.write_text("node0 slots=1\nnode1 slots=1\n")  # names only: --no_ssh never contacts them
        port = free_port()
        env = launch_env()
        # each node takes the machine's cores as its own (LOCAL_SIZE=1); here two share them
        env["OMP_NUM_THREADS"] = "1"
        self.logs = [tmp / f"{name}-node{n}.log" for n in (0, 1)]
        self.procs = []
        for n, extra in ((0, []), (1, list(node1_overrides))):
            cmd = node_cmd(n, port, hostfile, ds_config, overrides + extra, config)
            node_env = env
            if not launcher:  # the rank alone, with the environment DeepSpeed's launcher gives it (faster to start)
                cmd = [sys.executable, *cmd[cmd.index(str(REPO / "launchers" / "pretrain.py")):]]
                node_env = {**env, "RANK": str(n), "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_SIZE": "1",
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            with open(self.logs[n], "w") as out:
                self.procs.append(subprocess.Popen(cmd, cwd=REPO, env=node_env, stdout=out,
                                                   stderr=subprocess.STDOUT, start_new_session=True))

    def wait(self, timeout=300) -> list:
        try:
            return [p.wait(timeout=max(1.0, timeout)) for p in self.procs]
        finally:
            self.kill()

    def kill(self, node=None):
        for n, p in enumerate(self.procs):
            if node in (None, n) and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def output(self, node: int) -> str:
        return self.logs[node].read_text()


def kill_node1_then_resume(tmp: Path, ds_config: str, overrides: list, config=None) -> dict:
    """Train on two nodes, SIGKILL node 1 once step KILL_AFTER is logged (before step STEPS's checkpoint), time how
    long node 0 takes to exit by itself, then start both nodes again (--resume auto is the default)."""
    run_dir = Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("run_dir=")))
    nodes = Nodes(tmp, "first", ds_config, overrides, config=config)
    try:
        metrics, deadline = run_dir / "metrics.jsonl", time.time() + 300
        while not (metrics.is_file() and any(m["step"] >= KILL_AFTER for m in read_jsonl(metrics))):
            assert time.time() < deadline and all(p.poll() is None for p in nodes.procs), (
                nodes.output(0)[-3000:] + nodes.output(1)[-3000:])
            time.sleep(0.05)
        nodes.kill(1)
        killed = time.monotonic()
        try:
            rc0 = nodes.procs[0].wait(timeout=120)  # a dead peer must not leave node 0 waiting on it
        except subprocess.TimeoutExpired:
            pytest.fail(f"node 0 still running 120 s after node 1 was killed:\n{nodes.output(0)[-3000:]}")
        exit_s = time.monotonic() - killed
    finally:
        nodes.kill()
    first = {"rc0": rc0, "exit_s": exit_s, "out0": nodes.output(0),
             "latest": (run_dir / "checkpoints" / "latest").read_text().strip()}
    again = Nodes(tmp, "resume", ds_config, overrides, config=config)
    rcs = again.wait()
    assert rcs == [0, 0], again.output(0)[-3000:] + again.output(1)[-3000:]
    return {"run_dir": run_dir, "first": first, "out": [again.output(0), again.output(1)]}


def check_same_run(ref: Path, run: dict):
    """The resumed two-node run: resumed at the step-2 checkpoint, with the uninterrupted run's losses and samples."""
    run_dir = run["run_dir"]
    assert f"resumed from {run_dir / 'checkpoints' / f'step{EVERY:08d}'} at step {EVERY}" in run["out"][0]
    want, got = losses(ref), losses(run_dir)
    assert sorted(got) == list(range(1, STEPS + 1)), got
    # Steps 1-2: two nodes train as one launch of two ranks; steps 3-4: the resume continues its trajectory. Bit for
    # bit (measured): the same two ranks reduce in the same order over gloo, on one thread each, whoever started them.
    assert got == want
    ids = samples_per_step(run_dir)
    assert len(list(run_dir.glob("samples-rank*.jsonl"))) == 2 and sorted(ids) == list(range(1, STEPS + 1)), ids
    assert ids == samples_per_step(ref)  # each step the same samples, none repeated or skipped


# --------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eco_ref(sample_shards, tmp_path_factory) -> Path:
    """The uninterrupted single launch of 2 ranks, under torchrun (half the deepspeed runner's start-up; the numbers
    are the runner's, check_same_run): the runner is what the two-node launches test."""
    ref = tmp_path_factory.mktemp("eco") / "ref"
    proc = run_torchrun(2, "ds_configs/zero2.json", sets(sample_shards, ref))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return ref


@pytest.fixture(scope="module")
def eco_two_nodes(sample_shards, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("eco_nodes")
    return kill_node1_then_resume(tmp, "ds_configs/zero2.json", sets(sample_shards, tmp / "run"))


@pytest.mark.slow
def test_a_killed_node_stops_its_peer_with_one_line(eco_two_nodes):
    first = eco_two_nodes["first"]
    assert first["rc0"] != 0 and first["latest"] == f"step{EVERY:08d}", first["out0"][-3000:]
    assert first["exit_s"] < 60, first  # gloo reports the closed connection at once (measured: about 5 s in all)
    (line,) = [ln for ln in first["out0"].splitlines() if ln.startswith("[rank 0] error:")]
    assert f"lost contact with another rank during step {KILL_AFTER + 1}" in line, line
    assert f"the last complete checkpoint is step{EVERY:08d}" in line, line
    assert "failed: step 3/4 (stopped by the loss of another rank)" in first["out0"]


@pytest.mark.slow
def test_two_nodes_resume_on_the_single_launch_trajectory(eco_ref, eco_two_nodes):
    check_same_run(eco_ref, eco_two_nodes)


@pytest.mark.slow
def test_one_log_one_metrics_file_one_mlflow_run_for_all_nodes(eco_two_nodes):
    from mlflow.tracking import MlflowClient

    run_dir = eco_two_nodes["run_dir"]
    assert sorted(p.name for p in run_dir.glob("*.log")) == ["train.log"]
    log = (run_dir / "train.log").read_text().splitlines()
    for rank in (0, 1):  # both ranks' lines, of both attempts
        assert sum(ln.startswith(f"[rank {rank}] ==== ") and ln.endswith(" start ====") for ln in log) == 2
    assert any(ln.startswith("[rank 0] ") and "error: lost contact with another rank" in ln for ln in log)
    assert sum(ln.startswith(f"[rank 0] step {STEPS}/{STEPS} |") for ln in log) == 1
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, STEPS + 1))
    client = MlflowClient(tracking_uri=mlflow_store(run_dir))
    (run,) = mlflow_runs(run_dir)
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(1, STEPS + 1))
    for tag in (f"step{EVERY:08d}", f"step{STEPS:08d}"):
        client_state = json.loads((run_dir / "checkpoints" / tag / "client_state.json").read_text())
        assert client_state["mlflow_run_id"] == run.info.run_id, tag


@pytest.mark.slow
def test_expert_parallel_across_two_nodes_resumes_on_the_single_launch_trajectory(protein_shards, protlingo_yaml,
                                                                                   tmp_path):
    """ProtLingo with 4 experts, EP 2: each node holds 2 of them, and tokens cross nodes in the all-to-all."""
    more = ["train.expert_parallel_size=2"]
    ref = tmp_path / "ref"
    proc = run_torchrun(2, "ds_configs/zero2.json", sets(protein_shards, ref, *more, tiny=False),
                        extra=["--config", str(protlingo_yaml)])  # the single launch: torchrun, as eco_ref
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = kill_node1_then_resume(tmp_path, "ds_configs/zero2.json",
                                 sets(protein_shards, tmp_path / "run", *more, tiny=False), config=protlingo_yaml)
    assert run["first"]["rc0"] != 0 and run["first"]["latest"] == f"step{EVERY:08d}"
    check_same_run(ref, run)
    for tag in (f"step{EVERY:08d}", f"step{STEPS:08d}"):  # each node saved its own two experts of each layer
        names = {p.name for p in (tmp_path / "run" / "checkpoints" / tag).iterdir()}
        assert {f"layer_{i}_expert_{e}_mp_rank_00_model_states.pt" for i in (0, 1) for e in range(4)} <= names, names


# --------------------------------------------------------------------------------------------------------------------
def fails_before_training(tmp: Path, overrides: list, node1_overrides: list) -> str:
    """Both nodes exit 2 before step 1, each printing the same one error line; returns it. The ranks are started
    without DeepSpeed's launcher processes (the tests above start those), which halves the time of a launch."""
    nodes = Nodes(tmp, "mismatch", "ds_configs/zero2.json", overrides, node1_overrides, launcher=False)
    rcs = nodes.wait(timeout=120)
    out = [nodes.output(0), nodes.output(1)]
    assert rcs == [2, 2], out[0][-3000:] + out[1][-3000:]
    lines = [[ln for ln in o.splitlines() if ln.startswith(f"[rank {n}] error:")] for n, o in enumerate(out)]
    assert [len(x) for x in lines] == [1, 1], out
    assert lines[0][0].split("error:", 1)[1] == lines[1][0].split("error:", 1)[1]  # one message, on every node
    assert "step 1/" not in out[0] + out[1]
    return lines[0][0]


@pytest.mark.slow
def test_nodes_started_with_different_configs_fail_together(sample_shards, tmp_path):
    line = fails_before_training(tmp_path, sets(sample_shards, tmp_path / "run"), ["train.max_steps=5"])
    assert f"rank 1 (host {socket.gethostname()}) resolved another run than rank 0" in line, line
    assert f"train.max_steps is 5 there and {STEPS} on rank 0" in line, line
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "train.log").exists()


@pytest.mark.slow
def test_a_node_that_does_not_share_run_dir_fails_every_node(sample_shards, tmp_path):
    run, other = tmp_path / "run", tmp_path / "node1_local"
    line = fails_before_training(tmp_path, sets(sample_shards, run), [f"run_dir={other}"])
    assert f"run_dir {other} on rank 1 (host {socket.gethostname()}) does not show the file rank 0" in line, line
    assert "must be on storage every node shares" in line, line
    assert not other.exists()  # rank 1 created nothing
    assert sorted(p.name for p in run.iterdir()) == [".lock"]  # the probe is gone; nothing else was written


@pytest.mark.parametrize("rank, local_rank, printed", [(0, "0", True), (2, "0", True), (3, "1", False)])
def test_an_error_before_the_ranks_connect_reaches_every_nodes_console(rank, local_rank, printed, monkeypatch,
                                                                        capsys):
    """A config error raised alike on a node's ranks before they connect is printed once per node (by its first
    rank): node 1 missing its data must say so on node 1, where rank 0 is not."""
    from pipeline import run_log

    monkeypatch.setenv("LOCAL_RANK", local_rank)
    run_log.report_fatal(rank, "data.train_shards: no such directory", rank_specific=False)
    assert (capsys.readouterr().err == "error: data.train_shards: no such directory\n") == printed
