#!/usr/bin/env python
"""Write a randomly initialized ESM2 of a real shape as a Hugging Face directory (config.json + model.safetensors).

    python tools/make_random_esm2.py --size 8M --out data/esm2_random_8M

No machine here can download ESM2 weights, so tests and the CPU demo start from a random ESM2 of the real shape,
saved by ``transformers`` exactly as ``facebook/esm2_t6_8M_UR50D`` is laid out. With real weights, point
tools/upcycle_esm2.py at the downloaded directory instead (docs/protlingo.md, "Bringing ESM2").
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

# this checkout's pipeline, not one installed from another (as every tool here does)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# (layers, hidden, heads, FFN) of the published ESM2 checkpoints (docs/protlingo.md, "ESM2 backbone sizes")
SIZES = {"8M": (6, 320, 20, 1280), "35M": (12, 480, 20, 1920), "150M": (30, 640, 20, 2560),
         "650M": (33, 1280, 20, 5120)}


def esm2_config(size: str):
    from transformers import EsmConfig

    layers, hidden, heads, ffn = SIZES[size]
    return EsmConfig(vocab_size=33, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=ffn, position_embedding_type="rotary", token_dropout=True, mask_token_id=32,
                     pad_token_id=1, emb_layer_norm_before=False, max_position_embeddings=1026, layer_norm_eps=1e-5,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def build_parser() -> argparse.ArgumentParser:
    """main's command line, apart from main: tests parse the documented commands with it without running them."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="8M", help="the ESM2 shape (default 8M)")
    p.add_argument("--out", required=True, type=Path, help="the Hugging Face directory to write")
    p.add_argument("--seed", type=int, default=0, help="torch seed of the random weights (default 0)")
    p.add_argument("--force", action="store_true", help="replace a directory this tool wrote (a Hugging Face ESM "
                   "directory); anything else is never replaced")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    from pipeline.outputs import OutputDirError, check_output_dir, kept_note, publish_dir, staging_dir, written_by

    try:
        check_output_dir(args.out, force=args.force, owned=written_by("make_random_esm2.py"), what="an ESM2 model",
                         tool="make_random_esm2.py")
    except OutputDirError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch
    from transformers import EsmForMaskedLM

    torch.manual_seed(args.seed)
    model = EsmForMaskedLM(esm2_config(args.size))
    tmp = staging_dir(args.out)
    try:
        model.save_pretrained(str(tmp))
        kept = publish_dir(tmp, args.out, "make_random_esm2.py")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if kept:
        print(kept_note(kept, "make_random_esm2.py"), file=sys.stderr)
    n = sum(t.numel() for t in model.parameters())
    print(f"wrote a random ESM2-{args.size} ({n:,} parameters) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
