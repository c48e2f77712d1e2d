"""Expert parallelism (EP) for ProtLingo's upcycled MoE under DeepSpeed ZeRO stage 1-2.

The model file keeps the math (``pipeline/models/protlingo.py``: routing, losses, the reference experts); this file
only changes where the routed experts run, the way torchtitan keeps ``parallelize`` beside ``model.py``.

Why a ``MoE`` subclass (docs/architecture.md, "Expert parallelism and DeepSpeed's MoE"): DeepSpeed treats a module as an
MoE only if ``isinstance(module, deepspeed.moe.layer.MoE)``, decided in ``deepspeed.initialize`` before ZeRO is
built. A bare MoE module trains silently wrong under EP (rank 0's experts are broadcast to every rank, different
experts are averaged together); tagging the parameters alone, or setting ``engine.has_moe_layers`` afterwards, crashes
ZeRO-2. ``ExpertParallelMoE`` subclasses ``MoE`` without calling its ``__init__`` (which would build DeepSpeed's own
gate and experts) and sets exactly the attributes the engine, ZeRO-1/2 and the checkpoint code read:
``num_experts``, ``ep_size``, ``num_local_experts``, ``expert_group_name`` and ``set_deepspeed_parallelism``.

Layout: the parameter names stay those of the single-process model (``router``, ``shared``,
``deepspeed_moe.experts.deepspeed_experts.<i>``); on EP rank r, local expert i is global expert
``r * num_local_experts + i`` (DeepSpeed's convention: ``_save_moe_checkpoint`` writes it as
``layer_{L}_expert_{global}_mp_rank_00_model_states.pt`` with the global id in the keys, and ``load_moe_state_dict``
maps it back). Expert parameters carry ``allreduce = False`` and ``group_name = "ep_size_{ep}"``: ZeRO then reduces
their gradients over the expert-data-parallel group (the ranks holding the same experts) and partitions their
optimizer state over it.

Gradient convention (runtime/zero/stage_1_and_2.py ``average_tensor``): every bucket is divided by the whole
data-parallel size W and summed over its group, the expert-data-parallel group for expert parameters. The engine's
``backward(sum_loss * W / n_global)`` therefore gives experts the exact global-token-mean gradient too: the
all-to-all's backward returns to the expert's rank the gradient of every token routed to it from its EP group, and
the sum over the expert-data-parallel group adds the other EP groups; dividing by W cancels the factor W. No extra
1/ep (MegaBlocks' ``gradient_scale`` would be wrong here).

Dispatch per MoE layer and forward, over the EP group (gloo on CPU, NCCL on GPU):
  1. all_to_all of the per-expert token counts [E] (not differentiable, equal splits of num_local_experts);
  2. all_to_all of the tokens sorted by global expert id, uneven splits (``torch.distributed.nn.functional``:
     its backward is the reverse all_to_all);
  3. each local expert on the rows it received (every expert runs, on zero rows too, so every parameter is in the
     graph), then the reverse all_to_all back to the token's rank, and the original token order.
"""
from __future__ import annotations

import warnings
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
from deepspeed.moe.layer import MoE
from deepspeed.utils import groups

from pipeline.errors import ConfigError
from pipeline.models.protlingo import UpcycledMoE, _RoutedExperts
from pipeline.parallel.groups import EP_KEY, check_expert_parallel, group_name

# torch 2.13 marks torch.distributed.nn.functional deprecated in favour of _functional_collectives, whose autograd
# all_to_all is not available on gloo; the nn.functional one is differentiable and works on gloo and NCCL.
warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional\.all_to_all_single is deprecated",
                        category=FutureWarning)


class ExpertParallelMoE(UpcycledMoE, MoE):
    """``UpcycledMoE`` whose routed experts are spread over an EP group; DeepSpeed sees a native ``MoE``.

    ``forward`` and ``route`` are UpcycledMoE's own (the same routing, straight-through weight and losses as the
    single-process model, on this rank's tokens); only ``compute_experts`` dispatches. The router and the shared
    expert are ordinary data-parallel parameters (replicated, gradients averaged over every rank).
    """

    def __init__(self, ref: UpcycledMoE, ep_size: int, ep_rank: int, ep_group):
        nn.Module.__init__(self)  # not MoE.__init__: it would build DeepSpeed's gate and experts
        E = ref.num_experts
        self.num_experts = E
        self.ep_size = ep_size
        self.num_local_experts = E // ep_size
        self.expert_group_name = group_name(ep_size)
        self.ep_rank = ep_rank
        self.ep_group = ep_group
        self.use_residual = False  # read by DeepSpeed code paths that handle its own MoE
        self.enable_expert_tensor_parallelism = False
        self.router = ref.router
        self.shared = ref.shared
        first = ep_rank * self.num_local_experts
        # The same module path as the model file (deepspeed_moe.experts.deepspeed_experts.<local id>), holding this
        # rank's experts only; the others are dropped with ``ref``.
        self.deepspeed_moe = _RoutedExperts([ref.experts[first + i] for i in range(self.num_local_experts)])
        for p in self.deepspeed_moe.parameters():
            p.allreduce = False  # deepspeed.moe.utils.is_moe_param
            p.group_name = self.expert_group_name

    def global_expert_ids(self) -> list[int]:
        return [self.ep_rank * self.num_local_experts + i for i in range(self.num_local_experts)]

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False, **_):
        """Called by ``deepspeed.initialize`` on every module that has it. The groups already exist
        (``apply_expert_parallel`` created them to pick this rank's experts); check the layout did not change."""
        name = self.expert_group_name
        if name not in groups._get_expert_parallel_group_dict():
            groups._create_expert_and_data_parallel(self.ep_size,
                                                    use_data_before_expert_parallel_=use_data_before_expert_parallel_)
        group = groups._get_expert_parallel_group(name)
        if dist.get_rank(group) != self.ep_rank:
            raise RuntimeError(f"{name}: this rank holds the experts of EP rank {self.ep_rank} but DeepSpeed's expert "
                               f"parallel group makes it EP rank {dist.get_rank(group)}")
        self.ep_group = group

    def compute_experts(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """x [T, d] (this rank's tokens), expert [T] global ids -> routed_{expert_t}(x_t) [T, d]."""
        ep, nl, E = self.ep_size, self.num_local_experts, self.num_experts
        T, d = x.shape
        order = torch.argsort(expert, stable=True)  # tokens grouped by global expert, so by destination rank
        counts = torch.bincount(expert, minlength=E)  # [E] tokens of this rank for each expert
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.ep_group)  # nl counts to each EP rank
        recv = recv_counts.view(ep, nl)  # recv[s, i]: tokens EP rank s sends to local expert i
        send_splits = counts.view(ep, nl).sum(1).tolist()
        recv_splits = recv.sum(1).tolist()
        received = dist_fn.all_to_all_single(x.new_empty(sum(recv_splits), d), x.index_select(0, order).contiguous(),
                                             recv_splits, send_splits, group=self.ep_group)  # [R, d]
        local = torch.arange(nl, device=x.device).repeat(ep).repeat_interleave(recv.reshape(-1))  # [R] local ids
        out = received.new_zeros(received.shape)
        for i, mlp in enumerate(self.experts):
            idx = (local == i).nonzero().squeeze(1)
            out = out.index_add(0, idx, mlp(received.index_select(0, idx)))  # every expert runs, on zero rows too
        back = dist_fn.all_to_all_single(x.new_empty(T, d), out.contiguous(), send_splits, recv_splits,
                                         group=self.ep_group)  # [T, d] in sorted order
        return back.index_select(0, torch.argsort(order))  # the original token order


def apply_expert_parallel(model: nn.Module, ep_size: int, zero_stage: int = 2) -> nn.Module:
    """Replace every ``UpcycledMoE`` of ``model`` (weights already loaded, all experts present) by an
    ``ExpertParallelMoE`` holding this rank's experts; in place, before the optimizer is built. Creates DeepSpeed's
    expert-parallel and expert-data-parallel groups (``deepspeed.comm`` must be initialized)."""
    moes = [(n, m) for n, m in model.named_modules() if isinstance(m, UpcycledMoE)]
    if any(isinstance(m, ExpertParallelMoE) for _, m in moes):
        raise RuntimeError("apply_expert_parallel: the model is already expert-parallel")
    if any(type(m) is not UpcycledMoE for _, m in moes):
        raise RuntimeError("apply_expert_parallel: an MoE layer already runs another compute_experts (MegaBlocks?); "
                           "expert parallelism replaces only the reference one")
    if any(not n for n, _ in moes):
        raise RuntimeError("apply_expert_parallel: the root module is an MoE layer; pass the model that holds it")
    sizes = {m.num_experts for _, m in moes}
    if len(sizes) > 1:
        raise ConfigError(f"{EP_KEY}: MoE layers with different numbers of experts {sorted(sizes)}")
    layers = SimpleNamespace(moe_layers=[n for n, _ in moes], num_experts=sizes.pop() if sizes else 0)
    check_expert_parallel(layers, ep_size, dist.get_world_size(), zero_stage)  # ep > 1 without MoE layers included
    if not moes:
        return model
    name = group_name(ep_size)
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep_size)
    ep_group = groups._get_expert_parallel_group(name)
    ep_rank = dist.get_rank(ep_group)
    for path, moe in moes:
        parent_path, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent_path), attr, ExpertParallelMoE(moe, ep_size, ep_rank, ep_group))
    return model


def moe_param_groups(param_groups: list[dict]) -> list[dict]:
    """The engine's named AdamW groups (``pipeline.train.param_groups``) with the expert parameters moved into
    groups of their own (``moe: True``, ``name: ep_size_{ep}``): ZeRO-1/2 partition those over the
    expert-data-parallel group. DeepSpeed's own split; every input group needs a distinct ``name``."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    names = [g.get("name") for g in param_groups]
    if None in names or len(set(names)) != len(names):
        raise ValueError(f"moe_param_groups: every parameter group needs a distinct name, got {names}")
    out = split_params_into_different_moe_groups_for_optimizer(param_groups)
    return [g for g in out if g["params"]]  # a group left without parameters (all experts) is dropped
