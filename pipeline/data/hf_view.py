"""A shard directory as a Hugging Face ``datasets.IterableDataset``, read by the project's reader.

``shard_dataset(directory)`` yields, in manifest order, one example per record:

* sequences: ``{"id": "SHARD/KEY", "input_ids": uint ndarray [length], "meta": dict}`` (read_shard)
* clusters: ``{"id": "SHARD/KEY", "members": [uint ndarray [length], ...], "meta": dict}`` (read_clusters)

``id`` is the shard's path in the manifest and the record's key: keys restart in every shard, and the training
loader's sample ids begin the same way. The shards are the generator's ``gen_kwargs`` list, so ``datasets`` deals
whole shards to DataLoader workers and to ranks (``split_dataset_by_node``) as it does for its own files; no
``features`` are declared (meta objects differ per source), so the examples are the reader's objects as they are.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

from pipeline.data.shard_reader import read_clusters, read_shard
from pipeline.data.shards import load_manifest


def shard_dataset(directory: str | Path):
    """The records of the shard directory ``directory`` (its manifest.json) as a ``datasets.IterableDataset``."""
    try:  # only here: its import costs about a second that the rest of the project never needs
        import datasets
    except ImportError:
        raise ImportError("pipeline.data.hf_view needs Hugging Face datasets: pip install 'datasets>=3' (the "
                          "project's [hf] extra; scripts/setup.sh installs it with the tests)") from None

    directory = Path(directory)
    manifest = load_manifest(directory)
    shards = [(str(directory / s.path), s.path, s.samples) for s in manifest.shards]
    return datasets.IterableDataset.from_generator(
        _examples, gen_kwargs={"shards": shards, "clusters": manifest.layout == "clusters"})


def _examples(shards: list[tuple[str, str, int]], clusters: bool) -> Iterator[dict]:
    """The examples of ``shards`` ((file, path in the manifest, samples), a worker's share of them), in order."""
    for file, name, samples in shards:
        if clusters:
            for key, members, meta in read_clusters(file, samples):
                yield {"id": f"{name}/{key}", "members": members, "meta": meta}
        else:
            for key, tokens, meta in read_shard(file, samples):
                yield {"id": f"{name}/{key}", "input_ids": tokens, "meta": meta}
