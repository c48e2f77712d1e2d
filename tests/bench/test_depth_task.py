"""bench/depth_task.py: the count model is at chance on the task and bad flags exit 2. (The guard that the recurrent
model gains from depth waits for a training setting that learns the task on every seed: docs/depth_task.md.)"""
from bench import depth_task
from data_prep.__main__ import main as data_prep_main


def test_the_best_count_model_is_at_chance(tmp_path):
    """Every level is a permutation of the four values, so the counts of the visible tokens say nothing about the
    answer: the count model fitted on 4,000 training records is within sampling error of 1/4 on 1,000 held-out."""
    assert data_prep_main(["synthetic-hops", "--hops", "3", "--records", "4000", "--seed", "0", "--output",
                           str(tmp_path / "train")]) == 0
    assert data_prep_main(["synthetic-hops", "--hops", "3", "--min-hops", "3", "--records", "1000", "--seed", "1",
                           "--exclude", str(tmp_path / "train"), "--output", str(tmp_path / "held")]) == 0
    acc = depth_task.count_model(tmp_path / "train", tmp_path / "held")
    assert abs(acc - 0.25) < 0.05, acc  # 4 sd of a binomial(1000, 1/4) is 0.055


def test_bad_flags_exit_2(tmp_path, capsys):
    assert depth_task.main(["--out", str(tmp_path), "--hops", "1"]) == 2
    assert "--hops must lie in 2 .. 7" in capsys.readouterr().err
    assert depth_task.main(["--out", str(tmp_path), "--models", "control-1"]) == 2
    assert "--models" in capsys.readouterr().err
    assert not (tmp_path / "depth_task.json").exists()

