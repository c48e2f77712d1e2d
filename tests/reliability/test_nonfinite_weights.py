"""Campaign cases: NaN weights in a checkpoint were named "the last good one" and evaluated as ``nan | 0.0000`` with
exit 0, and evaluate.py on an export whose config.yaml does not match its weights ended in a traceback. Now weights
that hold a NaN are never resumed, evaluated or exported (one line naming the weight and what to do instead, exit 2),
and weights of another shape than their config are one line naming the tensor and both shapes."""
import sys

import pytest
import torch
import yaml

from conftest import HELDOUT_FASTA, REPO, TINY, run_launch, run_single
from pipeline.checkpoint.layout import write_digests

pytestmark = pytest.mark.slow  # DeepSpeed training launches

TRUST = "--trust-checkpoint"  # the files below are rewritten by torch.save: the digests are redone, the pickles ours


def train(shards, run_dir, steps, *extra):
    return run_single("ds_configs/zero2.json", TINY + [
        f"data.train_shards={shards}", f"run_dir={run_dir}", f"train.max_steps={steps}", "checkpoint.every_steps=2",
        "checkpoint.keep_last=0"], list(extra), timeout=300)


def tool(*args):
    return run_launch([sys.executable, *map(str, args)], timeout=300)


def one_error(proc) -> str:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    return line[line.index("error:"):]


def poison(tag_dir):
    """A NaN in one weight, wherever DeepSpeed keeps it (the module's copy and ZeRO's fp32 master partition), with
    the checkpoint's SHA256SUMS redone: weights that went bad before they were written, not bit rot."""
    states = tag_dir / "mp_rank_00_model_states.pt"
    model = torch.load(states, weights_only=False)
    next(iter(model["module"].values())).detach().view(-1)[0] = float("nan")
    torch.save(model, states)
    (optim_file,) = tag_dir.glob("*optim_states.pt")
    optim = torch.load(optim_file, weights_only=False)
    optim["optimizer_state_dict"]["single_partition_of_fp32_groups"][0].detach()[0] = float("nan")
    torch.save(optim, optim_file)
    write_digests(tag_dir)


def test_nan_weights_are_never_resumed_evaluated_or_exported(sample_shards, short_run, tmp_path):
    run = short_run  # 4 steps trained as train() does, checkpoints at steps 2 and 4 (conftest)
    ckpts = run / "checkpoints"
    export = tmp_path / "export"
    conv = tool(REPO / "tools/convert_checkpoint.py", "--checkpoint", ckpts / "step00000004", "--output", export)
    assert conv.returncode == 0, conv.stderr[-3000:]
    poison(ckpts / "step00000004")

    line = one_error(train(sample_shards, run, 6))
    assert line.startswith(f"error: checkpoint {ckpts / 'step00000004'} holds non-finite weights (") and (
        f"it cannot be resumed. Resume from an earlier one (--resume {ckpts / 'step00000002'})") in line, line
    assert (ckpts / "latest").read_text() == "step00000004"  # nothing rolled back or written

    for args in ((REPO / "launchers/evaluate.py", "--checkpoint", run, "--task", "reconstruction", "--data",
                  HELDOUT_FASTA, "--depths", "1", "--output", tmp_path / "e.json"),
                 (REPO / "tools/convert_checkpoint.py", "--checkpoint", run, "--output", tmp_path / "x")):
        line = one_error(tool(*args, TRUST))
        assert f"{ckpts / 'step00000004'}: weight " in line and "holds non-finite values" in line, line
        assert not (tmp_path / "e.json").exists() and not (tmp_path / "x").exists()

    # An export whose config.yaml says another width than its weights: one line naming a tensor and both shapes.
    cfg = yaml.safe_load((export / "config.yaml").read_text())
    cfg["model"]["d_ff"] = 96
    (export / "config.yaml").write_text(yaml.safe_dump(cfg))
    line = one_error(tool(REPO / "launchers/evaluate.py", "--checkpoint", export, "--task", "reconstruction",
                          "--data", HELDOUT_FASTA, "--depths", "1", "--output", tmp_path / "e.json"))
    assert line.startswith(f"error: {export}: weights do not fit the config: ") and " in the weights, [" in line \
        and "] in the model config (" in line, line
