"""launchers/slurm/pretrain.sbatch, run by bash with stand-ins for SLURM's srun and scontrol on PATH: the ranks it
starts see the rank variables torch and DeepSpeed read, a dry run plans the allocation, and a real 2-task training
runs."""
import stat
import subprocess
import sys

import pytest

from conftest import REPO, TINY, free_port, launch_env, read_jsonl, run_launch

SBATCH = REPO / "launchers" / "slurm" / "pretrain.sbatch"

# srun as SLURM runs a step: SLURM_NTASKS tasks, block-distributed over SLURM_NNODES nodes, each with its
# SLURM_PROCID, SLURM_LOCALID and SLURM_NODEID; it waits for all and returns the first non-zero status.
FAKE_SRUN = r"""#!/usr/bin/env bash
echo "$*" > "$FAKE_SLURM_LOG"
while [[ $1 == -* ]]; do shift; done  # srun's own options (the script passes them as --opt=value)
per=$((SLURM_NTASKS / SLURM_NNODES))
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
  SLURM_PROCID=$i SLURM_LOCALID=$((i % per)) SLURM_NODEID=$((i / per)) "$@" &
  pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do
  wait "$pid" && status=0 || status=$?
  if [[ $rc == 0 && $status != 0 ]]; then rc=$status; fi
done
exit $rc
"""
# scontrol show hostnames LIST: one name per line (the test's node list is comma-separated names)
FAKE_SCONTROL = r"""#!/usr/bin/env bash
[[ $1 == show && $2 == hostnames ]] || { echo "fake scontrol: unsupported: $*" >&2; exit 1; }
tr , '\n' <<< "$3"
"""


@pytest.fixture
def slurm_env(tmp_path) -> dict:
    """The environment a batch job of 2 nodes x 1 task sees, with the fake srun and scontrol first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IXUSR)
    env = launch_env()
    for key in [k for k in env if k.startswith("SLURM_") or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                                    "MASTER_PORT", "LOCAL_WORLD_SIZE", "LOCAL_SIZE")]:
        del env[key]
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="127.0.0.1,localhost",
               SLURM_NNODES="2", SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="1", SLURM_CPUS_PER_TASK="1",
               SLURM_SUBMIT_DIR=str(REPO), MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
               FAKE_SLURM_LOG=str(tmp_path / "srun_args"))
    return env


def sbatch(env: dict, args: list, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SBATCH), "--ds_config", "ds_configs/zero2.json", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def sets(overrides: list) -> list:
    return [a for o in overrides for a in ("--set", o)]


def test_script_parses():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)


def test_dry_run_plans_the_allocation(slurm_env, sample_shards, tmp_path):
    proc = sbatch(slurm_env, ["--dry-run", *sets([f"data.train_shards={sample_shards}",
                                                  f"run_dir={tmp_path / 'run'}", *TINY])], timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "job 4242: 2 ranks on 2 nodes (1 per node), rendezvous 127.0.0.1:" in out
    assert out.count("dry run: resolved without starting anything") == 1  # rank 0 alone prints the plan
    assert "world: 2 ranks = 2 nodes x 1 ranks per node (from the launcher's environment)" in out
    assert "  rank 0 (node 0): stream 0 [" in out and "  rank 1 (node 1): stream 1 [" in out
    assert (tmp_path / "srun_args").read_text().startswith("--kill-on-bad-exit=1 ")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_two_task_training(slurm_env, sample_shards, tmp_path):
    run_dir = tmp_path / "run"
    common = [f"data.train_shards={sample_shards}", f"run_dir={run_dir}", *TINY]
    proc = sbatch(slurm_env, sets([*common, "train.max_steps=2"]), timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    log = (run_dir / "train.log").read_text()
    assert "[rank 0]" in log and "[rank 1]" in log  # two ranks, one process group
    # The plan of continuing that run on one rank names its checkpoint and how it moves (2 ranks x 2 microbatches
    # -> 1 rank x 4 keeps the global batch).
    plan = run_launch([sys.executable, str(REPO / "launchers/pretrain.py"), "--dry-run", "--world-size", "1",
                       "--ds_config", "ds_configs/zero2.json", *sets([*common, "train.grad_accum_steps=4"])],
                      timeout=120)
    assert plan.returncode == 0, plan.stderr
    assert (f"resume: from {run_dir / 'checkpoints' / 'step00000002'} (step 2, written by 2 ranks under ZeRO stage "
            "2), through DeepSpeed's universal checkpoint") in plan.stdout
    assert not (run_dir / "universal").exists()  # planned, not done
