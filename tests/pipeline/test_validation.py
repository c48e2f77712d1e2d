"""Validation on a cadence (pipeline/validation.py, eval.* and checkpoint.keep_best): real 2-process launches on the
val split data_prep --val-fraction writes, compared with launchers/evaluate.py on the same checkpoint and set, across
world sizes and ZeRO stages, through a kill and resume; and the checks at start."""
import re
import subprocess
import sys

import pytest

from conftest import (REPO, SAMPLE_FASTA, TINY, launch_and_kill, mlflow_runs, mlflow_store, read_jsonl, run_launch,
                      run_pretrain, run_torchrun, torchrun_pretrain)
from golden.cases import CASES, REL
from prewarmed import run_python

DEPTHS = [1, 2, 4]
# 208 validation sequences in batches of 16: 13 batches, so rank 1 of 2 runs one lockstep pass it does not count.
ECO = [*TINY, "train.max_steps=6", "eval.every=2", "eval.max_samples=null", "eval.batch_size=16",
       f"eval.depths=[{','.join(map(str, DEPTHS))}]", "checkpoint.every_steps=3", "checkpoint.keep_last=1",
       # the highest loss is the "best": the first evaluation's checkpoint, which keep_last 1 would otherwise delete
       "checkpoint.keep_best=val/loss_K4", "checkpoint.best_mode=max", "tracking.enabled=false",
       "optim.lr=3e-3"]


def val_records(run_dir) -> dict:
    """{step: {val/...}} of a run's metrics.jsonl (asserting no step is logged twice)."""
    recs = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "val/seconds" in m]
    steps = [m["step"] for m in recs]
    assert len(steps) == len(set(steps)), f"an evaluation was logged twice: {steps}"
    return {m["step"]: {k: v for k, v in m.items() if k.startswith("val/")} for m in recs}


def same(a: dict, b: dict, keys=None, rel=1e-6):
    keys = keys or [k for k in b if k not in ("val/seconds", "val/time_share")]
    assert keys
    for k in keys:
        assert a[k] == pytest.approx(b[k], rel=rel, abs=1e-9), (k, a[k], b[k])


def evaluate_cli(checkpoint, data, out, *extra) -> dict:
    """launchers/evaluate.py --task validation in its own process: {metric: value} from its JSON (``out``)."""
    import json

    r = run_python(["launchers/evaluate.py", "--checkpoint", str(checkpoint), "--task", "validation", "--data",
                    str(data), "--trust-checkpoint", "--no-mlflow", "--output", str(out), *extra], REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(out.read_text())["metrics"]


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    out = tmp_path_factory.mktemp("val") / "rna"
    subprocess.run([sys.executable, "-m", "data_prep", "rnacentral", "--input", str(SAMPLE_FASTA), "--output",
                    str(out), "--shard-size", "300", "--val-fraction", "0.1"], cwd=REPO, check=True,
                   capture_output=True)
    return out


@pytest.fixture(scope="module")
def eco_run(split, tmp_path_factory):
    """The quickstart's way in (scripts/launch.sh, 2 ranks, ZeRO-2, validating), whose console and train.log carry
    only the training's own lines: no DeepSpeed accelerator detection or CUDA_VISIBLE_DEVICES line on a CPU host, no
    torch FutureWarning (DeepSpeed's deprecated all_gather_into_tensor, at every step), and every step line ends
    with the elapsed time and an ETA."""
    import torch

    run = tmp_path_factory.mktemp("eco") / "run"
    sets = [*ECO, f"run_dir={run}", f"data.train_shards={split}/train", "tracking.enabled=true"]  # beside: mlflow.db
    r = run_launch(["env", f"PY={sys.executable}", "NPROC=2", "bash", str(REPO / "scripts" / "launch.sh"),
                    str(REPO / "launchers" / "pretrain.py"), "--ds_config", str(REPO / "ds_configs" / "zero2.json"),
                    *sum((["--set", o] for o in sets), [])])
    assert r.returncode == 0, r.stderr[-3000:]
    log = (run / "train.log").read_text()
    for text in (r.stdout + r.stderr, log):
        assert "FutureWarning" not in text and "Setting accelerator" not in text, text[-3000:]
        if not torch.cuda.is_available():
            assert "CUDA_VISIBLE_DEVICES" not in text, text[-3000:]
    steps = [ln for ln in r.stdout.splitlines() if ln.startswith("step ")]
    assert len(steps) == 6 and all(re.search(r" \| elapsed \d+s eta \d+s$", ln) for ln in steps), steps
    assert steps[-1].endswith(" eta 0s") and "==== run " in r.stdout
    return run


@pytest.mark.slow
def test_eco_rna_validates_every_2_steps_as_evaluate_does_and_keeps_best(eco_run, split):
    from launchers.evaluate import run_reconstruction
    from pipeline.checkpoint import load_trained_model

    val = val_records(eco_run)
    assert sorted(val) == [2, 4, 6]
    assert set(val[6]) >= {f"val/{m}_K{k}" for m in ("loss", "accuracy") for k in DEPTHS}
    # the same numbers as evaluate.py's reconstruction runner on the same checkpoint and set (all 208 sequences)
    per_k = run_reconstruction(load_trained_model(eco_run), split / "val", DEPTHS, seed=0)["per_depth"]
    assert per_k["1"]["tokens"] > 1000
    same(val[6], {f"val/{m}_K{k}": per_k[str(k)][m] for k in DEPTHS for m in ("loss", "accuracy")})
    assert val[2]["val/loss_K4"] > val[6]["val/loss_K4"]  # it learns (and so step 2 is the "best" of mode max)
    ckpts = eco_run / "checkpoints"
    assert (ckpts / "best").read_text().strip() == "step00000002"
    # keep_last 1 kept the latest and the best; steps 3 and 4 (periodic, and step 4 not an improvement) are gone
    assert sorted(p.name for p in ckpts.glob("step*")) == ["step00000002", "step00000006"]
    assert (eco_run / "validation.png").stat().st_size > 0
    # MLflow: every step's loss (the validation steps' too: one record per step) and the validation with its plot
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_store(eco_run))
    (run,) = mlflow_runs(eco_run)
    run_id = run.info.run_id
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == [1, 2, 3, 4, 5, 6]
    assert sorted(m.step for m in client.get_metric_history(run_id, "val/loss_K4")) == [2, 4, 6]
    assert "validation.png" in [a.path for a in client.list_artifacts(run_id)]


@pytest.mark.slow
def test_the_same_weights_give_the_same_validation_on_any_world_size_and_zero_stage(eco_run, split, tmp_path):
    """--init-from the finished run, one step at lr 1e-12 (Adam moves a weight by about lr: the weights stay the
    checkpoint's far below the tolerance), validation after it: every layout must give evaluate.py's single-process
    numbers."""
    want = evaluate_cli(eco_run / "checkpoints" / "step00000006", split / "val", tmp_path / "eval.json", "--depths",
                        "1,2,4")
    for nproc, ds in ((1, "zero2"), (2, "zero1"), (2, "zero3")):
        run = tmp_path / f"{ds}-{nproc}"
        r = run_pretrain(nproc, f"ds_configs/{ds}.json",
                         [*ECO, f"run_dir={run}", f"data.train_shards={split}/train", f"train.init_from={eco_run}",
                          "optim.lr=1e-12", "train.max_steps=1", "eval.every=1", "checkpoint.keep_best=null"])
        assert r.returncode == 0, (ds, nproc, r.stderr[-3000:])
        same(val_records(run)[1], want)
        # the deepspeed runner without scripts/launch.sh: the ranks themselves keep train.log free of DeepSpeed's
        # accelerator detection and of its deprecated all-gather's FutureWarning (ZeRO-3's parameter gathers too)
        log = (run / "train.log").read_text()
        assert "Setting accelerator" not in log and "FutureWarning" not in log, log[-3000:]


@pytest.mark.slow
def test_kill_and_resume_neither_repeats_nor_skips_an_evaluation(eco_run, split, tmp_path):
    """Killed after step 5 (checkpoint at 3, evaluation at 4 done): the resumed run redoes steps 4-6 and logs each
    evaluation once, with the uninterrupted run's values; best still names step 2."""
    run = tmp_path / "run"
    over = [*ECO, f"run_dir={run}", f"data.train_shards={split}/train"]
    # torchrun (half the runner's start-up): eco_run's ranks had one thread each too, so the same numbers
    launch_and_kill(torchrun_pretrain(2, "ds_configs/zero2.json", over), run / "metrics.jsonl", at_step=5)
    assert 4 in val_records(run)
    r = run_torchrun(2, "ds_configs/zero2.json", over)
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = val_records(run), val_records(eco_run)
    assert sorted(got) == [2, 4, 6]
    for step in (2, 4, 6):
        same(got[step], want[step])
    assert (run / "checkpoints" / "best").read_text().strip() == "step00000002"


def protein_split(tmp_path):
    """300 UniRef90 sample records through data_prep uniref --val-fraction 0.2 (DIR/train, DIR/val)."""
    import gzip

    fa = tmp_path / "p.fa"
    text = gzip.decompress((REPO / "data" / "samples" / "uniref90_clusters_sample.fasta.gz").read_bytes()).decode()
    fa.write_text(">" + ">".join(text.split(">")[1:301]))
    out = tmp_path / "protein"
    subprocess.run([sys.executable, "-m", "data_prep", "uniref", "--input", str(fa), "--output", str(out),
                    "--shard-size", "60", "--max-length", "1000", "--val-fraction", "0.2"], cwd=REPO, check=True,
                   capture_output=True)
    return out


def text_split(tmp_path):
    """Lines of this repository's sources through data_prep babylm --val-fraction 0.1, with the golden text set's
    512-piece sentencepiece model (the tiny config's vocabulary)."""
    corpus = tmp_path / "corpus.txt"
    lines = "".join(p.read_text() for p in sorted((REPO / "pipeline").glob("*.py"))).splitlines()
    corpus.write_text("\n".join(ln for ln in lines[:3000] if ln.strip()) + "\n")
    out = tmp_path / "text"
    subprocess.run([sys.executable, "-m", "data_prep", "babylm", "--spm", str(REPO / REL / "data" / "text" /
                    "tokenizer.model"), "--input", str(corpus), "--output", str(out), "--shard-size", "500",
                    "--val-fraction", "0.1"], cwd=REPO, check=True, capture_output=True)
    return out


FAMILY_CASES = {  # the golden tiny config; its data split by data_prep --val-fraction; eval.max_samples
    "protlingo": ("protlingo_zero2", protein_split, "null"),
    "recursive_gpt": ("recursive_gpt_zero2", text_split, "60"),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILY_CASES))
def test_each_family_validates_as_evaluate_does(family, tmp_path):
    case, make_split, limit = FAMILY_CASES[family]
    config, ds, over = CASES[case]
    split = make_split(tmp_path)
    run, val_dir = tmp_path / "run", split / "val"  # val/ is found beside train/
    r = run_torchrun(2, ds, [*over, f"run_dir={run}", f"data.train_shards={split / 'train'}", "train.max_steps=6",
                             "train.log_every=1", "eval.every=2", "eval.batch_size=8", f"eval.max_samples={limit}",
                             "checkpoint.every_steps=6", "tracking.enabled=false"], ["--config", config])
    assert r.returncode == 0, r.stderr[-3000:]
    val = val_records(run)
    assert sorted(val) == [2, 4, 6]
    assert val[6]["val/perplexity"] == pytest.approx(2.718281828459045 ** val[6]["val/loss"], rel=1e-9)
    assert val[2]["val/loss"] > val[6]["val/loss"]
    same(val[6], evaluate_cli(run / "checkpoints" / "step00000006", val_dir, tmp_path / "eval.json"))
    if family == "protlingo":
        # routing and memory usage on the held-out set
        assert {"val/moe/L00/entropy", "val/moe/L00/effective_experts", "val/memory/L01/rows_per_batch"} <= set(val[6])
        assert not any(k.endswith("rows_addressed") for k in val[6])  # training state, not the held-out set
        assert 0 < val[6]["val/moe/L00/entropy"] <= 1
        # and paper 002's ablation metric, evaluate.py --task mlm (pipeline/eval/mlm.py), on the same proteins (all)
        from launchers.evaluate import run_mlm
        from pipeline.checkpoint import load_trained_model

        mlm = run_mlm(load_trained_model(run), val_dir, seed=0, batch_size=32)
        assert mlm["loss"] == pytest.approx(val[6]["val/loss"], rel=1e-6)


def test_validation_is_refused_at_start_when_it_cannot_run(tmp_path):
    from pipeline.config import ConfigError, load_config
    from pipeline.families import get_family
    from pipeline.validation import check_validation

    eco = REPO / "launchers" / "configs" / "eco_rna_demo.yaml"
    with pytest.raises(ConfigError, match="checkpoint.keep_best: needs validation"):
        load_config(eco, ["checkpoint.keep_best=val/loss_K4"])
    with pytest.raises(ConfigError, match="checkpoint.keep_best: must name a validation metric"):
        load_config(eco, ["checkpoint.keep_best=loss", "eval.every=2"])
    cfg = load_config(eco, ["eval.every=2", f"data.train_shards={REL}/data/rna"])
    with pytest.raises(ConfigError, match=r"data.val_shards: eval.every is set but there is no validation set"):
        check_validation(cfg, get_family(cfg.family))
    # protein shards for an RNA model: refused like training shards, naming the key
    cfg = load_config(eco, ["eval.every=2", f"data.val_shards=[{REPO / REL / 'data' / 'protein'}]"])
    with pytest.raises(ConfigError, match=r"data.val_shards: .*holds ESM-2 amino-acid tokens"):
        check_validation(cfg, get_family(cfg.family))
    assert check_validation(load_config(eco), get_family("eco_rna")) == []  # eval.every 0: nothing read


def test_a_rollback_points_best_at_the_resumed_timelines_best(tmp_path):
    """After a rollback moved the checkpoint ``best`` named aside, ``best`` names the resumed timeline's best
    (client_state val_best) when that checkpoint exists, and nothing when it does not."""
    from types import SimpleNamespace

    from pipeline.checkpoint.io import Checkpointer

    ckpts = tmp_path / "checkpoints"
    for tag in ("step00000002", "step00000004"):
        (ckpts / tag).mkdir(parents=True)
    (ckpts / "best").write_text("step00000006")  # moved to abandoned_after_step00000004_*
    Checkpointer._repoint_best(SimpleNamespace(ckpt_dir=ckpts), (1.5, 2))
    assert (ckpts / "best").read_text().strip() == "step00000002"
    (ckpts / "best").write_text("step00000006")
    Checkpointer._repoint_best(SimpleNamespace(ckpt_dir=ckpts), (1.5, 3))  # step 3 not kept
    assert not (ckpts / "best").exists()
    (ckpts / "best").write_text("step00000004")  # still there: left alone
    Checkpointer._repoint_best(SimpleNamespace(ckpt_dir=ckpts), (1.5, 2))
    assert (ckpts / "best").read_text().strip() == "step00000004"
