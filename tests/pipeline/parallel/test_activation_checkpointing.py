"""train.activation_checkpointing: blocks recomputes each transformer block in backward and changes nothing else:
in one process the loss and every gradient equal the plain model's on a real batch (each family, Eco-RNA with its
recurrent depths and backward window), the parameter names stay, and through the launcher on 2 processes the golden
cases (ZeRO-2, Eco-RNA under ZeRO-3, ProtLingo with expert parallelism) give their golden per-step losses."""
import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import read_jsonl, run_torchrun
from golden.cases import CASES, HERE, overrides
from pipeline.parallel.checkpointing import apply_activation_checkpointing

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_gradient_flow import FAMILY_CASE, loss_of, setup  # noqa: E402


@pytest.mark.parametrize("family", sorted(FAMILY_CASE))
def test_recomputed_blocks_give_the_same_loss_and_gradients(family):
    cfg, plain, fam, batches = setup(family)
    _, wrapped, _, _ = setup(family)  # the same seed: the same weights
    names = [n for n, _ in wrapped.named_parameters()]
    n = apply_activation_checkpointing(wrapped, fam.blocks)
    assert n >= 1 and [n_ for n_, _ in wrapped.named_parameters()] == names  # names (and checkpoints) unchanged
    for model in (plain, wrapped):
        for i, batch in enumerate(batches[:2]):
            torch.manual_seed(i)
            loss_of(fam, model, cfg, batch, i).backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), wrapped.named_parameters()):
        if a.grad is None:
            assert b.grad is None, name
            continue
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_family_without_blocks_is_refused():
    with pytest.raises(ValueError, match="train.activation_checkpointing: blocks, but the model has no"):
        apply_activation_checkpointing(torch.nn.Linear(2, 2), ())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["eco_rna_zero3", "protlingo_ep2", "recursive_gpt_zero2"])
def test_golden_runs_with_recomputed_blocks(name, tmp_path):
    config, ds_config, _ = CASES[name]
    r = run_torchrun(2, ds_config, overrides(name, str(tmp_path / "run")) + ["train.activation_checkpointing=blocks"],
                     ["--config", config], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    want = json.loads((HERE / f"{name}.json").read_text())["steps"]
    assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in want], rel=1e-6)
    assert [m["grad_norm"] for m in got] == pytest.approx([m["grad_norm"] for m in want], rel=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILY_CASE))
def test_recomputed_blocks_save_less_for_backward(family):
    """What autograd keeps between forward and backward (the activations): with recomputed blocks at most half."""
    cfg, plain, fam, batches = setup(family)
    _, wrapped, _, _ = setup(family)
    apply_activation_checkpointing(wrapped, fam.blocks)
    saved = {}
    for key, model in (("plain", plain), ("blocks", wrapped)):
        total = [0]

        def pack(t, total=total):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_of(fam, model, cfg, batches[0], 0)
        loss.backward()
        saved[key] = total[0]
    assert saved["blocks"] < 0.5 * saved["plain"], saved
