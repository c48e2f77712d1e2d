"""Run by tests/pipeline/tasks/test_task_models.py and the fine-tuning test in a process that cannot import this
repository (the meta-path finder of tests/tools/isolated_hf.py): an adapted export loads with the transformers Auto
class its task names, its tokenizer with AutoTokenizer, and returns its logits at several depths.

    python isolated_task_hf.py REQUESTS.json RESULTS.json

REQUESTS: [{"export": DIR, "auto": "AutoModelForSequenceClassification" | "AutoModelForTokenClassification",
"inputs": [sequences], "depths": [K, ...], "wrong": another Auto class name or null}]. For each it writes the model
class, the tokenizer's input ids and attention mask, the logits at each depth (nested lists) and, with "wrong", the
error that loading with that class raised.
"""
import json
import sys

import no_repository  # first: the repository cannot be imported from here on


def main(requests_file: str, results_file: str):
    import torch
    import transformers
    from transformers import AutoTokenizer

    no_repository.check()
    results = []
    for req in json.load(open(requests_file)):
        model = getattr(transformers, req["auto"]).from_pretrained(req["export"], trust_remote_code=True).eval()
        tok = AutoTokenizer.from_pretrained(req["export"], trust_remote_code=True)
        enc = tok(req["inputs"], return_tensors="pt", padding=True)
        with torch.no_grad():
            logits = {str(k): model(**enc, num_loops=k).logits.tolist() for k in req["depths"]}
        wrong = None
        if req.get("wrong"):
            try:
                getattr(transformers, req["wrong"]).from_pretrained(req["export"], trust_remote_code=True)
            except ValueError as e:
                wrong = str(e)
        results.append({"class": type(model).__name__, "module": type(model).__module__,
                        "input_ids": enc["input_ids"].tolist(), "attention_mask": enc["attention_mask"].tolist(),
                        "logits": logits, "id2label": model.config.id2label, "wrong": wrong})
    json.dump(results, open(results_file, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:])
