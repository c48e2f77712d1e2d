"""tools/flops.py prints each family's forward FLOPs at the depths asked for (keyword call: the families order the
arguments of forward_flops differently)."""
import pytest

from conftest import REPO
from prewarmed import run_python
from pipeline.config import load_config


def flops_lines(config: str, length: int, depths: str) -> list[str]:
    proc = run_python([REPO / "tools" / "flops.py", "--config", config, "--length", str(length), "--depths", depths],
                      REPO)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split("\n")


def test_eco_rna_prints_the_papers_figures():
    out = flops_lines("launchers/configs/eco_rna_80m.yaml", 512, "1,4,8")
    assert {"K=1: 90.011 GFLOPs", "K=4: 180.608 GFLOPs", "K=8: 301.404 GFLOPs"} <= set(out)


def test_recursive_gpt_counts_its_recurrence():
    cfg = load_config(REPO / "launchers" / "configs" / "recursive_gpt_10m.yaml").model
    out = flops_lines("launchers/configs/recursive_gpt_10m.yaml", 128, "8,16")
    for r in (8, 16):
        assert f"K={r}: {cfg.forward_flops(length=128, depth=r) / 1e9:.3f} GFLOPs" in out
    assert cfg.forward_flops(length=128, depth=8) < cfg.forward_flops(length=128, depth=16)


def gflops(out: list[str], k: int) -> float:
    (line,) = [ln for ln in out if ln.startswith(f"K={k}: ")]
    return float(line.split()[1])


def matrix_params(model, shared_prefix: str | None = None) -> tuple[int, int]:
    """(N_once, N_shared) from the built model: the numel of every weight matrix (2-D parameter) but the input
    embedding table (a lookup, no FLOPs); norm gains and biases (1-D) are elementwise and not counted either.
    ``shared_prefix``: parameters under it (RecursiveGPT's shared block) are counted separately, once per step."""
    once = shared = 0
    for name, p in model.named_parameters():
        if p.dim() != 2 or name == "embed.embed.weight":
            continue
        if shared_prefix and name.startswith(shared_prefix):
            shared += p.numel()
        else:
            once += p.numel()
    return once, shared


def test_standard_h384_is_two_params_times_length_plus_attention():
    """Issue 11: standard_h384 at L = 512 printed 0.057 GFLOPs (length and depth swapped). The forward count must be
    F = 2 N L + 4 n_layers L^2 H, N the built model's matrix parameters without the input embedding (the convention
    of the config's own forward_flops, which training logs): 34.053 GFLOPs."""
    import torch

    from pipeline.families import get_family

    cfg = load_config(REPO / "launchers" / "configs" / "standard_h384.yaml")
    torch.manual_seed(0)
    model = get_family(cfg.family).build_model(cfg.model)
    assert sum(p.numel() for p in model.parameters()) == cfg.model.num_params() == 41_139_072
    n, _ = matrix_params(model)
    L, H = 512, cfg.model.d_model
    assert n == 28_535_808  # 41,139,072 less the input embedding (12,582,912) and the norms (20,352)
    want = 2 * n * L + cfg.model.n_layers * 4 * L * L * H
    out = flops_lines("standard_h384", L, "1-8")  # a bare config name, a range
    got = [gflops(out, k) for k in range(1, 9)]
    assert got == [34.053] * 8  # one depth: every K is the same forward
    assert abs(got[0] * 1e9 - want) / want < 0.01  # within 1% (it is exact: 34,052,505,600)
    assert cfg.model.forward_flops(length=L) == want
    assert "2 N(K) L + 4 n_attn(K) L^2 d" in out[0] and "note: standard_gpt has one depth" in "\n".join(out)


def test_recursive_gpt_counts_its_shared_block_per_step():
    """RecursiveGPT: the shared block's matrices count once per step K, the head and the factorized projections once:
    F(K) = 2 (N_once + K N_block) L + 4 K L^2 H, N from the built model."""
    import torch

    from pipeline.families import get_family

    cfg = load_config(REPO / "launchers" / "configs" / "recursive_gpt_10m.yaml")
    torch.manual_seed(0)
    model = get_family(cfg.family).build_model(cfg.model)
    once, block = matrix_params(model, "block.")
    L, H = 256, cfg.model.d_model
    out = flops_lines("launchers/configs/recursive_gpt_10m.yaml", L, "1,4-5,16")
    for k in (1, 4, 5, 16):
        want = 2 * (once + k * block) * L + 4 * k * L * L * H
        assert abs(gflops(out, k) * 1e9 - want) / want < 1e-3
    assert not [ln for ln in out if ln.startswith("K=2:")]


def test_depths_syntax_and_cap_are_evaluate_s():
    """--depths goes through the parser launchers/evaluate.py uses (pipeline/eval/cli.py), cap included."""
    from launchers import evaluate
    from pipeline.eval import cli

    assert evaluate.parse_depths is cli.parse_depths
    assert cli.parse_depths("1-3,8,2") == [1, 2, 3, 8]
    proc = run_python([REPO / "tools" / "flops.py", "--config", "eco_rna_demo", "--length", "64", "--depths", "1-33"],
                      REPO)
    assert proc.returncode == 2 and "--depths '1-33': depth 33 is above the maximum 32" in proc.stderr
    assert "eco_rna_demo.yaml" in proc.stderr and "objective.k_cap 8" in proc.stderr


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "launchers" / "configs").glob("*.yaml")))
def test_every_config_counts_length_as_length(config):
    """The source of issue 11: the families' forward_flops order (depth, length) and (length, depth) differently, so
    tools/flops.py calls them by keyword. Guard that for every shipped config: doubling L at least doubles the count
    (attention makes it superlinear), and one more core application never lowers it."""
    import inspect

    m = load_config(REPO / "launchers" / "configs" / config).model
    assert {"length", "depth"} <= set(inspect.signature(m.forward_flops).parameters)
    f = lambda k, n: m.forward_flops(depth=k, length=n)  # noqa: E731
    assert f(1, 512) >= 2 * f(1, 256) > 0
    assert f(2, 256) >= f(1, 256)
