"""Inference on an export: embeddings, variant scores and masked-token predictions, at a fixed or adaptive depth.

    from pipeline.inference import Adaptive, Inference

    inf = Inference.from_pretrained("exports/eco_rna_demo")           # device="cuda" on a GPU
    emb = inf.embed(["ACGUAGC", "GGCUA"], depth=4, per_token=True)    # .pooled [2, d], .per_token[i] [L_i, d]
    var = inf.score_variants("ACGUAGC", ["A1G", "C2U,G3A"])           # .scores [2]: RNAGym's Eq. A.10
    pred = inf.predict_masked(["AC<mask>UAGC"], top_k=3)               # per <mask>: the 3 likeliest residues
    emb = inf.embed(seqs, depth=Adaptive(tol=1e-5, max_depth=8))     # .depths: iterations used per sequence

Families: the masked LMs, those whose spec has ``inference`` hooks (pipeline/families: Eco-RNA, its fixed-depth
control and ProtLingo); the causal text families are refused. ``depth`` applies to the families whose depth is
selectable (``Depth.selectable``: Eco-RNA's number of core iterations); the others have one depth and refuse an
explicit one.

Deterministic like the evaluators: every Eco-RNA call starts from the seed-fixed initial-state table of
pipeline/eval/reconstruction.py (``state_table(cfg.model, data.context_length, seed)``, seed 0 as
``launchers/evaluate.py``'s default), so a sequence gets the same output alone or in any batch, and
``score_variants`` equals ``launchers/evaluate.py --task rnagym`` (Eco-RNA, the control) or ``--task proteingym``
(ProtLingo) on the same wild type and mutants: it calls their parsing and scoring functions.

Default depth (``depth=None``): the export's ``export.json["task_depths"][TASK]`` (written by tools/choose_depth.py)
for the method's task -- ``embed``: "embed", ``predict_masked``: "reconstruction", ``score_variants``: "rnagym" --
else the training depth law's mean (``objective.train_depth`` for a fixed law; ``objective.mu_k`` rounded, within
[k_min, k_cap], for the Poisson-lognormal law).

Batching: sequences are sorted by length, cut into batches of at most ``max_tokens`` padded tokens (rows x the
batch's longest framed length) and the results are returned in the caller's order. Sequences are framed
``<cls> ... <eos>`` and may hold at most ``data.context_length - 2`` residues (the length the model was trained on
and the initial-state table covers); ``score_variants`` windows longer wild types as the evaluators do.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipeline.families import FAMILIES, get_family

MASK_TEXT = "<mask>"
TASK_OF = {"embed": "embed", "predict_masked": "reconstruction", "score_variants": "rnagym"}


@dataclass(frozen=True)
class Adaptive:
    """Adaptive depth (Eco-RNA): iterate each sequence until its relative displacement r_k (paper Eq. 9, the
    training penalty's ||s_k - s_{k-1}||^2 / ||s_{k-1}||^2 over its real tokens) is below ``tol``, at most
    ``max_depth`` iterations (EcoRNA.adaptive)."""

    tol: float = 1e-5
    max_depth: int = 8

    def __post_init__(self):
        if not self.tol >= 0:
            raise ValueError(f"Adaptive.tol: must be >= 0, got {self.tol}")
        if not (isinstance(self.max_depth, int) and self.max_depth >= 1):
            raise ValueError(f"Adaptive.max_depth: must be an integer >= 1, got {self.max_depth!r}")


@dataclass
class InferenceConfig:
    device: str = "cpu"
    max_tokens: int = 16384  # padded tokens per batch (rows x longest framed length)
    seed: int = 0  # the initial-state table's seed (launchers/evaluate.py --seed)
    proteingym_batch_size: int = 32  # ProtLingo score_variants: masked copies per forward (evaluate --batch-size)

    def __post_init__(self):
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"InferenceConfig.max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        if not (isinstance(self.proteingym_batch_size, int) and self.proteingym_batch_size >= 1):
            raise ValueError(f"InferenceConfig.proteingym_batch_size: must be an integer >= 1, "
                             f"got {self.proteingym_batch_size!r}")


@dataclass
class Embeddings:
    pooled: torch.Tensor  # [N, d] fp32 on the CPU: mean over each sequence's residues (no <cls>/<eos>, no padding)
    per_token: list | None  # N x [L_i, d] fp32 residue representations (per_token=True), else None
    depths: list | None  # Eco-RNA: core iterations each sequence received; None for the other families
    row_iterations: int  # Eco-RNA: core row-applications executed (= sum of depths); 0 otherwise


@dataclass
class MaskedPrediction:
    position: int  # 0-based residue index of the <mask> in the sequence as given (a <mask> counts as one residue)
    tokens: list  # top-k residue letters, likeliest first
    probs: list  # their probabilities under the softmax over the whole vocabulary


@dataclass
class MaskedPredictions:
    predictions: list  # N x [MaskedPrediction per <mask>, left to right]
    depths: list | None
    row_iterations: int


@dataclass
class VariantScores:
    scores: np.ndarray  # [N] float64, the evaluator's score of each mutant (0 for "" = the wild type itself)
    depths: list | None  # Eco-RNA: iterations of each forward pass (one per wild-type window)
    row_iterations: int


@dataclass
class _Out:
    logits: torch.Tensor  # [b, L, V]
    hidden: torch.Tensor  # [b, L, d] the representation the LM head reads
    depths: list | None
    row_iterations: int


def check_family(cfg, source: str):
    if get_family(cfg.family).inference is None:
        masked = [name for name, spec in FAMILIES.items() if spec.inference is not None]
        raise ValueError(f"{source}: inference supports the masked LMs ({', '.join(masked)}); "
                         f"{cfg.family} is not one")


class Inference:
    """A loaded masked LM and what inference needs around it (module docstring)."""

    def __init__(self, model, tokenizer, cfg, export_meta: dict | None = None,
                 config: InferenceConfig | None = None, source: str = "model"):
        check_family(cfg, source)
        self.config = config or InferenceConfig()
        self.model = model.to(self.config.device).eval()
        self.tokenizer, self.cfg, self.source = tokenizer, cfg, source
        self.meta = export_meta or {}
        self.family = get_family(cfg.family)
        self.hooks = self.family.inference
        self.recurrent = self.family.depth.selectable
        self.pad_id = self.family.pad_id
        self.prepared = self.hooks.prepare(cfg, self.config.seed)  # e.g. Eco-RNA's initial-state table [C, d]
        self.residue_ids = self.hooks.residue_ids()

    @classmethod
    def from_pretrained(cls, path, **config) -> "Inference":
        """From an export of tools/convert_checkpoint.py (pipeline.load_pretrained); ``config``: InferenceConfig
        fields (device, max_tokens, seed, proteingym_batch_size)."""
        from pipeline.config import build_config, load_yaml
        from pipeline.pretrained import load_pretrained

        cfg_inf = InferenceConfig(**config)
        d = Path(path)
        cfg = build_config(load_yaml(d / "config.yaml")) if (d / "config.yaml").is_file() else None
        if cfg is not None:  # before loading the weights and the tokenizer
            check_family(cfg, str(d))
        model, tokenizer = load_pretrained(d, device=cfg_inf.device)  # refuses what is not an export
        meta_path = d / "export.json"
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        return cls(model, tokenizer, cfg, meta, cfg_inf, source=str(d))

    # ---- depth ------------------------------------------------------------------------------------------------
    def default_depth(self, task: str) -> int | None:
        """export.json["task_depths"][task], else the family's default depth (Depth.default: Eco-RNA's training
        law's mean, rounded); None for the one-depth families."""
        if not self.recurrent:
            return None
        chosen = self.meta.get("task_depths", {}).get(task)
        return int(chosen) if chosen is not None else self.family.depth.default(self.cfg)

    def _depth(self, depth, task: str):
        if not self.recurrent:
            if depth is not None:
                raise ValueError(f"depth applies to a model of selectable depth (Eco-RNA) only; {self.cfg.family} has "
                                 "one depth (pass depth=None)")
            return None
        if depth is None:
            return self.default_depth(task)
        from pipeline.eval.cli import check_depths

        k = depth.max_depth if isinstance(depth, Adaptive) else depth
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"depth: must be an integer >= 1 or an Adaptive(...), got {depth!r}")
        check_depths([int(k)], self.cfg, self.source, flag="depth")
        return depth

    # ---- the forward pass ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def _run(self, tokens: torch.Tensor, mask: torch.Tensor, depth) -> _Out:
        """tokens, mask: [b, L] -> logits, hidden [b, L, ...] on the model's device; ``depth``: int, Adaptive or
        None (resolved by :meth:`_depth`)."""
        tokens, mask = tokens.to(self.config.device), mask.to(self.config.device)
        if depth is not None:  # a fixed depth K is the adaptive pass that never stops early (tol 0)
            depth = (depth.tol, depth.max_depth) if isinstance(depth, Adaptive) else (0.0, int(depth))
        return _Out(*self.hooks.forward(self.model, self.cfg, self.prepared, tokens, mask, depth))

    def _encode(self, seq: str, index: int) -> np.ndarray:
        """One sequence (``<mask>`` allowed) -> framed ids [n] int64; ValueError naming the sequence."""
        if not isinstance(seq, str) or not seq:
            raise ValueError(f"sequence {index}: must be a non-empty string, got {seq!r}")
        try:
            parts = [self.tokenizer.encode(p).astype(np.int64) for p in seq.split(MASK_TEXT)]
        except ValueError as e:
            raise ValueError(f"sequence {index}: {e}") from None
        body = parts[0]
        for p in parts[1:]:
            body = np.concatenate([body, [self.tokenizer.mask_id], p])
        limit = self.cfg.data.context_length - 2
        if len(body) > limit:
            raise ValueError(f"sequence {index}: {len(body)} residues; the model takes at most {limit} "
                             f"(data.context_length {self.cfg.data.context_length} with <cls>/<eos>)")
        return np.concatenate([[self.tokenizer.cls_id], body, [self.tokenizer.eos_id]]).astype(np.int64)

    def _batched(self, framed: list, depth):
        """Yield (indices into ``framed``, _Out) over length-sorted batches of at most max_tokens padded tokens."""
        order = sorted(range(len(framed)), key=lambda i: -len(framed[i]))  # longest first: a batch's first row
        batch: list = []                                                   # sets its padded length
        for i in order + [None]:
            if batch and (i is None or (len(batch) + 1) * len(framed[batch[0]]) > self.config.max_tokens):
                L = len(framed[batch[0]])
                tokens = torch.full((len(batch), L), self.pad_id, dtype=torch.long)
                mask = torch.zeros(len(batch), L, dtype=torch.bool)
                for r, j in enumerate(batch):
                    tokens[r, :len(framed[j])] = torch.from_numpy(framed[j])
                    mask[r, :len(framed[j])] = True
                yield batch, self._run(tokens, mask, depth)
                batch = []
            if i is not None:
                batch.append(i)

    # ---- the API ------------------------------------------------------------------------------------------------
    def embed(self, sequences: list, depth=None, per_token: bool = False) -> Embeddings:
        """Per-sequence embeddings: the mean over its residues of the representation the LM head reads (Eco-RNA:
        the readout N_o(C(W_o s_K)) of the state at depth K)."""
        depth = self._depth(depth, TASK_OF["embed"])
        framed = [self._encode(s, i) for i, s in enumerate(sequences)]
        pooled: list = [None] * len(framed)
        tokens: list = [None] * len(framed)
        depths, row_iterations = [None] * len(framed), 0
        for idx, out in self._batched(framed, depth):
            hidden = out.hidden.float().cpu()
            for r, j in enumerate(idx):
                h = hidden[r, 1:len(framed[j]) - 1]  # [L_j, d] residues only
                pooled[j] = h.mean(0)
                tokens[j] = h.clone() if per_token else None
                if out.depths is not None:
                    depths[j] = out.depths[r]
            row_iterations += out.row_iterations
        d = self.cfg.model.d_model
        return Embeddings(pooled=torch.stack(pooled) if pooled else torch.empty(0, d),
                          per_token=tokens if per_token else None,
                          depths=depths if self.recurrent else None, row_iterations=row_iterations)

    def predict_masked(self, sequences: list, depth=None, top_k: int = 5) -> MaskedPredictions:
        """The ``top_k`` likeliest residues at each ``<mask>`` of each sequence (the other positions are read as
        given, unmasked)."""
        if not (isinstance(top_k, int) and 1 <= top_k <= len(self.residue_ids)):
            raise ValueError(f"top_k: must be an integer in 1..{len(self.residue_ids)}, got {top_k!r}")
        depth = self._depth(depth, TASK_OF["predict_masked"])
        framed = [self._encode(s, i) for i, s in enumerate(sequences)]
        preds: list = [None] * len(framed)
        depths, row_iterations = [None] * len(framed), 0
        vocab = self.tokenizer.vocab
        for idx, out in self._batched(framed, depth):
            probs = torch.softmax(out.logits.float(), -1).cpu()[..., self.residue_ids]  # [b, L, R]
            for r, j in enumerate(idx):
                at = np.flatnonzero(framed[j] == self.tokenizer.mask_id)  # framed positions of the masks
                p, k = probs[r, torch.from_numpy(at)].topk(top_k, dim=-1)  # [n_mask, top_k]
                preds[j] = [MaskedPrediction(int(a) - 1, [vocab[int(self.residue_ids[c])] for c in row],
                                             pr.tolist()) for a, pr, row in zip(at, p, k)]
                if out.depths is not None:
                    depths[j] = out.depths[r]
            row_iterations += out.row_iterations
        return MaskedPredictions(preds, depths if self.recurrent else None, row_iterations)

    def score_variants(self, wild_type: str, mutants: list, depth=None) -> VariantScores:
        """Zero-shot scores of substitution mutants of ``wild_type``, exactly as the benchmark evaluators score
        them. Eco-RNA and its control: RNAGym's wild-type marginals (pipeline/eval/rnagym.py, Eq. A.10; mutants
        like ``"U6C,C74U"``, 1-based, T read as U; windows of data.context_length for long wild types). ProtLingo:
        ProteinGym's masked marginals (pipeline/eval/proteingym.py; mutants like ``"A1P:D2N"``, 1024-token
        windows)."""
        if self.hooks.variants == "rnagym":
            return self._score_rnagym(wild_type, list(mutants), self._depth(depth, TASK_OF["score_variants"]))
        self._depth(depth, "proteingym")  # refuses an explicit depth
        from pipeline.eval import proteingym

        proteingym.check_wild_type(wild_type, "score_variants")
        subs = []
        for text in mutants:
            s = proteingym.parse_mutant(text)
            proteingym.check_mutant(s, wild_type, text)
            subs.append(s)
        positions = {s.pos for one in subs for s in one}
        lp, _ = proteingym.masked_marginals(wild_type, positions, proteingym.masked_lm_logits_fn(self.model),
                                            batch_size=self.config.proteingym_batch_size)
        return VariantScores(proteingym.score_mutants(subs, lp), None, 0)

    def _score_rnagym(self, wild_type: str, mutants: list, depth) -> VariantScores:
        from pipeline.eval import rnagym

        assay = rnagym.assay_from_mutants(wild_type, mutants)
        depths, row_iterations = [], 0

        def forward(ids: np.ndarray) -> np.ndarray:  # framed window ids [n] -> log-probs [n, V]
            nonlocal row_iterations
            tokens = torch.from_numpy(ids).long()[None]
            out = self._run(tokens, torch.ones_like(tokens, dtype=torch.bool), depth)
            if out.depths is not None:
                depths.extend(out.depths)
            row_iterations += out.row_iterations
            return torch.log_softmax(out.logits[0].float(), -1).cpu().numpy()

        lp = rnagym.wildtype_logprobs(assay.wt_ids(), forward, self.cfg.data.context_length)
        return VariantScores(rnagym.score_variants(assay, lp), depths if self.recurrent else None, row_iterations)
