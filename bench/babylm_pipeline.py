#!/usr/bin/env python
r"""Check an export against the BabyLM 2025 evaluation pipeline itself (babylm/evaluation-pipeline-2025, a checkout
you pass; nothing of it is copied here):

    python bench/babylm_pipeline.py --pipeline PIPELINE_CHECKOUT --export EXPORT \
        --data tests/fixtures/babylm_eval [--out DIR] [--finetune-data DIR]

1. zero-shot: for every task folder of --data (blimp_filtered, supplement_filtered, ewok_filtered, entity_tracking,
   comps, wug_*), ``python -m evaluation_pipeline.sentence_zero_shot.run --backend causal --save_predictions`` in the
   checkout, then ``launchers/evaluate.py --task babylm`` on the same folder (at the export's default depth); the
   per-item predictions (predictions.json) must be identical, item by item. Both are timed, the pipeline summed over
   its one process per task, evaluate.py as its one process (model loading and imports included in both).
2. fine-tuning: ``python -m evaluation_pipeline.finetune.run`` for one epoch on a GLUE-format file pair
   (rte.train.jsonl / rte.valid.jsonl: sentence1, sentence2, label; --finetune-data, default
   tests/fixtures/babylm_glue), the path eval_finetuning.sh takes: AutoModel.from_pretrained(trust_remote_code=True),
   config.hidden_size, last_hidden_state.

Prints one line per task (items, identical predictions, both averages), the times and their ratio, and the
fine-tuning's metrics, and RESULT lines (BABYLM.time, BABYLM.agree; docs/benchmarks.md); exits 1 when a prediction differs or a run fails, 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# the pipeline's --task for each folder (its eval_zero_shot.sh)
PIPELINE_TASK = {"blimp_filtered": "blimp", "supplement_filtered": "blimp", "blimp_fast": "blimp",
                 "supplement_fast": "blimp", "ewok_filtered": "ewok", "ewok_fast": "ewok",
                 "entity_tracking": "entity_tracking", "entity_tracking_fast": "entity_tracking",
                 "wug_adj_nominalization": "wug_adj", "wug_past_tense": "wug_past", "comps": "comps"}


def run(cmd: list, cwd: Path, log: Path) -> tuple[int, float]:
    """(exit code, seconds) of ``cmd``, its output into ``log``."""
    t = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(cwd), "TQDM_DISABLE": "1", "WANDB_MODE": "disabled"}
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
    return rc, time.perf_counter() - t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pipeline", required=True, type=Path, help="a checkout of babylm/evaluation-pipeline-2025")
    p.add_argument("--export", required=True, type=Path, help="an export of tools/convert_checkpoint.py")
    p.add_argument("--data", required=True, type=Path, help="a folder of task folders (evaluation_data/full_eval)")
    p.add_argument("--out", type=Path, default=Path("runs/babylm_pipeline_check"), help="results and logs")
    p.add_argument("--finetune-data", type=Path, default=REPO / "tests" / "fixtures" / "babylm_glue",
                   help="rte.train.jsonl and rte.valid.jsonl (GLUE format); 'none' skips the fine-tuning")
    args = p.parse_args(argv)
    if not (args.pipeline / "evaluation_pipeline" / "sentence_zero_shot" / "run.py").is_file():
        print(f"error: {args.pipeline}: not a checkout of babylm/evaluation-pipeline-2025 "
              "(no evaluation_pipeline/sentence_zero_shot/run.py)", file=sys.stderr)
        return 2
    if not (args.export / "config.json").is_file():
        print(f"error: {args.export}: not an export (no config.json)", file=sys.stderr)
        return 2
    folders = [d.name for d in sorted(args.data.iterdir()) if d.is_dir() and d.name in PIPELINE_TASK] \
        if args.data.is_dir() else []
    if not folders:
        print(f"error: {args.data}: no BabyLM task folder in it ({', '.join(PIPELINE_TASK)})", file=sys.stderr)
        return 2
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    export, data = args.export.resolve(), args.data.resolve()
    py = sys.executable
    failed = False

    pipeline_seconds = 0.0
    for folder in folders:
        rc, sec = run([py, "-m", "evaluation_pipeline.sentence_zero_shot.run", "--model_path_or_name", str(export),
                       "--backend", "causal", "--task", PIPELINE_TASK[folder], "--data_path", str(data / folder),
                       "--save_predictions", "--output_dir", str(out / "pipeline")], args.pipeline,
                      out / f"pipeline-{folder}.log")
        pipeline_seconds += sec
        if rc:
            print(f"pipeline failed on {folder} (exit {rc}): {out / f'pipeline-{folder}.log'}")
            failed = True
    ours = out / "evaluate.json"
    rc, ours_seconds = run([py, str(REPO / "launchers" / "evaluate.py"), "--checkpoint", str(export), "--task",
                            "babylm", "--data", str(data), "--output", str(ours), "--no-mlflow"], REPO,
                           out / "evaluate.log")
    if rc:
        print(f"evaluate.py failed (exit {rc}): {out / 'evaluate.log'}")
        return 1
    result = json.loads(ours.read_text())
    k = str(result["table"][0][0])
    total = same = 0
    for folder in folders:
        found = list((out / "pipeline").glob(f"*/main/zero_shot/causal/{PIPELINE_TASK[folder]}/{folder}/"
                                               "predictions.json"))
        if not found:
            continue
        theirs = json.loads(found[0].read_text())
        mine = result["tasks"][folder]["per_depth"][k]["predictions"]
        pairs = [(t, m) for uid in theirs for t, m in zip(theirs[uid]["predictions"],
                                                          mine.get(uid, {}).get("predictions", []))]
        n = sum(len(v["predictions"]) for v in theirs.values())
        agree = sum(t["id"] == m["id"] and t["pred"] == m["pred"] for t, m in pairs)
        total, same = total + n, same + agree
        report = (found[0].parent / "best_temperature_report.txt").read_text().split("### AVERAGE")[-1].split()
        mine_avg = result["tasks"][folder]["per_depth"][k]
        avg = mine_avg.get("macro_accuracy", mine_avg.get("average", mine_avg.get("spearman")))
        scale = 1 if "spearman" in mine_avg else 100
        print(f"{folder}: {agree}/{n} predictions identical; average: pipeline {report[-1]}, "
              f"evaluate.py {avg * scale:.2f}")
        failed |= agree != n
    print(f"zero-shot: {same}/{total} predictions identical over {len(folders)} task folders (K = {k})")
    print(f"time: pipeline {pipeline_seconds:.1f} s ({len(folders)} processes), evaluate.py {ours_seconds:.1f} s "
          f"(one process): evaluate.py / pipeline = {ours_seconds / pipeline_seconds:.2f}")
    print(f"RESULT BABYLM.time {ours_seconds / pipeline_seconds:.3f} evaluate.py / the BabyLM pipeline, wall time on "
          f"the same files, target <= 1")
    print(f"RESULT BABYLM.agree {same / max(total, 1):.4f} predictions identical, target 1")

    ft = args.finetune_data
    if str(ft) != "none":
        rc, sec = run([py, "-m", "evaluation_pipeline.finetune.run", "--model_name_or_path", str(export),
                       "--train_data", str(ft.resolve() / "rte.train.jsonl"),
                       "--valid_data", str(ft.resolve() / "rte.valid.jsonl"),
                       "--predict_data", str(ft.resolve() / "rte.valid.jsonl"), "--task", "rte", "--num_labels", "2",
                       "--batch_size", "4", "--valid_batch_size", "8", "--num_epochs", "1", "--sequence_length", "64",
                       "--results_dir", str(out / "finetune"), "--metrics", "accuracy", "f1", "mcc",
                       "--metric_for_valid", "accuracy"], args.pipeline, out / "finetune.log")
        results = list((out / "finetune").glob("*/main/finetune/rte/results.txt"))
        if rc or not results:
            print(f"fine-tuning failed (exit {rc}): {out / 'finetune.log'}")
            failed = True
        else:
            metrics = ", ".join(results[0].read_text().split("\n"))
            print(f"fine-tuning (finetune.run, rte, 1 epoch): {metrics} ({sec:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
