"""Eco-RNA's Hugging Face classes: EcoRNAConfig ("eco_rna"), EcoRNAForMaskedLM (AutoModelForMaskedLM) and EcoRNAModel
(AutoModel); for adapted models (docs/adaptation.md) EcoRNATaskConfig ("eco_rna_task"),
EcoRNAForSequenceClassification (AutoModelForSequenceClassification: nRC) and EcoRNAForTokenClassification
(AutoModelForTokenClassification: per-token outputs, a pair head's or a reactivity head's). Registered by
pipeline/hf.py, and shipped in every export with the modules they import (pipeline/hf_code.py), so that the export
loads where this repository is not installed:

    from transformers import AutoModelForMaskedLM
    model = AutoModelForMaskedLM.from_pretrained("exports/eco_rna_demo", trust_remote_code=True)

This module imports torch, transformers and pipeline.models only (the shipped copy must run without the rest).

The deterministic convention (what ``launchers/evaluate.py`` does, so HF logits equal the pipeline's): every row runs
``num_loops`` core iterations from the evaluation initial state, the first L rows of the seed-fixed table
``pipeline.models.eco_rna.state_table(model config, context_length, state_seed)`` (zero at padding).
"""
from __future__ import annotations

import torch
from transformers.modeling_outputs import (BaseModelOutput, MaskedLMOutput, SequenceClassifierOutput,
                                          TokenClassifierOutput)

from pipeline.families.hf_base import PipelineConfig, Wrapped, cross_entropy
from pipeline.models.eco_rna import EcoRNA, initial_state, state_table
from pipeline.models.eco_rna import EcoRNAConfig as ModelConfig
from pipeline.models.heads import TaskModel, build_head


class EcoRNAConfig(PipelineConfig):
    """pipeline.models.eco_rna.EcoRNAConfig's fields, plus:

    num_loops: core iterations K when forward is not given one (convert_checkpoint: the trained mean depth E[K],
        rounded); task_depths: {task: K} chosen per task (tools/choose_depth.py); state_seed, context_length: the
        evaluation initial-state table (module docstring); molecule and tokenizer: the nucleotide tokenizer
        (pipeline.data.tokenizer.NucleotideTokenizer(molecule); ``tokenizer`` lists its vocabulary and special ids).
    """

    model_type = "eco_rna"
    model_config_cls = ModelConfig

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


class EcoRNAPreTrainedModel(Wrapped):
    config_class = EcoRNAConfig
    main_input_name = "input_ids"

    def __init__(self, config: EcoRNAConfig):
        super().__init__(config)
        self._adopt(EcoRNA(config.model_config()))
        self._tables = {}  # length -> initial-state table [length, d] (fp32, CPU)
        self.post_init()

    def initial_state(self, mask: torch.Tensor) -> torch.Tensor:
        """s0 [B, L, d]: the evaluation convention (module docstring); longer inputs than context_length get a table
        of their own length (the pipeline never evaluates those)."""
        n = max(self.config.context_length, mask.shape[1])
        if n not in self._tables:
            self._tables[n] = state_table(self.net.cfg, n, self.config.state_seed)
        return initial_state(self.net.cfg, mask, table=self._tables[n])

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
        loss = cross_entropy(logits, labels)
        if return_dict is False:
            return tuple(t for t in (loss, logits, hidden) if t is not None)
        return MaskedLMOutput(loss=loss, logits=logits, hidden_states=hidden)


# ---- adapted models: the backbone and a task head (pipeline/models/heads.py TaskModel) -----------------------------
class EcoRNATaskConfig(EcoRNAConfig):
    """EcoRNAConfig's fields plus the task head: ``task`` (its name) and ``head`` ({"name": a class of
    pipeline.models.heads, "kwargs": its arguments, "first": whether it reads the first-iteration features});
    ``id2label`` names the head's outputs (nRC classes, reactivity probes)."""

    model_type = "eco_rna_task"

    def __init__(self, task: str = "", head: dict | None = None, **kwargs):
        self.task = task
        self.head = dict(head or {})
        super().__init__(**kwargs)


class EcoRNATaskPreTrainedModel(Wrapped):
    """The adapted model: the pipeline's TaskModel (``backbone.*`` and ``head.*``, the training's names); its depth
    is selectable at every call (``num_loops``, default config.num_loops) from the evaluation initial state, as
    ``launchers/evaluate.py --task`` sweeps it."""

    config_class = EcoRNATaskConfig
    main_input_name = "input_ids"
    head_names: tuple = ()  # the heads this class serves (a head of another kind is refused at load)

    def __init__(self, config: EcoRNATaskConfig):
        super().__init__(config)
        if config.head.get("name") not in self.head_names:
            raise ValueError(f"{type(self).__name__} serves {' and '.join(self.head_names)} heads; this model's "
                             f"head is {config.head.get('name')!r} (task {config.task!r}): load it with the Auto "
                             "class its config.json's architectures names")
        self._adopt(TaskModel(EcoRNA(config.model_config()), build_head(config.head["name"], config.head["kwargs"]),
                              first=bool(config.head.get("first"))))
        self._tables = {}
        self.post_init()

    def get_input_embeddings(self):
        return self.backbone.embed

    def predict(self, input_ids, attention_mask=None, num_loops=None) -> torch.Tensor:
        """The head's output with every row at depth K = num_loops (default config.num_loops)."""
        K = self.config.num_loops if num_loops is None else int(num_loops)
        if K < 1:
            raise ValueError(f"num_loops: must be >= 1, got {K}")
        mask = self._mask(input_ids, attention_mask)
        n = max(self.config.context_length, mask.shape[1])
        if n not in self._tables:
            self._tables[n] = state_table(self.net.backbone.cfg, n, self.config.state_seed)
        s0 = initial_state(self.net.backbone.cfg, mask, table=self._tables[n]).to(self.backbone.embed.weight.device)
        return self.net.at_depths(input_ids, mask, [K], s0)[K]


class EcoRNAForSequenceClassification(EcoRNATaskPreTrainedModel):
    head_names = ("SequenceClassifier",)

    def forward(self, input_ids, attention_mask=None, num_loops=None, labels=None, return_dict=None, **kwargs):
        """-> SequenceClassifierOutput(loss: cross-entropy against ``labels`` [B], logits [B, num_labels])."""
        logits = self.predict(input_ids, attention_mask, num_loops)
        loss = cross_entropy(logits, labels)
        if return_dict is False:
            return tuple(t for t in (loss, logits) if t is not None)
        return SequenceClassifierOutput(loss=loss, logits=logits)


class EcoRNAForTokenClassification(EcoRNATaskPreTrainedModel):
    """Per-token outputs: the pair head's logits [B, L, L] (token i's row holds its logits of pairing with every
    token; sigmoid > 0.5 is a predicted pair) or the reactivity head's values [B, L, P] (id2label names the
    probes)."""

    head_names = ("PairHead", "ReactivityHead")

    def forward(self, input_ids, attention_mask=None, num_loops=None, return_dict=None, **kwargs):
        logits = self.predict(input_ids, attention_mask, num_loops)
        if return_dict is False:
            return (logits,)
        return TokenClassifierOutput(logits=logits)
