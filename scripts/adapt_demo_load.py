"""The last step of scripts/adapt_demo.sh: load the adapted exports with transformers' Auto classes in a process that
cannot import this repository (its own modules are refused on import), and check them against the sweeps.

    python scripts/adapt_demo_load.py NRC_EXPORT NRC_SWEEP.json SSP_EXPORT SSP_SWEEP.json TS0.csv

nRC: AutoModelForSequenceClassification, the classes it gives two sequences at K = 1 and 4. Secondary structure:
AutoModelForTokenClassification on TS0's sequences that fit the window, batched as the sweep batched them, pair
probabilities above 0.5 pooled over every sequence's L x L cells: the F1, precision and recall at K = 4 must be the
sweep's. Only torch, transformers (and its dependency yaml) and the standard library are used here.
"""
import csv
import importlib.abc
import json
import sys


class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"pipeline", "data_prep", "tools", "launchers", "bench"}:
            raise ModuleNotFoundError(f"No module named {name!r} (this process does not use the repository)")
        return None


sys.meta_path.insert(0, Refuse())


def main(nrc_export, nrc_sweep, ssp_export, ssp_sweep, ts0):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(nrc_export, trust_remote_code=True).eval()
    tok = AutoTokenizer.from_pretrained(nrc_export, trust_remote_code=True)
    seqs = ["GCGUACGGCCAUACUAUGGGGAAUACACCUGAUCCCGUCCGAUUUCAGAAGUUAAGCC",
            "GGGCUCGUAGAUCAGCGGUAGAUCGCUUCCUUCGCAAGGAAGAGGCCCUGGGUUCAAAUCCCAGCGAGUCCACCA"]
    with torch.no_grad():
        for k in (1, 4):
            logits = model(**tok(seqs, return_tensors="pt", padding=True), num_loops=k).logits
            names = [model.config.id2label[int(i)] for i in logits.argmax(-1)]
            print(f"nRC {type(model).__name__} (module {type(model).__module__}) K={k}: {names}")
    sweep = json.load(open(nrc_sweep))
    print(f"nRC sweep at K=4 on {sweep['data']}: accuracy {sweep['per_depth']['4']['accuracy']:.4f}")

    model = AutoModelForTokenClassification.from_pretrained(ssp_export, trust_remote_code=True).eval()
    tok = AutoTokenizer.from_pretrained(ssp_export, trust_remote_code=True)
    sweep = json.load(open(ssp_sweep))
    window = sweep["window"]
    rows = [r for r in csv.DictReader(open(ts0, newline="")) if len(r["sequence"]) <= window]
    import yaml  # a dependency of transformers

    batch = yaml.safe_load(open(f"{ssp_export}/config.yaml"))["eval"]["batch_size"]  # the sweep's batches
    tp = fp = fn = 0
    with torch.no_grad():
        for i in range(0, len(rows), batch):
            chunk = rows[i:i + batch]
            enc = tok([r["sequence"] for r in chunk], return_tensors="pt", padding=True)
            prob = torch.sigmoid(model(**enc, num_loops=4).logits.double())
            for b, r in enumerate(chunk):
                n = len(r["sequence"])
                ref = torch.zeros(n, n, dtype=torch.bool)
                for a, c in json.loads(r["base_pairs"]):
                    ref[a - 1, c - 1] = ref[c - 1, a - 1] = True
                pred = prob[b, 1:n + 1, 1:n + 1] > 0.5
                tp += int((pred & ref).sum())
                fp += int((pred & ~ref).sum())
                fn += int((~pred & ref).sum())
    got = {"f1": 2 * tp / (2 * tp + fp + fn), "precision": tp / max(tp + fp, 1), "recall": tp / max(tp + fn, 1)}
    want = {m: sweep["per_depth"]["4"][m] for m in got}
    print(f"ssp {type(model).__name__} at K=4 on {len(rows)} TS0 sequences: "
          + ", ".join(f"{m} {got[m]:.4f} (sweep {want[m]:.4f})" for m in got))
    if any(abs(got[m] - want[m]) > 1e-9 for m in got):
        sys.exit("error: the export's predictions differ from the sweep's")
    print("the exports load without the repository and predict what the sweeps measured")


if __name__ == "__main__":
    main(*sys.argv[1:])
