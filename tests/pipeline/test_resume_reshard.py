"""A checkpoint continues on another world size, ZeRO stage or EP size (DeepSpeed's universal checkpoint, or the
consolidated path for expert parallelism, + the loader's fixed streams): the first step's loss is the uninterrupted
run's, later steps follow it, and every step reads the uninterrupted run's samples."""
import shutil
import sys

import pytest

from conftest import REPO, TINY, losses, run_single, run_torchrun, samples_per_step

sys.path.insert(0, str(REPO / "tests" / "pipeline" / "parallel"))
from test_expert_parallel import protein_shards, protlingo_yaml  # noqa: E402,F401  (fixtures)

pytestmark = pytest.mark.slow
STEPS, AT = 6, 3


def overrides(shards, run_dir, ga, *more, config=None):
    return [f"data.train_shards={shards}", f"run_dir={run_dir}", f"train.max_steps={STEPS}",
            *(TINY if config is None else []), f"train.grad_accum_steps={ga}", f"checkpoint.every_steps={AT}",
            "train.log_samples=true", *more]


def train(nproc, stage, shards, run_dir, ga, *more, config=None):
    """A real launch; ``config``: a run config YAML (default: the Eco-RNA demo at TINY size). One rank: one process,
    without a launcher (conftest.run_single), the world of one the checkpoint is resharded to or from; two: torchrun,
    which starts in half the deepspeed runner's time (the launcher is not what these tests are about)."""
    sets, extra = overrides(shards, run_dir, ga, *more, config=config), ["--config", str(config)] if config else []
    ds_config = f"ds_configs/zero{stage}.json"
    proc = run_single(ds_config, sets, extra) if nproc == 1 else run_torchrun(nproc, ds_config, sets, extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def rewind(ref, run_dir):
    """A copy of run ``ref`` as it stood after its step-AT checkpoint (a run preempted there)."""
    shutil.copytree(ref, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / f"step{STEPS:08d}")
    (run_dir / "checkpoints" / "latest").write_text(f"step{AT:08d}")
    return run_dir


def check_continues(ref, run_dir, stdout, moved):
    assert f"resumed from {run_dir / 'checkpoints' / f'step{AT:08d}'} at step {AT} ({moved})" in stdout, stdout[-2000:]
    want, got = losses(ref), losses(run_dir)
    assert abs(got[AT + 1] - want[AT + 1]) <= 1e-5 * abs(want[AT + 1]), (got, want)  # fp32 round-off of the reduction
    # weights and Adam moments moved: the later steps stay on the uninterrupted trajectory
    assert all(abs(got[s] - want[s]) <= 1e-4 * abs(want[s]) for s in range(AT + 2, STEPS + 1)), (got, want)
    ids, want_ids = samples_per_step(run_dir), samples_per_step(ref)
    assert ids == want_ids  # each step the same samples: nothing repeated or skipped
    every = [i for c in ids.values() for i in c.elements()]
    assert len(every) == len(set(every)) == STEPS * 16
    assert not (run_dir / "universal").exists()  # the conversion goes once the run has its own checkpoint


def test_zero2_on_two_ranks_continues_on_one_rank_and_on_two_under_zero3(sample_shards, tmp_path):
    ref = tmp_path / "ref"
    train(2, 2, sample_shards, ref, 2)
    run = rewind(ref, tmp_path / "one_rank")
    out = train(1, 2, sample_shards, run, 4)
    check_continues(ref, run, out, "written by 2 ranks under ZeRO stage 2, continued on 1 under stage 2")
    run = rewind(ref, tmp_path / "zero3")
    out = train(2, 3, sample_shards, run, 2)
    check_continues(ref, run, out, "written by 2 ranks under ZeRO stage 2, continued on 2 under stage 3")


def test_one_rank_checkpoint_continues_on_two_ranks(sample_shards, tmp_path):
    ref = tmp_path / "ref"
    train(1, 2, sample_shards, ref, 4, "data.loader_streams=2")
    run = rewind(ref, tmp_path / "two_ranks")
    out = train(2, 2, sample_shards, run, 2, "data.loader_streams=2")
    check_continues(ref, run, out, "written by 1 ranks under ZeRO stage 2, continued on 2 under stage 2")


def test_expert_parallel_checkpoint_continues_without_ep_on_one_rank_and_under_zero1(protein_shards, protlingo_yaml,
                                                                                     tmp_path):
    ref = tmp_path / "ref"
    train(2, 2, protein_shards, ref, 2, "train.expert_parallel_size=2", config=protlingo_yaml)
    run = rewind(ref, tmp_path / "one_rank")
    out = train(1, 2, protein_shards, run, 4, config=protlingo_yaml)
    check_continues(ref, run, out, "written by 2 ranks under ZeRO stage 2 with EP 2, continued on 1 under stage 2 "
                                   "with EP 1")
    run = rewind(ref, tmp_path / "zero1")
    out = train(2, 1, protein_shards, run, 2, "train.expert_parallel_size=2", config=protlingo_yaml)
    check_continues(ref, run, out, "written by 2 ranks under ZeRO stage 2 with EP 2, continued on 2 under stage 1 "
                                   "with EP 2")
