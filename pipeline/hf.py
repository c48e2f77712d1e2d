"""Hugging Face ``transformers`` classes for the pipeline's model families (nn.Modules and configs only).

    import pipeline.hf  # registers the classes below with the Auto classes
    from transformers import AutoModelForMaskedLM
    model = AutoModelForMaskedLM.from_pretrained("exports/eco_rna_demo")

An export of ``tools/convert_checkpoint.py`` holds ``config.json`` (one of the configs here, or transformers' own
``EsmConfig``) beside ``model.safetensors``. The HF model holds the pipeline's own module (``pipeline.models``): its
submodules are registered on the HF model directly (the pipeline module itself is kept unregistered, ``.net``), so the
state-dict names are exactly the pipeline's and ``model.safetensors`` is the one file that ``pipeline.load_pretrained``
and ``from_pretrained`` both read. Nothing here imports DeepSpeed or torch.distributed.

    family          config (model_type)                  model classes (Auto class)
    eco_rna         EcoRNAConfig ("eco_rna")             EcoRNAForMaskedLM (AutoModelForMaskedLM), EcoRNAModel
                                                         (AutoModel)
    recursive_gpt   RecursiveGPTConfig ("recursive_gpt") RecursiveGPTForCausalLM (AutoModelForCausalLM, generate)
    standard_gpt    StandardGPTConfig ("standard_gpt")   StandardGPTForCausalLM (AutoModelForCausalLM, generate)
    protlingo       ProtLingoConfig ("protlingo")        ProtLingoForMaskedLM (AutoModelForMaskedLM)
    protlingo without MoE and memory, any dense ESM2:    transformers' EsmForMaskedLM ("esm"; esm_state_dict)

Eco-RNA's deterministic convention (what ``launchers/evaluate.py`` does, so HF logits equal the pipeline's): every
row runs ``num_loops`` core iterations from the evaluation initial state, the first L rows of the seed-fixed table
``pipeline.eval.reconstruction.state_table(model, context_length, state_seed)`` (zero at padding).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM, GenerationMixin,
                          PreTrainedConfig, PreTrainedModel)
from transformers import initialization as hf_init
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput, MaskedLMOutput

from pipeline.models import eco_rna as eco_rna_model
from pipeline.models import protlingo as protlingo_model
from pipeline.models import recursive_gpt as gpt_model
from pipeline.objectives.eco_rna import trained_mean_depth

IGNORE_INDEX = -100  # = pipeline.objectives.masking.IGNORE_INDEX and transformers' own label convention


def _fields(model_config_cls) -> list[str]:
    return [f.name for f in dataclasses.fields(model_config_cls)]


class _PipelineConfig(PreTrainedConfig):
    """A PreTrainedConfig carrying every field of one pipeline model config dataclass (``model_config_cls``) as an
    attribute of the same name; ``model_config()`` rebuilds (and so validates) the dataclass."""

    model_config_cls: type = None

    def __init__(self, **kwargs):
        defaults = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
                    for f in dataclasses.fields(self.model_config_cls)}
        for name, default in defaults.items():
            value = kwargs.pop(name, default)
            setattr(self, name, list(value) if isinstance(value, tuple) else value)
        super().__init__(**kwargs)

    def model_config(self):
        return self.model_config_cls(**{name: getattr(self, name) for name in _fields(self.model_config_cls)})

    @classmethod
    def from_model_config(cls, model_cfg, **kwargs):
        return cls(**dataclasses.asdict(model_cfg), **kwargs)


class _Wrapped(PreTrainedModel):
    """A PreTrainedModel whose submodules are those of a pipeline module (same parameter objects, same names)."""

    supports_gradient_checkpointing = False
    _supports_sdpa = True

    def _adopt(self, net: torch.nn.Module):
        object.__setattr__(self, "net", net)  # not a registered child: its children are ours, under their own names
        for name, child in net.named_children():
            self.add_module(name, child)
        if list(net.named_parameters(recurse=False)) or list(net.named_buffers(recurse=False)):
            raise TypeError(f"{type(net).__name__} holds tensors outside its submodules")

    def _init_weights(self, module):
        """The pipeline module initializes itself when built; from_pretrained then loads every tensor. Only the
        non-persistent buffers (never in a checkpoint; transformers leaves them empty after a meta-device build) are
        recomputed here."""
        if isinstance(module, protlingo_model.LatentNgramMemory):
            cfg = module.cfg
            radix = 2 ** cfg.memory_bits + 1
            hf_init.copy_(module.radix_powers, radix ** torch.arange(cfg.window, dtype=torch.int64))
            hf_init.copy_(module.bit_values, 2 ** torch.arange(cfg.memory_bits, dtype=torch.int64))

    def get_input_embeddings(self):
        return self.embed

    def _mask(self, input_ids, attention_mask):
        """[B, L] bool, True at real tokens (rows right-padded, the pipeline's layout)."""
        return torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()


def _cross_entropy(logits, labels):
    if labels is None:
        return None
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX)


# ---- Eco-RNA ------------------------------------------------------------------------------------------------------
class EcoRNAConfig(_PipelineConfig):
    """pipeline.models.eco_rna.EcoRNAConfig's fields, plus:

    num_loops: core iterations K when forward is not given one (convert_checkpoint: the trained mean depth E[K],
        rounded); task_depths: {task: K} chosen per task (tools/choose_depth.py); state_seed, context_length: the
        evaluation initial-state table (module docstring); molecule and tokenizer: the nucleotide tokenizer
        (pipeline.data.tokenizer.NucleotideTokenizer(molecule); ``tokenizer`` lists its vocabulary and special ids).
    """

    model_type = "eco_rna"
    model_config_cls = eco_rna_model.EcoRNAConfig

    def __init__(self, num_loops: int = 4, task_depths: dict | None = None, state_seed: int = 0,
                 context_length: int = 1024, molecule: str = "rna", tokenizer: dict | None = None, **kwargs):
        self.num_loops = int(num_loops)
        self.task_depths = dict(task_depths or {})
        self.state_seed = int(state_seed)
        self.context_length = int(context_length)
        self.molecule = molecule
        self.tokenizer = tokenizer
        if self.num_loops < 1:
            raise ValueError(f"num_loops: must be >= 1, got {self.num_loops}")
        kwargs.setdefault("pad_token_id", 0)
        kwargs.setdefault("tie_word_embeddings", False)  # the pipeline's TiedEmbedding is one tensor, used twice
        super().__init__(**kwargs)


class EcoRNAPreTrainedModel(_Wrapped):
    config_class = EcoRNAConfig
    main_input_name = "input_ids"

    def __init__(self, config: EcoRNAConfig):
        super().__init__(config)
        self._adopt(eco_rna_model.EcoRNA(config.model_config()))
        self._tables = {}  # length -> initial-state table [length, d] (fp32, CPU)
        self.post_init()

    def initial_state(self, mask: torch.Tensor) -> torch.Tensor:
        """s0 [B, L, d]: the evaluation convention (module docstring); longer inputs than context_length get a table
        of their own length (the pipeline never evaluates those)."""
        from pipeline.eval.reconstruction import state_table

        n = max(self.config.context_length, mask.shape[1])
        if n not in self._tables:
            self._tables[n] = state_table(self.net.cfg, n, self.config.state_seed)
        return eco_rna_model.initial_state(self.net.cfg, mask, table=self._tables[n])

    def trajectory(self, input_ids, attention_mask=None, num_loops=None, output_hidden_states=False):
        """(readout features [B, L, d] of s_K, hidden states or None). Core.forward and Stack.forward unrolled, the
        same operations in the same order, so that every block's output can be kept.

        hidden states (a tuple of [B, L, d] tensors, in execution order): the prelude output e (= N_p(P(E x)), what
        the core re-injects), then for each loop k = 1..K the outputs of its n_core blocks followed by the loop's
        state s_k = N_r(block output): 1 + K * (n_core + 1) tensors; the state of loop k is at index
        k * (n_core + 1), its block j (1-based) at index (k - 1) * (n_core + 1) + j."""
        K = self.config.num_loops if num_loops is None else int(num_loops)
        if K < 1:
            raise ValueError(f"num_loops: must be >= 1, got {K}")
        net = self.net
        mask = self._mask(input_ids, attention_mask)
        s = self.initial_state(mask).to(net.embed.weight.device)
        e, rope, key_mask = net._prelude(input_ids, mask)
        s = s.to(e.dtype)
        hidden = [e] if output_hidden_states else None
        for _ in range(K):
            x = net.core.inject(s, e)
            for blk in net.core.stack.blocks:
                x = blk(x, rope, key_mask)
                if hidden is not None:
                    hidden.append(x)
            s = net.core.norm(x)
            if hidden is not None:
                hidden.append(s)
        return net.readout(s, rope, key_mask), (tuple(hidden) if hidden is not None else None)


class EcoRNAModel(EcoRNAPreTrainedModel):
    """The Eco-RNA encoder: last_hidden_state = N_o(C(W_o s_K)) [B, L, d], the features the tied head reads."""

    def forward(self, input_ids, attention_mask=None, num_loops=None, output_hidden_states=None, return_dict=None,
                **kwargs):
        features, hidden = self.trajectory(input_ids, attention_mask, num_loops, bool(output_hidden_states))
        if return_dict is False:
            return (features,) + ((hidden,) if hidden is not None else ())
        return BaseModelOutput(last_hidden_state=features, hidden_states=hidden)


class EcoRNAForMaskedLM(EcoRNAPreTrainedModel):
    def forward(self, input_ids, attention_mask=None, num_loops=None, labels=None, output_hidden_states=None,
                return_dict=None, **kwargs):
        """input_ids, attention_mask: [B, L] (rows right-padded; mask 1 at real tokens); num_loops: K (default
        config.num_loops); labels: [B, L] with -100 where unsupervised -> MaskedLMOutput(loss, logits [B, L, V],
        hidden_states: see ``trajectory``). Without hidden states this is the pipeline's own forward (the training
        wavefront with every row at depth K), so the logits are the pipeline model's."""
        if output_hidden_states:
            features, hidden = self.trajectory(input_ids, attention_mask, num_loops, True)
            logits = self.net.embed(features, as_head=True)
        else:
            K = self.config.num_loops if num_loops is None else int(num_loops)
            mask = self._mask(input_ids, attention_mask)
            logits, hidden = self.net(input_ids, mask, K, self.initial_state(mask)).logits, None
        loss = _cross_entropy(logits, labels)
        if return_dict is False:
            return tuple(t for t in (loss, logits, hidden) if t is not None)
        return MaskedLMOutput(loss=loss, logits=logits, hidden_states=hidden)


# ---- RecursiveGPT / StandardGPT ------------------------------------------------------------------------------------
class RecursiveGPTConfig(_PipelineConfig):
    """pipeline.models.recursive_gpt.RecursiveGPTConfig's fields (depth: ``recurrence``, or forward's ``depth``).
    Token ids: the export's sentencepiece model (tokenizer.model; pipeline.data.tokenizer SPM_* ids)."""

    model_type = "recursive_gpt"
    model_config_cls = gpt_model.RecursiveGPTConfig

    def __init__(self, **kwargs):
        from pipeline.data.tokenizer import SPM_BOS_ID, SPM_EOS_ID, SPM_PAD_ID

        kwargs.setdefault("pad_token_id", SPM_PAD_ID)
        kwargs.setdefault("bos_token_id", SPM_BOS_ID)
        kwargs.setdefault("eos_token_id", SPM_EOS_ID)
        kwargs.setdefault("tie_word_embeddings", False)  # untied factorized maps
        kwargs.setdefault("use_cache", False)  # no KV cache: generate recomputes the prefix every step
        super().__init__(**kwargs)


class StandardGPTConfig(RecursiveGPTConfig):
    model_type = "standard_gpt"
    model_config_cls = gpt_model.StandardGPTConfig


class _CausalLM(_Wrapped, GenerationMixin):
    net_cls: type = None

    def __init__(self, config):
        super().__init__(config)
        self._adopt(self.net_cls(config.model_config()))
        self.post_init()

    def get_output_embeddings(self):
        return None  # untied; nothing for transformers to tie

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # no KV cache (below): generate must not build one

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        """No KV cache: every step runs the whole sequence so far (the pipeline model has no incremental path)."""
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    def forward(self, input_ids, attention_mask=None, depth=None, labels=None, return_dict=None, **kwargs):
        """input_ids, attention_mask: [B, L] (rows right-padded, or unpadded); depth: RecursiveGPT's R' (default
        ``recurrence``); labels: [B, L] (-100 ignored), shifted inside as transformers does -> CausalLMOutput with
        next-token logits [B, L, V]. generate: prompts of one length (no padding), no cache."""
        logits = self.net(input_ids, None if attention_mask is None else attention_mask.bool(), depth)
        loss = None
        if labels is not None:
            loss = _cross_entropy(logits[:, :-1], labels[:, 1:])
        if return_dict is False:
            return tuple(t for t in (loss, logits) if t is not None)
        return CausalLMOutput(loss=loss, logits=logits)


class RecursiveGPTForCausalLM(_CausalLM):
    config_class = RecursiveGPTConfig
    net_cls = gpt_model.RecursiveGPT


class StandardGPTForCausalLM(_CausalLM):
    config_class = StandardGPTConfig
    net_cls = gpt_model.StandardGPT


# ---- ProtLingo ------------------------------------------------------------------------------------------------------
class ProtLingoConfig(_PipelineConfig):
    """pipeline.models.protlingo.ProtLingoConfig's fields (ESM2 backbone, upcycled MoE, latent N-gram memory).
    Tokenizer: the ESM-2 alphabet (vocab.txt in the export; EsmTokenizer reads it)."""

    model_type = "protlingo"
    model_config_cls = protlingo_model.ProtLingoConfig

    def __init__(self, **kwargs):
        kwargs.setdefault("pad_token_id", 1)
        kwargs.setdefault("tie_word_embeddings", False)  # the head reads embed.weight itself: one tensor
        super().__init__(**kwargs)


class ProtLingoForMaskedLM(_Wrapped):
    config_class = ProtLingoConfig

    def __init__(self, config: ProtLingoConfig):
        super().__init__(config)
        # The reference MoE path (every expert on its own tokens): the one that runs without DeepSpeed.
        self._adopt(protlingo_model.ProtLingo(config.model_config()))
        self.post_init()

    def forward(self, input_ids, attention_mask=None, labels=None, return_dict=None, **kwargs):
        """input_ids, attention_mask: [B, L] (right-padded) -> MaskedLMOutput(loss, logits [B, L, V]); the MoE
        auxiliary losses are not part of ``loss`` (the masked-LM cross-entropy)."""
        logits = self.net(input_ids, self._mask(input_ids, attention_mask)).logits
        loss = _cross_entropy(logits, labels)
        if return_dict is False:
            return tuple(t for t in (loss, logits) if t is not None)
        return MaskedLMOutput(loss=loss, logits=logits)


def is_dense_esm(model_cfg) -> bool:
    """A ProtLingo config without MoE and memory is an ESM2: exported as transformers' EsmForMaskedLM."""
    return not model_cfg.moe_layers and not model_cfg.memory_layers


def esm_config(model_cfg, max_position_embeddings: int = 1026):
    """transformers' EsmConfig of a dense ProtLingo config (the inverse of protlingo.config_from_hf)."""
    from transformers import EsmConfig

    if not is_dense_esm(model_cfg):
        raise ValueError("model.moe_layers / model.memory_layers: an EsmForMaskedLM has neither")
    return EsmConfig(vocab_size=model_cfg.vocab_size, hidden_size=model_cfg.d_model,
                     num_hidden_layers=model_cfg.n_layers, num_attention_heads=model_cfg.n_heads,
                     intermediate_size=model_cfg.d_ff, layer_norm_eps=model_cfg.layer_norm_eps,
                     rope_theta=model_cfg.rope_theta, position_embedding_type="rotary",
                     token_dropout=model_cfg.token_dropout, mask_token_id=model_cfg.mask_token_id,
                     pad_token_id=model_cfg.pad_token_id, emb_layer_norm_before=False, hidden_act="gelu",
                     max_position_embeddings=max_position_embeddings, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, tie_word_embeddings=True)


def esm_state_dict(state: dict, model_cfg) -> dict[str, torch.Tensor]:
    """A dense ProtLingo state dict -> EsmForMaskedLM's names (protlingo._hf_names, the map hf_to_protlingo
    inverts). The decoder is tied to the embedding (not written); the contact head, which ProtLingo does not train,
    is written as zeros (regression [1, n_layers * n_heads], bias [1]), and the rotary inverse frequencies
    [head_dim / 2] as transformers computes them, so that loading initializes nothing."""
    from transformers.models.esm.modeling_esm import EsmRotaryEmbedding

    names = protlingo_model._hf_names(model_cfg.n_layers)
    extra = sorted(set(state) - set(names))
    if extra:
        raise ValueError(f"not a dense ProtLingo state dict: {extra[:3]} have no EsmForMaskedLM name")
    out = {names[k]: v for k, v in state.items()}
    dtype = state["embed.weight"].dtype
    out["esm.contact_head.regression.weight"] = torch.zeros(1, model_cfg.n_layers * model_cfg.n_heads, dtype=dtype)
    out["esm.contact_head.regression.bias"] = torch.zeros(1, dtype=dtype)
    out["esm.rotary_embeddings.inv_freq"] = EsmRotaryEmbedding.compute_default_rope_parameters(
        esm_config(model_cfg))[0]  # fp32 whatever the export's dtype, as transformers keeps it
    return out


def esm_vocab() -> list[str]:
    """EsmTokenizer's vocab.txt lines: the ESM-2 alphabet in id order (pipeline.data.protein_tokenizer.VOCAB)."""
    from pipeline.data.protein_tokenizer import VOCAB

    return list(VOCAB)


# ---- export config and registration --------------------------------------------------------------------------------
CONFIGS = {"eco_rna": EcoRNAConfig, "recursive_gpt": RecursiveGPTConfig, "standard_gpt": StandardGPTConfig,
           "protlingo": ProtLingoConfig}


def hf_config(cfg, num_loops: int | None = None):
    """The Hugging Face config of a RunConfig (the one config.json of its export holds): EsmConfig for a dense
    ProtLingo, else the family's config here. Eco-RNA: num_loops (default the trained mean depth, rounded), the
    evaluation table (data.context_length, state seed 0 as launchers/evaluate.py's default --seed) and the
    nucleotide tokenizer. ValueError for a family without HF classes (eco_rna_control)."""
    if cfg.family == "protlingo" and is_dense_esm(cfg.model):
        return esm_config(cfg.model, max(1026, cfg.data.context_length + 2))
    if cfg.family not in CONFIGS:
        raise ValueError(f"family: {cfg.family} has no Hugging Face classes (known: {', '.join(sorted(CONFIGS))})")
    arch = {"eco_rna": ["EcoRNAForMaskedLM"], "recursive_gpt": ["RecursiveGPTForCausalLM"],
            "standard_gpt": ["StandardGPTForCausalLM"], "protlingo": ["ProtLingoForMaskedLM"]}[cfg.family]
    extra = {}
    if cfg.family == "eco_rna":
        from pipeline.data.tokenizer import NucleotideTokenizer as Tok

        extra = {"num_loops": num_loops or max(1, round(trained_mean_depth(cfg.objective))),
                 "context_length": cfg.data.context_length, "molecule": cfg.data.molecule, "state_seed": 0,
                 "tokenizer": {"class": "pipeline.data.tokenizer.NucleotideTokenizer", "alphabet": cfg.data.molecule,
                               "vocab": list(Tok.vocab), "pad_id": Tok.pad_id, "cls_id": Tok.cls_id,
                               "eos_id": Tok.eos_id, "unk_id": Tok.unk_id, "mask_id": Tok.mask_id}}
    return CONFIGS[cfg.family].from_model_config(cfg.model, architectures=arch, **extra)


_REGISTERED = False


def register():
    """Make AutoConfig / AutoModel / AutoModelForMaskedLM / AutoModelForCausalLM know the classes here (idempotent;
    run on ``import pipeline.hf``)."""
    global _REGISTERED
    if _REGISTERED:
        return
    for cfg_cls in CONFIGS.values():
        AutoConfig.register(cfg_cls.model_type, cfg_cls, exist_ok=True)
    AutoModel.register(EcoRNAConfig, EcoRNAModel, exist_ok=True)
    AutoModelForMaskedLM.register(EcoRNAConfig, EcoRNAForMaskedLM, exist_ok=True)
    AutoModelForMaskedLM.register(ProtLingoConfig, ProtLingoForMaskedLM, exist_ok=True)
    AutoModelForCausalLM.register(RecursiveGPTConfig, RecursiveGPTForCausalLM, exist_ok=True)
    AutoModelForCausalLM.register(StandardGPTConfig, StandardGPTForCausalLM, exist_ok=True)
    _REGISTERED = True


register()
