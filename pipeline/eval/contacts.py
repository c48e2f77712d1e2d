"""Long-range contacts from a frozen encoder's attention (paper 002, Table 2), with the head trained per encoder.

Paper 002 follows Rao et al. (ICLR 2021): freeze each encoder and *train* the same lightweight head on its own pairwise
features. The features (:func:`contact_features`): every layer's and head's attention map, ``<cls>`` and ``<eos>``
removed, symmetrized (A + A^T) and average-product corrected (A - a_i a_j / a): [L, L, layers x heads]. The head: a
logistic regression over those channels with an L1 penalty (scikit-learn ``LogisticRegression(l1_ratio=1,
solver="liblinear")``, C = 0.15 by default, ``--contact-C``), fitted on a small training set of structures over the
residue pairs with |i - j| >= 6 whose contact state is known (Rao et al.'s training pairs, ``--contact-train-sep``).
Contacts (:mod:`pipeline.eval.structures`): C-beta within 8 angstrom, C-alpha for glycine; a pair touching a
residue without that atom (unobserved, or its C-beta missing) is unknown and never counted either way.

Metric (:func:`precision_at_l`, CASP / ESM): of the top L / k pairs with |i - j| >= 24 (long range) and a known
state, ranked by probability, the fraction that are contacts, k = 1, 2, 5; L is the chain's full length; the mean over
structures (domains) is reported.

``attention_maps`` reads ProtLingo's (or a dense ESM2's) attention with hooks; on a dense model the features equal
what transformers' EsmForMaskedLM returns as attentions, and ``contact_probs`` with ESM2's shipped regression equals
its ``predict_contacts`` (tests/pipeline/eval/test_contacts.py).

``--task contacts`` (:func:`run`): ``--contact-train DIR`` fits the head on DIR's structures and saves it beside the
checkpoint it was fitted on (``contact_head.safetensors``; ``--contact-head PATH`` elsewhere), then scores ``--data``
(a folder of structures, or one); without ``--contact-train`` the saved head is read. An ESM2 checkpoint that ships
its own regression (a Hugging Face directory, or a fair-esm ``.pt`` with its ``-contact-regression.pt``) is scored
with that head too, on the same structures: with real ESM2 weights the fitted head should match the shipped one's
quality (the self-check of docs/evaluation.md, "Contacts").
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from pipeline.eval.benchmark import Benchmark
from pipeline.eval.plots import save_figure
from pipeline.models.layers import apply_rope

FRACTIONS = (1, 2, 5)
LONG_RANGE = 24  # |i - j| >= 24: long range (CASP)
TRAIN_SEPARATION = 6  # Rao et al. train on pairs |i - j| >= 6
L1_C = 0.15  # the inverse L1 strength of Rao et al.'s regression
HEAD_FILE = "contact_head.safetensors"
COLUMNS = ("head", "p_at_l", "p_at_l_2", "p_at_l_5")  # MLflow-safe names of P@L, P@L/2, P@L/5


def attention_maps(model, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Every block's softmax attention of a ProtLingo model: [B, layers, heads, L, L] (float32), read with forward
    hooks on the attention modules (their inputs are recomputed into probabilities: SDPA returns none)."""
    maps, hooks = [], []

    def capture(module, args, _output):
        x, (cos, sin), key_mask = args
        B, L, _ = x.shape
        split = lambda t: t.view(B, L, module.n_heads, module.head_dim).transpose(1, 2).float()  # noqa: E731
        q = apply_rope(split(module.q(x)), cos, sin)
        k = apply_rope(split(module.k(x)), cos, sin)
        scores = q @ k.transpose(-1, -2) / module.head_dim ** 0.5  # [B, H, L, L]
        scores = scores.masked_fill(~key_mask[:, None, None, :].bool(), float("-inf"))
        maps.append(scores.softmax(-1))

    for layer in model.layers:
        hooks.append(layer.attn.register_forward_hook(capture))
    try:
        with torch.no_grad():
            model(tokens, attention_mask)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(maps, dim=1)


def contact_features(attentions: torch.Tensor, tokens: torch.Tensor, attention_mask: torch.Tensor,
                     eos_id: int = 2) -> torch.Tensor:
    """attentions [B, layers, heads, L, L] -> the contact head's features [B, L - 2, L - 2, layers x heads]
    between the residues (<cls> and the last position dropped, <eos> zeroed, padding zeroed): symmetrized, then
    average-product corrected, as ESM's contact head computes them."""
    m = attention_mask.to(attentions.dtype)
    a = attentions * m[:, None, None, None, :] * m[:, None, None, :, None]  # padding neither attends nor is attended
    keep = tokens.ne(eos_id).to(a.dtype)
    a = a * (keep[:, None, :] * keep[:, :, None])[:, None, None]
    a = a[..., :-1, :-1][..., 1:, 1:]
    B, layers, heads, L, _ = a.shape
    a = a.reshape(B, layers * heads, L, L)
    a = a + a.transpose(-1, -2)  # symmetrize
    a = a - a.sum(-1, keepdim=True) * a.sum(-2, keepdim=True) / a.sum((-1, -2), keepdim=True)  # APC
    return a.permute(0, 2, 3, 1)


def contact_probs(attentions: torch.Tensor, tokens: torch.Tensor, attention_mask: torch.Tensor,
                  weight: torch.Tensor, bias: torch.Tensor, eos_id: int = 2) -> torch.Tensor:
    """attentions [B, layers, heads, L, L] -> contact probabilities [B, L - 2, L - 2]: the logistic regression
    (``weight`` [1, layers x heads], ``bias`` [1]) on :func:`contact_features`."""
    f = contact_features(attentions, tokens, attention_mask, eos_id)
    return torch.sigmoid(f @ weight.to(f.dtype).T + bias.to(f.dtype)).squeeze(-1)


def protein_features(model, sequence: str) -> np.ndarray:
    """float32 [L, L, layers x heads]: the features of one chain, framed <cls> sequence <eos>, alone in its batch."""
    from pipeline.data.protein_tokenizer import CLS_ID, EOS_ID, VOCAB

    ids = torch.tensor([[CLS_ID, *(VOCAB.index(c) for c in sequence), EOS_ID]])
    device = next(model.parameters()).device
    ids = ids.to(device)
    mask = torch.ones_like(ids, dtype=torch.bool)
    return contact_features(attention_maps(model, ids, mask), ids, mask)[0].float().cpu().numpy()


def pairs(L: int, min_separation: int) -> tuple[np.ndarray, np.ndarray]:
    """(i, j) of every pair i < j with j - i >= min_separation."""
    i, j = np.triu_indices(L, k=min_separation)
    return i, j


def precision_at_l(probs, contacts, min_separation: int = LONG_RANGE, fractions: tuple[int, ...] = FRACTIONS,
                   known=None) -> dict[str, float]:
    """probs, contacts (bool), known (bool, optional): [L, L] for one protein -> {"P@L", "P@L/2", "P@L/5"}: the
    precision of the top L / k pairs i < j with j - i >= ``min_separation`` and a known contact state, ranked by
    probability (ties broken by position: stable); L is the chain's length."""
    probs, contacts = np.asarray(probs, dtype=np.float64), np.asarray(contacts, dtype=bool)
    L = probs.shape[-1]
    i, j = pairs(L, min_separation)
    if known is not None:
        ok = np.asarray(known, dtype=bool)[i, j]
        i, j = i[ok], j[ok]
    order = np.argsort(-probs[i, j], kind="stable")
    truth = contacts[i, j][order]
    out = {}
    for k in fractions:
        n = min(L // k, truth.size)
        out["P@L" if k == 1 else f"P@L/{k}"] = float(truth[:n].mean()) if n else math.nan
    return out


def contacts_from_coordinates(cb: torch.Tensor, threshold: float = 8.0) -> torch.Tensor:
    """C-beta coordinates [L, 3] (NaN where missing) -> contact map [L, L] bool (a missing atom is no contact)."""
    d = torch.cdist(cb, cb)
    return (d < threshold) & ~torch.isnan(d)


# ---- the trained head ---------------------------------------------------------------------------------------------
def training_rows(features: np.ndarray, contacts: np.ndarray, known: np.ndarray,
                  min_separation: int = TRAIN_SEPARATION) -> tuple[np.ndarray, np.ndarray]:
    """(X [n, C], y [n]) of one protein: the pairs i < j, j - i >= min_separation, with a known contact state."""
    i, j = pairs(features.shape[0], min_separation)
    ok = known[i, j]
    return features[i[ok], j[ok]], contacts[i[ok], j[ok]].astype(np.int64)


def fit_head(rows: list[tuple[np.ndarray, np.ndarray]], C: float = L1_C) -> tuple[np.ndarray, float]:
    """The L1-regularized logistic regression on every training protein's rows -> (weight [channels], bias)."""
    from sklearn.linear_model import LogisticRegression

    x = np.concatenate([r[0] for r in rows]).astype(np.float64)
    y = np.concatenate([r[1] for r in rows])
    if len(np.unique(y)) < 2:
        raise ValueError("the training structures hold no contact (or only contacts) among their pairs: no head fits")
    import inspect

    # pure L1: scikit-learn 1.8 deprecated penalty="l1" for l1_ratio=1 (which older versions ignore without it)
    new = inspect.signature(LogisticRegression).parameters["penalty"].default == "deprecated"
    reg = LogisticRegression(C=C, solver="liblinear", max_iter=1000,
                             **({"l1_ratio": 1.0} if new else {"penalty": "l1"})).fit(x, y)
    return reg.coef_[0].astype(np.float64), float(reg.intercept_[0])


def head_probs(features: np.ndarray, weight: np.ndarray, bias: float) -> np.ndarray:
    """Contact probabilities [L, L] of the head on one protein's features [L, L, C]."""
    return 1.0 / (1.0 + np.exp(-(features.astype(np.float64) @ np.asarray(weight, dtype=np.float64) + bias)))


def save_head(path: Path, weight: np.ndarray, bias: float, meta: dict) -> None:
    """weight [1, C] and bias [1] as safetensors (the layout of ESM's contact_head.regression), ``meta`` as the
    file's metadata (what it was fitted on)."""
    from safetensors.torch import save_file

    save_file({"regression.weight": torch.tensor(weight, dtype=torch.float32)[None],
               "regression.bias": torch.tensor([bias], dtype=torch.float32)}, str(path),
              metadata={"contact_head": json.dumps(meta)})


def load_head(path: Path, channels: int) -> tuple[np.ndarray, float, dict]:
    """(weight [C], bias, metadata) of a saved head; ValueError naming the file unless it has ``channels``."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            meta = json.loads((f.metadata() or {}).get("contact_head", "{}"))
            w, b = f.get_tensor("regression.weight"), f.get_tensor("regression.bias")
    except Exception as e:  # a truncated or foreign file
        raise ValueError(f"{path}: not a contact head written by --task contacts ({str(e).splitlines()[0][:200]})") \
            from None
    if w.shape != (1, channels):
        raise ValueError(f"{path}: a head of {w.shape[-1]} channels; this model's attention has {channels} "
                         "(layers x heads): fit one for it with --contact-train")
    return w[0].double().numpy(), float(b[0]), meta


def shipped_head(trained) -> tuple[np.ndarray, float] | None:
    """An ESM2 checkpoint's own regression (Hugging Face esm.contact_head, fair-esm's -contact-regression.pt), when
    the model was read from one and it ships it; else None."""
    source = trained.client_state.get("foreign_checkpoint")
    if source is None:
        return None
    from pipeline.checkpoint import load_esm2

    _, state = load_esm2(source)
    w, b = state.get("esm.contact_head.regression.weight"), state.get("esm.contact_head.regression.bias")
    if w is None or b is None:
        return None
    return w.reshape(-1).double().numpy(), float(b.reshape(-1)[0])


# ---- --task contacts ------------------------------------------------------------------------------------------------
def options(p) -> None:
    p.add_argument("--contact-train", type=Path, default=None, help="contacts: fit the head on these structures (a "
                   "folder of PDB / mmCIF files, or one) and save it beside the checkpoint (or --contact-head)")
    p.add_argument("--contact-head", type=Path, default=None, help="contacts: the head to write with "
                   f"--contact-train or to read without it (default: CHECKPOINT/{HEAD_FILE})")
    p.add_argument("--contact-C", type=float, default=L1_C, help="contacts: inverse L1 strength of the logistic "
                   f"regression (default {L1_C}, Rao et al.'s)")
    p.add_argument("--contact-train-sep", type=int, default=TRAIN_SEPARATION, help="contacts: the training pairs' "
                   f"minimum |i - j| (default {TRAIN_SEPARATION}, Rao et al.'s)")


def head_path(trained, args) -> Path:
    """--contact-head, else beside the checkpoint the model came from: DIR/contact_head.safetensors for a
    directory (a run's checkpoint, an export, a Hugging Face ESM2), FILE_STEM.contact_head.safetensors beside a file."""
    if getattr(args, "contact_head", None) is not None:
        return Path(args.contact_head)
    src = Path(trained.client_state.get("foreign_checkpoint") or trained.tag_dir)
    return src / HEAD_FILE if src.is_dir() else src.with_name(f"{src.stem}.{HEAD_FILE}")


def read_set(path, window: int) -> list:
    """The structures of ``path`` (pipeline/eval/structures.py), each at most ``window`` - 2 residues."""
    from pipeline.eval.structures import read_structure, structure_files

    out = [read_structure(f) for f in structure_files(path)]
    for s in out:
        if s.length > window - 2:
            raise ValueError(f"{s.path}: {s.length} residues; contacts need the whole chain in one window of "
                             f"--window {window} tokens (<cls> and <eos> included)")
    return out


def run(trained, data, runs, args) -> dict:
    """--task contacts (module docstring)."""
    from pipeline.eval.cli import progress
    from pipeline.eval.structures import contact_map

    window = getattr(args, "window", None) or 1024
    model = trained.model.cuda() if torch.cuda.is_available() else trained.model
    test = read_set(data, window)
    path = head_path(trained, args)
    train_dir = getattr(args, "contact_train", None)
    C, sep = getattr(args, "contact_C", L1_C), getattr(args, "contact_train_sep", TRAIN_SEPARATION)
    if not C > 0 or sep < 1:
        raise ValueError(f"--contact-C must be > 0 and --contact-train-sep >= 1 (got {C}, {sep})")
    channels = len(model.layers) * model.layers[0].attn.n_heads
    train_report = None
    if train_dir is not None:
        if not Path(train_dir).exists():
            raise FileNotFoundError(f"{train_dir}: --contact-train: no such file or directory")
        train = read_set(train_dir, window)
        seen = {s.sequence: s.path for s in train}
        leak = next((s for s in test if s.sequence in seen), None)
        if leak is not None:
            raise ValueError(f"{leak.path}: its chain is also in the training set ({seen[leak.sequence]}): the "
                             "evaluated structures must be held out")
        rows = [training_rows(protein_features(model, s.sequence), *contact_map(s.coords), sep)
                for s in progress(train, desc="contacts: training features", unit="structure")]
        weight, bias = fit_head(rows, C)
        train_report = {"structures": [s.name for s in train], "n_structures": len(train),
                        "n_pairs": int(sum(len(r[1]) for r in rows)), "n_contacts": int(sum(r[1].sum() for r in rows)),
                        "C": C, "min_separation": sep, "nonzero_weights": int((weight != 0).sum()),
                        "channels": channels}
        meta = {**train_report, "checkpoint": str(trained.client_state.get("foreign_checkpoint") or trained.tag_dir),
                "step": trained.client_state.get("step")}
        try:
            save_head(path, weight, bias, meta)
        except OSError as e:
            raise ValueError(f"{path}: cannot write the fitted head ({e.strerror or e}); pass --contact-head PATH") \
                from None
    else:
        if not path.is_file():
            raise ValueError(f"{path}: no contact head fitted for this checkpoint: pass --contact-train STRUCTURES "
                             "(or --contact-head PATH)")
        weight, bias, meta = load_head(path, channels)
    heads = {"fitted": (weight, bias)}
    shipped = shipped_head(trained)
    if shipped is not None and len(shipped[0]) == channels:
        heads["shipped"] = shipped
    per = {h: {} for h in heads}
    for s in progress(test, desc="contacts", unit="structure"):
        f = protein_features(model, s.sequence)
        contacts, known = contact_map(s.coords)
        i, j = pairs(s.length, LONG_RANGE)
        for h, (w, b) in heads.items():
            per[h][s.name] = {**precision_at_l(head_probs(f, w, b), contacts, LONG_RANGE, known=known),
                              "L": s.length, "observed": int(s.observed.sum()), "aligned_by": s.aligned_by,
                              "long_range_pairs_known": int(known[i, j].sum()),
                              "long_range_contacts": int(contacts[i, j].sum())}
    keys = ("P@L", "P@L/2", "P@L/5")
    means = {h: {k: float(np.nanmean([v[k] for v in per[h].values()])) for k in keys} for h in heads}
    return {"head_file": str(path), "fitted_now": train_report is not None, "train": train_report or meta,
            "structures": [s.name for s in test], "heads": {h: {"per_structure": per[h], "mean": means[h]}
                                                           for h in heads},
            "columns": COLUMNS, "table": [(h, *(means[h][k] for k in keys)) for h in heads]}


def plot(result: dict, out: Path, title: str) -> Path:
    """OUT_STEM.png: long-range P@L of every held-out structure for each head, its mean dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = result["structures"]
    heads = list(result["heads"])
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(names) + 2), 3.8))
    width = 0.8 / len(heads)
    for n, h in enumerate(heads):
        vals = [result["heads"][h]["per_structure"][s]["P@L"] for s in names]
        ax.bar(np.arange(len(names)) + n * width, vals, width, label=f"{h} head (mean {np.nanmean(vals):.3f})")
        ax.axhline(result["heads"][h]["mean"]["P@L"], ls="--", lw=0.8, color=f"C{n}")
    ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names, rotation=60, fontsize=6)
    ax.set_ylim(0, 1)
    ax.set_ylabel("long-range P@L (|i - j| >= 24)")
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=7)
    fig.tight_layout()
    return save_figure(fig, out.with_name(f"{out.stem}.png"), dpi=100)


BENCHMARK = Benchmark(name="contacts", help="long-range contacts (P@L, P@L/2, P@L/5, |i - j| >= 24) of a folder of "
                      "PDB / mmCIF structures, from an L1 logistic regression on the frozen model's symmetrized, "
                      "APC-corrected attention (fitted with --contact-train, saved beside the checkpoint)",
                      scorer="trained_head", metrics=("p_at_l", "p_at_l_2", "p_at_l_5"), run=run, options=options,
                      model="protein", depth_axis=False, plot=plot)
