"""BabyLM rules in the engine: running words total, checkpoints at word milestones, stop at the word budget."""
import subprocess
import sys

import pytest

from conftest import REPO, SHARED_DATA, read_jsonl, run_launch

TEXT = SHARED_DATA / "text"


pytestmark = [pytest.mark.slow, pytest.mark.skipif(not TEXT.is_dir(), reason="needs ../shared/data (English text "
                                                                               "for the sentencepiece model)")]


@pytest.fixture(scope="module")
def babylm_shards(tmp_path_factory):
    """Real English text -> sentencepiece BPE -> babylm shards, through the data_prep CLI."""
    tmp = tmp_path_factory.mktemp("babylm")
    texts = [str(TEXT / "tinyshakespeare.txt"), str(TEXT / "switchboard_swda_val_set.txt")]
    spm, shards = tmp / "spm" / "demo", tmp / "shards"
    for cmd in (["train-spm", "--input", *texts, "--output", str(spm), "--vocab-size", "2048"],
                ["babylm", "--spm", f"{spm}.model", "--input", *texts, "--output", str(shards),
                 "--shard-size", "4000"]):
        proc = subprocess.run([sys.executable, "-m", "data_prep", *cmd], cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    return shards


def demo_command(run_dir, shards, *overrides):
    launch = [sys.executable, str(REPO / "launchers/pretrain.py"), "--ds_config", str(REPO / "ds_configs/zero1.json"),
              "--config", str(REPO / "launchers/configs/recursive_gpt_demo.yaml")]
    for o in [f"run_dir={run_dir}", f"data.train_shards={shards}", "train.max_steps=200",
              "checkpoint.every_steps=1000", "tracking.enabled=false", *overrides]:
        launch += ["--set", o]
    return launch


def test_word_budget_and_milestones(babylm_shards, tmp_path):
    run_dir = tmp_path / "run"
    launch = demo_command(run_dir, babylm_shards, "train.max_words=2500", "checkpoint.at_words=[1000,2000]")
    proc = run_launch(launch)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    totals = [m["total/words"] for m in metrics]
    assert totals == sorted(totals) and totals[-1] >= 2500 > totals[-2]  # stopped at the first step past the budget
    assert sum(m["words"] for m in metrics) == totals[-1]
    first = lambda w: next(m["step"] for m in metrics if m["total/words"] >= w)  # noqa: E731
    tags = sorted(p.name for p in (run_dir / "checkpoints").glob("step*"))
    assert tags == [f"step{first(1000):08d}", f"step{first(2000):08d}", f"step{metrics[-1]['step']:08d}"]
    # resuming after the budget is spent trains nothing more
    again = run_launch(launch)
    assert again.returncode == 0 and read_jsonl(run_dir / "metrics.jsonl") == metrics


def test_epoch_budget(babylm_shards, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_launch(demo_command(run_dir, babylm_shards, "train.max_epochs=0.01"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert metrics[-1]["epochs"] >= 0.01 > metrics[-2]["epochs"]
    assert metrics[-1]["total/samples"] == sum(m["samples"] for m in metrics)
    assert metrics[0]["loss"] > metrics[-1]["loss"]  # packed real English text: the loss falls
