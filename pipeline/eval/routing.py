"""ProtLingo's MoE routing against residue annotations: paper 002's Fig. 4a (expert specialization), Table 4
(enrichment over a matched background) and Fig. 4b (replacing the top-1 expert).

Inputs: ``--data`` the proteins (FASTA) and their annotations in standard formats (pipeline/eval/annotations.py):
``--uniprot`` UniProtKB flat files, ``--pfam-domtblout`` HMMER3 domain tables of a Pfam scan, ``--ss`` secondary
structure as FASTA-aligned label strings. A category is one feature key, Pfam family or structure state; categories
with fewer than ``--min-residues`` annotated residues are left out (listed).

Every residue of every protein is read once (proteins longer than ``--window`` - 2 residues in consecutive windows,
<cls>/<eos> framing each) and the expert each MoE block sends it to is the one the forward used (RoutingInfo.expert).

``expert_specialization`` (Fig. 4a, Table 4), per category and MoE block:
  expert_share  the fraction of the category's residues routed to each expert; top_share that of the commonest
                (the paper: "80-99% of residues in specific categories were routed to one expert at particular
                layers"); best_block the block where top_share is highest.
  enrichment    every annotated residue paired with a residue of the same protein, amino acid and relative-position
                bin that the category does not annotate (annotations.matched_background; ``--position-bins``,
                ``--seed``): the share of annotated residues routed to the category's top expert over the share of
                their partners routed to it (NaN when no partner is); n_pairs and unmatched beside it.

``expert_intervention`` (Fig. 4b): each protein is masked once (``--mask-fraction`` of its residues, seeded) and the
masked-LM cross-entropy is read at the masked residues of a category, with its residues' top-1 expert replaced at the
chosen blocks (``--intervene-blocks``, all MoE blocks by default) by ``--force-expert`` (``second``: the router's second
choice on that forward; or an expert id), through the model's routing override; and, as the control, the same
replacement on their matched partners, read at the masked partners. ``delta`` is intervened minus unmodified
cross-entropy; ``effect`` the category's delta minus its control's.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from pipeline.eval import annotations as ann
from pipeline.eval.benchmark import Benchmark
from pipeline.eval.plots import save_figure

MIN_RESIDUES = 20


# ---- inputs --------------------------------------------------------------------------------------------------------
def options(p) -> None:
    p.add_argument("--uniprot", type=Path, action="append", default=[], help="expert_specialization / "
                   "expert_intervention: a UniProtKB flat file of the proteins' features (repeatable)")
    p.add_argument("--pfam-domtblout", type=Path, action="append", default=[], help="expert_*: an HMMER3 "
                   "--domtblout of a Pfam scan of the proteins (repeatable)")
    p.add_argument("--ss", type=Path, action="append", default=[], help="expert_*: secondary-structure labels as "
                   "FASTA-aligned strings, one record per protein (Q8 or Q3; repeatable)")
    p.add_argument("--pfam-max-evalue", type=float, default=1e-5, help="expert_*: drop Pfam domains with a larger "
                   "i-Evalue (default 1e-5)")
    p.add_argument("--position-bins", type=int, default=10, help="expert_*: relative-position bins of the matched "
                   "background (default 10)")
    p.add_argument("--min-residues", type=int, default=MIN_RESIDUES, help="expert_*, memory_motifs: leave out "
                   f"categories / families with fewer residues or occurrences (default {MIN_RESIDUES})")


def intervention_options(p) -> None:
    p.add_argument("--intervene-blocks", default=None, help="expert_intervention: MoE blocks whose top-1 choice is "
                   "replaced, e.g. 1-3,5 (default: every MoE block)")
    p.add_argument("--force-expert", default="second", help="expert_intervention: 'second' (the router's second "
                   "choice) or an expert id (default second)")
    p.add_argument("--mask-fraction", type=float, default=0.15, help="expert_intervention: residues masked per "
                   "protein (default 0.15)")
    p.add_argument("--max-categories", type=int, default=8, help="expert_intervention: the largest categories "
                   "intervened on (default 8)")


def load_inputs(data, args) -> tuple[dict[str, str], ann.Annotations, dict]:
    """(sequences {protein: str}, annotations {protein: {category: set}}, what each source read and skipped)."""
    sequences, aliases = ann.read_proteins(data)
    names = ann.by_name(sequences, aliases)
    sources = [(p, "uniprot", lambda p: ann.read_uniprot(p, names)) for p in getattr(args, "uniprot", [])]
    sources += [(p, "pfam", lambda p: ann.read_domtblout(p, names, args.pfam_max_evalue))
                for p in getattr(args, "pfam_domtblout", [])]
    sources += [(p, "ss", lambda p: ann.read_secondary_structure(p, names)) for p in getattr(args, "ss", [])]
    if not sources:
        raise ValueError("--uniprot, --pfam-domtblout or --ss: the routing analyses need residue annotations")
    found, report = [], {}
    for path, kind, read in sources:
        if not Path(path).is_file():
            raise FileNotFoundError(f"{path}: no such annotation file")
        got, skipped = read(path)
        found.append(ann.canonical(got, aliases))
        report[str(path)] = {"kind": kind, "proteins": len(got), "skipped": skipped}
    return sequences, ann.merge(*found), report


def categories(annotations: ann.Annotations, min_residues: int) -> tuple[dict[str, dict[str, set]], dict]:
    """({category: {protein: positions}} with at least ``min_residues`` residues, {left-out category: count})."""
    by_cat: dict[str, dict[str, set]] = {}
    for protein, cats in annotations.items():
        for cat, pos in cats.items():
            by_cat.setdefault(cat, {})[protein] = set(pos)
    counts = {c: sum(len(p) for p in v.values()) for c, v in by_cat.items()}
    kept = {c: v for c, v in sorted(by_cat.items()) if counts[c] >= min_residues}
    return kept, {c: n for c, n in sorted(counts.items()) if c not in kept}


# ---- forwards -------------------------------------------------------------------------------------------------------
def windows_of(length: int, window: int) -> list[tuple[int, int]]:
    """[(start, end)) of consecutive windows of at most ``window`` - 2 residues covering a chain."""
    step = window - 2
    return [(s, min(length, s + step)) for s in range(0, length, step)]


def moe_blocks(model) -> list[int]:
    """The MoE blocks of a ProtLingo (its routing layers); ValueError for a model without any."""
    from pipeline.models.protlingo import UpcycledMoE

    blocks = [i for i, layer in enumerate(model.layers) if isinstance(layer.ffn, UpcycledMoE)]
    if not blocks:
        raise ValueError("the model has no MoE block (a dense ESM2 or a ProtLingo without model.moe_layers): no "
                         "routing to analyse")
    return blocks


def forward_window(model, seq: str, masked: set | None = None, override: dict | None = None):
    """One window framed <cls> seq <eos> (residues in ``masked`` replaced by <mask>) -> (logits [L + 2, V], {block:
    experts [L] of its residues}, {block: router logits [L, E]})."""
    from pipeline.data.protein_tokenizer import CLS_ID, EOS_ID, MASK_ID, VOCAB
    from pipeline.models.protlingo import UpcycledMoE, token_experts

    ids = [CLS_ID, *(MASK_ID if masked and i in masked else VOCAB.index(c) for i, c in enumerate(seq)), EOS_ID]
    device = next(model.parameters()).device
    tokens = torch.tensor([ids], device=device)
    mask = torch.ones_like(tokens, dtype=torch.bool)
    router, hooks = {}, []
    for i, layer in enumerate(model.layers):
        if isinstance(layer.ffn, UpcycledMoE):
            hooks.append(layer.ffn.register_forward_hook(
                lambda m, a, o, i=i: router.update({i: (a[0][0].float() @ m.router.weight.float().T)[1:-1]})))
    forced = None if override is None else {b: torch.tensor([[-1, *v, -1]], device=device) for b, v in override.items()}
    try:
        with torch.no_grad():
            out = model(tokens, mask, route_override=forced)
    finally:
        for h in hooks:
            h.remove()
    experts = {b: token_experts(r, mask)[0, 1:-1].cpu().numpy() for b, r in out.routing.items()}
    return out.logits[0].float().cpu(), experts, {b: v.cpu() for b, v in router.items()}


def route_residues(model, sequences: dict[str, str], window: int, desc: str | None = None) -> dict[str, dict]:
    """{protein: {MoE block: expert [L] of each residue}} from one unmodified forward per window."""
    from pipeline.eval.cli import progress

    out = {}
    for protein in progress(sorted(sequences), desc=desc, unit="protein") if desc else sorted(sequences):
        seq = sequences[protein]
        per: dict[int, list] = {}
        for s, e in windows_of(len(seq), window):
            _, experts, _ = forward_window(model, seq[s:e])
            for b, v in experts.items():
                per.setdefault(b, []).append(v)
        out[protein] = {b: np.concatenate(v) for b, v in per.items()}
    return out


# ---- Fig. 4a and Table 4 --------------------------------------------------------------------------------------------
def specialization(experts: dict, cats: dict, sequences: dict, num_experts: int, bins: int, seed: int) -> dict:
    """The per-category, per-block report of ``expert_specialization`` (module docstring)."""
    blocks = sorted(next(iter(experts.values())))
    out = {}
    for c, (cat, positions) in enumerate(cats.items()):
        pairs, unmatched = ann.matched_background(positions, sequences, bins, np.random.default_rng([seed, c]))
        per_block = {}
        for b in blocks:
            chosen = np.concatenate([experts[p][b][sorted(pos)] for p, pos in positions.items()])
            share = np.bincount(chosen, minlength=num_experts) / len(chosen)
            top = int(share.argmax())
            a = np.array([experts[p][b][i] == top for p, i, _ in pairs], dtype=float)
            m = np.array([experts[p][b][j] == top for p, _, j in pairs], dtype=float)
            fa, fb = (float(a.mean()), float(m.mean())) if pairs else (math.nan, math.nan)
            per_block[str(b)] = {"expert_share": share.tolist(), "top_expert": top, "top_share": float(share[top]),
                                 "annotated_share": fa, "background_share": fb,
                                 "enrichment": fa / fb if pairs and fb > 0 else math.nan}
        best = max(blocks, key=lambda b: (per_block[str(b)]["top_share"], -b))
        out[cat] = {"n_residues": sum(len(p) for p in positions.values()), "n_proteins": len(positions),
                    "n_pairs": len(pairs), "unmatched": unmatched, "best_block": best, "blocks": per_block}
    return out


def run_specialization(trained, data, runs, args) -> dict:
    model = trained.model
    blocks = moe_blocks(model)
    sequences, annotations, sources = load_inputs(data, args)
    cats, left_out = categories(annotations, getattr(args, "min_residues", MIN_RESIDUES))
    if not cats:
        raise ValueError(f"{data}: no category with {args.min_residues} annotated residues (--min-residues)")
    window = getattr(args, "window", None) or 1024
    experts = route_residues(model, sequences, window, desc="expert_specialization")
    rep = specialization(experts, cats, sequences, model.cfg.num_experts, args.position_bins, args.seed)
    table = [(cat, r["n_residues"], r["best_block"], r["blocks"][str(r["best_block"])]["top_share"],
              r["blocks"][str(r["best_block"])]["enrichment"]) for cat, r in rep.items()]
    return {"proteins": len(sequences), "residues": sum(map(len, sequences.values())), "moe_blocks": blocks,
            "num_experts": model.cfg.num_experts, "sources": sources, "left_out": left_out,
            "position_bins": args.position_bins, "categories": rep,
            "columns": ("category", "n_residues", "best_block", "top_share", "enrichment"), "table": table}


def plot_specialization(result: dict, out: Path, title: str) -> Path:
    """OUT_STEM.png: categories x MoE blocks, the top expert's share (Fig. 4a) and log2 enrichment (Table 4)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats, blocks = list(result["categories"]), [str(b) for b in result["moe_blocks"]]
    share = np.array([[result["categories"][c]["blocks"][b]["top_share"] for b in blocks] for c in cats])
    enr = np.array([[result["categories"][c]["blocks"][b]["enrichment"] for b in blocks] for c in cats], dtype=float)
    fig, axes = plt.subplots(1, 2, figsize=(4 + 0.5 * len(blocks) * 2, 1.5 + 0.3 * len(cats)), squeeze=False)
    for ax, grid, label, kw in ((axes[0, 0], share, "top expert's share", {"vmin": 0, "vmax": 1}),
                                (axes[0, 1], np.log2(enr), "log2 enrichment over matched background",
                                 {"cmap": "coolwarm", "vmin": -2, "vmax": 2})):
        im = ax.imshow(grid, aspect="auto", **kw)
        ax.set_xticks(range(len(blocks)), blocks, fontsize=7)
        ax.set_yticks(range(len(cats)), cats, fontsize=6)
        ax.set_xlabel("MoE block", fontsize=7)
        fig.colorbar(im, ax=ax, label=label)
    fig.suptitle(title, fontsize=7)
    fig.tight_layout()
    return save_figure(fig, out.with_name(f"{out.stem}.png"), dpi=100)


# ---- Fig. 4b ---------------------------------------------------------------------------------------------------------
def masked_positions(length: int, fraction: float, rng: np.random.Generator) -> set:
    """A seeded ``fraction`` of a chain's residues (at least one)."""
    return set(rng.choice(length, size=max(1, round(fraction * length)), replace=False).tolist())


def run_intervention(trained, data, runs, args) -> dict:
    """--task expert_intervention (module docstring)."""
    from pipeline.eval.cli import parse_depths, progress

    model = trained.model
    blocks = moe_blocks(model)
    chosen = blocks if args.intervene_blocks is None else parse_depths(args.intervene_blocks, "--intervene-blocks",
                                                                         minimum=0)
    if any(b not in blocks for b in chosen):
        raise ValueError(f"--intervene-blocks {args.intervene_blocks}: the MoE blocks are {blocks}")
    E = model.cfg.num_experts
    force = args.force_expert
    if force != "second" and not (force.isdigit() and int(force) < E):
        raise ValueError(f"--force-expert {force!r}: 'second' or an expert id in 0..{E - 1}")
    if not 0 < args.mask_fraction < 1:
        raise ValueError(f"--mask-fraction {args.mask_fraction}: must be in (0, 1)")
    sequences, annotations, sources = load_inputs(data, args)
    cats, left_out = categories(annotations, args.min_residues)
    cats = dict(sorted(cats.items(), key=lambda kv: -sum(map(len, kv[1].values())))[:args.max_categories])
    if not cats:
        raise ValueError(f"{data}: no category with {args.min_residues} annotated residues (--min-residues)")
    window = getattr(args, "window", None) or 1024
    rng = np.random.default_rng(args.seed)
    masked = {p: masked_positions(len(s), args.mask_fraction, rng) for p, s in sorted(sequences.items())}
    base = {}  # protein -> (per-residue CE [L] at masked residues (NaN elsewhere), {block: alternative expert [L]})
    for p in progress(sorted(sequences), desc="expert_intervention baseline", unit="protein"):
        base[p] = cross_entropy(model, sequences[p], masked[p], window, None, force)

    def intervened_ce(targets: dict[str, set]) -> dict[str, np.ndarray]:
        out = {}
        for p, pos in targets.items():
            alt = base[p][1]
            override = {b: np.where(np.isin(np.arange(len(sequences[p])), sorted(pos)), alt[b], -1) for b in chosen}
            out[p] = cross_entropy(model, sequences[p], masked[p], window, override, force)[0]
        return out

    rep = {}
    for c, (cat, positions) in enumerate(progress(list(cats.items()), desc="expert_intervention", unit="category")):
        pairs, unmatched = ann.matched_background(positions, sequences, args.position_bins,
                                                  np.random.default_rng([args.seed, c]))
        partners: dict[str, set] = {}
        for p, _, j in pairs:
            partners.setdefault(p, set()).add(j)
        entry = {"n_residues": sum(map(len, positions.values())), "n_pairs": len(pairs), "unmatched": unmatched}
        for name, targets in (("annotated", positions), ("control", partners)):
            new = intervened_ce(targets)
            idx = [(p, i) for p, pos in targets.items() for i in sorted(pos) if i in masked[p]]
            b_ce = np.array([base[p][0][i] for p, i in idx])
            n_ce = np.array([new[p][i] for p, i in idx])
            entry[name] = {"n_masked": len(idx), "ce": float(b_ce.mean()) if idx else math.nan,
                           "ce_intervened": float(n_ce.mean()) if idx else math.nan,
                           "delta": float((n_ce - b_ce).mean()) if idx else math.nan}
        entry["effect"] = entry["annotated"]["delta"] - entry["control"]["delta"]
        rep[cat] = entry
    table = [(cat, r["annotated"]["delta"], r["control"]["delta"], r["effect"]) for cat, r in rep.items()]
    return {"proteins": len(sequences), "moe_blocks": blocks, "intervened_blocks": chosen, "force_expert": force,
            "mask_fraction": args.mask_fraction, "sources": sources, "left_out": left_out, "categories": rep,
            "columns": ("category", "delta_annotated", "delta_control", "effect"), "table": table}


def cross_entropy(model, seq: str, masked: set, window: int, override: dict | None, force: str):
    """(cross-entropy [L] at the masked residues, NaN elsewhere; {block: the alternative expert [L]}) of one chain,
    window by window, with ``override`` {block: forced [L]} applied through the routing override."""
    from pipeline.data.protein_tokenizer import VOCAB

    ce = np.full(len(seq), np.nan)
    alt: dict[int, list] = {}
    for s, e in windows_of(len(seq), window):
        local = {i - s for i in masked if s <= i < e}
        ov = None if override is None else {b: v[s:e].tolist() for b, v in override.items()}
        logits, experts, router = forward_window(model, seq[s:e], local, ov)
        lp = torch.log_softmax(logits[1:-1].double(), -1)
        for i in local:
            ce[s + i] = -float(lp[i, VOCAB.index(seq[s + i])])
        for b, r in router.items():
            second = r.topk(2, dim=-1).indices[:, 1].numpy() if r.shape[-1] > 1 else experts[b]
            alt.setdefault(b, []).append(second if force == "second" else np.full(e - s, int(force)))
    return ce, {b: np.concatenate(v) for b, v in alt.items()}


def plot_intervention(result: dict, out: Path, title: str) -> Path:
    """OUT_STEM.png: per category the change of masked-LM cross-entropy when its residues' top-1 expert is replaced,
    beside the same replacement on the matched background."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = list(result["categories"])
    x = np.arange(len(cats))
    fig, ax = plt.subplots(figsize=(max(5.0, 0.6 * len(cats) + 2), 3.6))
    for k, (name, color) in enumerate((("annotated", "C3"), ("control", "C7"))):
        ax.bar(x + 0.4 * k, [result["categories"][c][name]["delta"] for c in cats], 0.4, color=color,
               label=f"{name} residues" if name == "annotated" else "matched background")
    ax.axhline(0, color="k", lw=0.6)
    ax.set_xticks(x + 0.2, cats, rotation=50, fontsize=6, ha="right")
    ax.set_ylabel("delta masked-LM cross-entropy (nats)")
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=7)
    fig.tight_layout()
    return save_figure(fig, out.with_name(f"{out.stem}.png"), dpi=100)


SPECIALIZATION = Benchmark(name="expert_specialization", help="MoE expert specialization over residue annotations "
                           "(--uniprot / --pfam-domtblout / --ss; --data the proteins' FASTA): the top expert's share "
                           "per category and block, and its enrichment over a matched background (Fig. 4a, Table 4)",
                           scorer="routing", metrics=("top_share", "enrichment"), run=run_specialization,
                           options=options, model="protein", depth_axis=False, plot=plot_specialization)
INTERVENTION = Benchmark(name="expert_intervention", help="replace annotated residues' top-1 expert (routing "
                         "override) and measure the masked-LM cross-entropy change against the matched background "
                         "(Fig. 4b)", scorer="routing", metrics=("effect", "delta_annotated"), run=run_intervention,
                         options=intervention_options, model="protein", depth_axis=False, plot=plot_intervention)
