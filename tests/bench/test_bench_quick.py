"""Every bench script runs in the suite: each is started as a user starts it (python bench/X.py, its quickest
arguments, cwd the repository root) and must exit 0 and print the RESULT lines it owes, read by bench/run_all.py's own
runner and parser. Nothing ran the benches before: when the Trainer's refactor broke bench/engine.py's P4 (it died in
on_fit_end on Trainer.stopped_by), no test noticed.

A script in run_all.BENCHES is run with --quick and owes the figures BENCHES lists, unless SMALLER gives its runs
(fewer steps, the multi-process part apart and marked slow); so a bench registered there later is smoke-tested here
without a new test. Every other bench/*.py has a run in OTHERS or a named test elsewhere (ELSEWHERE), and
test_every_bench_script_has_a_smoke_run fails for a script with neither.
"""
from __future__ import annotations

import io
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench import run_all
from conftest import HELDOUT_FASTA, REPO, SHARED_DATA

sys.path.insert(0, str(REPO / "tests" / "tools"))
from checkpoint_factory import tiny_config, write_export  # noqa: E402


@dataclass(frozen=True)
class Smoke:
    script: str
    args: tuple = ()  # after --quick when quick
    expected: tuple = ()  # RESULT IDs it owes
    quick: bool = True
    says: tuple = ()  # lines its output must hold (scripts that print no RESULT figure)
    slow: bool = False  # starts several training processes (pytest -m slow)
    name: str = ""
    timeout: float = 560  # seconds, under pytest's own 600

    @property
    def id(self) -> str:
        return self.name or Path(self.script).stem


# BENCHES entries run smaller than --quick, to keep the suite's time down (--quick alone took 15 min on the shared
# 2-core host). Where a script's --quick overrides the sizes given with it, the run is not quick and names them all.
# bench/engine.py's scaling launches 2 ranks: marked slow, apart from P4.
SMALLER = {
    "bench/wavefront.py": [
        Smoke("bench/wavefront.py", ("--length", "32", "--repeats", "1"), ("P1", "P1.waste", "P1.gather"),
              quick=False),
    ],
    "bench/data.py": [  # (b)'s inputs repeated to 2 MB of FASTA, not 64 (the 10x runs of (c) and (d): 20 MB)
        Smoke("bench/data.py", ("--repeats", "1", "--mb", "2"),
              ("P2", "P3", "P3.steady", "P3w2", "P3j2", "P3j2.merged")
              + (("P3uc", "P3uc.rss10", "P3uc.x10") if (SHARED_DATA / "protein").is_dir() else ()),
              says=("merged == one job: True",)),
    ],
    "bench/engine.py": [
        Smoke("bench/engine.py", ("--skip-scaling", "--steps", "2", "--warmup", "1"), ("P4", "P4.cpu"),
              name="engine-P4"),
        Smoke("bench/engine.py", ("--skip-p4", "--scaling-steps", "8"), ("scaling",), slow=True,
              name="engine-scaling"),
    ],
    "bench/activation_checkpointing.py": [
        Smoke("bench/activation_checkpointing.py", ("--context", "128", "--rows", "1", "--steps", "1"),
              ("AC.memory", "AC.step"), quick=False),
    ],
    "bench/validation.py": [
        # 3 steps, one validation at the last (the step-time median leaves the first 2 out)
        Smoke("bench/validation.py", ("--steps", "3", "--every", "3"), ("VAL.overhead", "VAL.per_eval")),
    ],
    "bench/checkpoint_stall.py": [  # the demo Eco-RNA, not the 80M: 2 launches of 2 ranks (both save modes)
        Smoke("bench/checkpoint_stall.py", ("--config", "eco_rna_demo", "--ranks", "2", "--steps", "4", "--every",
                                            "2"), ("CKPT.stall2", "CKPT.loss2"), quick=False, slow=True),
    ],
    # the host figures, one timed step (COMPILE over 100 steps: tests/pipeline/test_compile_blocks.py), on the 80M
    # config with one core block and no prelude or coda (tests/bench/compiled_smoke.yaml says why)
    "bench/compiled.py": [
        Smoke("bench/compiled.py", ("--skip-compile", "--host-steps", "1", "--config",
                                    "tests/bench/compiled_smoke.yaml"), ("HOST.step", "HOST.token")),
    ],
    "bench/step_proxies.py": [  # one shape step (the counts themselves: tests/bench/test_step_proxies.py)
        Smoke("bench/step_proxies.py", ("--shape-steps", "1"),
              ("OPS.step", "OPS.forward", "OPS.backward", "OPS.optimizer", "SYNC.micro", "SYNC.step", "SHAPES.core",
               "SHAPES.core.packed", "SHAPES.tokens")),
    ],
}

# Scripts outside BENCHES with a run here. {tmp} is the test's temporary directory, {export} a tiny Eco-RNA export.
OTHERS = [
    Smoke("bench/moe_gpu.py", ("--dry-run",), quick=False, says=("dry run: ok",)),
    # --tol 1e9 stops every sequence at K = 1 and --within 100 accepts its loss: the verdict line reads yes and the
    # exit is 0 whenever the script works (a crash exits non-zero).
    Smoke("bench/adaptive_depth.py", ("--export", "{export}", "--data", str(HELDOUT_FASTA), "--fixed", "2",
                                      "--max-depth", "2", "--tol", "1e9", "--within", "100"), quick=False,
          says=("fixed-depth loss by K: 1: ", "with fewer core applications: yes")),
    # Without --quick (which forces 20 steps): 2 steps of two variants (full and dense: the MoE and memory switches
    # on and off; tests/bench/test_protlingo_ablation.py checks the four configs), one seed, on the shipped 771-protein
    # sample (the bench's source without ../shared; its held-out tenth scores in a fraction of the 5,000's time). Slow:
    # 2 trainings, each its own launcher process, plus an upcycle and an evaluation process each: its own timeout.
    Smoke("bench/protlingo_ablation.py", ("--out", "{tmp}/ablation", "--steps", "2", "--seeds", "0", "--variants",
                                          "full,dense", "--source", "data/samples/uniref90_clusters_sample.fasta.gz"),
          quick=False, says=("ablation: full ", ", dense "), slow=True, timeout=1500),
]

# Scripts whose smoke run is an existing test (file::function); the check below reads that the function exists.
ELSEWHERE = {
    "bench/run_all.py": "tests/bench/test_run_all.py::test_collects_figures_and_reports_failures",
    "bench/eco_rna_gpu.py": "tests/bench/test_gpu_scripts.py::test_eco_rna_gpu_dry_run_runs_every_step",
    "bench/gpu_report.py": "tests/bench/test_gpu_report.py::test_family_cli_prints_every_figure",
    "bench/depth_study.py": "tests/bench/test_depth_study.py::test_tiny_study_trains_both_models_with_the_real_launcher",
    "bench/depth_task.py": "tests/bench/test_bench_quick.py::test_depth_task_tiny_study_runs_end_to_end",
    "bench/comm_volume.py": "tests/tools/test_scaling.py::test_predicted_volume_is_the_counted_volume",
    # the full run needs a checkout of the BabyLM pipeline (BABYLM_PIPELINE); its argument check runs everywhere
    "bench/babylm_pipeline.py": "tests/bench/test_babylm_pipeline.py::test_predictions_identical_to_the_pipeline",
}


# Scripts committed by another engineer whose BENCHES entry (and with it the smoke run above) comes in their own
# commit: tolerated here while unregistered, and checked like every other once run_all.BENCHES names them (the entry
# here is then harmless and can go).
AWAITING_REGISTRATION: set = set()  # scripts committed before their BENCHES entry (none now)


def smoke_runs() -> list:
    runs = []
    for _, script, expected in run_all.BENCHES:
        runs += SMALLER.get(script, [Smoke(script, (), tuple(expected))])
    return runs + OTHERS


def bench_scripts() -> set:
    """bench/*.py as committed (git's index): a script another engineer is still writing, untracked, is not yet a
    bench; once added it must be registered. Outside a git checkout, every file."""
    r = subprocess.run(["git", "ls-files", "--", "bench/*.py"], cwd=REPO, capture_output=True, text=True)
    if r.returncode == 0 and r.stdout.strip():
        return {ln for ln in r.stdout.splitlines() if ln.count("/") == 1}
    return {f"bench/{p.name}" for p in (REPO / "bench").glob("*.py")}


def run_smoke(smoke: Smoke, tmp_path: Path) -> tuple[run_all.BenchRun, str]:
    """Run one script through run_all.run_bench (its subprocess, RESULT parsing and checks); (the run, its output)."""
    args = []
    for a in smoke.args:
        if "{export}" in a:
            a = a.replace("{export}", str(write_export(tmp_path / "export", tiny_config(tmp_path), seed=0)))
        args.append(a.replace("{tmp}", str(tmp_path)))
    out = io.StringIO()
    run = run_all.run_bench(run_all.BenchRun(smoke.id, smoke.script, smoke.expected, tuple(args)),
                            quick=smoke.quick, timeout=smoke.timeout, out=out)
    return run, out.getvalue()


def marks(s: Smoke) -> list:
    return ([pytest.mark.slow] if s.slow else []) + ([pytest.mark.timeout(s.timeout + 60)] if s.timeout > 540 else [])


@pytest.mark.parametrize("smoke", [pytest.param(s, id=s.id, marks=marks(s)) for s in smoke_runs()])
def test_bench_script_runs_and_prints_its_figures(smoke, tmp_path):
    run, out = run_smoke(smoke, tmp_path)
    tail = "\n".join(out.splitlines()[-40:])
    assert not run.problems, f"{smoke.script}: {'; '.join(run.problems)}\n{tail}"
    assert run.rc == 0
    for line in smoke.says:
        assert line in out, f"{smoke.script}: no {line!r} in its output\n{tail}"


def test_every_bench_script_is_in_run_all_or_says_why_not():
    """run_all.BENCHES names every bench/*.py that prints RESULT figures; NOT_IN_RUN_ALL says why each other is not
    there. A new script in neither fails here, so run_all cannot silently miss it."""
    listed = [b[1] for b in run_all.BENCHES]
    assert len(listed) == len(set(listed)), listed
    kept_out = run_all.NOT_IN_RUN_ALL
    assert not set(listed) & set(kept_out), "in BENCHES and in NOT_IN_RUN_ALL"
    unregistered = sorted(bench_scripts() - set(listed) - set(kept_out) - AWAITING_REGISTRATION)
    assert not unregistered, (f"{', '.join(unregistered)}: add to bench/run_all.py's BENCHES (name, script, RESULT IDs) "
                              "or to NOT_IN_RUN_ALL with the reason")
    assert not (set(listed) | set(kept_out)) - bench_scripts(), "a listed script does not exist"
    assert all(why.strip() for why in kept_out.values())
    for script in listed:  # a BENCHES script prints figures: its source has a RESULT line
        assert "RESULT " in (REPO / script).read_text(), script


def test_every_bench_script_has_a_smoke_run():
    covered = {s.script for s in smoke_runs()} | set(ELSEWHERE)
    missing = sorted(bench_scripts() - covered - (AWAITING_REGISTRATION - {b[1] for b in run_all.BENCHES}))
    assert not missing, f"{', '.join(missing)}: no smoke run (tests/bench/test_bench_quick.py OTHERS or ELSEWHERE)"
    for script, node in ELSEWHERE.items():
        path, func = node.split("::")
        assert f"def {func}(" in (REPO / path).read_text(), f"{script}: {node} does not exist"
        assert Path(script).name in (REPO / path).read_text() or Path(script).stem in (REPO / path).read_text(), node


@pytest.mark.slow  # two trainings, each its own launcher process (140 s on the loaded 2-core host)
def test_depth_task_tiny_study_runs_end_to_end(tmp_path):
    """bench/depth_task.py as a user runs it, at its smallest: data, the count model, the recurrent model's two stages
    through the real launcher (the second --init-from the first), the evaluation at every K, the JSON and the plot.
    Only the recurrent model trains (the controls take the same path): the verdict then is 'not accepted', exit 1,
    so success is read from what it wrote, and a crash (also exit 1) from the missing JSON and its traceback."""
    import json

    out = tmp_path / "task"
    r = subprocess.run([sys.executable, "bench/depth_task.py", "--out", str(out), "--hops", "2", "--slots", "4",
                        "--queries", "1", "--records", "300", "--steps", "2", "--stage2-steps", "1", "--seeds", "0",
                        "--models", "recurrent"], cwd=REPO, capture_output=True, text=True, timeout=420)
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 1 and "Traceback" not in r.stderr, tail
    res = json.loads((out / "depth_task.json").read_text())
    (run,) = res["runs"]["recurrent"]
    assert [s["steps"] for s in run["stages"]] == [1, 1], run["stages"]
    assert len(run["accuracy"]) == 8 and all(0 <= a <= 1 for a in run["accuracy"].values()), run["accuracy"]
    assert res["accepted"] is False and (out / "depth_task.png").is_file()
    assert "depth task: K1 acc" in r.stdout, tail
