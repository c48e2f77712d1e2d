#!/usr/bin/env python
"""How a ProtLingo model routes and addresses a protein set (paper 002, Figure 4): per MoE layer the normalized
routing entropy H(f) / log E and the effective number of experts exp H(f) of the fraction f_e of residues sent to
each expert, the expert usage per amino acid, and the mean over MoE layers (the paper's summary); per memory layer
the fraction of table rows the set addresses and, for hashed tables, the share of window keys that collide.

    python tools/routing_report.py --checkpoint exports/protlingo_demo --fasta proteins.fasta --out reports/routing

Writes OUT/routing_report.json and OUT/routing_report.png (one heatmap per MoE layer: amino acid x expert, each row
the fraction of that amino acid's residues routed to each expert). Every residue of every record is read (records
longer than the model's context are cut into consecutive windows), <cls> and <eos> excluded. A DeepSpeed checkpoint
follows evaluate.py's pickle rule. Bad input is one ``error:`` line and exit 2.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.eval.cli import TRUST_FLAG, TRUST_HELP  # noqa: E402


def windows(seq, length: int):
    """A record's residues in consecutive windows of at most ``length``."""
    return [seq[i:i + length] for i in range(0, len(seq), length)] or []


def batches(records: list, context: int, batch_size: int):
    """Token batches [B, <= context] framed <cls> residues <eos>, right-padded -> (ids, mask) tensors."""
    import torch

    from pipeline.data.protein_tokenizer import ProteinTokenizer as T

    rows = [w for r in records for w in windows(r, context - 2)]
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        width = max(len(w) for w in chunk) + 2
        ids = torch.full((len(chunk), width), T.pad_id, dtype=torch.long)
        for i, w in enumerate(chunk):
            ids[i, :len(w) + 2] = torch.tensor([T.cls_id, *w.tolist(), T.eos_id])
        yield ids, ids != T.pad_id


def report(model, records: list, context: int, batch_size: int = 16) -> dict:
    """The routing and memory statistics of ``model`` (a ProtLingo) over ``records`` (uint8 token arrays), read in
    windows of ``context`` tokens (the training context: data.context_length)."""
    import torch

    from pipeline.data.protein_tokenizer import VOCAB
    from pipeline.models.protlingo import LatentNgramMemory, UpcycledMoE

    cfg = model.cfg
    E = cfg.num_experts
    usage = {}  # MoE block -> [vocab, E] residue counts
    rows_seen, keys_seen = {}, {}  # memory block -> set of (route, row) / (route, key) pairs
    current = {}  # the batch's token ids, for the hooks

    def on_moe(index):
        def hook(module, args, out):
            token_mask = args[1]
            expert = out[1].expert  # the expert each real token ran through (RoutingInfo, real_index order)
            residue = current["ids"][token_mask]
            keep = (residue != 0) & (residue != 2)  # <cls>, <eos>: no amino acid
            counts = usage.setdefault(index, torch.zeros(len(VOCAB), E, dtype=torch.long))
            counts.index_put_((residue[keep], expert[keep]), torch.ones_like(residue[keep]), accumulate=True)
        return hook

    def on_memory(index):
        def hook(module, args):
            h, residue, real = args
            rows, keys = module.addresses(module.norm(h), residue)  # [B, L, R]
            route = torch.arange(cfg.routes).expand_as(rows)
            sel = residue.bool()
            r = route[sel].reshape(-1)  # [N R]: every (route, row) / (route, key) pair of the batch's residues
            rows_seen.setdefault(index, set()).update(zip(r.tolist(), rows[sel].reshape(-1).tolist()))
            keys_seen.setdefault(index, set()).update(zip(r.tolist(), keys[sel].reshape(-1).tolist()))
        return hook

    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, UpcycledMoE):
            hooks.append(m.register_forward_hook(on_moe(int(name.split(".")[1]))))
        elif isinstance(m, LatentNgramMemory):
            hooks.append(m.register_forward_pre_hook(on_memory(int(name.split(".")[1]))))
    from pipeline.eval.cli import progress

    # A bar in residues (stderr): a large protein set is minutes of forwards on a CPU, silent without it.
    bar = progress(total=sum(len(r) for r in records), desc="routing report", unit="residue")
    try:
        with torch.no_grad():
            for ids, mask in batches(records, context, batch_size):
                current["ids"] = ids
                model(ids, mask)
                bar.update(int(mask.sum()) - 2 * len(ids))  # <cls> and <eos> of every window are no residue
    finally:
        bar.close()
        for h in hooks:
            h.remove()
    residues = [VOCAB[i] for i in range(len(VOCAB)) if any(int(u[i].sum()) for u in usage.values())]
    layers = {}
    for index, counts in sorted(usage.items()):
        per_expert = counts.sum(0).double()
        f = per_expert / per_expert.sum()
        h = -float((f[f > 0] * f[f > 0].log()).sum())
        by_residue = {VOCAB[i]: (counts[i].double() / counts[i].sum()).tolist() for i in range(len(VOCAB))
                      if int(counts[i].sum())}
        layers[str(index)] = {"residues": int(per_expert.sum()), "fraction_per_expert": f.tolist(),
                              "normalized_entropy": h / math.log(E), "effective_experts": math.exp(h),
                              "usage_by_amino_acid": by_residue}
    memory = {}
    for index in sorted(rows_seen):
        rows, keys = len(rows_seen[index]), len(keys_seen[index])
        memory[str(index)] = {"rows_addressed": rows, "table_rows": cfg.routes * cfg.table_rows,
                              "fraction_addressed": rows / (cfg.routes * cfg.table_rows), "distinct_keys": keys,
                              "collision_fraction": (keys - rows) / keys if keys else 0.0,
                              "exact_addresses": cfg.exact_addresses}
    return {"records": len(records), "residues": sum(len(r) for r in records), "num_experts": E,
            "amino_acids": residues, "moe_layers": layers, "memory_layers": memory, **across_layers(layers, E)}


def across_layers(layers: dict, num_experts: int) -> dict:
    """The paper's summary over MoE blocks (Fig. 4: "mean normalized assignment entropy 0.971, an effective 3.85 of
    four experts"): the mean over blocks of H(f) / log E, and the effective experts E^(that mean) = exp(mean H(f)),
    the exponential of the mean entropy (not the mean of the per-block exp H)."""
    if not layers:
        return {}
    mean = sum(v["normalized_entropy"] for v in layers.values()) / len(layers)
    return {"mean_normalized_entropy": mean, "mean_effective_experts": num_experts ** mean}


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    layers = doc["moe_layers"]
    if not layers:
        return
    acids = doc["amino_acids"]
    n = len(layers)
    cols = min(n, 6)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.2 * cols + 1, 4.2 * rows), squeeze=False)
    for ax, (index, layer) in zip(axes.flat, layers.items()):
        grid = np.array([layer["usage_by_amino_acid"].get(a, [np.nan] * doc["num_experts"]) for a in acids])
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_title(f"block {index}\nH/logE {layer['normalized_entropy']:.2f}", fontsize=8)
        ax.set_xticks(range(doc["num_experts"]))
        ax.set_yticks(range(len(acids)), acids, fontsize=6)
        ax.set_xlabel("expert", fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(f"expert usage per amino acid ({doc['residues']:,} residues, {doc['records']:,} proteins)")
    fig.subplots_adjust(top=0.82 if rows == 1 else 0.9, right=0.8, wspace=0.5, hspace=0.45)
    fig.colorbar(im, cax=fig.add_axes([0.84, 0.2, 0.02, 0.55]), label="fraction of the amino acid's residues")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    """main's command line, apart from main: tests parse the documented commands with it without running them."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, type=Path, help="a ProtLingo export, run dir or checkpoint tag dir")
    p.add_argument("--fasta", required=True, type=Path, help="proteins (plain or .gz)")
    p.add_argument("--out", required=True, type=Path, help="directory for routing_report.json and .png")
    p.add_argument("--max-records", type=int, default=None, help="read only the first N records")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per forward pass (default 16)")
    p.add_argument(TRUST_FLAG, action="store_true", help=TRUST_HELP)
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    from pipeline.config import ConfigError
    from pipeline.eval.cli import locate_checkpoint, require_trust

    try:
        tag_dir, cfg, _ = locate_checkpoint(args.checkpoint)
        if cfg.family != "protlingo":
            raise ConfigError(f"{tag_dir}: family {cfg.family}; the routing report reads ProtLingo models")
        if not args.fasta.is_file():
            raise FileNotFoundError(f"{args.fasta}: no such file")
        if args.out.exists() and not args.out.is_dir():
            raise ConfigError(f"{args.out}: --out exists and is not a directory")
        require_trust(tag_dir, args.trust_checkpoint)
        from data_prep.fasta import iter_fasta
        from pipeline.checkpoint import load_trained_model
        from pipeline.data.protein_tokenizer import ProteinTokenizer

        tok = ProteinTokenizer()
        records = []
        for r in iter_fasta(args.fasta, tok.invalid_positions):
            if len(r.seq):
                records.append(tok.encode(r.seq.upper()))
            if args.max_records and len(records) >= args.max_records:
                break
        if not records:
            raise ValueError(f"{args.fasta}: no protein to read (an empty file, or headers without sequences)")
        model = load_trained_model(tag_dir, trusted=args.trust_checkpoint).model
    except (ValueError, OSError) as e:  # ConfigError, FastaError: ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
    doc = {"checkpoint": str(tag_dir), "fasta": str(args.fasta),
           **report(model, records, cfg.data.context_length, args.batch_size)}
    from pipeline.outputs import write_atomic

    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "routing_report.json", json.dumps(doc, indent=1) + "\n")
    plot(doc, args.out / "routing_report.png")
    for index, layer in doc["moe_layers"].items():
        print(f"MoE block {index}: normalized entropy {layer['normalized_entropy']:.3f}, effective experts "
              f"{layer['effective_experts']:.2f} of {doc['num_experts']}")
    if doc["moe_layers"]:
        print(f"mean over {len(doc['moe_layers'])} MoE blocks: normalized entropy {doc['mean_normalized_entropy']:.3f},"
              f" effective experts {doc['mean_effective_experts']:.2f} of {doc['num_experts']}")
    for index, mem in doc["memory_layers"].items():
        print(f"memory before block {index}: {mem['fraction_addressed']:.1%} of {mem['table_rows']:,} rows addressed"
              + ("" if mem["exact_addresses"] else f", {mem['collision_fraction']:.1%} of keys collide"))
    print(f"wrote {args.out / 'routing_report.json'} and routing_report.png ({doc['records']:,} proteins, "
          f"{doc['residues']:,} residues)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
