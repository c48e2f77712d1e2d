"""python tools/inspect_shards.py DIR [--samples 3] [--verify]

Prints the manifest summary (source, tokenizer, samples, tokens, residues, filtered by reason, normalization
counters, per-input counts), the first few samples decoded with the manifest's tokenizer, and with --verify checks
every shard's sha256 and sample count. A corrupt shard is one line ``inspect_shards: error: ...`` naming the shard
(and the member when one is unreadable), exit status 1.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.data.shard_reader import read_clusters, read_shard  # noqa: E402
from pipeline.data.shards import ShardError, load_manifest, sha256_file  # noqa: E402


def decoder(directory: Path, tokenizer: dict):
    """ids -> text with the tokenizer the manifest names."""
    name = tokenizer.get("name")
    if name == "sentencepiece":
        import sentencepiece as spm
        sp = spm.SentencePieceProcessor(model_file=str(directory / tokenizer["model"]))
        return lambda ids: sp.decode([int(i) for i in ids])
    vocab = tokenizer["vocab"]  # nucleotide and esm: one string per id
    shown = ["#" if t == "<sep>" else t for t in vocab]  # <sep> printed as OpenGenome2's contig split
    return lambda ids: "".join(shown[int(i)] for i in ids)


def build_parser() -> argparse.ArgumentParser:
    """main's command line, apart from main: tests parse the documented commands with it without running them."""
    ap = argparse.ArgumentParser(prog="inspect_shards.py", description=__doc__.split("\n\n")[1])
    ap.add_argument("directory", type=Path, help="a shard directory (manifest.json and its .tar shards)")
    ap.add_argument("--samples", type=int, default=3, metavar="N", help="decoded samples to print (default 3)")
    ap.add_argument("--verify", action="store_true", help="check every shard's sha256 and sample count")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    d = args.directory
    bar = None
    try:
        m = load_manifest(d)
        tok = m.tokenizer
        print(f"{d}: source {m.source}, tokenizer {tok.get('name')} "
              f"({tok.get('vocab_size', len(tok.get('vocab', [])))} tokens), {len(m.shards)} shards, "
              f"{m.total_samples} samples, {m.total_tokens} tokens")
        read = sum(i.get("records", 0) for i in m.inputs)
        print(f"  records read {read}, kept {m.total_samples}, filtered {sum(m.filtered.values())} "
              f"({', '.join(f'{k}={v}' for k, v in m.filtered.items())})")
        if m.stats:
            print(f"  stats {json.dumps(m.stats, sort_keys=True)}")
        for i in m.inputs:
            print(f"  input {i['path']}: " + ", ".join(f"{k} {v}" for k, v in i.items() if k != "path"))
        # A cluster sample (layout "clusters") holds several members: shown one after the other, " | " between.
        clusters = m.layout == "clusters"
        read = read_clusters if clusters else read_shard
        if args.samples > 0:
            decode = decoder(d, tok)
            shown = 0
            for s in m.shards:
                for key, ids, meta in read(d / s.path, s.samples):
                    text = " | ".join(decode(t) for t in ids) if clusters else decode(ids)
                    text = text if len(text) <= 120 else f"{text[:117]}..."
                    size = (f"{len(ids)} members, {sum(len(t) for t in ids)} tokens, {ids[0].dtype}" if clusters
                            else f"{len(ids)} tokens, {ids.dtype}")
                    print(f"  sample {s.path}/{key} ({size}) {json.dumps(meta)[:200]}\n"
                          f"    {text!r}")
                    shown += 1
                    if shown >= args.samples:
                        break
                if shown >= args.samples:
                    break
        if args.verify:
            from pipeline.eval.cli import progress

            # every byte of every shard is read twice (members, then sha256): minutes on a large directory
            bar = progress(total=len(m.shards), desc="verify", unit="shard")
            for s in m.shards:
                read(d / s.path, s.samples)  # first: damage that breaks a member is named by that member
                digest = sha256_file(d / s.path)
                if digest != s.sha256:
                    raise ShardError(f"{d / s.path}: sha256 {digest[:16]}... differs from the manifest's "
                                     f"{s.sha256[:16]}...")
                bar.update()
            bar.close()
            print(f"  verified {len(m.shards)} shards: sha256 and sample counts match the manifest")
    except (ShardError, FileNotFoundError, OSError) as e:
        if bar is not None:
            bar.close()  # its last frame ends its line: the error is a line of its own
        print(f"inspect_shards: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
