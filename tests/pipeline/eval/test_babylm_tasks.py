"""The BabyLM 2025 zero-shot tasks (BLiMP, its supplement, COMPS, EWoK, Entity Tracking, the wug tasks) scored by
launchers/evaluate.py's benchmarks (pipeline/eval/benchmarks.py) equal an independent computation with plain
transformers on the export: the files decoded here as the pipeline's read_files.py decodes them, each option's whole
sentence through AutoTokenizer with offsets (<s> first), the completion's tokens those whose span ends after the
completion's first character, summed log-softmax of AutoModelForCausalLM's logits (the shipped code, one unpadded
sequence at a time), the first of the best options chosen. At depths 1 and 3 of a model trained (here: built) at
R = 2; every item's summed log-probability to 1e-4 and every choice equal. Ties go to the first option in every
task."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, run_launch

sys.path.insert(0, str(Path(__file__).parent))
from text_export import FIXTURES, make_export, sentencepiece  # noqa: E402

DEPTHS = (1, 3)
TASKS = {  # benchmark, folder of the fixtures
    "blimp": ("blimp", "blimp_filtered"), "supplement": ("blimp", "supplement_filtered"), "comps": ("comps", "comps"),
    "ewok": ("ewok", "ewok_filtered"), "entity_tracking": ("entity_tracking", "entity_tracking"),
    "wug_adj": ("wug_adj", "wug_adj_nominalization"), "wug_past": ("wug_past", "wug_past_tense")}


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("babylm")
    return make_export(tmp, sentencepiece(tmp))


# ---- the independent side: the pipeline's read_files.py rules, plain transformers --------------------------------------
def decode(task: str, rec: dict, path: Path) -> tuple[list[str], list[str], str]:
    """(sentences, completions, UID) of one record as read_files.py decodes it."""
    if task in ("blimp", "supplement"):
        s = [rec["sentence_good"], rec["sentence_bad"]]
        return s, s, rec["UID"] if "field" in rec else path.stem
    if task == "comps":
        s = [" ".join([rec["prefix_acceptable"], rec["property_phrase"]]),
             " ".join([rec["prefix_unacceptable"], rec["property_phrase"]])]
        uid = {"comps_base": "base", "comps_wugs": "wugs", "comps_wugs_dist-before": "wugs_dist_before"}.get(
            path.stem, "wugs_dist_in_between")
        return s, [rec["property_phrase"]] * 2, uid
    if task == "ewok":
        return ([" ".join([rec["Context1"], rec["Target1"]]), " ".join([rec["Context1"], rec["Target2"]])],
                [" " + rec["Target1"], " " + rec["Target2"]], rec["Domain"])
    if task == "entity_tracking":
        return ([rec["input_prefix"] + o for o in rec["options"]], list(rec["options"]),
                f"{path.stem}_{rec['numops']}_ops")
    s = rec["sentences"].split("\t")
    return s, s, task


def records(task: str, folder: Path) -> list:
    return [decode(task, json.loads(line), f) for f in sorted(folder.glob("*.jsonl"))
            for line in f.read_text().splitlines() if line.strip()]


def reference_scores(export: Path, decoded: list, depth: int) -> list[list[float]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(export), trust_remote_code=True).eval()
    tok = AutoTokenizer.from_pretrained(str(export))
    out = []
    for sentences, completions, _ in decoded:
        row = []
        for s, c in zip(sentences, completions):
            enc = tok(s, return_offsets_mapping=True)
            ids, cut = enc["input_ids"], len(s) - len(c)
            assert ids[0] == tok.bos_token_id  # <s> first, as a user calls the tokenizer
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=torch.tensor([ids]), depth=depth).logits[0].double(), -1)
            row.append(float(sum(logp[t - 1, ids[t]] for t in range(1, len(ids))
                                 if enc["offset_mapping"][t][1] > cut)))
        out.append(row)
    return out


def evaluated(export: Path, bench_name: str, data: Path, depth: int, **options) -> dict:
    from types import SimpleNamespace

    from pipeline.checkpoint import load_trained_model
    from pipeline.eval.benchmarks import TABLE

    trained = load_trained_model(export)
    args = SimpleNamespace(spm=None, batch_size=4, blimp_method="full", **options)  # 4: several batches per task
    return TABLE[bench_name].run(trained, data, [(depth, depth)], args)["per_depth"][str(depth)]


@pytest.mark.parametrize("task", list(TASKS))
def test_scores_and_choices_equal_plain_transformers(export, task):
    bench, folder = TASKS[task]
    decoded = records(task, FIXTURES / folder)
    for depth in DEPTHS:
        got = evaluated(export, bench, FIXTURES / folder, depth)
        want = reference_scores(export, decoded, depth)
        np.testing.assert_allclose(np.array(got["scores"]), np.array(want), atol=1e-4, rtol=0)
        want_choice = [int(np.argmax(r)) for r in want]  # argmax: the first of equal maxima
        assert got["chosen"] == want_choice, (task, depth)
        # the pipeline's predictions.json: per UID, ids UID_i in data order, the chosen completion (COMPS: sentence)
        uids = {}
        for (sentences, completions, uid), c in zip(decoded, want_choice):
            preds = uids.setdefault(uid, {"predictions": []})["predictions"]
            pred = (sentences if task in ("comps", "blimp", "supplement") else completions)[c]
            preds.append({"id": f"{uid}_{len(preds)}", "pred": pred})
        got_preds = {u: {"predictions": [{k: p[k] for k in ("id", "pred")} for p in d["predictions"]]}
                     for u, d in got["predictions"].items()}
        assert got_preds == uids, task
    # depth matters: the two depths give different scores (the depth reaches the model)
    assert evaluated(export, bench, FIXTURES / folder, 1)["scores"] != evaluated(export, bench, FIXTURES / folder,
                                                                                3)["scores"]


TIES = {  # one record per task whose options are the same text: every option scores alike
    "supplement": ("blimp", "ties.jsonl", {"sentence_good": "The cat sat on the mat.",
                                           "sentence_bad": "The cat sat on the mat."}),
    "comps": ("comps", "comps_base.jsonl", {"prefix_acceptable": "A robin", "prefix_unacceptable": "A robin",
                                            "property_phrase": "can fly."}),
    "ewok": ("ewok", "d.jsonl", {"Context1": "The cup is on the table.", "Context2": "x", "Target1": "It is up.",
                                 "Target2": "It is up.", "Domain": "d", "ContextType": "c", "ContextDiff": "c",
                                 "TargetDiff": "t"}),
    "entity_tracking": ("entity_tracking", "regular.jsonl", {"input_prefix": "Box 0 contains", "numops": 0,
                                                            "options": [" the apple.", " the apple.", " the apple."]}),
    "wug_adj": ("wug_adj", "w.jsonl", {"sentences": "The blickness is odd.\tThe blickness is odd.", "ratio": 0.5}),
}


@pytest.mark.parametrize("task", list(TIES))
def test_a_tie_goes_to_the_first_option(export, task, tmp_path):
    bench, name, rec = TIES[task]
    (tmp_path / name).write_text(json.dumps(rec) + "\n" + json.dumps(rec) + "\n")
    got = evaluated(export, bench, tmp_path, 2)
    scores = np.array(got["scores"])
    assert (scores == scores[:, :1]).all()  # exact ties
    assert got["chosen"] == [0, 0]
    if bench == "wug_adj":
        assert [p["pred"] for p in got["predictions"]["wug_adj"]["predictions"]] == ["The blickness is odd."] * 2
    else:
        accuracy = got["per_phenomenon"] if bench == "blimp" else got["accuracy"]
        assert all((v["accuracy"] if isinstance(v, dict) else v) == 1.0 for v in accuracy.values())


def test_supplement_ties_count_as_the_pipeline_counts_them(export, tmp_path):
    """The issue's file: supplement-format pairs, 10 of them exact ties; the macro accuracy is the pipeline's (ties
    right) and not the old strict comparison's."""
    lines = [{"sentence_good": f"The dog number {i} barks.", "sentence_bad": f"The dog number {i} barks."}
             for i in range(10)]
    lines += [{"sentence_good": f"The dog {w} loudly.", "sentence_bad": f"The dog {w} loud."}
              for w in ("barks", "runs", "sings", "sleeps", "eats", "jumps")]
    (tmp_path / "qa_ties.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    got = evaluated(export, "blimp", tmp_path, 2)
    scores = np.array(got["scores"])
    right = scores[:, 0] >= scores[:, 1]
    assert got["per_phenomenon"]["qa_ties"]["accuracy"] == pytest.approx(right.mean())
    assert right[:10].all() and got["per_phenomenon"]["qa_ties"]["accuracy"] >= 10 / 16


def test_evaluate_babylm_folder_json_and_plot(export, tmp_path):
    """launchers/evaluate.py --task babylm on the fixture folders: every task folder found and named as the pipeline
    names them, predictions.json form in the JSON, the plot written, the averages as the pipeline averages."""
    out = tmp_path / "babylm.json"
    proc = run_launch([sys.executable, str(REPO / "launchers" / "evaluate.py"), "--checkpoint", str(export), "--task",
                       "babylm", "--data", str(FIXTURES), "--depths", "1,2", "--output", str(out), "--no-mlflow"],
                      timeout=300)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    folders = ["blimp_filtered", "supplement_filtered", "ewok_filtered", "entity_tracking", "wug_adj_nominalization",
               "wug_past_tense", "comps"]
    assert res["columns"] == ["K", *folders] and [r[0] for r in res["table"]] == [1, 2]
    et = res["tasks"]["entity_tracking"]["per_depth"]["2"]
    splits = {s: np.mean([v for k, v in et["accuracy"].items() if k.startswith(s)])
              for s in ("regular", "ambiref", "move_contents")}
    assert et["average"] == pytest.approx(np.mean(list(splits.values())))
    comps = res["tasks"]["comps"]["per_depth"]["1"]
    assert set(comps["accuracy"]) == {"base", "wugs", "wugs_dist_before", "wugs_dist_in_between"}
    assert comps["predictions"]["base"]["predictions"][0]["id"] == "base_0"
    assert set(res["tasks"]["ewok_filtered"]["per_depth"]["1"]["by"]) == {"context_type", "context_contrast",
                                                                          "target_contrast"}
    assert (tmp_path / "babylm-vs-depth.png").is_file()
    assert "%|" in proc.stderr and "%|" not in proc.stdout  # progress bars on stderr only


def test_bad_records_name_the_file_line_and_key(export, tmp_path):
    (tmp_path / "comps_base.jsonl").write_text(json.dumps({"prefix_acceptable": "A", "property_phrase": "b"}) + "\n")
    proc = run_launch([sys.executable, str(REPO / "launchers" / "evaluate.py"), "--checkpoint", str(export), "--task",
                       "comps", "--data", str(tmp_path), "--no-mlflow", "--output", str(tmp_path / "o.json")])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'comps_base.jsonl'}:1: key 'prefix_unacceptable' missing (COMPS: prefix_acceptable, "
        "prefix_unacceptable, property_phrase)")
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_launch([sys.executable, str(REPO / "launchers" / "evaluate.py"), "--checkpoint", str(export), "--task",
                       "babylm", "--data", str(empty), "--no-mlflow"])
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(
        f"error: {empty}: no BabyLM task folder in it (looked for blimp_filtered")


def test_averages_as_the_pipeline_takes_them():
    """run.py process_results: the mean over UID subsets; Entity Tracking the mean over its three splits of the mean
    over each split's subsets (here 1/3, where the mean over all five subsets would be 0.6)."""
    from pipeline.eval.ranked import Item, accuracy_report

    uids = ["regular_0_ops", "regular_1_ops", "regular_2_ops", "ambiref_0_ops", "move_contents_0_ops"]
    items = [Item(("a", "b"), ("a", "b"), u) for u in uids]
    chosen = np.array([0, 0, 0, 1, 1])  # regular all right, the other two splits wrong
    et = accuracy_report(items, chosen, "entity_tracking")
    assert et["splits"] == {"regular": 1.0, "ambiref": 0.0, "move_contents": 0.0}
    assert et["average"] == pytest.approx(1 / 3)
    assert accuracy_report(items, chosen)["average"] == pytest.approx(0.6)
    by_field = accuracy_report([Item(("a", "b"), ("a", "b"), "u", meta={"field": f}) for f in "xxy"],
                               np.array([0, 1, 0]))
    assert by_field["by"]["field"] == {"x": 0.5, "y": 1.0} and by_field["average"] == pytest.approx(2 / 3)
