"""tools/choose_depth.py on a tiny Eco-RNA export with the shipped held-out Rfam sample and a real RNAGym assay."""
import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_factory import REPO, tiny_config, write_export  # noqa: E402
from conftest import SHARED_DATA  # noqa: E402

sys.path.insert(0, str(REPO / "tools"))
import choose_depth  # noqa: E402

HELDOUT = REPO / "data" / "samples" / "rfam_nrc_heldout_sample.fasta.gz"
RNAGYM = SHARED_DATA / "eval" / "rnagym"


@pytest.fixture(scope="module")
def base_export(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("choose")
    return write_export(tmp / "export", tiny_config(tmp), seed=1)


@pytest.fixture
def export(base_export, tmp_path):
    d = tmp_path / "export"
    shutil.copytree(base_export, d)
    (d / "export.json").write_text(json.dumps({"step": 7, "task_depths": {"rnagym": 2}}))
    (d / "config.json").write_text(json.dumps({"model_type": "eco_rna", "num_loops": 3}))  # an HF config
    return d


def test_choose_is_the_smallest_depth_within_the_tolerance():
    table = [(1, 2.0), (2, 1.50), (3, 1.49), (4, 1.49)]
    assert choose_depth.choose(table, 1, False, 0.0) == 3  # exact tie 3 = 4 -> 3
    assert choose_depth.choose(table, 1, False, 0.02) == 2
    assert choose_depth.choose([(1, 0.1), (2, float("nan")), (4, 0.3)], 1, True, 0.0) == 4


def test_reconstruction_sweep_writes_the_best_depth(export, capsys):
    from launchers.evaluate import main as evaluate

    assert choose_depth.main(["--export", str(export), "--task", "reconstruction", "--data", str(HELDOUT),
                              "--depths", "1-4"]) == 0
    out = capsys.readouterr().out
    # the same sweep as launchers/evaluate.py --task reconstruction
    assert evaluate(["--checkpoint", str(export), "--task", "reconstruction", "--data", str(HELDOUT),
                     "--depths", "1-4", "--output", str(export.parent / "eval.json"), "--no-mlflow"]) == 0
    losses = {int(k): v["loss"] for k, v in json.loads((export.parent / "eval.json").read_text())["per_depth"].items()}
    best = min(losses, key=lambda k: (losses[k], k))
    assert f"reconstruction: K = {best}" in out and "<-" in out
    meta = json.loads((export / "export.json").read_text())
    assert meta == {"step": 7, "task_depths": {"rnagym": 2, "reconstruction": best}}  # other keys kept
    hf = json.loads((export / "config.json").read_text())
    assert hf == {"model_type": "eco_rna", "num_loops": 3, "task_depths": {"reconstruction": best}}


@pytest.mark.skipif(not (RNAGYM / "reference_sheet.csv").is_file(), reason="needs ../shared/data (RNAGym)")
def test_rnagym_sweep(export, tmp_path, capsys):
    assay = tmp_path / "Tome_2014_GFP_aptamer.csv"  # the first 60 variants of a real assay keep the test fast
    assay.write_text("".join((RNAGYM / assay.name).read_text().splitlines(keepends=True)[:61]))
    assert choose_depth.main(["--export", str(export), "--task", "rnagym", "--data", str(assay),
                              "--reference-sheet", str(RNAGYM / "reference_sheet.csv"), "--depths", "1,2"]) == 0
    k = json.loads((export / "export.json").read_text())["task_depths"]["rnagym"]
    assert k in (1, 2) and f"rnagym: K = {k}" in capsys.readouterr().out


@pytest.mark.parametrize("args,msg", [
    (["--task", "proteingym"], "--task 'proteingym': must be one of"),
    (["--task", "reconstruction", "--depths", "2-x"], "--depths '2-x'"),
    (["--task", "reconstruction", "--depths", "1-500"], "is above the maximum"),
    (["--task", "reconstruction", "--data", "/no/such/file"], "/no/such/file: no such file"),
    (["--task", "reconstruction", "--export", "NOT_EXPORT"], "not an export"),
])
def test_bad_input_is_one_line_and_writes_nothing(export, tmp_path, capsys, args, msg):
    before = {f.name: f.read_bytes() for f in export.iterdir()}
    argv = {"--export": str(export), "--data": str(HELDOUT)}
    for flag, value in zip(args[::2], args[1::2]):
        argv[flag] = str(tmp_path) if value == "NOT_EXPORT" else value
    assert choose_depth.main([x for kv in argv.items() for x in kv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and msg in err and "\n" not in err
    assert {f.name: f.read_bytes() for f in export.iterdir()} == before
