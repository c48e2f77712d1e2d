"""The BabyLM word milestones end to end on the documented demo (issue 53, acceptance 3): a training with the
challenge's schedule scaled down (checkpoint.at_words: babylm/1000, every 1,000 words to 10,000, then every 10,000)
saves each milestone at the step that reaches it, keeps it while keep_last: 1 rotates the others, and after a SIGKILL
and a resume holds each milestone exactly once; tools/convert_checkpoint.py --milestones exports them as chck_*K
folders that load with AutoModelForCausalLM, and launchers/evaluate.py --milestones scores every one of them and plots
the tasks against words seen."""
import json
import subprocess
import sys

import pytest

from conftest import REPO, launch_and_kill, launch_env, read_jsonl, run_launch

pytestmark = pytest.mark.slow
SAMPLES = [REPO / "data" / "samples" / "babylm_alice_train_sample.txt.gz",
           REPO / "data" / "samples" / "babylm_shakespeare_train_sample.txt.gz"]


def command(run_dir, shards):
    cmd = [sys.executable, str(REPO / "launchers/pretrain.py"), "--ds_config", str(REPO / "ds_configs/zero1.json"),
           "--config", str(REPO / "launchers/configs/recursive_gpt_demo.yaml")]
    for o in [f"run_dir={run_dir}", f"data.train_shards={shards}", "train.max_steps=30", "checkpoint.every_steps=4",
              "checkpoint.keep_last=1", "checkpoint.at_words=babylm/1000", "tracking.enabled=false",
              "train.log_every=1"]:
        cmd += ["--set", o]
    return cmd


def test_milestones_saved_kept_resumed_exported_and_scored(tmp_path):
    spm, shards = tmp_path / "spm" / "m", tmp_path / "shards"
    for cmd in (["train-spm", "--input", *map(str, SAMPLES), "--output", str(spm), "--vocab-size", "2048"],
                ["babylm", "--spm", f"{spm}.model", "--input", *map(str, SAMPLES), "--output", str(shards),
                 "--shard-size", "4000"]):
        proc = subprocess.run([sys.executable, "-m", "data_prep", *cmd], cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    run_dir = tmp_path / "run"
    launch_and_kill(command(run_dir, shards), run_dir / "metrics.jsonl", at_step=9)  # killed between checkpoints
    proc = run_launch(command(run_dir, shards), timeout=400)  # resumes from the last checkpoint
    assert proc.returncode == 0, proc.stderr[-3000:]

    words = {m["step"]: m["total/words"] for m in read_jsonl(run_dir / "metrics.jsonl")}  # the resumed run's view
    steps = sorted(words)
    assert steps == list(range(1, 31))
    schedule = [1000 * i for i in range(1, 11)] + [20000, 30000, 40000]
    want = {}
    for w in schedule:
        first = next((s for s in steps if words[s] >= w), None)
        if first is not None:
            want.setdefault(f"step{first:08d}", []).append(w)
    ckpts = run_dir / "checkpoints"
    flagged = {}
    for tag in sorted(p.name for p in ckpts.glob("step*")):
        client = json.loads((ckpts / tag / "client_state.json").read_text())
        if client["milestone"]:
            flagged[tag] = client["cumulative"]["words"]
            assert client["cumulative"]["words"] == words[int(tag[4:])]  # the exact words seen, recorded
    assert sorted(flagged) == sorted(want), (flagged, want)  # each milestone once, none rotated away
    assert len(want) >= 10  # the schedule's first ten milestones fall in 30 steps of the demo
    periodic = [p.name for p in ckpts.glob("step*") if p.name not in flagged]
    assert periodic == ["step00000030"]  # keep_last 1: the other periodic checkpoints were rotated

    export = tmp_path / "export"
    proc = run_launch([sys.executable, str(REPO / "tools/convert_checkpoint.py"), "--checkpoint", str(run_dir),
                       "--output", str(export), "--milestones"], timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = sorted((p.name for p in export.glob("chck_*")), key=lambda n: int(n[5:-1]))
    assert names == [f"chck_{w // 1000}K" for ws in want.values() for w in ws][:len(names)]
    assert len(names) == sum(len(ws) for ws in want.values())
    from transformers import AutoModelForCausalLM

    for name in names:
        meta = json.loads((export / name / "export.json").read_text())["milestone"]
        assert meta["words"] >= meta["target"] == int(name[5:-1]) * 1000
        AutoModelForCausalLM.from_pretrained(str(export / name), trust_remote_code=True)

    out = tmp_path / "curve.json"
    proc = subprocess.run([sys.executable, str(REPO / "launchers/evaluate.py"), "--checkpoint", str(export),
                           "--task", "babylm", "--data", str(REPO / "tests" / "fixtures" / "babylm_eval"),
                           "--milestones", "--output", str(out), "--no-mlflow"], cwd=REPO, env=launch_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [m["name"] for m in res["milestones"]] == names
    assert res["columns"][0] == "words" and "comps" in res["columns"] and "blimp_filtered" in res["columns"]
    assert [r[0] for r in res["table"]] == [m["words"] for m in res["milestones"]]
    assert (tmp_path / "curve-vs-words.png").is_file()
