"""tools/flops.py prints each family's forward FLOPs at the depths asked for (keyword call: the families order the
arguments of forward_flops differently)."""
import subprocess
import sys

from conftest import REPO
from pipeline.config import load_config


def flops_lines(config: str, length: int, depths: str) -> list[str]:
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "flops.py"), "--config", config, "--length",
                           str(length), "--depths", depths], cwd=REPO, capture_output=True, text=True, check=True)
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
