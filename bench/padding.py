#!/usr/bin/env python
"""Benchmark P6: tokens computed / real tokens of the loader's microbatches, per batching setup, in one run.

    python bench/padding.py [--quick] [--input FASTA] [--windows N]

Tokens computed = rows x padded length summed over microbatches (what the model runs on); real tokens = the
attention-mask sum. Shards are built in a temp dir by the real ``python -m data_prep rnacentral`` CLI (1,000 records
a shard) from the RNAcentral ncRNA test set in ../shared/data (6,001 records, 16-11,420 nt), or, when that is absent,
the shipped Rfam sample (2,107 records, with a note: shorter records, so less padding to remove). Every setup loads
a shipped config, points it at those shards, and builds its loader with the training's own RunPlan.build_dataset (the
family's transform: framing, random crop to data.context_length, masking; its pad id; every data.* key), one loader
stream (data.num_workers 0; each worker stream batches alike), rank 0 of 1. A setup with length windows is measured
over whole windows (its first N x data.length_window draws), the others over at least as many samples.

Setups: the demo and eco_rna_80m configs as shipped, eco_rna_80m in draw order (data.length_window 0, 32 rows: the
80M config before length-aware batching), and eco_rna_80m at context 1024 in draw order (32 rows; a 32 x 1024 or
16,384-token budget) and with length windows (the shipped W, the 32 x 1024 budget: the headline P6; 32 rows). ``--quick``
(what bench/run_all.py passes): one window per setup, about a minute on two cores; the default: three.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipeline.config import load_config  # noqa: E402
from pipeline.data.loader import make_loader  # noqa: E402
from pipeline.data.streams import StreamLayout  # noqa: E402
from pipeline.train import RunPlan  # noqa: E402
from pipeline.families import get_family  # noqa: E402
from pipeline.train.memory import as_on_device  # noqa: E402

RNACENTRAL = REPO.parent / "shared" / "data" / "rna" / "rnacentral_ncrna6_testset.fasta"
SAMPLE = REPO / "data" / "samples" / "rfam_nrc_train_sample.fasta.gz"
CONFIGS = REPO / "launchers" / "configs"
CTX1024 = ["data.context_length=1024"]
BUDGET1024 = ["train.max_tokens_per_microbatch=32768"]  # 32 rows x 1024: the shipped rule, rows x context
W8192 = ["data.length_window=8192"]  # the window these setups measured with before the 80M config's grew to 32,768
DRAW_ORDER = ["data.length_window=0", "train.max_tokens_per_microbatch=null"]

# (result id, config, overrides, what it is)
SETUPS = [
    ("P6.demo", "eco_rna_demo.yaml", [], "demo config as shipped (context 128, 8 rows, draw order)"),
    ("P6.eco_rna_80m_draw_order", "eco_rna_80m.yaml", DRAW_ORDER,
     "eco_rna_80m without length windows (context 512, 32 rows: the config before length-aware batching)"),
    ("P6.eco_rna_80m", "eco_rna_80m.yaml", [], "eco_rna_80m as shipped on one H200 (context 512, length_window "
     "32768, auto: a 131,072-token budget)"),
    ("P6.eco_rna_80m_w8192", "eco_rna_80m.yaml", W8192, "the same with the 8,192-sample windows it had before"),
    ("P6.eco_rna_80m_16k", "eco_rna_80m.yaml", ["train.max_tokens_per_microbatch=16384"] + W8192,
     "eco_rna_80m with the 16,384-token budget and 8,192-sample windows it fixed before auto (16,384 tokens a rank "
     "on 8 GPUs)"),
    ("P6.ctx1024_draw_order", "eco_rna_80m.yaml", DRAW_ORDER + CTX1024, "context 1024, 32 rows, draw order"),
    ("P6.ctx1024_budget_draw_order", "eco_rna_80m.yaml", DRAW_ORDER + CTX1024 + BUDGET1024,
     "context 1024, 32768-token budget, draw order"),
    ("P6.ctx1024_budget16k_draw_order", "eco_rna_80m.yaml", DRAW_ORDER + CTX1024 + [
        "train.max_tokens_per_microbatch=16384"], "context 1024, 16384-token budget, draw order"),
    ("P6.ctx1024_rows32", "eco_rna_80m.yaml", ["train.max_tokens_per_microbatch=null"] + CTX1024 + W8192,
     "context 1024, 32 rows, length_window 8192"),
    ("P6", "eco_rna_80m.yaml", CTX1024 + BUDGET1024 + W8192,
     "context 1024, 32768-token budget, length_window 8192 (eco_rna_80m otherwise as shipped)"),
]


def build_shards(fasta: Path, out: Path) -> Path:
    proc = subprocess.run([sys.executable, "-m", "data_prep", "rnacentral", "--input", str(fasta), "--output",
                           str(out), "--shard-size", "1000", "--progress", "off"], cwd=REPO, capture_output=True,
                          text=True)
    if proc.returncode:
        raise SystemExit(f"data_prep rnacentral failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return out


def measure(config: str, overrides: list, shards: Path, windows: int) -> tuple[float, int, int, int]:
    """(tokens computed / real tokens, samples, microbatches, length_window) of one setup's loader."""
    cfg = load_config(CONFIGS / config, [*overrides, f"data.train_shards={shards}", "data.num_workers=0"])
    cfg = as_on_device(cfg, get_family(cfg.family))  # auto: the microbatch of one H200
    # the training's own construction: RunPlan.build_dataset reads cfg, family and the stream layout only
    layout = StreamLayout.fresh(1, 0, cfg.data.num_workers, cfg.data.loader_streams)
    dataset = RunPlan.build_dataset(SimpleNamespace(cfg=cfg, family=get_family(cfg.family), loader_layout=layout,
                                                    cache=None),  # local shards: no remote cache
                                    rank=0)
    W = cfg.data.length_window
    target = windows * (W or 8192)
    computed = real = samples = batches = 0
    for b in make_loader(dataset, 0):
        computed += b.input_ids.numel()  # rows x padded length
        real += int(b.attention_mask.sum())
        samples, batches = samples + len(b.sample_ids), batches + 1
        if samples >= target and (not W or b.state["window_batches"] == 0):  # whole windows only
            break
    return computed / real, samples, batches, W


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one window per setup (bench/run_all.py)")
    p.add_argument("--windows", type=int, default=None, help="windows of 8,192 draws per setup (default 3, quick 1)")
    p.add_argument("--input", type=Path, default=None,
                   help=f"RNAcentral-style FASTA (default {RNACENTRAL}, else the shipped Rfam sample)")
    args = p.parse_args(argv)
    windows = args.windows if args.windows is not None else (1 if args.quick else 3)
    if windows < 1:
        p.error(f"--windows {windows}: must be >= 1")
    fasta = args.input or (RNACENTRAL if RNACENTRAL.is_file() else SAMPLE)
    if not fasta.is_file():
        p.error(f"--input {fasta}: file not found")
    note = "" if fasta != SAMPLE else " (note: ../shared/data absent; the shipped Rfam sample, shorter records)"
    print(f"input: {fasta}{note}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        shards = build_shards(fasta, Path(tmp) / "shards")
        for rid, config, overrides, what in SETUPS:
            t0 = time.perf_counter()
            ratio, samples, batches, W = measure(config, overrides, shards, windows)
            rows.append((rid, ratio, what))
            print(f"{rid:30s} {ratio:6.3f}  {samples:6d} samples in {batches:5d} microbatches "
                  f"({time.perf_counter() - t0:.1f} s)  {what}", flush=True)
    data = "RNAcentral test set" if fasta == RNACENTRAL else fasta.name
    for rid, ratio, what in rows:
        target = " (target <= 1.05)" if rid == "P6" else ""
        print(f"RESULT {rid} {ratio:.4f} tokens computed / real tokens, {what}, {data}{target}")


if __name__ == "__main__":
    main()
