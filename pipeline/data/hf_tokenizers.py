"""The tokenizers an export carries for ``transformers.AutoTokenizer`` (tokenizer.json, read by the ``tokenizers``
library alone), built from the pipeline's own tokenizers so that both give the same ids:

* nucleotides (Eco-RNA): pipeline.data.tokenizer's 23-token vocabulary, one character one token, ``<cls> ... <eos>``
  around every sequence, lowercase (soft-masked) bases read as uppercase, and the run's molecule rule: an RNA model
  reads T as U, a DNA model U as T (data.molecule; its training data were written that way). Whitespace separates
  nothing and is dropped; a character outside the alphabet becomes ``<unk>`` (the pipeline's encode refuses it).
* sentencepiece (RecursiveGPT, the standard GPT): the run's tokenizer.model converted by transformers' own converter
  (``SpmConverter.build_tokenizer_from_spm_proto``: its normalizer spec, BPE merges ranked by piece score, byte
  fallback), ``<s>`` before every text as the causal-LM objective frames documents.
* ProtLingo keeps transformers' EsmTokenizer (protlingo_hf.write_tokenizer).
"""
from __future__ import annotations

from pathlib import Path

from pipeline.data.tokenizer import (NUM_SPECIAL, SPM_BOS_ID, SPM_EOS_ID, SPM_PAD_ID, SPM_UNK_ID, VOCAB,
                                     NucleotideTokenizer)


def nucleotide_tokenizer(molecule: str | None, model_max_length: int | None = None):
    """A PreTrainedTokenizerFast equal to NucleotideTokenizer(molecule).encode(seq, add_special=True) on every
    sequence that encode accepts (tests/pipeline/test_hf_tokenizers.py)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    NucleotideTokenizer(molecule)  # the same check of the molecule
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    rules = [normalizers.Replace(c.lower(), c) for c in VOCAB[NUM_SPECIAL:] if c.isalpha()]
    if molecule == "rna":
        rules.append(normalizers.Replace("T", "U"))
    elif molecule == "dna":
        rules.append(normalizers.Replace("U", "T"))
    tok.normalizer = normalizers.Sequence(rules)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Split(Regex("."), behavior="isolated")])
    tok.decoder = decoders.Fuse()  # one character per token: decode without separators
    tok.post_processor = processors.TemplateProcessing(
        single="<cls> $A <eos>", pair="<cls> $A <eos> $B:1 <eos>:1",
        special_tokens=[("<cls>", VOCAB.index("<cls>")), ("<eos>", VOCAB.index("<eos>"))])
    extra = {} if model_max_length is None else {"model_max_length": model_max_length}
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", cls_token="<cls>", eos_token="<eos>",
                                   unk_token="<unk>", mask_token="<mask>", sep_token="<sep>",
                                   model_input_names=["input_ids", "attention_mask"], **extra)


def sentencepiece_tokenizer(model_file: Path, model_max_length: int | None = None):
    """A PreTrainedTokenizerFast of a sentencepiece model of data_prep/spm.py (BPE, byte fallback; ids 0 <pad>,
    1 <s>, 2 </s>, 3 <unk>): the same pieces as sentencepiece's encode, ``<s>`` first (``add_bos_token=False`` at
    load, or setting the attribute, leaves it out; under transformers 5 the attribute reads False until set, since
    tokenizer.json's template decides). ``model_max_length``: the trained context."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

    model_pb2 = import_protobuf()
    proto = model_pb2.ModelProto()
    proto.ParseFromString(Path(model_file).read_bytes())
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    tok = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=True)  # a leading space kept, as spm
    pieces = [p.piece for p in proto.pieces]
    bos, eos, pad, unk = (pieces[i] for i in (SPM_BOS_ID, SPM_EOS_ID, SPM_PAD_ID, SPM_UNK_ID))
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
                                                       special_tokens=[(bos, SPM_BOS_ID)])
    # add_bos_token=True (saved in tokenizer_config.json): <s> first by default, and
    # from_pretrained(EXPORT, add_bos_token=False) rebuilds the template without it, as transformers' Llama
    # tokenizers do (lm-evaluation-harness passes it from its model_args: docs/evaluation.md)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad,
                                   unk_token=unk, model_input_names=["input_ids", "attention_mask"],
                                   add_bos_token=True, add_eos_token=False,
                                   **({} if model_max_length is None else {"model_max_length": model_max_length}),
                                   split_special_tokens=True)  # "<unk>" in a text is text, as in sentencepiece
