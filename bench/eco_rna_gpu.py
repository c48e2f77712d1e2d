#!/usr/bin/env python
"""Benchmark (CUDA): Eco-RNA 80M attention paths, parity and speed, in one run.

    python bench/eco_rna_gpu.py [--repeats 5] [--lengths 512,1024] [--dry-run]

(a) Parity of every attention path against an fp32 SDPA reference of the same weights, on the right-aligned
    wavefront with k_max above every depth, so that the first wavefront steps call the core on zero rows (one of them
    inside the backward window), with the anchor readout and the real objective (pipeline/objectives/eco_rna.py
    recurrent_loss: terminal MLM + displacement + anchor). Paths: padded SDPA (attn_backend sdpa, unpad false); the
    packed layout as training runs it (attn_backend auto, unpad true: flash-attn's varlen kernel when it imports,
    else on CUDA torch's varlen kernel, else one SDPA call per sequence); the packed layout's pure-PyTorch fallback
    (attn_backend sdpa, unpad true: one SDPA call per sequence); flash-attn padded and packed when it imports. Each
    with the module in bf16 as DeepSpeed's bf16 mode trains it. Compared: the loss, the logits at real tokens and
    every parameter gradient, each as a relative error in norm against fp32. A path passes when its errors are at
    most twice those of bf16 SDPA (padded), the bf16 rounding every path shares, plus 1e-3; the other rows also
    print their distance from bf16 SDPA itself.
(b) Forward+backward of the same objective (no optimizer) on launchers/configs/eco_rna_80m.yaml's model, for
    L = 512 (32 rows, its micro_batch_size) and L = 1024 (16 rows): the two layouts training chooses between,
    padded and packed, each as training runs it (attn_backend auto; ``unpad`` false and true), module in bf16 and
    fp32 weights under bf16 autocast; each row names the attention kernel it ran. Row lengths are seeded: one row of L, the others log-uniform in [32, L] (43 % padding at
    L = 512); depths from the config's law (mu_K 4, sigma 0.5, cap 32; W_bwd 4, K_a 1), seeded, the same for every
    path. Per setting: ms per step (median of --repeats, CUDA events, after two warm-up steps), real tokens/s,
    executed TFLOP/s and MFU (EcoRNAConfig.train_flops of the executed schedule: the realized K_i, the backward
    window, the anchor readouts; padded rows at L, unpacked rows at their own lengths), the MFU of the real tokens'
    FLOPs alone (comparable across paths), and peak memory (torch.cuda.max_memory_allocated). Peak: 989 TFLOP/s,
    the H200/H100 SXM dense bf16 datasheet figure (matrix products measured here reach about 790).

Prints ``RESULT P5 <MFU>``: the best executed-schedule MFU at the first length (512) with the module in bf16 (the
training path), and ``packed / padded``: the packed layout's step time over the padded one's at each length (bf16),
the figure that decides model.unpad (below 1: packed is faster).
Exits with one line where torch sees no CUDA device; ``--dry-run`` runs every step on the CPU with a tiny model
(the script's own check; its figures mean nothing). Exit status 1 when a bf16 path fails parity or crashes.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from pipeline.models.eco_rna import EcoRNA, EcoRNAConfig, initial_state  # noqa: E402
from pipeline.models.layers import flash_available, torch_varlen_available  # noqa: E402
from pipeline.objectives.eco_rna import EcoRNAObjectiveConfig, Plan, recurrent_loss, sample_depths  # noqa: E402
from pipeline.objectives.masking import IGNORE_INDEX  # noqa: E402

PEAK_FLOPS = 989e12  # H200 (= H100 SXM) dense bf16, datasheet
CONFIG = REPO / "launchers" / "configs" / "eco_rna_80m.yaml"
MASK_ID, RESIDUES = 4, (6, 10)  # <mask>; A C G U
TINY = dict(d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, n_prelude=1, n_core=1, n_coda=1)  # --dry-run


def load_config(dry_run: bool):
    raw = yaml.safe_load(CONFIG.read_text())
    model = dict(raw["model"], **(TINY if dry_run else {}))
    return model, EcoRNAObjectiveConfig(**raw["objective"])


def make_cfg(model: dict, backend: str, unpad: bool) -> EcoRNAConfig:
    return EcoRNAConfig(**dict(model, attn_backend=backend, unpad=unpad))


BASE = ("sdpa", False)  # padded SDPA: the parity's reference path (and, in fp32, its reference)
PADDED, PACKED = ("auto", False), ("auto", True)  # the two layouts as training runs them (attn_backend auto)


def parity_paths() -> tuple[list, list]:
    """([(backend, unpad)] whose parity runs here, [notes on those that cannot])."""
    out = [BASE, PACKED, ("sdpa", True)]
    if flash_available():
        out += [("flash", False), ("flash", True)]
        return out, []
    return out, ["flash: not run (flash-attn does not import or no CUDA; bash scripts/install_gpu_kernels.sh)"]


def speed_paths() -> list:
    """The layouts whose speed decides model.unpad: padded and packed, each with training's own kernel choice."""
    return [PADDED, PACKED]


def kernel_of(backend: str, unpad: bool, device: torch.device) -> str:
    """The attention kernel (backend, unpad) runs on ``device`` with a bf16 module (pipeline/models/layers.py)."""
    if backend == "flash" or (backend == "auto" and flash_available() and device.type == "cuda"):
        return "flash-attn varlen" if unpad else "flash-attn"
    if not unpad:
        return "SDPA"
    probe = torch.zeros(1, device=device, dtype=torch.bfloat16)
    if backend == "auto" and torch_varlen_available(probe):
        return "torch varlen"
    return "SDPA per sequence"


def name_of(backend, unpad) -> str:
    return f"{backend} {'packed' if unpad else 'padded'}"


def make_batch(rows: int, length: int, lengths: list, gen: torch.Generator, device):
    """Random residues, 15 % of the real positions masked and supervised, right padding."""
    tokens = torch.randint(*RESIDUES, (rows, length), generator=gen)
    mask = torch.arange(length)[None] < torch.tensor(lengths)[:, None]
    pick = (torch.rand(rows, length, generator=gen) < 0.15) & mask
    labels = torch.where(pick, tokens, IGNORE_INDEX)
    inputs = torch.where(pick, MASK_ID, tokens) * mask  # 0 = <pad>
    return SimpleNamespace(input_ids=inputs.to(device), attention_mask=mask.to(device), labels=labels.to(device))


def seeded_lengths(rows: int, length: int, gen: torch.Generator) -> list:
    """One row of ``length`` (the padded extent), the others log-uniform in [32, length] (in [length / 8, length]
    below 256)."""
    lo = math.log(min(32, max(2, length // 8)))
    rest = torch.exp(lo + torch.rand(rows - 1, generator=gen) * (math.log(length) - lo)).long().clamp(2, length)
    return [length] + rest.tolist()


class Case:
    """One batch with its depths, initial state and k_max: identical inputs for every path."""

    def __init__(self, model_cfg: dict, obj, rows, length, lengths, depths, k_max, device, seed):
        gen = torch.Generator().manual_seed(seed)
        self.batch = make_batch(rows, length, lengths, gen, device)
        self.lengths, self.length = lengths, length
        self.depths = torch.as_tensor(depths, dtype=torch.long)
        self.k_max = int(k_max)
        self.s0 = initial_state(make_cfg(model_cfg, *BASE), self.batch.attention_mask.cpu(), gen).to(device)
        self.obj = obj

    def loss(self, model, cfg):
        plan = Plan(self.depths, None, {"k_max": self.k_max}, init_state=self.s0)
        # the training's token buckets (objective.token_buckets) on the packed layout: this batch is one microbatch
        train = SimpleNamespace(max_tokens_per_microbatch=len(self.lengths) * self.length)
        out = recurrent_loss(model, self.batch, SimpleNamespace(model=cfg, objective=self.obj, train=train), plan)
        return out.sum_loss / max(out.num_tokens, 1)

    def flops(self, cfg, packed: bool) -> int:
        """EcoRNAConfig.train_flops of the executed schedule: padded rows at L, packed rows at their lengths."""
        w, ka = self.obj.backward_window, self.obj.anchor_depth
        ks = self.depths.tolist()
        if not packed:
            return cfg.train_flops(ks, self.length, w, sum(k > ka for k in ks) if self.obj.lambda_anchor > 0 else 0)
        return sum(cfg.train_flops([k], n, w, int(k > ka and self.obj.lambda_anchor > 0))
                   for k, n in zip(ks, self.lengths))

    @property
    def real_tokens(self) -> int:
        return int(sum(self.lengths))


def build(model_cfg: dict, backend, unpad, state, device, dtype):
    cfg = make_cfg(model_cfg, backend, unpad)
    with torch.device(device):  # initialized where it runs: 80M parameters drawn on the CPU take seconds
        model = EcoRNA(cfg)
    model.load_state_dict(state)
    return model.to(dtype=dtype), cfg


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()


def run_once(model, cfg, case, autocast_device=None):
    """(loss, logits at real tokens, {param: grad}) of one forward+backward."""
    model.zero_grad(set_to_none=True)
    seen = {}

    def forward(*a, **kw):  # the objective calls the model once: keep its output for the logits
        seen["out"] = model(*a, **kw)
        return seen["out"]

    ctx = torch.autocast(autocast_device, torch.bfloat16) if autocast_device else torch.enable_grad()
    with ctx:
        loss = case.loss(forward, cfg)
    loss.backward()
    logits = seen["out"].logits[case.batch.attention_mask].detach().float()
    grads = {n: (p.grad.float().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32))
             for n, p in model.named_parameters()}
    return loss.detach().float(), logits, grads


def parity(model_cfg, obj, state, device, dry_run: bool) -> bool:
    L = 32 if dry_run else 512
    gen = torch.Generator().manual_seed(12)
    rows = 4 if dry_run else 8
    depths = sample_depths(rows, obj, gen)
    cases = {
        # k_max 6 > every K_i: steps 1-3 run the core on zero rows (step 3 inside W_bwd = 4); K_a = 1 anchors rows 2-4
        "idle steps": Case(model_cfg, obj, 4, L, [L, L * 3 // 4, L // 4, 9], [1, 2, 3, 2], 6, device, 11),
        # the law's depths with k_max two above their maximum: two zero-row steps at the start
        "law depths, k_max + 2": Case(model_cfg, obj, rows, L, seeded_lengths(rows, L, gen), depths.tolist(),
                                      int(depths.max()) + 2, device, 13),
    }
    runnable, notes = parity_paths()
    ok = True
    print("(a) parity against fp32 SDPA, module in bf16; relative errors in norm (the loss, logits at real tokens, "
          "the gradient of every parameter together, and the worst single parameter)")
    for cname, case in cases.items():
        print(f"  case '{cname}': rows {len(case.lengths)}, L {case.length}, lengths {case.lengths}, depths "
              f"{case.depths.tolist()}, k_max {case.k_max}, W {obj.backward_window}, K_a {obj.anchor_depth}")
        ref_model, ref_cfg = build(model_cfg, *BASE, state, device, torch.float32)
        ref = run_once(ref_model, ref_cfg, case)
        del ref_model
        results = {}
        for backend, unpad in runnable:
            try:
                m, cfg = build(model_cfg, backend, unpad, state, device, torch.bfloat16)
                results[(backend, unpad)] = run_once(m, cfg, case)
                del m
            except Exception as e:  # noqa: BLE001 - a crash is this path's result, the others still run
                print(f"    {name_of(backend, unpad):<14} FAILED: {type(e).__name__}: {str(e).splitlines()[0]}")
                ok = False
        base_key = BASE
        errs = {}
        for key, (loss, logits, grads) in results.items():
            g_all = torch.cat([g.flatten() for g in grads.values()])
            r_all = torch.cat([g.flatten() for g in ref[2].values()])
            worst = max(((n, rel(grads[n], ref[2][n])) for n in grads if ref[2][n].norm() > 0), key=lambda x: x[1])
            errs[key] = (abs(loss.item() - ref[0].item()) / abs(ref[0].item()), rel(logits, ref[1]), rel(g_all, r_all),
                         worst)
        if base_key not in errs:
            print("    bf16 SDPA did not run: nothing to compare against")
            ok = False
            continue
        base = errs[base_key]
        print(f"    {'path':<14}{'kernel':<19}{'loss':>10}{'logits':>10}{'grads':>10}  {'worst parameter':<56}"
              f"{'vs bf16 sdpa':<34}  verdict")
        for key, (e_loss, e_logits, e_grads, (wname, werr)) in errs.items():
            passed = all(e <= 2 * b + 1e-3 for e, b in ((e_loss, base[0]), (e_logits, base[1]), (e_grads, base[2])))
            vs = ""
            if key != base_key:  # this path against bf16 SDPA itself
                (_, lg, gr), (_, lg0, gr0) = results[key], results[base_key]
                flat, flat0 = (torch.cat([g.flatten() for g in x.values()]) for x in (gr, gr0))
                vs = f"logits {rel(lg, lg0):.2e} grads {rel(flat, flat0):.2e}"
            print(f"    {name_of(*key):<14}{kernel_of(*key, device):<19}{e_loss:>10.2e}{e_logits:>10.2e}{e_grads:>10.2e}  "
                  f"{wname + f' {werr:.2e}':<56}{vs:<34}{'ok' if passed else 'FAIL'}")
            ok &= passed
    for n in notes:
        print(f"  {n}")
    return ok


class Timer:
    def __init__(self, device, warmup: int = 2):
        self.cuda, self.warmup = device.type == "cuda", warmup

    def time_ms(self, fn, repeats: int) -> float:
        for _ in range(self.warmup):  # kernel selection, allocator
            fn()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(repeats):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def throughput(model_cfg, obj, state, device, lengths_list, repeats: int, dry_run: bool) -> tuple[bool, dict]:
    runnable = speed_paths()
    timer = Timer(device, warmup=1 if dry_run else 2)
    ok, best, ms_of = True, {}, {}
    print(f"(b) forward+backward of the training objective, no optimizer; MFU against {PEAK_FLOPS / 1e12:.0f} TFLOP/s")
    hdr = (f"  {'L':>5} {'rows':>4} {'precision':<10}{'path':<14}{'kernel':<19}{'ms/step':>9}{'real tok/s':>12}"
           f"{'TFLOP/s':>9}{'MFU':>7}{'MFU real':>9}{'peak GiB':>9}")
    print(hdr)
    for L in lengths_list:
        rows = (4 if dry_run else 32) if L <= 512 else (2 if dry_run else 16)
        gen = torch.Generator().manual_seed(1000 + L)
        lengths = seeded_lengths(rows, L, gen)
        depths = sample_depths(rows, obj, gen)
        case = Case(model_cfg, obj, rows, L, lengths, depths.tolist(), int(depths.max()), device, 2000 + L)
        print(f"  L {L}: {rows} rows, {case.real_tokens} real tokens of {rows * L} "
              f"({1 - case.real_tokens / (rows * L):.0%} padding), depths {sorted(case.depths.tolist())}")
        for precision in ("bf16", "autocast"):
            for backend, unpad in runnable:
                label = name_of(backend, unpad)
                try:
                    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
                    m, cfg = build(model_cfg, backend, unpad, state, device, dtype)
                    ac = device.type if precision == "autocast" else None

                    def step(m=m, cfg=cfg, ac=ac):
                        m.zero_grad(set_to_none=True)
                        ctx = torch.autocast(ac, torch.bfloat16) if ac else torch.enable_grad()
                        with ctx:
                            loss = case.loss(m, cfg)
                        loss.backward()

                    ms = timer.time_ms(step, repeats)
                    packed = bool(m.unpadded(case.batch.input_ids))
                    if packed != unpad:  # the layout this row claims is the one that ran
                        raise RuntimeError(f"the model ran {'packed' if packed else 'padded'} with unpad={unpad}")
                    flops, real = case.flops(cfg, packed), case.flops(cfg, True)
                    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
                    mfu = flops / (ms / 1e3) / PEAK_FLOPS
                    ms_of[(L, precision, unpad)] = ms
                    print(f"  {L:>5} {rows:>4} {precision:<10}{label:<14}{kernel_of(backend, unpad, device):<19}"
                          f"{ms:>9.2f}{case.real_tokens / ms * 1e3:>12.0f}"
                          f"{flops / (ms / 1e3) / 1e12:>9.1f}{mfu:>7.1%}{real / (ms / 1e3) / PEAK_FLOPS:>9.1%}"
                          f"{peak:>9.2f}")
                    if precision == "bf16" and L == lengths_list[0] and mfu > best.get("mfu", -1):
                        best = {"mfu": mfu, "path": label, "ms": ms, "L": L, "rows": rows}
                    m = step = None  # free this setting's weights and gradients before the next
                except Exception as e:  # noqa: BLE001 - reported; only a bf16 (training-path) crash fails the run
                    why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    verdict = "FAILED" if precision == "bf16" else "not run"
                    print(f"  {L:>5} {rows:>4} {precision:<9}{label:<14} {verdict}: {why[:160]}")
                    ok &= precision != "bf16"
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    print("  (the packed layout's pure-PyTorch fallback, one SDPA call per sequence, is in (a) only: training on CUDA "
          "never runs it)")
    for L in lengths_list:
        if (L, "bf16", False) in ms_of and (L, "bf16", True) in ms_of:
            r = ms_of[(L, "bf16", True)] / ms_of[(L, "bf16", False)]
            print(f"packed / padded (bf16, L {L}): {r:.2f} of the step time, packed on "
                  f"{kernel_of(*PACKED, device)} ({'packed' if r < 1 else 'padded'} is faster)")
            print(f"RESULT P5.packed_over_padded.L{L} {r:.3f}")
            best.setdefault("ratios", {})[L] = r
    return ok, best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="timed steps per setting (median)")
    p.add_argument("--lengths", default="512,1024", help="context lengths for (b)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model: checks the script, measures nothing")
    p.add_argument("--skip-parity", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() and not args.dry_run:
        sys.exit("bench/eco_rna_gpu.py: needs a CUDA device (torch sees none); --dry-run checks the script on the CPU")
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        p.error(f"--lengths: comma-separated integers, got {args.lengths!r}")
    if args.dry_run:
        lengths = [32]
    device = torch.device("cpu" if args.dry_run else "cuda")
    model_cfg, obj = load_config(args.dry_run)
    torch.manual_seed(0)
    state = EcoRNA(make_cfg(model_cfg, *BASE)).state_dict()  # one set of weights for every path
    n_params = sum(t.numel() for t in state.values())
    where = (f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}" if device.type == "cuda"
             else "CPU dry run (tiny model)")
    print(f"{where}, torch {torch.__version__}; Eco-RNA {n_params / 1e6:.2f}M parameters "
          f"(d {model_cfg['d_model']}, {model_cfg['n_prelude']}+{model_cfg['n_core']}xK+{model_cfg['n_coda']} blocks); "
          f"flash-attn {'yes' if flash_available() else 'no'}; the packed layout runs {kernel_of(*PACKED, device)}")
    ok = True
    if not args.skip_parity:
        t0 = time.perf_counter()
        ok &= parity(model_cfg, obj, state, device, args.dry_run)
        print(f"  ({time.perf_counter() - t0:.1f} s)")
    if not args.skip_speed:
        t0 = time.perf_counter()
        sp_ok, best = throughput(model_cfg, obj, state, device, lengths, max(1, args.repeats), args.dry_run)
        ok &= sp_ok
        print(f"  ({time.perf_counter() - t0:.1f} s)")
        if "mfu" in best:
            print(f"RESULT P5 {best['mfu']:.4f} Eco-RNA {n_params / 1e6:.0f}M fwd+bwd MFU of the executed schedule "
                  f"(realized depths), L {best['L']}, {best['rows']} rows, module bf16, best path '{best['path']}' "
                  f"({best['ms']:.1f} ms/step), peak {PEAK_FLOPS / 1e12:.0f} TFLOP/s"
                  + (" [dry run: meaningless]" if args.dry_run else ""))
    if not ok:
        print("bench/eco_rna_gpu.py: FAILED (see the FAIL/FAILED lines above)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
