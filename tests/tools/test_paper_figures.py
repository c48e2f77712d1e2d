"""tools/paper_figures.py: Figure 1 and Figure 3 from launchers/evaluate.py's RNAGym sweeps of a recurrent model and
its fixed-depth control (the FLOPs the configs give, the |Spearman| the JSON holds, the Pareto frontier), and Table 1
from a run's checkpoints, equal to launchers/evaluate.py --task reconstruction on each."""
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import HELDOUT_FASTA, REPO
from pipeline.eval.paper import pareto

sys.path.insert(0, str(REPO / "tests" / "tools"))
from checkpoint_factory import write_export  # noqa: E402


def test_pareto_keeps_the_points_nothing_beats():
    """By hand: (cost, score). (2, .5) is beaten by (1, .6); (3, .6) ties (1, .6) in score at a higher cost; (4, .9)
    and (1, .6) and (8, .95) stay."""
    pts = [(2, 0.5), (1, 0.6), (3, 0.6), (4, 0.9), (8, 0.95), (9, 0.94)]
    assert pareto(pts) == [1, 3, 4]
    assert pareto([(1, 0.2), (1, 0.2)]) == [0, 1]  # equal points do not dominate each other


def tool(*args, timeout=300):
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**__import__("os").environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"})


def write_assays(folder):
    """Two RNAGym-format assays (Aptamer, tRNA) with random single mutants, and their reference sheet."""
    rng = np.random.default_rng(0)
    folder.mkdir()
    sheet = ["DMS_ID,RNA_TYPE,RAW_CONSTRUCT_SEQ"]
    for dms, kind, n in (("Apt_2020_toy", "Aptamer", 28), ("tRNA_2021_toy", "tRNA", 34)):
        wt = "".join(rng.choice(list("ACGU"), n))
        sheet.append(f"{dms},{kind},{wt}")
        rows = ["mutant,DMS_score,sequence"]
        for _ in range(30):
            p = int(rng.integers(n))
            to = "ACGU".replace(wt[p], "")[int(rng.integers(3))]
            rows.append(f"{wt[p]}{p + 1}{to},{rng.normal():.4f},{wt[:p] + to + wt[p + 1:]}")
        (folder / f"{dms}.csv").write_text("\n".join(rows) + "\n")
    (folder / "reference_sheet.csv").write_text("\n".join(sheet) + "\n")
    return folder


def test_figures_1_and_3_show_what_the_sweeps_measured(tmp_path):
    from pipeline.config import load_config

    configs = REPO / "launchers" / "configs"
    tiny = ["model.d_model=16", "model.n_heads=2", "model.n_kv_heads=1", "model.d_ff=32"]
    rec = load_config(configs / "eco_rna_demo.yaml", [*tiny, f"run_dir={tmp_path}/r"])
    ctl = load_config(configs / "eco_rna_control_demo.yaml", [*tiny, f"run_dir={tmp_path}/c"])
    gym = write_assays(tmp_path / "gym")
    results = {}
    for name, cfg, depths in (("rec", rec, ["--depths", "1-3"]), ("ctl", ctl, [])):
        export = write_export(tmp_path / name, cfg, seed=3)
        r = tool("launchers/evaluate.py", "--checkpoint", str(export), "--task", "rnagym", "--data", str(gym),
                 *depths, "--output", str(tmp_path / f"{name}.json"), "--no-mlflow")
        assert r.returncode == 0, r.stderr[-2000:]
        results[name] = json.loads((tmp_path / f"{name}.json").read_text())
    others = tmp_path / "others.csv"
    others.write_text("model,gflops,spearman\nBigModel,5000,0.99\nSmallModel,0.0001,0.0\n")
    r = tool("tools/paper_figures.py", "figure1", "--rnagym", str(tmp_path / "rec.json"), "--control",
             str(tmp_path / "ctl.json"), "--others", str(others), "--out", str(tmp_path / "f1.png"))
    assert r.returncode == 0, r.stderr[-2000:]
    lines = {ln[:32].strip(): ln[32:].split() for ln in r.stdout.splitlines()[1:] if not ln.startswith("wrote")}
    for k in (1, 2, 3):
        gflops, rho, *star = lines[f"Eco-RNA K={k}"]
        assert float(gflops) == pytest.approx(rec.model.forward_flops(depth=k, length=512) / 1e9, abs=5e-4)
        assert float(rho) == pytest.approx(results["rec"]["per_depth"][str(k)]["aggregate"]["spearman"], abs=5e-5)
    gflops, rho, *_ = lines["Eco-RNA (fixed depth)"]
    assert float(gflops) == pytest.approx(ctl.model.forward_flops(depth=1, length=512) / 1e9, abs=5e-4)
    assert float(rho) == pytest.approx(results["ctl"]["per_depth"]["1"]["aggregate"]["spearman"], abs=5e-5)
    exact = {f"Eco-RNA K={k}": (rec.model.forward_flops(depth=k, length=512) / 1e9,
                                results["rec"]["per_depth"][str(k)]["aggregate"]["spearman"]) for k in (1, 2, 3)}
    exact["Eco-RNA (fixed depth)"] = (ctl.model.forward_flops(depth=1, length=512) / 1e9,
                                      results["ctl"]["per_depth"]["1"]["aggregate"]["spearman"])
    exact |= {"BigModel": (5000.0, 0.99), "SmallModel": (0.0001, 0.0)}
    on_front = {name for name, v in lines.items() if v[-1] == "*"}
    names = list(exact)
    assert on_front == {names[i] for i in pareto(list(exact.values()))}
    assert {"BigModel", "SmallModel"} <= on_front and (tmp_path / "f1.png").stat().st_size > 10_000
    r = tool("tools/paper_figures.py", "figure3", "--rnagym", str(tmp_path / "rec.json"), "--control",
             str(tmp_path / "ctl.json"), "--out", str(tmp_path / "f3.png"))
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout.splitlines()
    row = next(ln for ln in out if ln.strip().startswith("tRNA_2021_toy")).split()  # the |Spearman| block first
    per = results["rec"]["per_depth"]
    want = [results["ctl"]["per_depth"]["1"]["per_assay"]["tRNA_2021_toy"]["spearman"],
            *(per[k]["per_assay"]["tRNA_2021_toy"]["spearman"] for k in ("1", "2", "3"))]
    assert [float(v) for v in row[1:]] == pytest.approx(want, abs=5e-5)
    r = tool("tools/paper_figures.py", "figure1", "--rnagym", str(others), "--out", str(tmp_path / "x.png"))
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(f"error: {others}: not a readable")


@pytest.mark.slow
def test_table1_equals_evaluate_reconstruction_on_each_checkpoint(_short_run, tmp_path):
    run = _short_run / "run"
    r = tool("tools/paper_figures.py", "table1", "--run", str(run), "--data", str(HELDOUT_FASTA), "--out",
             str(tmp_path / "t1"))
    assert r.returncode == 0, r.stderr[-2000:]
    table = json.loads((tmp_path / "t1" / "table1.json").read_text())
    assert [row[0] for row in table["rows"]] == [2, 4]
    for row in table["rows"]:
        tag = run / "checkpoints" / f"step{row[0]:08d}"
        e = tool("launchers/evaluate.py", "--checkpoint", str(tag), "--task", "reconstruction", "--data",
                 str(HELDOUT_FASTA), "--depths", "1,4,8", "--output", str(tmp_path / "e.json"), "--no-mlflow")
        assert e.returncode == 0, e.stderr[-2000:]
        per = json.loads((tmp_path / "e.json").read_text())["per_depth"]
        assert row[1:4] == [per[k]["loss"] for k in ("1", "4", "8")]  # the same computation, bit for bit
        assert row[4] == per["1"]["loss"] - per["4"]["loss"]
    assert (tmp_path / "t1" / "table1.md").read_text().startswith("| step | K=1 | K=4 | K=8 | K=1 -> 4 |")
