"""The dry run: the plan of a training, from the training's own checks, with nothing started or written."""
from __future__ import annotations

import json
import os

import torch

from pipeline.checkpoint.layout import read_latest
from pipeline.config import ConfigError, RunConfig
from pipeline.data.loader import ShardStream
from pipeline.parallel import EP_KEY
from pipeline.train.plan import RunPlan


def dry_run(cfg: RunConfig, ds_config_path: str, resume: str = "auto", allow_config_change: bool = False,
            world_size: int = 1, local_world_size: int | None = None, origin: str = "", *,
            trust_checkpoint: bool = False, allow_data_change: bool = False) -> str:
    """What a training of ``cfg`` on ``world_size`` ranks, ``local_world_size`` per node, would do, as text.

    It resolves the inputs with the training's own code: ``RunPlan`` (batch arithmetic, ds_config, resume point and
    its config, EP layout, data against the model, shards against streams) and rank 0's loader dataset
    (``build_dataset``: the loader's own checks). So every error a training raises before DeepSpeed starts is raised
    here too, the same one line. Nothing is started (no process group, no DeepSpeed engine) and nothing is written:
    not even the run directory. ``origin`` says where the world size came from (flags or the launcher's env).
    """
    local = local_world_size or world_size
    if world_size < 1 or local < 1 or world_size % local:
        raise ConfigError(f"world size {world_size} does not split into nodes of {local} ranks "
                          "(--world-size, --nproc-per-node, or the launcher's WORLD_SIZE and LOCAL_WORLD_SIZE)")
    try:
        plan = RunPlan(cfg, ds_config_path, resume, allow_config_change, world_size=world_size,
                       trust_checkpoint=trust_checkpoint, allow_data_change=allow_data_change)
    except ConfigError as e:
        t = cfg.train
        per_rank = t.micro_batch_size * t.grad_accum_steps
        if str(e).startswith("train.global_batch_size") and "--world-size" not in origin \
                and t.global_batch_size % per_rank == 0:  # planned for the default world: say how to plan another
            raise ConfigError(f"{e}; this dry run planned {world_size} rank{'s' if world_size > 1 else ''} "
                              f"({origin or 'no launcher'}): pass --world-size {t.global_batch_size // per_rank} to "
                              "plan the world size this batch needs") from None
        raise
    try:
        dataset = plan.build_dataset(rank=0)  # stream g's shards do not depend on the rank reading it
    except ValueError as e:  # the loader's own input checks (workers, windows, cluster sampling): one line
        raise ConfigError(str(e).splitlines()[0]) from None
    cfg = plan.cfg  # train.max_tokens_per_microbatch: auto resolved
    run_dir, nodes = plan.run_dir, world_size // local
    lines = ["dry run: resolved without starting anything; nothing was written",
             f"run_dir: {run_dir} ({'exists' if run_dir.exists() else 'not created yet'})",
             f"world: {world_size} ranks = {nodes} node{'s' if nodes > 1 else ''} x {local} ranks per node"
             + (f" ({origin})" if origin else "") + (f"; rank r runs on node r // {local}" if nodes > 1 else ""),
             *_plan_batch(cfg, world_size), *([f"  {plan.microbatch.why}"] if plan.microbatch else []),
             _plan_budget(cfg, plan.dataset_samples), *_plan_resume(plan)]
    if cfg.train.expert_parallel_size > 1:
        lines += _plan_expert_parallel(cfg, world_size, local, plan.moe_backend)
    elif getattr(cfg.model, "moe_layers", None):
        lines.append(f"experts: every rank holds all {cfg.model.num_experts} experts (train.expert_parallel_size 1), "
                     f"moe backend {plan.moe_backend}")
    lines.append(f"ds_config: {plan.ds_config_path} resolved for {world_size} ranks (ZeRO stage "
                 f"{plan.zero_stage}, {'bf16' if plan.dtype == torch.bfloat16 else 'fp32'}):")
    lines.append(json.dumps(plan.ds_config, indent=1))
    lines += _plan_data(plan, dataset, local)
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


def _plan_batch(cfg: RunConfig, world: int) -> list[str]:
    t, d = cfg.train, cfg.data
    accum = f"grad_accum_steps {t.grad_accum_steps} x {world} ranks"
    supervised = "  supervised tokens per step: data-dependent (lengths, masking); counted and all-reduced every step"
    if t.max_tokens_per_microbatch:
        budget = t.max_tokens_per_microbatch * t.grad_accum_steps * world
        return [f"batch: token budget train.max_tokens_per_microbatch {t.max_tokens_per_microbatch} per microbatch "
                f"(sequences x longest) x {accum} = at most {budget} padded tokens per optimizer step; the sequences "
                "per microbatch depend on their lengths (train.micro_batch_size is not used by the loader)", supervised]
    rows = t.micro_batch_size * t.grad_accum_steps * world
    agreed = " (= train.global_batch_size)" if t.global_batch_size is not None else ""
    kind = "rows of packed documents" if d.pack else "sequences"
    return [f"batch: micro_batch_size {t.micro_batch_size} x {accum} = global batch {rows} {kind} per optimizer "
            f"step{agreed}",
            f"  tokens per step: at most {rows} x data.context_length {d.context_length} = "
            f"{rows * d.context_length}" + ("" if d.pack else " (each microbatch padded to its longest sequence)"),
            supervised]


def _plan_budget(cfg: RunConfig, dataset_samples: int) -> str:
    t = cfg.train
    parts = [f"train.max_steps {t.max_steps}"]
    if t.max_words is not None:
        parts.append(f"train.max_words {t.max_words}")
    if t.max_epochs is not None:
        parts.append(f"train.max_epochs {t.max_epochs:g} (= {t.max_epochs * dataset_samples:.0f} samples)")
    if t.max_hours is not None:
        parts.append(f"train.max_hours {t.max_hours:g} per attempt")
    return f"budget: stops at the first of {', '.join(parts)}" if len(parts) > 1 else f"budget: {parts[0]}"


def _plan_resume(plan: RunPlan) -> list[str]:
    ckpt = plan.ckpt_dir
    if plan.resume_tag:
        saved = plan.saved
        how = {None: "on its own layout",
               "universal": f"through DeepSpeed's universal checkpoint (rank 0 converts it into "
                            f"{plan.run_dir / 'universal' / plan.resume_tag} first)",
               "consolidated": "through the consolidated expert-parallel path"}[plan.reshard]
        lines = [f"resume: from {ckpt / plan.resume_tag} (step {saved.get('step')}, written by "
                 f"{saved.get('world_size')} ranks under ZeRO stage {saved['zero_stage']}), {how}"]
        if plan.resume != "auto" and read_latest(ckpt) != plan.resume_tag:
            lines.append(f"  a rollback: the checkpoints after {plan.resume_tag} would move to "
                         f"{ckpt}/abandoned_after_{plan.resume_tag}_TIME/")
        if plan.resume_note:
            lines.append(f"  note: {plan.resume_note}")
        if plan.finished:
            lines.append(f"  already finished (train.max_steps {plan.cfg.train.max_steps}): a training would exit "
                         "at once")
        lines += [f"  config changed (--allow-config-change): {c}" for c in plan.config_changes]
        if plan.cfg.train.init_from:
            lines.append("  train.init_from is not read: the run has checkpoints of its own")
        if plan.resumed_loader is not None:
            lines.append(f"  the loader continues every stream where the checkpoint left it (each rank has consumed "
                         f"{plan.resumed_loader[0]['batches_consumed']} microbatches)")
        return lines
    if plan.init_source is not None:
        what = "weights and AdamW moments" if plan.cfg.train.init_from_optimizer else "weights"
        return [f"resume: none; a new run starting from the {what} of {plan.init_source} (train.init_from)"]
    why = "--resume never" if plan.resume == "never" else f"no checkpoint in {ckpt}"
    if plan.cfg.checkpoint.mirror and plan.resume == "auto":
        return [f"resume: none in {ckpt}; a training first takes the newest complete checkpoint of checkpoint.mirror "
                f"{plan.cfg.checkpoint.mirror} (its digests checked), a fresh start only when the mirror holds none"]
    return [f"resume: none; a fresh start ({why})"]


def _plan_expert_parallel(cfg: RunConfig, world: int, local: int, backend: str) -> list[str]:
    """DeepSpeed's groups for EP size ep (utils/groups.py ``_create_expert_and_data_parallel``, no model or pipeline
    parallelism): EP groups of consecutive ranks, expert-data-parallel groups of the ranks with equal rank % ep."""
    ep, experts = cfg.train.expert_parallel_size, cfg.model.num_experts
    per = experts // ep
    where = ("each EP group inside one node" if local % ep == 0 else
             "EP groups span nodes: every MoE layer's all-to-all crosses the network")
    return [f"expert parallel: {EP_KEY} {ep} over {world} ranks, moe backend {backend}: {world // ep} EP groups of "
            f"consecutive ranks (all-to-all: ranks {ep}g .. {ep}g+{ep - 1}), {where}",
            f"  experts ({per} of {experts} per rank): "
            + "; ".join(f"r % {ep} = {e}: {e * per}" + (f"-{e * per + per - 1}" if per > 1 else "") for e in range(ep))
            + f"; ZeRO reduces and partitions them over the {world // ep} ranks with the same r % {ep}"]


def _plan_data(plan: RunPlan, dataset: ShardStream, local: int) -> list[str]:
    """The stream layout and, per source, the shards every rank's streams read in epoch 0 (module docstring of
    pipeline/data/loader.py, "Streams"), one line per rank, and how evenly the samples fall on the ranks."""
    layout, d = plan.loader_layout, plan.cfg.data
    origin = ("kept from the checkpoint" if plan.resumed_loader is not None else
              "data.loader_streams" if d.loader_streams else
              f"default: {layout.world_size} ranks x max(1, data.num_workers {d.num_workers})")
    readers = (f"{d.num_workers} workers per rank (worker p reads streams p, p + {d.num_workers}, ...)"
               if d.num_workers else "read by the rank itself")
    share = ("rank r reads stream r" if layout.local == 1 else
             f"rank r reads streams {layout.local}r .. {layout.local}r+{layout.local - 1}")
    lines = [f"data: {layout.streams} loader streams ({origin}): {share}, {readers}; shards per stream in epoch 0:"]
    keys = [key for key, _ in plan.shard_specs()]
    for key, src in zip(keys, dataset.sources):
        counts = src.counts
        prefix, suffix, short = _compact_names([sh.name for sh in src.shards])
        lines.append(f"source {src.name} ({key} = {src.spec}): {len(counts)} shards, {int(counts.sum())} samples"
                     + (f"; shard names {prefix}*{suffix}, * below" if prefix or suffix else ""))
        per_rank = []
        for r in range(layout.world_size):
            parts, total = [], 0
            for g in range(r * layout.local, (r + 1) * layout.local):
                ids = src.stream_shards(g, 0)
                total += int(counts[ids].sum())
                parts.append(f"stream {g} [{' '.join(short[i] for i in ids)}]")
            per_rank.append(total)
            lines.append(f"  rank {r} (node {r // local}): {', '.join(parts)}: {total} samples")
        lo, hi = min(per_rank), max(per_rank)
        lines.append(f"  samples per rank in epoch 0: min {lo} (rank {per_rank.index(lo)}), max {hi} "
                     f"(rank {per_rank.index(hi)}), max/min {hi / lo if lo else float('inf'):.2f}")
    if len(keys) > 1:
        lines.append("  (a mixture draws each sample's source by the schedule's weights; every source continues "
                     "into its next epoch independently)")
    return lines


def _compact_names(names: list[str]) -> tuple[str, str, list[str]]:
    """(common prefix, common suffix, what differs) of shard names, cut at digit boundaries so a shard number stays
    whole: rnacentral-000003.tar -> ("rnacentral-", ".tar", "000003"). No common part: ("", "", the names)."""
    if len(names) < 2:
        return "", "", list(names)
    prefix = os.path.commonprefix(names)
    suffix = os.path.commonprefix([n[::-1] for n in names])[::-1]
    prefix = prefix.rstrip("0123456789")
    suffix = suffix.lstrip("0123456789")
    shortest = min(len(n) for n in names)
    if len(prefix) + len(suffix) >= shortest:
        return "", "", list(names)
    return prefix, suffix, [n[len(prefix):len(n) - len(suffix)] for n in names]
