"""Do a source's shards fit the model? Checked once per source when a run starts, before anything trains.

A shard directory's manifest names the tokenizer its ids come from (``tokenizer`` entry, written by data_prep):

* ``{"name": "nucleotide", "vocab": [23 tokens], "alphabet": ...}`` (rnacentral, opengenome2, fasta): the ids of
  pipeline/data/tokenizer.py, read by the Eco-RNA families (|V| = 23);
* ``{"name": "esm", "vocab": [33 tokens]}`` (uniref): the ESM-2 ids of pipeline/data/protein_tokenizer.py, read by
  ProtLingo (|V| = 33);
* ``{"name": "sentencepiece", "vocab_size": V, "pad_id": 0, "bos_id": 1, "eos_id": 2, "unk_id": 3, ...}``
  (babylm --spm): a sentencepiece model's ids, read by the causal LMs (RecursiveGPT, StandardGPT).

Which kind a family reads is its spec's ``tokenizer`` (pipeline/families).

Shards fit a model when their tokenizer is the family's kind, its id table is the one this code numbers by (the
character vocabularies must equal ours entry for entry; a sentencepiece model must use our special ids) and every
id is below ``model.vocab_size`` (a model may have more rows than the tokenizer has ids, never fewer). Protein
shards under an Eco-RNA model, or a 32768-piece model under a 2048-row embedding, fail here with one line naming
the config key and the shard directory, instead of training on wrong ids or crashing mid-run in the embedding.

Sources given as brace URLs (``dir/x-{000000..000007}.tar``) have no manifest and are not checked here; the loader
still refuses any id >= ``model.vocab_size`` as it reads a sample (ShardStream ``vocab_size``).
"""
from __future__ import annotations

from pathlib import Path

from pipeline import commands
from pipeline.errors import ConfigError
from pipeline.data import protein_tokenizer, tokenizer
from pipeline.data.shards import MANIFEST, Manifest, ShardError

# What each kind is and which data_prep command writes it (after the running python, pipeline.commands): the
# error says how to get fitting shards.
KINDS = {
    "nucleotide": ("nucleotide", "-m data_prep rnacentral|opengenome2|fasta"),
    "esm": ("ESM-2 amino-acid", "-m data_prep uniref"),
    "sentencepiece": ("sentencepiece text", "-m data_prep babylm --spm MODEL"),
}
_VOCABS = {"nucleotide": list(tokenizer.VOCAB), "esm": list(protein_tokenizer.VOCAB)}
_SPM_IDS = {"pad_id": tokenizer.SPM_PAD_ID, "bos_id": tokenizer.SPM_BOS_ID, "eos_id": tokenizer.SPM_EOS_ID,
            "unk_id": tokenizer.SPM_UNK_ID}


def shard_vocab(manifest: Manifest, where: str | Path) -> tuple[str, int]:
    """(tokenizer kind, number of ids) of a manifest's tokenizer entry. ShardError naming ``where`` (the manifest
    file) when the entry is not one data_prep writes, or numbers its tokens differently from this code."""
    entry = manifest.tokenizer
    kind = entry.get("name") if isinstance(entry, dict) else None
    if kind not in KINDS:
        raise ShardError(f"{where}: tokenizer {kind!r} is not one the loader knows (expected one of "
                         f"{', '.join(KINDS)})")
    if kind in _VOCABS:
        vocab = entry.get("vocab")
        if vocab != _VOCABS[kind]:
            n = len(vocab) if isinstance(vocab, list) else None
            raise ShardError(f"{where}: the {kind} tokenizer's vocabulary ({n} tokens) differs from the "
                             f"{len(_VOCABS[kind])}-token table the models are numbered by; rebuild the shards "
                             "with this version's data_prep")
        return kind, len(vocab)
    size = entry.get("vocab_size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ShardError(f"{where}: the sentencepiece tokenizer entry has no vocab_size (got {size!r})")
    for name, want in _SPM_IDS.items():
        if name in entry and entry[name] != want:
            raise ShardError(f"{where}: the sentencepiece model's {name} is {entry[name]!r}, the models expect "
                             f"{want}; train it with `{commands.python()} -m data_prep train-spm`")
    return kind, size


def check_shards_fit(spec: str | Path, family, vocab_size: int, key: str) -> None:
    """Refuse a source whose shards the model cannot read: ConfigError ``KEY: SPEC: ...`` (one line naming the
    config key, e.g. ``data.train_shards`` or ``data.sources[rna].shards``, and the shard directory) when the
    manifest's tokenizer is not the kind ``family`` reads (``family``: the model family's spec,
    pipeline.families.Family, read for its ``name`` and ``tokenizer`` kind; this layer does not import it), or has more ids than ``vocab_size`` (model.vocab_size).
    A missing or unreadable manifest, or a tokenizer entry this code does not know, raises load_manifest's
    FileNotFoundError / ShardError naming the manifest. Brace-URL specs have no manifest: nothing is checked (the
    loader checks each id as it reads, see the module docstring)."""
    from pipeline.data.streams import is_url_pattern

    spec = str(spec)
    if is_url_pattern(spec):
        return
    want = family.tokenizer
    if want not in KINDS:
        raise ConfigError(f"family: {family.name}'s tokenizer kind {want!r} is not one the loader knows (known: "
                          f"{', '.join(KINDS)})")
    from pipeline.data.remote import is_remote, join, manifest_of

    manifest = manifest_of(spec)
    kind, n = shard_vocab(manifest, join(spec, MANIFEST) if is_remote(spec) else Path(spec) / MANIFEST)
    if kind != want:
        have_name, want_name = KINDS[kind][0], KINDS[want][0]
        raise ConfigError(f"{key}: {spec} holds {have_name} tokens (manifest tokenizer {kind!r}), but the {family} "
                          f"model reads {want_name} tokens; point {key} at shards made by `{commands.python()} {KINDS[want][1]}`")
    if n > vocab_size:
        raise ConfigError(f"{key}: {spec}: its {kind} tokenizer has {n} ids, more than model.vocab_size "
                          f"{vocab_size} (ids {vocab_size}..{n - 1} have no embedding row); set "
                          f"model.vocab_size={n} or use shards of a smaller tokenizer")
