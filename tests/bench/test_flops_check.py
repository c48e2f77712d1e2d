"""Issue 47, item 5: for every family the FLOPs a training step executes (FlopCounterMode on the CPU, with
bench/flops_check.py's rules for what it miscounts there) against the FLOPs its MFU counts (the objective's "flops"
total): executed / accounted within [1 / 1.10, 1.10], and today exactly 1. Each family on its narrow twin (every
block, expert and layer of the real config, small widths) with a ragged microbatch of 4 x 128 tokens (padding and
attention both matter), seconds each."""
import pytest
import torch
import torch.nn.functional as F

from bench import flops_check as fc


def counted(fn) -> dict:
    with fc.counting() as c:
        fn()
    return {str(k): v for k, v in c.get_flop_counts()["Global"].items()}


def test_cpu_rules_count_attention_and_grouped_convolutions():
    """The CPU SDPA kernel is counted (torch's FlopCounterMode leaves it at zero): forward QK^T and PV, backward
    their four gradient products; a depthwise convolution's backward is twice its forward (torch counts its weight
    gradient groups times over)."""
    from torch.utils.flop_counter import FlopCounterMode

    B, H, Hkv, L, hd = 2, 4, 2, 16, 8
    q = torch.randn(B, H, L, hd, requires_grad=True)
    k, v = (torch.randn(B, Hkv, L, hd, requires_grad=True) for _ in range(2))
    mask = torch.ones(B, 1, 1, L, dtype=torch.bool)
    mask[1, ..., 10:] = False

    def attention():
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).sum().backward()

    ops = counted(attention)
    fwd = 4 * B * H * L * L * hd
    assert ops == {"aten._scaled_dot_product_flash_attention_for_cpu": fwd,
                   "aten._scaled_dot_product_flash_attention_for_cpu_backward": 2 * fwd}
    with FlopCounterMode(display=False) as plain:
        attention()
    assert plain.get_total_flops() == 0  # why the rule exists

    d, n = 6, 10
    x = torch.randn(B, d, n, requires_grad=True)
    conv = torch.nn.Conv1d(d, d, kernel_size=3, groups=d)  # ProtLingo's memory convolution
    ops = counted(lambda: conv(F.pad(x, (2, 0))).sum().backward())
    assert ops == {"aten.convolution": 2 * B * d * n * 3, "aten.convolution_backward": 2 * 2 * B * d * n * 3}
    with FlopCounterMode(display=False) as plain:
        conv(F.pad(x, (2, 0))).sum().backward()
    assert plain.get_flop_counts()["Global"][torch.ops.aten.convolution_backward] > 2 * 2 * B * d * n * 3


@pytest.mark.parametrize("config", fc.CONFIGS)
def test_executed_flops_are_the_accounted_flops(config):
    """The acceptance line (executed / accounted <= 1.10, and >= 1 / 1.10 so that an over-count fails too), and the
    count is exact: every matmul, attention and convolution the step runs is in the formula once per execution
    (ProtLingo: the routed experts and the router on the real tokens only, the memory's W_q forward only, its
    depthwise convolution; Eco-RNA: the drawn depths, the truncated backward, the anchor readout)."""
    r = fc.check(config)
    assert 1 / fc.TARGET <= r["ratio"] <= fc.TARGET, r
    assert r["executed"] == r["accounted"], r
    assert r["by_op"]["aten._scaled_dot_product_flash_attention_for_cpu_backward"] > 0  # attention was counted
    assert r["real_tokens"] < r["shape"][0] * r["shape"][1]  # a padded microbatch


@pytest.mark.parametrize("lengths", [(128, 128, 128, 128), (128, 9, 3, 100)])
def test_protlingo_counts_its_real_tokens(lengths):
    """ProtLingo's count follows the real tokens (the routed experts run on those only), from full rows to rows of
    a few tokens, and without MoE or memory (the plain ESM2 backbone)."""
    for extra in ([], ["model.moe_layers=[]", "model.memory_layers=[]"]):
        r = fc.check("protlingo_150m", ["model.n_layers=4", "model.moe_layers=[1,2,3]", "model.memory_layers=[0,3]"]
                     + extra, batch={"lengths": lengths})
        assert r["real_tokens"] == sum(lengths) and r["executed"] == r["accounted"], (extra, r)
