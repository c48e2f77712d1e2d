"""One optimizer step with exact token normalization over microbatches and ranks (DeepSpeed ZeRO).

The step:
  1. draw all ``grad_accum_steps`` microbatches of the step (the loader position advances by that many);
  2. all-reduce the supervised-token count n_global over ranks and microbatches (skip the update if it is 0);
  3. per microbatch: ``engine.backward(sum_token_loss * world / n_global, scale_wrt_gas=False)`` and ``engine.step()``.
     ``scale_wrt_gas=False`` turns off DeepSpeed's division by gradient_accumulation_steps (runtime/engine.py
     ``backward``); the factor ``world`` cancels its average over data-parallel ranks (zero/stage_1_and_2.py,
     comm/coalesced_collectives.py for stage 3). The update is then the gradient of the global token mean.
     Under expert parallelism the same factor is exact for the experts too: DeepSpeed sums their gradients over the
     expert-data-parallel group and divides by the whole data-parallel size (pipeline/parallel/expert_parallel.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from pipeline.config import RunConfig
from pipeline.distributed import all_gather_object
from pipeline.models.layers import host_tensor


def train_step(engine, family, cfg: RunConfig, micro: list, step: int, device, between=None,
               unreadable: bool = False) -> dict:
    """One optimizer step over the microbatches ``micro`` of this rank (see the module docstring). ``between(i, n)``
    is called after each microbatch's backward (the Trainer's heartbeat and mid-step stop). ``unreadable``: this
    rank could not read all of its microbatches (remote data that could not be fetched); the flag rides on the token
    counts' all-reduce, and when any rank raised it every rank returns ``{"unreadable": True}`` right after it,
    with no other collective and no update.

    Collectives, in order: one all-reduce (SUM) of the token counts, one (MAX) of the plans' sync values, then the
    microbatches' forward/backward, then one all-gather of the statistic names and one all-reduce (SUM) of their
    values. Every rank makes the same calls in the same order, whatever its data. The reduced tensors live on
    ``device``: an NCCL process group reduces only CUDA tensors. One rank makes no collective. Device reads: one per
    collective before the loop, none inside it, one for the statistics and the gradient norm after it.
    """
    world = dist.get_world_size()
    # a microbatch's draws (depths, initial states) are seeded by its origin, not by the rank reading it: a run
    # continued on another world size draws what the uninterrupted run would have
    plans = [family.plan(b, cfg, step=step, stream=b.origin[0], index=b.origin[1]) for b in micro]
    # tokens computed: rows x padded length of every microbatch [B, L], real tokens included (padding_ratio)
    counts = [sum(b.num_supervised for b in micro), sum(int(b.attention_mask.sum()) for b in micro),
              sum(len(b.sample_ids) for b in micro), sum(b.input_ids.numel() for b in micro), float(unreadable)]
    n_global, tokens_global, samples_global, computed, failed = (
        int(v) for v in all_reduce_host(counts, torch.float64, device))
    if failed:
        return {"unreadable": True}
    sync_keys = sorted(plans[0].sync_max) if plans else []
    if sync_keys:  # e.g. K_max: every rank must call the shared core equally often
        local = [p.sync_max[k] for p in plans for k in sync_keys]
        synced = all_reduce_host(local, torch.int64, device, dist.ReduceOp.MAX)
        for i, p in enumerate(plans):
            p.sync_max = dict(zip(sync_keys, synced[i * len(sync_keys):(i + 1) * len(sync_keys)]))
    rec = {"supervised_tokens": n_global, "tokens": tokens_global, "samples": samples_global,
           "tokens_computed": computed, "skipped": int(n_global == 0)}
    if n_global == 0:  # an update needs a positive token count (A.2); skip it rather than divide by zero
        rec.update(loss=float("nan"), grad_norm=0.0)  # the trainer sets each step's lr itself: nothing to advance
        return rec
    # Statistics stay where the loss made them (device tensors or host numbers) until the end of the step: nothing
    # in this loop reads the device back, so the host can queue the next microbatch while the GPU works.
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    stats, totals = {}, {}
    for i, (batch, p) in enumerate(zip(micro, plans)):
        out = family.loss(engine, batch.to(device, non_blocking=True), cfg, p)
        engine.backward(out.sum_loss * (world / n_global), scale_wrt_gas=False)
        engine.step()
        if between is not None:
            between(i + 1, len(micro))
        loss_sum += out.sum_loss.detach().double()
        for k, (num, den) in out.stats.items():
            a, b = stats.get(k, (0.0, 0.0))
            stats[k] = (a + _f64(num), b + _f64(den))
        for k, v in out.totals.items():
            totals[k] = totals.get(k, 0.0) + _f64(v)
    # Names differ between ranks (a depth drawn on one rank only): gather them so every rank reduces the same vector.
    gathered = all_gather_object((sorted(stats), sorted(totals))) if world > 1 else [(sorted(stats), sorted(totals))]
    names = sorted(set().union(*(g[0] for g in gathered)))
    tnames = sorted(set().union(*(g[1] for g in gathered)))
    vec = _vector([loss_sum] + [v for k in names for v in stats.get(k, (0.0, 0.0))]
                  + [totals.get(k, 0.0) for k in tnames], device)
    norm = engine.get_global_grad_norm()
    if torch.is_tensor(norm):  # read with the statistics, not by a sync of its own
        vec = torch.cat([vec, norm.detach().to(device=device, dtype=torch.float64).reshape(1)])
    if world > 1:
        dist.all_reduce(vec)
    values = vec.tolist()  # the step's one device-to-host read
    if torch.is_tensor(norm):
        norm = values.pop() / world  # identical on every rank: the all-reduce summed world copies
    rec.update(loss=values[0] / n_global, grad_norm=float(norm) if norm is not None else float("nan"))
    for i, k in enumerate(names):
        num, den = values[1 + 2 * i], values[2 + 2 * i]
        if den:
            rec[k] = num / den
    for i, k in enumerate(tnames):
        rec[k] = values[1 + 2 * len(names) + i]
    if family.derive_metrics is not None:  # metrics of the reduced step totals (e.g. routing entropy)
        rec.update(family.derive_metrics(rec))
    return rec


def all_reduce_host(values: list, dtype, device, op=dist.ReduceOp.SUM) -> list:
    """Host numbers reduced over the ranks, back on the host (one device read, none at world size 1)."""
    if dist.get_world_size() == 1:
        return list(values)
    t = host_tensor(values, dtype, device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def _f64(x):
    """A statistic as float64: device tensors stay on the device (read once at the end of the step)."""
    return x.detach().double() if torch.is_tensor(x) else float(x)


def _vector(values: list, device) -> torch.Tensor:
    """[n] float64 on ``device`` from host numbers and device scalars, with one host-to-device copy for the numbers
    and one stack for the tensors (not one copy per value)."""
    host = [i for i, v in enumerate(values) if not torch.is_tensor(v)]
    dev = [i for i, v in enumerate(values) if torch.is_tensor(v)]
    vec = torch.zeros(len(values), dtype=torch.float64, device=device)
    if host:
        vec[host_tensor(host, torch.long, device)] = host_tensor([values[i] for i in host], torch.float64, device)
    if dev:
        vec[host_tensor(dev, torch.long, device)] = torch.stack([values[i].to(device).reshape(()) for i in dev])
    return vec
