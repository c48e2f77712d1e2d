"""Golden behaviour, pinned before the redesign of the trainer (issue: a house one can read in an hour): each
family's tiny config trained 5 steps on 2 processes through the launcher gives today's per-step losses and gradient
norms, and the step-3 checkpoint each family wrote with today's code resumes and continues to today's steps 4-5.
The data (tests/golden/data) and the checkpoints are committed; make_golden.py regenerates them, on purpose only.

The launcher is torchrun, which starts 2 ranks in half the deepspeed runner's time (5 s against 11 s a case); the
numbers do not depend on which of the two starts the ranks (both gave the same losses and gradient norms, bit for
bit, on every case), and the runner itself stays tested by the tests of what it adds (test_pretrain_cli,
test_engine_distributed, test_multinode, test_faults, test_ctrl_c, ...: conftest's deepspeed_cmd). make_golden.py
writes the numbers through the runner.

The comparison is to 1e-6 relative (a moved operation changes the last bits, a changed computation far more); on the
machine that wrote the numbers the runs are bit-identical, which the printed line reports."""
import json

import pytest

from conftest import read_jsonl, run_torchrun
from golden.cases import CASES, CHECKPOINTED, HERE, SAVED, STEPS, overrides, unpack_checkpoint


def golden(name: str) -> list:
    return json.loads((HERE / f"{name}.json").read_text())["steps"]


def compare(name: str, got: list, want: list):
    assert [m["step"] for m in got] == [m["step"] for m in want], (name, got)
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in got] == pytest.approx([m[key] for m in want], rel=1e-6, abs=0), (name, key)
    exact = all(g[k] == w[k] for g, w in zip(got, want) for k in ("loss", "grad_norm"))
    print(f"{name}: steps {[m['step'] for m in got]} {'bit-identical' if exact else 'within 1e-6'}")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_five_steps_give_the_golden_losses(name, tmp_path):
    config, ds_config, _ = CASES[name]
    r = run_torchrun(2, ds_config, overrides(name, str(tmp_path / "run")), ["--config", config], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    compare(name, read_jsonl(tmp_path / "run" / "metrics.jsonl"), golden(name))


@pytest.mark.slow
@pytest.mark.parametrize("name", CHECKPOINTED)
def test_an_old_checkpoint_resumes_to_the_golden_steps(name, tmp_path):
    """The committed step-3 checkpoint (DeepSpeed shards, client state, config as today's code writes them)."""
    config, ds_config, _ = CASES[name]
    unpack_checkpoint(name, tmp_path / "run" / "checkpoints")
    r = run_torchrun(2, ds_config, overrides(name, str(tmp_path / "run")), ["--config", config], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"step{SAVED:08d} at step {SAVED}" in r.stdout, r.stdout[-2000:]
    compare(name, read_jsonl(tmp_path / "run" / "metrics.jsonl"), golden(name)[SAVED:STEPS])
