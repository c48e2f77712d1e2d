"""A changed config never resumes silently. Rerunning a finished run with ``--set optim.lr=...`` resumed it, did 0
steps and printed ``loss: final nan``; a changed model config resumed into DeepSpeed's RuntimeError traceback. Now a
resume whose config differs from its checkpoint's (beyond budgets, cadences, tracking and validation) is refused in
one line listing each change with both values; --allow-config-change continues and logs the diff in train.log; a
finished run asked for no more steps says so and exits 0."""
import pytest

from conftest import SAMPLE_FASTA, TINY, read_jsonl, run_single

pytestmark = pytest.mark.slow  # DeepSpeed training launches


def train(shards, run_dir, steps, *sets, extra=()):
    # the config of the short run (conftest) but for max_steps and *sets
    return run_single("ds_configs/zero2.json", TINY + [
        f"data.train_shards={shards}", f"run_dir={run_dir}", f"train.max_steps={steps}", "checkpoint.every_steps=2",
        "checkpoint.keep_last=0", *sets], list(extra), timeout=300)


def error_line(proc) -> str:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    return line


def test_a_changed_config_is_refused_listed_or_logged(sample_shards, short_run):
    assert SAMPLE_FASTA.is_file()
    shards, run = sample_shards, short_run  # finished at train.max_steps 4 (conftest)
    metrics = (run / "metrics.jsonl").read_bytes()
    ckpt = run / "checkpoints" / "step00000004"

    # The quickstart rerun with another learning rate (and seed): refused, each key with both values, nothing written.
    line = error_line(train(shards, run, 4, "optim.lr=0.002", "seed=7"))
    assert line.startswith(f"error: the config differs from the one checkpoint {ckpt} trained with (optim.lr: 0.003 "
                           "-> 0.002; seed: 1234 -> 7): ") and "another run_dir" in line and "--allow-config-change" in line, line
    assert (run / "metrics.jsonl").read_bytes() == metrics

    # Unchanged and finished: nothing to do, no NaN anywhere.
    done = train(shards, run, 4, "train.log_every=5")  # a key that may change on resume
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"run {run} already finished at step 4 (train.max_steps 4)" in done.stdout, done.stdout
    assert "nan" not in (done.stdout + done.stderr).lower()

    # Another model: refused before DeepSpeed, even with --allow-config-change (the weights are its own model's).
    line = error_line(train(shards, run, 6, "model.d_ff=96"))
    assert "(model.d_ff: 128 -> 96)" in line, line
    line = error_line(train(shards, run, 6, "model.d_ff=96", extra=["--allow-config-change"]))
    assert line.startswith(f"error: model.d_ff: checkpoint {ckpt} holds the weights of its own model "
                           "(model.d_ff: 128 -> 96); "), line

    # With the flag the run continues, and the change is in train.log.
    go = train(shards, run, 5, "optim.lr=0.002", extra=["--allow-config-change"])
    assert go.returncode == 0, go.stderr[-3000:]
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    log = (run / "train.log").read_text()
    assert "config changed since checkpoint step00000004 (--allow-config-change): optim.lr: 0.003 -> 0.002" in log
