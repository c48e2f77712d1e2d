"""A RecursiveGPT export where the ecosystem reads it: the names in config.json (hidden_size, num_hidden_layers,
num_attention_heads, vocab_size, max_position_embeddings = the trained context), AutoModel's last_hidden_state (the
BabyLM fine-tuning's base model) with right padding and the fine-tuning's causal 3-D mask, the tokenizer's
add_bos_token, the depth the run trained at as the default of the export and of launchers/evaluate.py (train_depth !=
recurrence) with the recurrence still settable at load, and lm-evaluation-harness 0.4.13 (an optional extra: skipped
without it): the context length read from config.json, rolling log-likelihood equal to plain transformers on <s> +
text with add_bos_token=False, and its BLiMP requests decided as evaluate.py decides them with an empty target
delimiter."""
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO

sys.path.insert(0, str(REPO / "tests" / "pipeline" / "eval"))
from text_export import FIXTURES, make_export, sentencepiece  # noqa: E402

HAS_LM_EVAL = importlib.util.find_spec("lm_eval") is not None and importlib.util.find_spec("accelerate") is not None


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """(export at R = 2 trained at depth 2, export at R = 2 trained at depth 3)."""
    tmp = tmp_path_factory.mktemp("eco")
    spm = sentencepiece(tmp)
    return make_export(tmp, spm), make_export(tmp, spm, ["objective.train_depth=3"], seed=1, name="deep")


def test_config_names_and_auto_model(exports):
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    export, _ = exports
    doc = json.loads((export / "config.json").read_text())
    assert (doc["hidden_size"], doc["num_attention_heads"], doc["num_hidden_layers"], doc["vocab_size"],
            doc["max_position_embeddings"]) == (32, 2, 2, 1024, 64)
    assert doc["auto_map"]["AutoModel"] == "modeling_gpt.RecursiveGPTModel"
    cfg = AutoConfig.from_pretrained(str(export), trust_remote_code=True)
    assert cfg.hidden_size == 32 and cfg.max_position_embeddings == 64
    base = AutoModel.from_pretrained(str(export), trust_remote_code=True).eval()
    lm = AutoModelForCausalLM.from_pretrained(str(export), trust_remote_code=True).eval()
    tok = AutoTokenizer.from_pretrained(str(export), padding_side="right")
    batch = tok(["The cat sat on the mat.", "A dog."], return_tensors="pt", padding=True)
    with torch.no_grad():
        hidden = base(**batch).last_hidden_state
        logits = lm(**batch).logits
        alone = base(**tok(["A dog."], return_tensors="pt")).last_hidden_state
        causal = batch["attention_mask"].unsqueeze(1).repeat(1, batch["attention_mask"].shape[-1], 1).tril()
        hidden3 = base(input_ids=batch["input_ids"], attention_mask=causal).last_hidden_state
    assert hidden.shape == (2, batch["input_ids"].shape[1], 32)
    # the head of the causal LM reads exactly these states
    torch.testing.assert_close(lm.net.head(hidden), logits, atol=1e-5, rtol=0)
    n = int(batch["attention_mask"][1].sum())
    torch.testing.assert_close(hidden[1, :n], alone[0], atol=1e-5, rtol=0)  # right padding changes nothing real
    torch.testing.assert_close(hidden3, hidden, atol=0, rtol=0)  # the fine-tuning's --causal mask


def test_tokenizer_honours_add_bos_token(exports):
    from transformers import AutoTokenizer

    export, _ = exports
    with_bos = AutoTokenizer.from_pretrained(str(export))("The cat")["input_ids"]
    without = AutoTokenizer.from_pretrained(str(export), add_bos_token=False)("The cat")["input_ids"]
    assert with_bos[0] == 1 and with_bos[1:] == without and without[0] != 1
    tok = AutoTokenizer.from_pretrained(str(export))
    tok.add_bos_token = False
    assert tok("The cat")["input_ids"] == without
    assert AutoTokenizer.from_pretrained(str(export)).model_max_length == 64


def test_the_export_and_evaluate_default_to_the_trained_depth(exports):
    """Issue 53, acceptance 5: trained with objective.train_depth 3 at recurrence 2."""
    from transformers import AutoModelForCausalLM

    from pipeline import load_pretrained
    from pipeline.config import build_config, load_yaml
    from pipeline.families import get_family

    _, deep = exports
    doc = json.loads((deep / "config.json").read_text())
    assert (doc["recurrence"], doc["trained_recurrence"], doc["num_hidden_layers"]) == (3, 2, 3)
    cfg = build_config(load_yaml(deep / "config.yaml"))
    assert get_family(cfg.family).depth.sweep(cfg) == [3]  # launchers/evaluate.py without --depths
    model, _ = load_pretrained(deep)
    ids = torch.tensor([[1, 40, 50, 60, 70]])
    hf = AutoModelForCausalLM.from_pretrained(str(deep), trust_remote_code=True).eval()
    at8 = AutoModelForCausalLM.from_pretrained(str(deep), trust_remote_code=True, recurrence=8).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, model(ids, None, 3), atol=1e-5, rtol=0)
        assert not torch.allclose(hf(input_ids=ids).logits, model(ids, None, 2), atol=1e-3)
        torch.testing.assert_close(at8(input_ids=ids).logits, model(ids, None, 8), atol=1e-5, rtol=0)
        torch.testing.assert_close(hf(input_ids=ids, depth=5).logits, model(ids, None, 5), atol=1e-5, rtol=0)
    assert at8.config.num_hidden_layers == 8


def _plain_logprob(export: Path, ids: list[int]) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(export), trust_remote_code=True).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
    return float(sum(logp[t - 1, ids[t]] for t in range(1, len(ids))))


@pytest.mark.skipif(not HAS_LM_EVAL, reason="lm-evaluation-harness is an optional extra: pip install "
                                            "'bioseq-pretrain[lm-eval]' (lm-eval[hf]==0.4.13)")
def test_lm_eval_reads_the_context_and_scores_as_transformers(exports):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    export, _ = exports
    text = "Alice was beginning to get very tired of sitting by her sister on the bank."
    tok = AutoTokenizer.from_pretrained(str(export))
    ids = tok(text)["input_ids"]
    assert ids[0] == 1 and len(ids) < 64  # one window
    want = _plain_logprob(export, ids)
    documented = HFLM(pretrained=str(export), trust_remote_code=True, add_bos_token=False, batch_size=1,
                      device="cpu")
    assert documented.max_length == 64  # config.json's max_position_embeddings, not lm-eval's 2,048
    (got,) = documented.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    assert got == pytest.approx(want, abs=1e-4)
    default = HFLM(pretrained=str(export), trust_remote_code=True, batch_size=1, device="cpu")
    (doubled,) = default.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    assert doubled != pytest.approx(want, abs=1e-3)  # <s> <s>: what the docs warn about

    # BLiMP as lm-eval's stock task asks for it: context "", each choice after the target delimiter
    from types import SimpleNamespace

    from pipeline.checkpoint import load_trained_model
    from pipeline.eval.benchmarks import TABLE

    res = TABLE["blimp"].run(load_trained_model(export), FIXTURES / "blimp_filtered", [(2, 2)],
                             SimpleNamespace(spm=None, batch_size=64, blimp_method="full"))["per_depth"]["2"]
    ours = np.argmax(np.array(res["scores"]), axis=1)
    pairs = [json.loads(line) for f in sorted((FIXTURES / "blimp_filtered").glob("*.jsonl"))
             for line in f.read_text().splitlines()]
    decisions = {}
    for delimiter in ("", " "):
        reqs = [Instance("loglikelihood", {}, ("", delimiter + p[k]), i)
                for i, p in enumerate(pairs) for k in ("sentence_good", "sentence_bad")]
        ll = np.array([r[0] for r in documented.loglikelihood(reqs)]).reshape(-1, 2)
        decisions[delimiter] = np.argmax(ll, axis=1)
        if delimiter == "":
            np.testing.assert_allclose(ll, np.array(res["scores"]), atol=1e-4)
    assert (decisions[""] == ours).all()
    print(f"lm-eval BLiMP requests on {len(pairs)} fixture pairs: delimiter '' decides "
          f"{int((decisions[''] == ours).sum())} like evaluate.py, delimiter ' ' {int((decisions[' '] == ours).sum())}")
