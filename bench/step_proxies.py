#!/usr/bin/env python
"""CPU proxies of GPU efficiency for one training step: operators dispatched, host-device syncs, core shapes.

    python bench/step_proxies.py [--quick] [--shape-steps 100] [--config launchers/configs/eco_rna_80m.yaml]
                                 [--set KEY=VALUE ...] [--top 15]

A GPU step of the Eco-RNA 80M config is bound by kernel launches and host syncs, not FLOPs; CI has no GPU, so these
counts stand in for them (docs/performance.md has the measured values and what each one catches):

- OPS: aten operators dispatched by one optimizer step as the trainer runs it, ``pipeline.train.step.train_step``
  with a real DeepSpeed engine (ds_configs/zero2.json: ZeRO-2, one process, gloo, world size 1, fp32 on CPU),
  counted by a TorchDispatchMode: plans, forward, loss, backward, DeepSpeed's step and the step statistics, on the
  config's narrow twin (width_twin: widths shrunk, every count unchanged; --full-width for the real widths). Split:
  OPS.forward (inside ``family.loss``: forward + loss), OPS.backward (inside ``engine.backward``: autograd and
  ZeRO's gradient hooks), OPS.optimizer (inside ``engine.step``, every microbatch's). An operator is one or
  more kernel launches on CUDA, or none for a view (OPS.nonview leaves views out): a proxy that moves with the
  launches. The microbatches are fixed (OPS_BATCH: 4 rows x 128 tokens, seeded tokens and masks,
  ``train.grad_accum_steps`` 2) and so are the depths (``family.plan`` is seeded by (seed, step, microbatch)); the
  counted step is the second on the engine, so the optimizer's first-step state allocation is not in it. The
  count is identical run to run (checked by the CLI without --quick and by tests/bench/test_step_proxies.py).
- SYNC: what would force a device-to-host sync on CUDA, counted on CPU: the dispatcher ops
  ``aten::_local_scalar_dense`` (``float(t)``, ``int(t)``, ``bool(t)``, ``if t:``; ``Tensor.item`` is counted as
  itself, once), ``aten::nonzero``, ``aten::masked_select``, ``aten::_unique``/``_unique2``/``unique_dim``/
  ``unique_consecutive``/``unique_dim_consecutive``, ``aten::repeat_interleave.Tensor`` without ``output_size``,
  ``aten::equal``, and ``aten::index``/``index_put``/``index_put_``/``_index_put_impl_`` with a boolean index (the
  ``nonzero`` inside them runs below the mode and is not seen on its own); plus the Python-level reads
  ``Tensor.tolist``, ``Tensor.item``, ``Tensor.numpy`` (patched while counting). Every such read counts, whatever
  the tensor's device: on this CPU run a host tensor and a device result look alike, and a read of host metadata
  inside the microbatch loop is still a host round trip worth moving out. Not seen: ``.cpu()`` / ``.to("cpu")``
  copies (no-ops on CPU tensors) and syncs inside C++ kernels below the dispatcher.
  SYNC.micro: the syncs inside the microbatch loop, from entering the first ``family.loss`` to the ``between``
  callback of the last microbatch (loss, backward, the non-final microbatches' ``engine.step`` and the loop's own
  bookkeeping between them), without the boundary ``engine.step`` (DeepSpeed's real optimizer step, once per step).
  SYNC.step: all of ``train_step``. Each sync is attributed to its innermost frame outside torch (the CLI lists them).
- SHAPES: distinct core input shapes (rows, length, grad mode) over ``--shape-steps`` steps of the real loader on the
  shipped Rfam sample (data_prep'd into a temp dir) with the config's batching (train.max_tokens_per_microbatch,
  data.length_window, data.num_workers), on a tiny model (SHAPES_MODEL: d 64, one block per stack: shapes do not
  depend on width or block count) and no backward or optimizer (a forward's core calls fix the backward's). Also
  the distinct (rows, length) of attention calls (prelude, core, coda, anchor readout). On the padded layout (CPU,
  and GPU without flash-attn) the shapes are [rows, L, d]; on the packed layout they are [tokens, d].
- Any family (``--config``; nothing here names one): the counted microbatch is step_batch's (records of the family's
  tokenizer kind through its own sample transform and the loader's collate, or pack_rows with data.pack), the narrow
  twin the family's ``Proxies.narrow``; SHAPES reads shards of its tokenizer kind made from data/samples
  (family_shards: Rfam, UniRef50 clusters, BabyLM text with a small sentencepiece model), runs them through its
  ``Proxies.shapes`` model and counts the inputs of ``Proxies.core`` (else its blocks) as SHAPES.core and of its
  blocks (Family.blocks: one attention each) as SHAPES.attention. ``--by-module``: one microbatch's forward
  operators by module (module_census).

Prints ``RESULT <ID> <value> <description>`` lines (bench/run_all.py's format) and the top operators per phase.
--quick: 5 shape steps instead of 100 and one counted step instead of two (the repeat check left to the test):
70-100 s on two cores; the full run 10-20 min, nearly all of it SHAPES.

Importable (tests, thresholds): ``count_step(overrides, ...) -> dict`` and ``core_shapes(steps, overrides, ...) ->
set`` / ``shape_census(...) -> dict``; overrides are ``--set`` style strings applied after the config and the
bench's own (OPS_RUN and the narrow twin, the family's SHAPES model), so a test can shrink the model.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
CONFIG = REPO / "launchers" / "configs" / "eco_rna_80m.yaml"
DS_CONFIG = REPO / "ds_configs" / "zero2.json"
SAMPLE_FASTA = REPO / "data" / "samples" / "rfam_nrc_train_sample.fasta.gz"

# OPS / SYNC: a fixed step of 2 microbatches of 4 rows x 128 tokens, no token-budget batching (the batch is built
# here, not by the loader), the config's model, objective and depth law (seeded per microbatch).
OPS_RUN = ["train.micro_batch_size=4", "train.grad_accum_steps=2", "train.max_tokens_per_microbatch=null",
           "data.length_window=0", "data.num_workers=0", "data.context_length=128",
           # any family's config: no global batch to match, no word budget (its counting needs the sentencepiece
           # model beside real shards; the counted step has none), no start from an export
           "train.global_batch_size=null", "train.global_batch_tokens=null", "train.max_words=null", "checkpoint.at_words=[]", "train.init_from=null"]
OPS_BATCH = dict(rows=4, length=128, lengths=(128, 117, 96, 70))  # real tokens per row: padding as in real batches
OPS_STEP = 7  # the step index the plans are drawn for (fixes the depths)
# SHAPES: the config's data and batching, a tiny model (width and block counts change no shape): the family's
# Proxies.shapes (shape_data); Eco-RNA's is this list (pipeline/families/eco_rna.py shapes_model).
SHAPES_MODEL = ["model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128", "model.n_prelude=1",
                "model.n_core=1", "model.n_coda=1"]

SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique", "aten::_unique2",
            "aten::unique_dim", "aten::unique_consecutive", "aten::unique_dim_consecutive", "aten::equal",
            "aten::bincount"}  # bincount: CUDA reads max(input) to size its output (ProtLingo's routing counts)
BOOL_INDEX_OPS = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}
PY_READS = ("tolist", "item", "numpy")
# Operators that only make a new view or alias of a tensor's metadata: no kernel launch on CUDA. OPS counts them (the
# dispatcher and autograd overhead is real); OPS.nonview leaves them out, nearer to the kernel launches.
VIEW_OPS = {"aten::view", "aten::_unsafe_view", "aten::reshape", "aten::t", "aten::transpose", "aten::permute",
            "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::slice", "aten::select", "aten::detach",
            "aten::alias", "aten::as_strided", "aten::split", "aten::chunk", "aten::split_with_sizes",
            "aten::unbind", "aten::narrow", "aten::_reshape_alias", "aten::unflatten", "aten::flatten",
            "aten::lift_fresh", "aten::view_as"}
PHASES = ("pre", "forward", "backward", "optimizer", "loop", "end")


# --------------------------------------------------------------------------------------------------------------------
# counting
# --------------------------------------------------------------------------------------------------------------------
def _bool_index(indices) -> bool:
    import torch

    return any(t is not None and isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)
               for t in (indices or ()))


def sync_kind(func, args, kwargs) -> str | None:
    """The sync name of a dispatched op, or None when the op does not sync on CUDA."""
    name = func._schema.name
    if name in SYNC_OPS:
        return name
    if name == "aten::repeat_interleave" and func._overloadname == "Tensor" and kwargs.get("output_size") is None \
            and (len(args) < 2 or args[1] is None):
        return name  # the output length is the sum of a device tensor of repeats
    if name in BOOL_INDEX_OPS and len(args) > 1 and _bool_index(args[1]):
        return f"{name}[bool]"
    return None


_SKIP_FRAMES = (os.sep + "torch" + os.sep, os.sep + "contextlib.py", os.sep + "functools.py")


def call_site() -> str:
    """The innermost caller outside torch and this file: 'pipeline/objectives/eco_rna.py:215 recurrent_loss'."""
    here = str(Path(__file__).resolve())
    for fr in reversed(traceback.extract_stack()):
        if fr.filename == here or any(s in fr.filename for s in _SKIP_FRAMES):
            continue
        f = fr.filename
        for root in (os.sep + "site-packages" + os.sep, str(REPO) + os.sep):  # a venv may sit inside the repo
            if root in f:
                f = f.split(root, 1)[1]
                break
        return f"{f}:{fr.lineno} {fr.name}"
    return "?"


class StepCounter:
    """Counts dispatched aten ops and sync events by phase, while active (``with counter.counting():``)."""

    def __init__(self, sites: bool = True):
        self.phase = "pre"
        self.ops = {p: collections.Counter() for p in PHASES}
        self.syncs = {p: collections.Counter() for p in PHASES}  # phase -> (kind, site) -> count
        self.micro_syncs = 0  # see the module docstring: SYNC.micro
        self.micro_sites = collections.Counter()  # (kind, site) -> count, of those
        self.in_loop = False
        self.boundary = False  # inside the boundary engine.step
        self.sites = sites
        self._tls = threading.local()

    def _sync(self, kind: str):
        key = (kind, call_site() if self.sites else "")
        self.syncs[self.phase][key] += 1
        if self.in_loop and not self.boundary:
            self.micro_syncs += 1
            self.micro_sites[key] += 1

    def mode(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                counter.ops[counter.phase][func._schema.name] += 1
                kind = sync_kind(func, args, kwargs)
                # Tensor.item is counted by its Python patch; its _local_scalar_dense is the same sync
                if kind and not (kind == "aten::_local_scalar_dense" and getattr(counter._tls, "py", 0)):
                    counter._sync(kind)
                return func(*args, **kwargs)

        return _Mode()

    @contextlib.contextmanager
    def counting(self):
        import torch

        saved = {n: getattr(torch.Tensor, n) for n in PY_READS}

        def patched(name, orig):
            def read(t, *a, **k):
                self._tls.py = getattr(self._tls, "py", 0) + 1
                try:
                    if self._tls.py == 1:
                        self._sync(f"Tensor.{name}")
                    return orig(t, *a, **k)
                finally:
                    self._tls.py -= 1
            return read

        for n, orig in saved.items():
            setattr(torch.Tensor, n, patched(n, orig))
        try:
            with self.mode():
                yield self
        finally:
            for n, orig in saved.items():
                setattr(torch.Tensor, n, orig)

    @contextlib.contextmanager
    def in_phase(self, phase: str):
        before, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = before

    def result(self) -> dict:
        total = sum((c for c in self.ops.values()), collections.Counter())
        sync_sites = collections.Counter()
        for c in self.syncs.values():
            sync_sites.update(c)
        return {"ops_step": sum(total.values()), "ops_forward": sum(self.ops["forward"].values()),
                "ops_backward": sum(self.ops["backward"].values()),
                "ops_optimizer": sum(self.ops["optimizer"].values()),
                "ops_other": sum(self.ops[p].total() for p in ("pre", "loop", "end")),
                "ops_nonview": sum(n for k, n in total.items() if k not in VIEW_OPS),
                "sync_micro": self.micro_syncs, "sync_step": sum(sync_sites.values()),
                "ops_by_phase": {p: dict(c) for p, c in self.ops.items()}, "ops_total": dict(total),
                "syncs_by_phase": {p: {f"{k} @ {s}": n for (k, s), n in c.items()} for p, c in self.syncs.items()},
                "sync_sites": {f"{k} @ {s}": n for (k, s), n in sync_sites.items()},
                "micro_sites": {f"{k} @ {s}": n for (k, s), n in self.micro_sites.items()}}


# --------------------------------------------------------------------------------------------------------------------
# OPS and SYNC: one train_step on a real DeepSpeed engine
# --------------------------------------------------------------------------------------------------------------------
def ops_config(overrides=(), config: Path = CONFIG, run_dir: str | None = None):
    from pipeline.config import load_config

    run_dir = run_dir or tempfile.mkdtemp(prefix="step_proxies_run_")
    return load_config(config, OPS_RUN + [f"run_dir={run_dir}"] + list(overrides))


def width_twin(cfg) -> list[str]:
    """Overrides that shrink the model's widths only (head_dim 8, d_ff 128; the block, head and KV-head counts, the
    vocabulary and every other setting kept): the same operators are dispatched, as no op count depends on a width
    (2026-12-04: every OPS and SYNC figure of the 80M config equal at d 768 and at d 96; docs/performance.md), and
    ZeRO-2's one reduce bucket holds either. A width-dependent path (a kernel chosen by size, more buckets than one)
    would break this: ``count_step(full_width=True)`` / ``--full-width`` counts at the real widths. Asked of the
    config's family (pipeline/families: Proxies.narrow), which knows its width fields (ProtLingo's shared expert and
    memory latent, RecursiveGPT's factorized embedding)."""
    from pipeline.families import get_family

    return list(get_family(cfg.family).proxies.narrow(cfg))


def fixed_batch(cfg, index: int, rows: int | None = None, length: int | None = None, lengths=None):
    """Eco-RNA's first counted microbatch: seeded residues between <cls> and <eos>, right-padded to ``length``, 15%
    of each row's residues masked and supervised (at least one per row). count_step now uses step_batch, any
    family's; for Eco-RNA every OPS and SYNC count is the same with either (checked operator by operator)."""
    import torch

    from pipeline.data.batch import Batch
    from pipeline.data.tokenizer import IGNORE_INDEX, NucleotideTokenizer as tok

    rows = rows or OPS_BATCH["rows"]
    length = length or OPS_BATCH["length"]
    lengths = list(lengths or OPS_BATCH["lengths"])[:rows]
    lengths += [length] * (rows - len(lengths))
    gen = torch.Generator().manual_seed(1000 + index)
    residues = torch.tensor(tok.residue_ids(cfg.data.molecule))
    ids = torch.full((rows, length), tok.pad_id, dtype=torch.long)
    labels = torch.full((rows, length), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((rows, length), dtype=torch.bool)
    for r, n in enumerate(lengths):
        n = min(n, length)
        body = residues[torch.randint(len(residues), (n - 2,), generator=gen)]
        ids[r, 0], ids[r, 1:n - 1], ids[r, n - 1] = tok.cls_id, body, tok.eos_id
        mask[r, :n] = True
        sup = (torch.rand(n - 2, generator=gen) < 0.15).nonzero().squeeze(-1) + 1
        if len(sup) == 0:
            sup = torch.tensor([1])
        labels[r, sup] = ids[r, sup]
        ids[r, sup] = tok.mask_id
    return Batch(ids, labels, mask, [f"fixed/{index}/{r}" for r in range(rows)], origin=(0, index))


# --------------------------------------------------------------------------------------------------------------------
# any family: the counted microbatch and the SHAPES data, from the spec (tokenizer kind, sample transform, proxies)
# --------------------------------------------------------------------------------------------------------------------
def record_pool(kind: str, cfg):
    """The ids a shard record of tokenizer ``kind`` (Family.tokenizer, pipeline/data/compat.py KINDS) holds, as
    data_prep writes them: the molecule's bases, the 20 standard amino acids, any sentencepiece piece but the four
    specials (pad, <s>, </s>, unk) below the model's vocabulary."""
    import numpy as np

    from pipeline.data.protein_tokenizer import ProteinTokenizer
    from pipeline.data.tokenizer import NucleotideTokenizer, SPM_UNK_ID

    pools = {"nucleotide": lambda: NucleotideTokenizer.residue_ids(cfg.data.molecule),
             "esm": ProteinTokenizer.residue_ids,
             "sentencepiece": lambda: np.arange(SPM_UNK_ID + 1, cfg.model.vocab_size)}
    if kind not in pools:
        raise ValueError(f"tokenizer kind {kind!r}: no record pool (known: {', '.join(pools)})")
    return pools[kind]()


def step_batch(cfg, family, index: int, rows: int | None = None, length: int | None = None, lengths=None):
    """Microbatch ``index`` of the counted step for any family: seeded records of the family's tokenizer kind
    (record_pool), through the family's own sample transform (framing, masking or the causal shift:
    ``family.make_transform``) and the loader's batching (collate, or pack_rows with ``data.pack``: two documents a
    row), right-padded to ``length``. Row r holds ``lengths[r]`` real tokens, framing included (OPS_BATCH: 128, 117,
    96, 70); origin (0, index), so the plans (Eco-RNA's depths) are drawn as for the loader's microbatch ``index``."""
    import numpy as np

    from pipeline.data.batch import collate, pack_rows

    rows = rows or OPS_BATCH["rows"]
    length = length or OPS_BATCH["length"]
    lengths = list(lengths or OPS_BATCH["lengths"])[:rows]
    lengths += [length] * (rows - len(lengths))
    pool = record_pool(family.tokenizer, cfg)
    transform = family.make_transform(cfg)
    # tokens the transform adds to a record (MLM: <cls> and <eos>; causal LM: <s> and </s> less the shift)
    framing = len(transform(pool[:1].astype(np.uint16), np.random.default_rng(0))["input_ids"]) - 1

    def sample(r: int, d: int, n: int) -> dict:
        rng = np.random.default_rng([1000 + index, r, d])
        s = transform(pool[rng.integers(len(pool), size=max(1, min(n, length) - framing))].astype(np.uint16), rng)
        return {**s, "sample_id": f"fixed/{index}/{r}/{d}"}

    if cfg.data.pack:  # whole documents side by side, as the packing loader makes rows (document and position ids)
        docs = [[sample(r, 0, n // 2), sample(r, 1, n - n // 2)] for r, n in enumerate(lengths)]
        b = pack_rows(docs, length, family.pad_id)
    else:
        b = collate([sample(r, 0, n) for r, n in enumerate(lengths)], family.pad_id)
        pad = length - b.input_ids.shape[1]  # every row shorter than ``length``: padded on to it
        if pad > 0:
            import torch.nn.functional as F

            from pipeline.data.tokenizer import IGNORE_INDEX

            b.input_ids = F.pad(b.input_ids, (0, pad), value=family.pad_id)
            b.labels = F.pad(b.labels, (0, pad), value=IGNORE_INDEX)
            b.attention_mask = F.pad(b.attention_mask, (0, pad), value=False)
    b.origin = (0, index)
    return b


def build_engine(cfg, ds_config: Path = DS_CONFIG):
    """The Trainer's engine (pipeline/train/trainer.py, setup) without its run directory, tracker or loader."""
    import deepspeed
    import torch

    from pipeline.distributed import init_distributed
    from pipeline.ds_config import load_ds_config, resolve_ds_config
    from pipeline.families import get_family
    from pipeline.parallel import optimizer_groups, parallelize
    from pipeline.train.optim import param_groups

    import torch.distributed as dist

    if not dist.is_initialized():
        init_distributed(cfg.train.collective_timeout)
    ds = resolve_ds_config(load_ds_config(str(ds_config)), cfg, 1, str(ds_config), torch.cuda.is_available())
    zero_stage = ds.get("zero_optimization", {}).get("stage", 0)
    dtype = torch.bfloat16 if ds["bf16"]["enabled"] else torch.float32
    torch.manual_seed(cfg.seed)
    model = get_family(cfg.family).build_model(cfg.model)
    model = parallelize(model, cfg, zero_stage, dtype)
    o = cfg.optim
    optimizer = torch.optim.AdamW(optimizer_groups(model, param_groups(model, o)), lr=o.lr, betas=tuple(o.betas),
                                  eps=o.eps)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
    return engine


@contextlib.contextmanager
def _instrumented(engine, counter: StepCounter):
    """engine.backward / engine.step wrapped to switch the counter's phase (instance attributes, removed after)."""
    orig_backward, orig_step = engine.backward, engine.step

    def backward(*a, **k):
        with counter.in_phase("backward"):
            return orig_backward(*a, **k)

    def step(*a, **k):
        counter.boundary = engine.is_gradient_accumulation_boundary()
        try:
            with counter.in_phase("optimizer"):
                return orig_step(*a, **k)
        finally:
            counter.boundary = False

    engine.backward, engine.step = backward, step
    try:
        yield
    finally:
        del engine.backward, engine.step


def count_step(overrides=(), *, family=None, config: Path = CONFIG, ds_config: Path = DS_CONFIG, warmup: int = 1,
               repeats: int = 1, sites: bool = True, batch: dict | None = None, full_width: bool = False) -> dict:
    """OPS and SYNC of one ``train_step`` (module docstring). ``overrides``: --set strings after OPS_RUN;
    ``family``: a pipeline.families Family to use instead of the config's (e.g. with an instrumented ``loss``);
    ``warmup`` uncounted steps first; ``repeats`` > 1 counts that many steps on the same engine and microbatches and
    adds ``"repeat_equal"`` (every count identical); ``batch``: OPS_BATCH keys to change (rows, length, lengths);
    ``full_width``: the config's own widths instead of its narrow twin (width_twin: the same operators, ~8x faster).

    Returns ops_step / ops_forward / ops_backward / ops_optimizer / ops_other / sync_micro / sync_step, the
    per-phase operator counters (ops_by_phase, ops_total), and the syncs by site (sync_sites, syncs_by_phase)."""
    import torch

    from pipeline.families import get_family
    from pipeline.train.step import train_step

    cfg = ops_config(overrides, config)
    if not full_width:
        cfg = ops_config(width_twin(cfg) + list(overrides), config)
    base = get_family(cfg.family) if family is None else family
    engine = build_engine(cfg, ds_config)
    device = torch.device("cpu")
    micro = [step_batch(cfg, base, i, **(batch or {})) for i in range(cfg.train.grad_accum_steps)]
    results = []
    for r in range(warmup + repeats):
        counter = StepCounter(sites=sites)

        def loss(*a, **k):
            counter.phase, counter.in_loop = "forward", True  # the loop starts at the first loss (SYNC.micro)
            try:
                return base.loss(*a, **k)
            finally:
                counter.phase = "loop"

        def between(i, n):
            counter.phase = "loop" if i < n else "end"
            counter.in_loop = i < n

        fam = dataclasses.replace(base, loss=loss)
        with _instrumented(engine, counter):
            if r < warmup:
                train_step(engine, fam, cfg, micro, OPS_STEP, device, between=between)
                continue
            with counter.counting():
                train_step(engine, fam, cfg, micro, OPS_STEP, device, between=between)
        results.append(counter.result())
    out = results[0]
    if repeats > 1:
        keys = ("ops_by_phase", "sync_micro", "syncs_by_phase")
        out["repeat_equal"] = all(all(r[k] == out[k] for k in keys) for r in results[1:])
    out["config"] = {"rows": micro[0].input_ids.shape[0], "length": micro[0].input_ids.shape[1],
                     "grad_accum_steps": cfg.train.grad_accum_steps, "step": OPS_STEP,
                     "depths": [list(p.depths) if hasattr(p, "depths") else None for p in  # drawn depths only
                                (base.plan(b, cfg, step=OPS_STEP, stream=b.origin[0], index=b.origin[1])
                                 for b in micro)],
                     "params": sum(p.numel() for p in engine.module.parameters())}
    return out


# --------------------------------------------------------------------------------------------------------------------
# SHAPES: core and attention input shapes over real loader steps
# --------------------------------------------------------------------------------------------------------------------
def build_shards(out: Path) -> Path:
    """The shipped Rfam sample as shards, by the real data_prep CLI."""
    subprocess.run([sys.executable, "-m", "data_prep", "rnacentral", "--input", str(SAMPLE_FASTA), "--output",
                    str(out), "--shard-size", "300", "--progress", "off"], cwd=REPO, check=True,
                   capture_output=True)
    return out


SAMPLES = REPO / "data" / "samples"
SPM_VOCAB = 4096  # the SHAPES text model's pieces: the shipped BabyLM sample fills about that many


def _data_prep(*args) -> None:
    subprocess.run([sys.executable, "-m", "data_prep", *map(str, args)], cwd=REPO, check=True, capture_output=True)


def family_shards(family, out: Path) -> tuple[Path, list[str]]:
    """Shards of the family's tokenizer kind from the shipped samples (data/samples), by the real data_prep CLI, as
    bench/gpu.sh's step 2 makes them; -> (shard directory, the ``--set`` overrides they need). Nucleotide: the Rfam
    sample (build_shards); esm: the UniRef90 members of the sample's UniRef50 clusters (uniref --clusters);
    sentencepiece: a SPM_VOCAB-piece model trained on the BabyLM samples, then the babylm job (the model's
    vocabulary shrunk to the tokenizer's: the head's width changes no shape)."""
    kind = family.tokenizer
    if kind == "nucleotide":
        return build_shards(out), []
    if kind == "esm":
        _data_prep("uniref", "--input", SAMPLES / "uniref90_clusters_sample.fasta.gz", "--clusters",
                   SAMPLES / "uniref50_to_uniref90_sample.tsv", "--output", out, "--shard-size", 100,
                   "--progress", "off")
        return out, []
    if kind == "sentencepiece":
        texts = sorted(SAMPLES.glob("babylm_*_train_sample.txt.gz"))
        _data_prep("train-spm", "--input", *texts, "--output", out.parent / "spm", "--vocab-size", SPM_VOCAB)
        _data_prep("babylm", "--spm", out.parent / "spm.model", "--input", *texts, "--output", out,
                   "--shard-size", 2000, "--progress", "off")
        return out, [f"model.vocab_size={SPM_VOCAB}"]
    raise ValueError(f"tokenizer kind {kind!r}: no shipped sample to shard")


def shape_census(steps: int, overrides=(), *, shards: Path | None = None, config: Path = CONFIG,
                 device: str | None = None) -> dict:
    """{"core": {(rows, length, grad), ...} ({(tokens, grad)} on the packed layout), "attention": {(rows, length)},
    "core_calls", "attention_calls", "steps", "microbatches", "batches": [(rows, length)] per microbatch} over
    ``steps`` steps of the real loader (module docstring); ``overrides`` after the family's SHAPES model (Eco-RNA:
    SHAPES_MODEL); ``shards``: a data_prep'd directory (default: the shipped sample of the family's tokenizer kind,
    built into a temp dir: family_shards). ``device``: where the model runs, default the meta device where the
    family's Proxies.meta allows it (shapes without compute), else the CPU. The packed layout's ``tokens`` (core
    tokens summed over calls) measures what token buckets add."""
    import torch

    from pipeline.config import load_config
    from pipeline.data.loader import make_loader
    from pipeline.train.plan import RunPlan

    with tempfile.TemporaryDirectory(prefix="step_proxies_shapes_") as tmp:
        tmp = Path(tmp)
        shards, model_sets = shape_data(config, tmp, shards)
        cfg = load_config(config, model_sets + [f"data.train_shards={shards}", f"run_dir={tmp / 'run'}"]
                          + list(overrides))
        cfg = gpu_batching(cfg, config)
        plan = RunPlan(cfg, str(DS_CONFIG), resume="never", world_size=1)
        family = plan.family
        device = device or ("meta" if family.proxies.meta else "cpu")
        if device == "meta" and hasattr(cfg.objective, "state_on_device"):  # no generator on the meta device
            cfg = dataclasses.replace(cfg, objective=dataclasses.replace(cfg.objective, state_on_device=False))
        torch.manual_seed(cfg.seed)
        with torch.device(device):
            model = family.build_model(cfg.model)
        core, attn = collections.Counter(), collections.Counter()

        def on_core(mod, args):
            core[(*args[0].shape[:-1], torch.is_grad_enabled())] += 1

        def on_attn(mod, args):
            attn[tuple(args[0].shape[:-1])] += 1

        core_cls, block_cls = census_modules(family)  # hooked separately: a block may be the core too
        hooks = [m.register_forward_pre_hook(on_core) for m in model.modules() if isinstance(m, core_cls)]
        hooks += [m.register_forward_pre_hook(on_attn) for m in model.modules() if isinstance(m, block_cls)]
        dataset = plan.build_dataset(0)
        loader = make_loader(dataset, cfg.data.num_workers)
        n_micro, batches = 0, []
        try:
            for step in range(steps):
                for _ in range(cfg.train.grad_accum_steps):
                    b = next(loader)
                    batches.append(tuple(b.input_ids.shape))
                    p = family.plan(b, cfg, step=step, stream=b.origin[0], index=b.origin[1])
                    family.loss(model, b.to(device), cfg, p)  # grad enabled as in training; no backward
                    n_micro += 1
        finally:
            for h in hooks:
                h.remove()
            close = getattr(loader, "close", None)
            if close:
                close()
    return {"core": set(core), "attention": set(attn), "core_calls": sum(core.values()),
            "attention_calls": sum(attn.values()), "steps": steps, "microbatches": n_micro, "batches": batches,
            "tokens": sum(n * math.prod(shape[:-1]) for shape, n in core.items()),
            "microbatch": cfg.train.max_tokens_per_microbatch, "device": device}


def gpu_batching(cfg, config: Path):
    """``cfg`` with train.max_tokens_per_microbatch: auto resolved as on one H200 for the config's real model (the
    census's model is tiny: auto would size its microbatch to it), so that SHAPES sees a GPU run's microbatches."""
    from pipeline.config import load_config
    from pipeline.families import get_family
    from pipeline.train.memory import as_on_device

    return as_on_device(cfg, get_family(cfg.family), sized=load_config(config, []))


def module_census(overrides=(), *, config: Path = CONFIG, full_width: bool = False, index: int = 0) -> dict:
    """Where a microbatch's forward operators go, by module: ``family.plan`` and ``family.loss`` of step_batch
    ``index`` on the bare model (no DeepSpeed engine; the config as count_step builds it, narrow twin unless
    ``full_width``), each dispatched aten op charged to the innermost running module whose class is the project's
    (pipeline.*: a Linear's ops go to the FFN or attention that holds it; ops outside any, the loss's, to "loss").
    -> {"forward": {class: ops}, "ops": {class: {aten op: n}}, "backward": {aten op: n} (the autograd backward of
    the same loss, without ZeRO's gradient hooks), "calls": {class: forward calls}}."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from pipeline.families import get_family

    cfg = ops_config(overrides, config)
    if not full_width:
        cfg = ops_config(width_twin(cfg) + list(overrides), config)
    family = get_family(cfg.family)
    torch.manual_seed(cfg.seed)
    model = family.build_model(cfg.model)
    b = step_batch(cfg, family, index)
    plan = family.plan(b, cfg, step=OPS_STEP, stream=b.origin[0], index=b.origin[1])
    stack, calls = ["loss"], collections.Counter()
    ops = collections.defaultdict(collections.Counter)
    backward = collections.Counter()
    phase = {"backward": False}

    def pre(mod, args):
        if type(mod).__module__.startswith("pipeline."):
            stack.append(type(mod).__name__)
            calls[type(mod).__name__] += 1

    def post(mod, args, out):
        if type(mod).__module__.startswith("pipeline."):
            stack.pop()

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            (backward if phase["backward"] else ops[stack[-1]])[func._schema.name] += 1
            return func(*args, **(kwargs or {}))

    hooks = [m.register_forward_pre_hook(pre) for m in model.modules()]
    hooks += [m.register_forward_hook(post) for m in model.modules()]
    try:
        with Mode():
            out = family.loss(model, b, cfg, plan)
            phase["backward"] = True
            out.sum_loss.backward()
    finally:
        for h in hooks:
            h.remove()
    return {"forward": {k: c.total() for k, c in ops.items()}, "ops": {k: dict(c) for k, c in ops.items()},
            "backward": dict(backward), "calls": dict(calls)}


def shape_data(config: Path, tmp: Path, shards: Path | None = None) -> tuple[Path, list[str]]:
    """SHAPES' shards (given, or family_shards of the config's family into ``tmp``) and the ``--set`` overrides of
    its model: the family's Proxies.shapes (Eco-RNA: d 64, one block per stack), then what the shards need, and no
    start from an export (a random model gives the same shapes)."""
    from pipeline.config import load_config
    from pipeline.families import get_family

    cfg = load_config(config, ["train.init_from=null"])
    family = get_family(cfg.family)
    data_sets = []
    if shards is None:
        shards, data_sets = family_shards(family, tmp / "shards")
    return shards, list(family.proxies.shapes(cfg)) + data_sets + ["train.init_from=null"]


def census_modules(family) -> tuple[tuple, tuple]:
    """(the module classes whose inputs SHAPES.core counts, those SHAPES.attention counts): the family's
    Proxies.core (or its blocks), and its blocks (Family.blocks): every block runs one attention on its input's
    rows and length, so the blocks' input shapes are the attention calls' (Eco-RNA: its sandwich blocks, one
    Attention each)."""
    return tuple(family.proxies.core or family.blocks), tuple(family.blocks)


def packed_layouts(config: Path) -> list[tuple[str, list[str]]]:
    """[(name, --set overrides)] of the packed layout as the config runs it on a GPU with a varlen kernel, and
    without its token buckets, for a config whose objective buckets tokens (Eco-RNA's); [] otherwise."""
    from pipeline.config import load_config

    cfg = load_config(config, ["train.init_from=null"])
    if not getattr(cfg.objective, "token_buckets", 0) or not hasattr(cfg.model, "unpad"):
        return []
    return [("packed", ["model.unpad=true"]), ("packed_exact", ["model.unpad=true", "objective.token_buckets=0"])]


def core_shapes(steps: int, overrides=(), **kw) -> set:
    """The distinct core input shapes of shape_census."""
    return shape_census(steps, overrides, **kw)["core"]


# --------------------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------------------
def _top(counter: dict, n: int) -> str:
    items = sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
    return ", ".join(f"{k.removeprefix('aten::')} {v}" for k, v in items)


def print_module_census(m: dict, top: int) -> None:
    fwd = sum(m["forward"].values())
    print(f"one microbatch on the bare model: {fwd} forward operators, {sum(m['backward'].values())} in autograd's "
          f"backward (without ZeRO's hooks); forward by module (calls; share; top operators):")
    for k, v in sorted(m["forward"].items(), key=lambda kv: -kv[1]):
        print(f"  {k} ({m['calls'].get(k, 0)} calls) {v} ({v / fwd:.0%}): {_top(m['ops'][k], top)}")
    print(f"  backward: {_top(m['backward'], top)}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="5 shape steps instead of 100, one counted step instead of two (70-100 s)")
    p.add_argument("--shape-steps", type=int, default=None, help="loader steps for SHAPES (default 100, --quick 5)")
    p.add_argument("--config", type=Path, default=CONFIG, help="run config (default: the Eco-RNA 80M)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for OPS/SYNC (after the bench's own), repeatable")
    p.add_argument("--shape-set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for SHAPES (after the family's SHAPES model), repeatable")
    p.add_argument("--top", type=int, default=15, help="operators listed per phase (default 15)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--skip-shapes", action="store_true")
    p.add_argument("--full-width", action="store_true",
                   help="OPS/SYNC at the config's own widths (80M: ~5 min) instead of its narrow twin (same counts)")
    p.add_argument("--by-module", action="store_true",
                   help="also one microbatch's forward operators by module (module_census: bare model, no engine)")
    args = p.parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    shape_steps = args.shape_steps or (5 if args.quick else 100)
    t0 = time.perf_counter()
    repeats = 1 if args.quick else 2
    r = count_step(args.set, config=args.config, repeats=repeats, full_width=args.full_width)
    c = r["config"]
    twin = "" if args.full_width else " (narrow twin)"
    print(f"OPS/SYNC: {c['params'] / 1e6:.2f}M parameters{twin}, {c['grad_accum_steps']} microbatches of "
          f"{c['rows']} x {c['length']}, depths {c['depths']}, plans of step {c['step']}; {repeats} counted "
          f"step(s) after 1 warm-up{', identical: ' + str(r['repeat_equal']) if repeats > 1 else ''} "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    if not r.get("repeat_equal", True):
        print("error: two consecutive steps on the same batches dispatched different operators", file=sys.stderr)
        return 1
    for ph in ("forward", "backward", "optimizer"):
        print(f"top {args.top} operators, {ph}: {_top(r['ops_by_phase'][ph], args.top)}")
    print(f"top {args.top} operators, whole step: {_top(r['ops_total'], args.top)}")
    print("sync sites (phase, count, of which in SYNC.micro, kind @ innermost caller outside torch):")
    for phase in PHASES:
        for k, v in sorted(r["syncs_by_phase"][phase].items(), key=lambda kv: -kv[1]):
            print(f"  {phase:9s} {v:4d} {r['micro_sites'].get(k, 0):4d}  {k}")
    where = f"{args.config.name}{' ' + ' '.join(args.set) if args.set else ''}"
    desc = (f"{where}{'' if args.full_width else ' narrow twin'}, {c['grad_accum_steps']} x {c['rows']} rows x "
            f"{c['length']} tokens, ZeRO-2 world 1 fp32 CPU")
    print(f"RESULT OPS.step {r['ops_step']} aten ops dispatched by one train_step ({desc}); lower is better")
    print(f"RESULT OPS.forward {r['ops_forward']} of them inside family.loss (forward + loss, all microbatches)")
    print(f"RESULT OPS.backward {r['ops_backward']} of them inside engine.backward (autograd + ZeRO hooks)")
    print(f"RESULT OPS.optimizer {r['ops_optimizer']} of them inside engine.step (every microbatch's)")
    print(f"RESULT OPS.nonview {r['ops_nonview']} of them not views or aliases (view, t, slice, detach, ...: no "
          f"kernel on CUDA), nearer to the launches")
    print(f"RESULT SYNC.micro {r['sync_micro']} host syncs inside the microbatch loop (loss, backward, non-final "
          f"engine.step, loop bookkeeping; CUDA-syncing ops + tolist/item/numpy)")
    print(f"RESULT SYNC.step {r['sync_step']} host syncs in the whole train_step")
    if args.by_module:
        print_module_census(module_census(args.set, config=args.config, full_width=args.full_width), args.top)
    if not args.skip_shapes:
        t1 = time.perf_counter()
        s = shape_census(shape_steps, args.shape_set, config=args.config)
        print(f"SHAPES: {s['steps']} steps, {s['microbatches']} microbatches of {s['microbatch']} tokens (the "
              f"config's batching, auto as on one H200), {s['core_calls']} core calls, {s['attention_calls']} "
              f"attention calls, model on {s['device']} ({time.perf_counter() - t1:.1f} s)")
        print(f"RESULT SHAPES.core {len(s['core'])} distinct core input shapes over {s['steps']} loader steps "
              f"({args.config.name} as configured: its layout on the CPU, tiny model); lower is better")
        print(f"RESULT SHAPES.attention {len(s['attention'])} distinct input shapes of its blocks (attention calls) "
              f"over the same steps")
        for name, sets in packed_layouts(args.config):  # the layout the GPU runs, with and without token buckets
            p = shape_census(shape_steps, list(args.shape_set) + sets, config=args.config)
            print(f"RESULT SHAPES.core.{name} {len(p['core'])} distinct core input shapes (tokens, grad), packed "
                  f"layout ({' '.join(sets)}); {p['tokens']:,} core tokens", flush=True)
            if name == "packed":
                bucketed = p
            else:
                print(f"RESULT SHAPES.tokens {bucketed['tokens'] / p['tokens']:.4f} core tokens with token buckets / "
                      f"without (target <= 1.05)")
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # DeepSpeed's process group and threads: leave without their teardown (bench/engine.py uses exit_process too)
    from pipeline.train import exit_process

    exit_process(code)
