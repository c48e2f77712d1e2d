"""Run by tests/tools/test_export_hf.py in a process that cannot import this repository: a meta-path finder refuses
``pipeline``, ``data_prep``, ``tools``, ``launchers`` and ``bench`` (the venv's editable install would otherwise find
them), the working directory is a temporary one and PYTHONPATH is unset. What is left is torch, transformers,
safetensors and tokenizers.

    python isolated_hf.py REQUESTS.json RESULTS.json

REQUESTS: [{"export": DIR, "kind": "fill-mask" | "text-generation", "inputs": [...], "targets": [...] (fill-mask),
"max_new_tokens": N (text-generation), "input_ids", "attention_mask" (lists: logits to return)}]. For each it loads
the model with trust_remote_code=True and the tokenizer with AutoTokenizer, runs the transformers pipeline and a
forward on the given ids, and writes the pipeline's outputs, the tokenizer's ids of the inputs, the model class and
the logits.
"""
import json
import sys

import no_repository  # first: the repository cannot be imported from here on


def main(requests_file: str, results_file: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer, pipeline

    no_repository.check()
    results = []
    for req in json.load(open(requests_file)):
        auto = AutoModelForCausalLM if req["kind"] == "text-generation" else AutoModelForMaskedLM
        model = auto.from_pretrained(req["export"], trust_remote_code=True).eval()
        tok = AutoTokenizer.from_pretrained(req["export"], trust_remote_code=True)
        run = pipeline(req["kind"], model=model, tokenizer=tok)
        if req["kind"] == "fill-mask":
            out = []
            for text in req["inputs"]:
                found = run(text, targets=req["targets"], top_k=len(req["targets"]))
                per_mask = [found] if isinstance(found[0], dict) else found  # one list per <mask> when several
                out.append([{d["token_str"]: d["score"] for d in mask} for mask in per_mask])
        else:
            out = [run(text, max_new_tokens=req["max_new_tokens"], do_sample=False, return_tensors=True)[0]
                   ["generated_token_ids"] for text in req["inputs"]]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(req["input_ids"]),
                           attention_mask=torch.tensor(req["attention_mask"])).logits
        results.append({"class": type(model).__name__, "module": type(model).__module__, "pipeline": out,
                        "ids": [tok(text)["input_ids"] for text in req["inputs"]], "logits": logits.tolist()})
    json.dump(results, open(results_file, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:])
