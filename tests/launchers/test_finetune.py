"""launchers/finetune.py on the training engine, as pretraining is tested: a secondary-structure fine-tune of a
pretrained Eco-RNA (the session's short run) trained on 2 ranks under ZeRO-2 continues on 1 rank on the 2-rank
trajectory (the same samples, the loss normalized by the global count of valid pair cells, fp32 round-off apart), a
1-rank run killed mid-epoch and resumed gives the uninterrupted run's losses bit for bit, the depth sweep of each
run's checkpoint equals, at K = 4, that run's own validation (2 ranks and 1 rank), and the exported model loads where
the repository cannot be imported and predicts what the checkpoint predicts. Without a launch: the command's
refusals, one line each."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import REPO, launch_and_kill, losses, read_jsonl, run_launch, samples_per_step, torchrun

SSP = REPO / "data" / "samples" / "tasks" / "bprna_vl0_sample.csv"
STEPS = 6
TASK_YAML = """\
task:
  name: ssp
  channels: 8
  pos_weight: 20.0  # predicted pairs from the first steps: precision and recall are not both 0
data:
  context_length: 82  # every fixture sequence whole (at most 80 nt)
  loader_streams: 2   # 2 ranks x 1 stream; a continuation on 1 rank reads both in turn
optim:
  lr: 3.0e-3
  lr_scale: {head: 3.0}
  warmup_steps: 2
train:
  max_steps: %d
  micro_batch_size: 4
  log_every: 1
  log_samples: true
eval:
  every: 3
  depths: [1, 4]
  batch_size: 8
checkpoint:
  every_steps: 2
  keep_last: 0
""" % STEPS


@pytest.fixture(autouse=True)
def one_thread():
    """The in-process sweeps and predictions on one thread (tests/pipeline/tasks/test_task_models.py: why)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def finetune_cmd(run_dir, config, source, ga: int, extra=()):
    return [sys.executable, str(REPO / "launchers" / "finetune.py"), "--ds_config", str(REPO / "ds_configs/zero2.json"),
            "--config", str(config), "--init-from", str(source), "--set", f"run_dir={run_dir}",
            "--set", f"train.grad_accum_steps={ga}", *extra]


def rewind(ref, run_dir, step: int):
    """A copy of run ``ref`` as it stood after its step-``step`` checkpoint (a run preempted there)."""
    shutil.copytree(ref, run_dir)
    for ckpt in (run_dir / "checkpoints").glob("step*"):
        if int(ckpt.name[4:]) > step:
            shutil.rmtree(ckpt)
    (run_dir / "checkpoints" / "latest").write_text(f"step{step:08d}")
    kept = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m["step"] <= step]  # what the run had logged then
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in kept))
    return run_dir


@pytest.fixture(scope="module")
def runs(_short_run, tmp_path_factory):
    """two: 2 ranks from the pretrained short run, 6 steps; one: two's step-2 checkpoint continued on 1 rank;
    killed: the same continuation killed after step 5 (its own checkpoint at 4, mid-epoch) and resumed."""
    root = tmp_path_factory.mktemp("finetune")
    shards = root / "ssp"
    r = subprocess.run([sys.executable, str(REPO / "tools" / "prepare_task.py"), "--task", "ssp", "--input", str(SSP),
                        "--output", str(shards), "--val-fraction", "0.2"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    config = root / "ssp.yaml"
    config.write_text(TASK_YAML.replace("data:\n", f"data:\n  train_shards: {shards / 'train'}\n", 1))
    source = _short_run / "run"
    two = finetune_cmd(root / "two", config, source, 1)
    r = run_launch(torchrun(2, REPO / "launchers" / "finetune.py", two[2:]), timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    out = {"two": (root / "two", r.stdout), "shards": shards}
    one = rewind(root / "two", root / "one", 2)
    r = run_launch(finetune_cmd(one, config, source, 2), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out["one"] = (one, r.stdout)
    killed = rewind(root / "two", root / "killed", 2)
    launch_and_kill(finetune_cmd(killed, config, source, 2), killed / "metrics.jsonl", at_step=5)
    assert (killed / "checkpoints" / "latest").read_text() == "step00000004"
    r = run_launch(finetune_cmd(killed, config, source, 2), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out["killed"] = (killed, r.stdout)
    return out


@pytest.mark.slow
def test_two_ranks_under_zero2_continue_on_one_rank_from_the_pretrained_backbone(runs):
    (two, out2), (one, out1) = runs["two"], runs["one"]
    assert "initialized from" in out2 and "(weights)" in out2
    assert f"resumed from {one / 'checkpoints' / 'step00000002'} at step 2" in out1, out1[-2000:]
    a, b = losses(two), losses(one)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    assert all(a[s] == b[s] for s in (1, 2))  # the 2-rank history the continuation kept
    assert all(abs(a[s] - b[s]) <= 1e-4 * abs(a[s]) for s in range(3, STEPS + 1)), (a, b)
    assert samples_per_step(two) == samples_per_step(one)  # the same samples each step
    first = read_jsonl(one / "metrics.jsonl")[0]
    # the normalization's units: the valid pair cells of the step's 8 sequences (L^2 each), not its tokens
    assert first["supervised_tokens"] > 8 * 30 ** 2 and first["supervised_tokens"] != first["tokens"]
    assert a[STEPS] < a[1]


@pytest.mark.slow
def test_a_fine_tune_killed_mid_epoch_resumes_to_the_uninterrupted_losses(runs):
    (killed, out), (one, _) = runs["killed"], runs["one"]
    assert f"resumed from {killed / 'checkpoints' / 'step00000004'} at step 4" in out, out[-2000:]
    loader = json.loads((killed / "checkpoints" / "step00000004" / "client_state.json").read_text())["loader"]
    taken = sum(st["taken"][0] for st in loader[0]["streams"])
    assert 0 < taken < 80  # 32 of the ~100 training records: inside the first epoch
    assert losses(killed) == losses(one)  # bit for bit
    assert samples_per_step(killed) == samples_per_step(one)


@pytest.mark.slow
def test_the_sweep_at_k4_equals_each_runs_validation_on_any_world_size(runs):
    from pipeline.checkpoint import load_trained_model
    from pipeline.eval.task_sweeps import sweep

    for name in ("two", "one"):
        run_dir = runs[name][0]
        val = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "val/f1_K4" in m][-1]
        assert val["step"] == STEPS
        res = sweep(load_trained_model(run_dir), "ssp", runs["shards"] / "val", [1, 2, 4, 8], seed=0)
        k4 = res["per_depth"][4]
        assert k4["tp"] > 0 and k4["fp"] > 0 and k4["fn"] > 0
        for m in ("f1", "precision", "recall"):  # ratios of integer counts: exact on 1 or 2 ranks
            assert k4[m] == val[f"val/{m}_K4"], (name, m)
        assert res["sequences"] == res["records"]  # nothing left out: the validation's records


@pytest.mark.slow
def test_the_export_predicts_what_the_checkpoint_predicts_without_the_repository(runs, tmp_path):
    from pipeline.checkpoint import load_trained_model
    from pipeline.objectives.eco_rna import eval_state

    run_dir = runs["two"][0]
    export = tmp_path / "export"
    r = subprocess.run([sys.executable, str(REPO / "tools" / "convert_checkpoint.py"), "--checkpoint", str(run_dir),
                        "--output", str(export)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["architectures"] == ["EcoRNAForTokenClassification"] and cfg["head"]["name"] == "PairHead"
    seqs = ["GGGAAACCCUUCGAGGCU", "GCCCGAAUAGCUCAGCCGGUUAGAGCACUUGACUG"]
    (tmp_path / "req.json").write_text(json.dumps([{"export": str(export), "auto": "AutoModelForTokenClassification",
                                                    "inputs": seqs, "depths": [1, 4]}]))
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(REPO / "tests" / "tools" / "isolated_task_hf.py"),
                        str(tmp_path / "req.json"), str(tmp_path / "res.json")], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    (res,) = json.loads((tmp_path / "res.json").read_text())
    trained = load_trained_model(run_dir)
    ids, mask = torch.tensor(res["input_ids"]), torch.tensor(res["attention_mask"]).bool()
    with torch.no_grad():
        want = trained.model.at_depths(ids, mask, [1, 4], eval_state(trained.cfg, mask, 0))
    for k in (1, 4):
        assert torch.equal(torch.tensor(res["logits"][str(k)]), want[k]), k


def test_refusals_are_one_line(tmp_path):
    """A task config without a model and nothing to take it from, and one without a task, before anything starts."""
    config = tmp_path / "t.yaml"
    config.write_text("task:\n  name: nrc\ndata:\n  train_shards: nowhere\n")
    r = subprocess.run([sys.executable, str(REPO / "launchers" / "finetune.py"), "--ds_config",
                        str(REPO / "ds_configs/zero2.json"), "--config", str(config), "--set",
                        f"run_dir={tmp_path / 'run'}", "--dry-run"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith(
        "no model: section and nothing to take it from: pass --init-from (a pretraining run, checkpoint or export)")
    config.write_text("data:\n  train_shards: nowhere\n")
    r = subprocess.run([sys.executable, str(REPO / "launchers" / "finetune.py"), "--ds_config",
                        str(REPO / "ds_configs/zero2.json"), "--config", str(config), "--dry-run"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "task: missing" in r.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("name", ["finetune_nrc_demo", "finetune_ssp_demo"])
def test_the_demo_configs_take_their_backbone_from_the_quickstart_run(name, tmp_path):
    """launchers/configs/finetune_*_demo.yaml (scripts/adapt_demo.sh) as launchers/finetune.py reads them: family,
    model, objective (the depth law the backbone adapts at) and the window from a checkpoint of the quickstart's
    config, the task's own keys kept; the secondary-structure demo's --max-length 126 is that window's residues."""
    sys.path.insert(0, str(REPO))
    from launchers import finetune
    from pipeline.config import dump_yaml, load_config

    pre = load_config(REPO / "launchers" / "configs" / "eco_rna_demo.yaml")
    source = tmp_path / "step00000100"
    source.mkdir()
    (source / "client_state.json").write_text("{}")
    (source / "config.yaml").write_text(dump_yaml(pre))
    cfg = finetune.task_config(name, [f"train.init_from={source}", f"run_dir={tmp_path / 'run'}"])
    assert cfg.task.name == name.split("_")[1] and cfg.task.backbone == "full"
    assert (cfg.family, cfg.model, cfg.objective) == (pre.family, pre.model, pre.objective)
    assert cfg.data.context_length == pre.data.context_length == 128
    assert cfg.optim.lr_scale["head"] > 1  # the head faster than the backbone
    assert "--max-length 126" in (REPO / "scripts" / "adapt_demo.sh").read_text()
