#!/usr/bin/env python
"""Print forward GFLOPs of one sequence per recurrent depth from the config, before (and without) building the model.

    python tools/flops.py --config launchers/configs/eco_rna_80m.yaml --length 512 --depths 1,4,8
    python tools/flops.py --config standard_h384 --length 512 --depths 1-8

--config is a file or the name of one in launchers/configs; --depths takes the syntax of launchers/evaluate.py
--depths (pipeline/eval/cli.py parses both): depths and ranges such as 1-8 or 1-4,8, up to the same cap.

The count is the model config's own ``forward_flops`` (the one training logs as FLOPs): dense matrix multiplies only,
a multiply-add counted as two, norms and other elementwise work left out. For every family it amounts to

    F(K, L) = 2 N(K) L + 4 n_attn(K) L^2 d

with N(K) the parameters a token passes through as a matrix at depth K (every weight matrix once per application,
the output head included; the input embedding table is a lookup and is excluded, as are norm gains and biases) and
n_attn(K) the attention layers applied (scores and values over the full L x L, causal or not). Per family:

* eco_rna (paper 000, Eq. A.8-A.9): D(K) F_blk(L) + 2 (K + 1) L d^2 + 2 L d |V|, D(K) = L_p + K L_r + L_c; 80M at
  L = 512 gives 90.011, 180.608, 301.404 GFLOPs at K = 1, 4, 8.
* recursive_gpt / standard_gpt (paper 003): 2 L V E (untied head) + 4 L E H (both factorized projections, when
  E != H) + S (2 L P_blk + 4 L^2 H), with S = K steps of the shared block (RecursiveGPT) or the n_layers layers
  (standard: every K is the same, the model has one depth) and P_blk = 4 H^2 + H n_heads + 2 H d_ff.
  standard_h384 at L = 512: N = 28,535,808 (its 41,139,072 parameters less the input embedding's 12,582,912 and the
  norms' 20,352), so 2 N L = 29.221 G plus attention 12 x 4 L^2 H = 4.832 G: 34.053 GFLOPs.
* eco_rna_control, protlingo: one depth; ``depth`` does not change the count. ProtLingo's adds the memory's
  depthwise convolution (3 taps: 6 L d per memory layer), which runs as a convolution, not a matrix multiply.

A training step's count is not always 3 x this: the backward repeats no multiply of Eco-RNA's iterations outside
its backward window nor of ProtLingo's W_q (no gradient reaches it), and ProtLingo's routed experts run on the real
tokens only, not on padding. Each objective's "flops" total is the training count (what MFU divides), and
bench/flops_check.py checks it against the FLOPs a step executes.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def forward_flops(model_cfg, depth: int, length: int) -> int:
    """The config's forward FLOPs at ``depth`` and ``length``, called by keyword: the families order the two
    arguments differently (eco_rna ``(depth, length)``, the others ``(length, depth)``), and a positional call swapped
    them for the GPT configs (0.057 instead of 34.053 GFLOPs for standard_h384 at L = 512)."""
    return model_cfg.forward_flops(depth=depth, length=length)


def build_parser() -> argparse.ArgumentParser:
    """main's command line, apart from main: tests parse the documented commands with it without running them."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="a config file, or a name in launchers/configs")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set model.d_model=512 (repeatable)")
    p.add_argument("--length", type=int, required=True, help="sequence length L in tokens")
    p.add_argument("--depths", default="1,4,8", help="core applications K: a list and/or ranges, e.g. 1,4,8 or 1-8 "
                   "(the syntax and cap of launchers/evaluate.py --depths)")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    from pipeline.config import ConfigError, load_config
    from pipeline.config_files import resolve_config
    from pipeline.eval.cli import check_depths, parse_depths

    try:
        if args.length < 1:
            raise ConfigError(f"--length {args.length}: must be a positive number of tokens")
        depths = parse_depths(args.depths)
        path = resolve_config(args.config)
        cfg = load_config(path, args.overrides)
        check_depths(depths, cfg, path, text=args.depths)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    m = cfg.model
    print(f"{cfg.family} ({path}), L = {args.length}: forward FLOPs of one sequence = 2 N(K) L + 4 n_attn(K) L^2 d "
          "(N(K): matrix parameters a token passes through at depth K, input embedding and norms excluded)")
    for k in depths:
        print(f"K={k}: {forward_flops(m, k, args.length) / 1e9:.3f} GFLOPs")
    if len({forward_flops(m, k, args.length) for k in depths}) == 1 and len(depths) > 1:
        print(f"note: {cfg.family} has one depth: every K is the same forward")
    return 0


if __name__ == "__main__":
    sys.exit(main())
