"""The lean optimizer step against the plain one: torch's fused AdamW against its default kernel, and the foreach
overflow check against DeepSpeed's per-gradient one (bf16 ZeRO-1/2, pipeline/train/optim.py)."""
from types import SimpleNamespace

import pytest
import torch
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline.config import OptimConfig
from pipeline.train.optim import lean_overflow_check, make_optimizer


class Count(TorchDispatchMode):
    n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def test_fused_adamw_takes_the_plain_step():
    """Three steps with decay and no-decay groups: the fused kernel's parameters equal the default kernel's."""
    torch.manual_seed(0)
    params = [torch.randn(5, 7), torch.randn(7), torch.randn(3, 3)]
    runs = []
    for fused in (True, False):
        ps = [p.clone().requires_grad_() for p in params]
        groups = [{"params": ps[::2], "weight_decay": 0.1}, {"params": ps[1:2], "weight_decay": 0.0}]
        opt = make_optimizer(groups, OptimConfig(lr=1e-2, fused=fused), torch.device("cpu"))
        assert opt.defaults["fused"] is (True if fused else None)
        for step in range(3):
            opt.zero_grad()
            sum(((p - step) ** 2).sum() for p in ps).backward()
            opt.step()
        runs.append(ps)
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def zero_optimizer(grads_per_group):
    return SimpleNamespace(bit16_groups=[[None] * len(g) for g in grads_per_group],
                           averaged_gradients=dict(enumerate(grads_per_group)), check_grad_overflow=True,
                           cpu_offload=False,
                           has_overflow_partitioned_grads_serial=lambda: None, _has_inf_or_nan=None)


@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
def test_foreach_overflow_check_finds_what_deepspeeds_finds(bad):
    """Gradients in two groups (one None): a single inf or NaN anywhere is an overflow for both checks, and none is
    none; the lean check dispatches a dozen operators at most where DeepSpeed's makes several per gradient."""
    g = torch.Generator().manual_seed(1)
    grads = [[torch.randn(40, generator=g) for _ in range(30)], [None, torch.randn(8, generator=g)]]
    if bad is not None:
        grads[0][17][5] = bad
    opt = zero_optimizer(grads)
    opt._has_inf_or_nan = DeepSpeedZeroOptimizer._has_inf_or_nan
    with Count() as plain:
        want = bool(DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial(opt))
    assert lean_overflow_check(opt)
    with Count() as lean:
        got = bool(opt.has_overflow_partitioned_grads_serial())
    assert got == want == (bad is not None)
    assert lean.n <= 12 < 4 * len(grads[0]) <= plain.n, (lean.n, plain.n)


def test_overflow_check_left_alone_where_deepspeed_runs_none():
    """fp32 (no check), CPU offload (its own path): nothing replaced."""
    for kw in ({"check_grad_overflow": False}, {"cpu_offload": True}):
        opt = zero_optimizer([[torch.ones(2)]])
        opt.__dict__.update(kw)
        assert not lean_overflow_check(opt)
