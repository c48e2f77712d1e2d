"""bench/depth_task.py: the count model is at chance on the task and bad flags exit 2; and the CI guard of the
recurrence: Eco-RNA trained through the real launcher on the depth task gains from depth."""
import pytest

from bench import depth_task
from data_prep.__main__ import main as data_prep_main
from pipeline.data.shards import load_manifest


@pytest.mark.parametrize("slots,queries", [(4, 1), (5, 3)])
def test_the_best_count_model_is_at_chance(tmp_path, slots, queries):
    """Every level is a permutation of the S values, so the counts of the visible tokens say nothing about the
    answer: the count model fitted on 4,000 training records is within sampling error of 1/S on 1,000 held-out."""
    task = ["--hops", "3", "--slots", str(slots), "--queries", str(queries)]
    assert data_prep_main(["synthetic-hops", *task, "--records", "4000", "--seed", "0",
                           "--output", str(tmp_path / "train")]) == 0
    assert data_prep_main(["synthetic-hops", *task, "--min-hops", "3", "--records", "1000", "--seed", "1",
                           "--exclude", str(tmp_path / "train"), "--output", str(tmp_path / "held")]) == 0
    acc = depth_task.count_model(tmp_path / "train", tmp_path / "held")
    assert abs(acc - 1 / slots) < 0.05, acc  # 4 sd of a binomial(1000, 1/4) is 0.055 (Q answers: less)


def test_the_data_is_reused_only_when_it_is_the_asked_task(tmp_path):
    """A rerun reuses the shards when they hold exactly the task and count asked for, and writes both sets again
    otherwise (never a held-out set of one task against training records of another)."""
    train, held = depth_task.make_data(tmp_path, 2, 4, 1, 300, 50)
    first = (train / "manifest.json").stat().st_mtime_ns, (held / "manifest.json").stat().st_mtime_ns
    assert depth_task.make_data(tmp_path, 2, 4, 1, 300, 50) == (train, held)
    assert ((train / "manifest.json").stat().st_mtime_ns, (held / "manifest.json").stat().st_mtime_ns) == first
    depth_task.make_data(tmp_path, 2, 5, 3, 300, 50)
    for d in (train, held):
        m = load_manifest(d)
        assert (m.stats["task"]["slots"], m.stats["task"]["queries"]) == (5, 3), d
    assert sum(s.samples for s in load_manifest(held).shards) == 50


def test_the_verdict_measures_k1_against_the_tasks_own_chance():
    """Chance is 1/S: at S = 5 (0.20) a shared core at 0.38 with one application has read something and fails the
    K = 1 bound (chance + 0.15), which it would pass against S = 4's 0.25."""
    def run(k1, rest):  # one seed's accuracy: k1 at K = 1, rest at every other K
        return [{"accuracy": {str(k): (k1 if k == 1 else rest) for k in depth_task.DEPTHS}}]

    def result(slots, k1):
        return {"depth": 4, "chance": 1 / slots,
                "runs": {"recurrent": run(k1, 1.0), "control-1": run(0.2, 0.2), "control-h": run(1.0, 1.0)}}
    assert depth_task.verdict(result(5, 0.30))[0] and not depth_task.verdict(result(5, 0.38))[0]
    assert depth_task.verdict(result(4, 0.38))[0]


def test_bad_flags_exit_2(tmp_path, capsys):
    assert depth_task.main(["--out", str(tmp_path), "--hops", "1"]) == 2
    assert "--hops must lie in 2 .. 7" in capsys.readouterr().err
    assert depth_task.main(["--out", str(tmp_path), "--queries", "6"]) == 2
    assert "--queries must lie in 1 .. --slots 5, got 6" in capsys.readouterr().err
    assert depth_task.main(["--out", str(tmp_path), "--models", "control-1"]) == 2
    assert "--models" in capsys.readouterr().err
    assert not (tmp_path / "depth_task.json").exists()



@pytest.mark.slow
def test_the_recurrence_gains_from_depth(tmp_path, monkeypatch):
    """The CI guard of the recurrent path and of the two-minute demo at once (docs/depth_task.md): it runs
    scripts/depth_demo.sh as a user does. Eco-RNA (eco_rna_depth_demo.yaml, one shared block) trained through the
    launcher for 1,500 steps at K = 3 on the H = 2, S = 5, Q = 3 task answers 500 held-out records, none of them in
    training, at K = 3 and is at chance at K = 1, where one read cannot reach the value; the script's own check says
    so (exit 0). The depth plot and validation.png are written with no MLflow run anywhere (tracking is off)."""
    import json
    import sys

    from conftest import REPO, run_launch

    monkeypatch.setenv("PY", sys.executable)  # the suite's interpreter: no install into .venv
    monkeypatch.setenv("DEMO_DIR", str(tmp_path))
    r = run_launch(["bash", str(REPO / "scripts" / "depth_demo.sh")], timeout=600)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    res = json.loads((tmp_path / "eval-reconstruction.json").read_text())
    acc = {int(k): v["accuracy"] for k, v in res["per_depth"].items()}
    print(f"held-out answer accuracy by K: {acc}")
    assert sorted(acc) == list(range(1, 9))
    assert abs(res["chance"]["accuracy"] - 0.2) < 0.05  # the commonest of 5 equally likely answers
    assert acc[1] <= res["chance"]["accuracy"] + 0.15, acc  # one application cannot reach the value
    assert acc[3] >= 0.9, acc
    assert "more core iterations, better predictions" in r.stdout
    for png in (tmp_path / "eval-reconstruction-vs-depth.png", tmp_path / "run" / "validation.png"):
        assert png.read_bytes()[:4] == b"\x89PNG", png
    assert not list(tmp_path.rglob("mlflow.db")) and not list(tmp_path.rglob("mlruns"))


def test_every_model_trains_on_the_same_data_steps_width_and_batch(tmp_path, monkeypatch):
    """The study's comparison is fair only if the recurrent model (both stages together) and the controls see the same
    shards, optimizer steps, width and microbatch; only the peak lr is each model's own. The launcher runs are
    recorded instead of run (the study itself is bench/depth_task.py, 27 minutes)."""
    calls = []

    def fake_train(name, config, shards, out, steps, sets, nproc):
        calls.append((name, shards, steps, sets))
        return {"run_dir": str(out / name), "train_seconds": 1.0}

    monkeypatch.setattr(depth_task, "train", fake_train)
    data = []
    monkeypatch.setattr(depth_task, "make_data", lambda out, *a: data.append(a) or (out / "train", out / "held"))
    monkeypatch.setattr(depth_task, "count_model", lambda *a: 0.25)
    chance = {"accuracy": dict.fromkeys(depth_task.DEPTHS, 0.25), "loss": dict.fromkeys(depth_task.DEPTHS, 1.4)}
    monkeypatch.setattr(depth_task, "evaluate", lambda run_dir, held: chance)
    assert depth_task.main(["--out", str(tmp_path), "--seeds", "0"]) == 1  # chance everywhere: not accepted

    def last(sets, key):  # the value a key ends with (later --set wins); None: the config's own
        return ([s.split("=", 1)[1] for s in sets if s.startswith(key + "=")] or [None])[-1]

    per_model = {}
    for name, shards, steps, sets in calls:
        model = name.split("-seed")[0]
        seen = per_model.setdefault(model, {"steps": 0, "shape": set(), "shards": set()})
        seen["steps"] += steps
        seen["shards"].add(shards)
        seen["shape"].add(tuple(last(sets, k) for k in ("model.d_model", "model.n_heads", "model.n_kv_heads",
                                                         "model.d_ff", "train.micro_batch_size")))
    assert set(per_model) == {"recurrent", "control-1", "control-h"}
    assert {m["steps"] for m in per_model.values()} == {depth_task.FULL["steps"]}, per_model
    full = depth_task.FULL  # the study's task reaches data_prep: H, S, Q, training and held-out records
    assert data == [tuple(full[k] for k in ("hops", "slots", "queries", "records", "heldout"))], data
    assert len({s for m in per_model.values() for s in m["shape"]}) == 1, per_model
    assert {s for m in per_model.values() for s in m["shards"]} == {tmp_path / "train"}
