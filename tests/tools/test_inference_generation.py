"""docs/inference.md's text-generation call produces new tokens even when the model's first choice is ``</s>`` (the
demo RecursiveGPT's: without ``min_new_tokens`` the call returned the prompt unchanged). Run on a tiny random
RecursiveGPT export whose end-of-sequence id is set to its first greedy choice."""
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_factory import tiny_config, write_export  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def documented_call() -> str:
    """The ``gen(...)`` line of docs/inference.md, its comment dropped."""
    calls = [ln for ln in (REPO / "docs" / "inference.md").read_text().splitlines() if ln.startswith("gen(")]
    assert len(calls) == 1, calls
    return re.sub(r"\)\s*#.*$", ")", calls[0])


def test_documented_generation_produces_new_tokens(tmp_path):
    from transformers import pipeline

    from data_prep.spm import train_spm
    from pipeline import hf
    from pipeline.families import get_family
    from pipeline.hf_code import write_modeling_code

    text = tmp_path / "text.train"
    # lowercase words: the 256 byte pieces, 4 specials and their characters fit the tiny model's 320 ids
    words = re.findall(r"[a-z]+", (REPO / "docs" / "inference.md").read_text().lower())
    text.write_text("\n".join(" ".join(words[i:i + 12]) for i in range(0, len(words), 12)))
    spm = train_spm([text], tmp_path / "spm" / "tiny", vocab_size=320)
    cfg = tiny_config(tmp_path, "recursive_gpt")
    # what tools/convert_checkpoint.py writes for a pipeline-format text export: weights, config.json, the shipped
    # modeling code, tokenizer.json (it needs a DeepSpeed checkpoint as its input; this is a random model)
    export = write_export(tmp_path / "export", cfg)
    spec = get_family(cfg.family).hf_export()
    hf.hf_config(cfg).save_pretrained(str(export))
    write_modeling_code(export, spec)
    spec.write_tokenizer(export, cfg, spm)

    gen = pipeline("text-generation", model=str(export), trust_remote_code=True)
    prompt = "Once upon a time"
    ids = gen.tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        first = int(gen.model(input_ids=ids).logits[0, -1].argmax())
    # The demo's case: its first greedy token ends the sequence.
    for name in ("config.json", "generation_config.json"):
        if (export / name).is_file():
            conf = json.loads((export / name).read_text())
            conf["eos_token_id"] = first
            (export / name).write_text(json.dumps(conf))
    gen = pipeline("text-generation", model=str(export), trust_remote_code=True)
    # the issue, reproduced: greedy decoding stops at once, on the end-of-sequence token (</s> decodes to nothing)
    plain = gen(prompt, max_new_tokens=20, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
    assert plain[ids.shape[1]:] == [first], plain

    call = documented_call()
    out = eval(call, {"gen": gen})  # noqa: S307 - the documentation's own line
    assert out[0]["generated_text"].startswith(prompt) and len(out[0]["generated_text"]) > len(prompt), (call, out)
    got = eval(call.removesuffix(")") + ", return_tensors=True)", {"gen": gen})[0]["generated_token_ids"]  # noqa: S307
    assert len(got) - ids.shape[1] == 20 and got[ids.shape[1]] != first, (call, got)
