"""Evaluation and distribution: lm-eval's `lynx` model and tasks, the results table, calibration, the Hub folder.
Everything reads the fixtures (LYNX_MMLU_PRO_PATH → tests/fixtures/mmlu_pro.jsonl), never the network."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lynx_hf import LynxCache, LynxQuantConfig
from lynx_hf.local import prefill

FIXTURES = Path(__file__).parent / "fixtures"
QUESTIONS = str(FIXTURES / "mmlu_pro.jsonl")
TEXT = str(FIXTURES / "shakespeare.txt")


@pytest.fixture(autouse=True)
def local_questions(monkeypatch):
    monkeypatch.setenv("LYNX_MMLU_PRO_PATH", QUESTIONS)


def _cli(*args, timeout=900, env=None):
    p = subprocess.run([sys.executable, "-m", "lynx_hf.cli", *args], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "LYNX_MMLU_PRO_PATH": QUESTIONS, **(env or {})})
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-3000:])
    return p


def _full_tier_greedy(model, ids, new_tokens, cfg=None, mask=None):
    """Plain greedy decoding on the Lynx full tier: the reference every Lynx path must equal."""
    kv, logits = prefill(model, ids, mask)
    cache = LynxCache.from_kv(model, ids.shape[1], kv, logits, cfg or LynxQuantConfig()).pin_tier("full")
    return model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=new_tokens, do_sample=False)


# -- tasks -----------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # indexes every lm-eval task
def test_every_task_yaml_is_indexed():
    """lm-eval skips a YAML that fails to parse without a word: every task and group in the folder must be found."""
    from lynx_hf.eval.lmeval.lm_eval_model import TASKS_DIR, task_manager

    tm = task_manager()
    names = []
    for f in Path(TASKS_DIR).glob("*.yaml"):
        body = yaml.load(f.read_text().replace("!function", ""), Loader=yaml.SafeLoader)
        names.append(body.get("group") or body.get("task"))
    assert set(names) == {"mmlu_pro_local", "mmlu_pro_longctx", *(f"mmlu_pro_longctx_{n}k" for n in (1, 2, 4, 8))}
    missing = [n for n in names if n not in tm.all_tasks]
    assert not missing, f"not indexed by lm-eval: {missing}"
    assert "mmlu_pro" in tm.all_tasks  # lm-eval's own stays reachable next to ours


def test_local_task_matches_lm_eval_prompts():
    from lm_eval.tasks.mmlu_pro import utils as stock

    from lynx_hf.eval.lmeval.tasks import lynx_mmlu_pro as mp

    docs = mp.load_local()["test"]
    qs = [json.loads(l) for l in open(QUESTIONS)]
    shot_ids = {q["question_id"] for q in qs[: mp.SHOTS]}  # the fixture is one category: its first 5 are the shots
    assert len(docs) == len(qs) - mp.SHOTS and not shot_ids & set(docs["question_id"])
    doc = docs[0]
    prompt = mp.local_prompt(doc)
    assert prompt.startswith(mp.DESCRIPTION.format(doc["category"]) + "Question:\n")
    assert prompt.endswith(stock.doc_to_text(doc))  # the question exactly as lm-eval's mmlu_pro writes it
    assert prompt.count("The answer is (") == mp.SHOTS and prompt.count("Question:\n") == mp.SHOTS + 1
    for q in qs[: mp.SHOTS]:
        assert stock.doc_to_text(q) + f" The answer is ({q['answer']}).\n\n" in prompt


def test_longctx_prompts_fill_the_context(model_and_tok):
    from lynx_hf.eval.lmeval.tasks import lynx_mmlu_pro as mp

    _, tok = model_and_tok
    docs = mp.load_longctx(context_tokens=1024)["test"]
    qs = {q["question_id"]: q for q in map(json.loads, open(QUESTIONS))}
    order = [json.loads(l)["question_id"] for l in open(QUESTIONS)]
    for doc in docs.select(range(5)):
        n = len(tok(mp.longctx_prompt(doc), add_special_tokens=False).input_ids)
        assert 1024 - 400 <= n <= 1024 + 2, n  # whole shots up to the budget (BPE joins may shift a token)
        shots = [qs[order[j]] for j in doc["shot_ids"]]
        assert doc["question_id"] not in {q["question_id"] for q in shots}
        assert all(q["category"] == doc["category"] for q in shots)
        assert mp.longctx_prompt(doc).endswith("Answer: The answer is (")
        assert mp.longctx_choices(doc) == list("ABCDEFGHIJ"[: len(doc["options"])])


# -- scoring and the lm-eval model ------------------------------------------------------------------------------------
def test_continuation_logprobs(model_and_tok):
    """The identity mode equals a plain forward pass; each codec moves the scores by its precision."""
    from lynx_hf.eval.lib.kv_modes import continuation_logprobs

    model, tok = model_and_tok
    ctx = tok((FIXTURES / "shakespeare.txt").read_text()[:1500], add_special_tokens=False).input_ids
    conts = [ctx[-40:-30], ctx[-30:-29], ctx[-29:-20]]
    with torch.inference_mode():
        plain = torch.log_softmax(model(torch.tensor([ctx + conts[0]])).logits.float(), -1)[0, len(ctx) - 1:-1]
    lp = continuation_logprobs(model, ctx, conts, "identity")
    assert [x.shape[0] for x in lp] == [10, 1, 9]
    torch.testing.assert_close(lp[0], plain, atol=2e-4, rtol=0)  # same math, another attention path
    err = {m: float((continuation_logprobs(model, ctx, conts[:1], m)[0] - plain).abs().max())
           for m in ("int8", "lynx", "int4", "kivi2")}
    assert err["int8"] < err["int4"] < err["kivi2"] and err["lynx"] < err["int4"], err
    with pytest.raises(ValueError, match="kv must be one of"):
        continuation_logprobs(model, ctx, conts, "int3")


@pytest.fixture(scope="module")
def lynx_lm(model_and_tok):
    from lynx_hf.eval.lmeval.lm_eval_model import LynxLM

    return LynxLM(kv="lynx", residual_after=3, batch_size=2)


def test_lm_eval_model_scores_through_the_codec(lynx_lm, model_and_tok):
    from lynx_hf.eval.lib.kv_modes import continuation_logprobs

    model, tok = model_and_tok
    ctx = tok("Question: What is the capital of France?\nAnswer: The answer is (", add_special_tokens=False).input_ids
    reqs = [(None, ctx, tok(c, add_special_tokens=False).input_ids) for c in ("A", "B", "Paris).")]
    got = lynx_lm._loglikelihood_tokens(reqs, disable_tqdm=True)
    for (_, c, cont), (ll, greedy) in zip(reqs, got):
        ref = continuation_logprobs(model, c, [cont], "lynx")[0]
        # the LM scores a context's continuations in one padded batch, the reference one at a time: float32
        # rounding, 1e-5 relative
        assert ll == pytest.approx(float(ref.gather(1, torch.tensor(cont)[:, None]).sum()), rel=1e-5, abs=1e-5)
        assert greedy == bool((ref.argmax(-1) == torch.tensor(cont)).all())
    with pytest.raises(ValueError, match="kv must be one of"):
        type(lynx_lm)(kv="fp4")


def test_lm_eval_rolling_loglikelihood_close_to_exact(lynx_lm, model_and_tok):
    """loglikelihood_rolling goes through the override too; at the full tier it stays within 1 % of exact KV."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    model, tok = model_and_tok
    text = (FIXTURES / "shakespeare.txt").read_text()[:2000]
    got = lynx_lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)[0]
    exact = HFLM(pretrained=model, tokenizer=tok, device="cpu").loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)[0]
    assert got == pytest.approx(exact, rel=1e-2) and got < 0


def test_lm_eval_generate_until_equals_full_tier(lynx_lm, model_and_tok):
    """A left-padded batch through LynxCache + speculative_generate: each row is full-tier greedy decoding."""
    from lm_eval.api.instance import Instance

    model, tok = model_and_tok
    texts = ["Question: Name a primary colour.\nAnswer: Let's think step by step.",
             (FIXTURES / "shakespeare.txt").read_text()[:700]]
    until = {"until": ["Question:"], "max_gen_toks": 12, "do_sample": False, "temperature": 0.0}
    reqs = [Instance("generate_until", {}, (t, until), i) for i, t in enumerate(texts)]
    got = lynx_lm.generate_until(reqs, disable_tqdm=True)
    for text, out in zip(texts, got):
        ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
        ref = tok.decode(_full_tier_greedy(model, ids, 12)[0, ids.shape[1]:])
        assert out == ref.split("Question:")[0], (out, ref)


@pytest.mark.slow  # subprocess / spawned processes
def test_eval_cli_offline_end_to_end(tmp_path):
    """`lynx-hf eval` hands over to lm-eval's CLI: both project tasks, lm-eval's table and results file."""
    p = _cli("eval", "--model", "lynx", "--model_args", "kv=lynx,residual_after=2", "--tasks",
             "mmlu_pro_local,mmlu_pro_longctx_1k", "--limit", "2", "--gen_kwargs", "max_gen_toks=8",
             "--output_path", str(tmp_path))
    assert "mmlu_pro_local" in p.stdout and "mmlu_pro_longctx_1k" in p.stdout and "exact_match" in p.stdout
    res = json.loads(next(tmp_path.rglob("results_*.json")).read_text())["results"]
    assert set(res) == {"mmlu_pro_local", "mmlu_pro_longctx_1k"} and 0 <= res["mmlu_pro_longctx_1k"]["acc,none"] <= 1


@pytest.mark.slow  # subprocess / spawned processes
@pytest.mark.parametrize("kv", ["cachegen", "lynx"])
def test_ruler_through_lynx_hf_eval_on_a_tiny_model(tmp_path, kv):
    """lm-eval's own RULER task end to end, offline, on a tiny model saved with the embedded tokenizer (RULER sizes its
    haystack with the folder's tokenizer): lm-eval's table has the task at 1024 tokens, scored in [0, 1]."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lynx_hf.model import default_tokenizer

    tok = default_tokenizer()
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    p = _cli("eval", "--model", "lynx", "--model_args", f"pretrained={tmp_path / 'm'},kv={kv},residual_after=1",
             "--tasks", "niah_single_1", "--limit", "2", "--metadata", '{"max_seq_lengths":[1024]}',
             "--gen_kwargs", "max_gen_toks=4", "--output_path", str(tmp_path / "out"))
    res = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]["niah_single_1"]
    assert 0.0 <= res["1024,none"] <= 1.0 and "niah_single_1" in p.stdout


def test_a_failed_download_is_named_in_one_line():
    """Offline, a RULER task that downloads its haystack (from the Hub's `baber/paul_graham_essays`, through
    `datasets`) fails with the ConnectionError below: `lynx-hf eval` turns such a chain into one line."""
    from lynx_hf.eval.lmeval import lm_eval_model as L

    try:
        try:
            raise ConnectionError("Couldn't reach 'baber/paul_graham_essays' on the Hub (LocalEntryNotFoundError)")
        except ConnectionError as e:
            raise RuntimeError("while building niah_single_2") from e
    except RuntimeError as e:
        assert L._is_download_error(e)
    assert not L._is_download_error(ValueError("a bug, not the network"))
    assert "ruler_qa_squad" in L.DOWNLOADS and "niah_single_1" not in L.DOWNLOADS


# -- results table, card, custom_generate ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def results_md(tmp_path_factory):
    out = tmp_path_factory.mktemp("results") / "results.md"
    _cli("results", "--questions", "2", "--contexts", "300", "--out", str(out), "--json", "--ruler-samples", "2",
         "--ruler-cells", "niah_single_1@1024", "--no-demo")
    return out


@pytest.mark.slow  # subprocess / spawned processes
def test_results_table(results_md):
    rep = json.loads(results_md.with_suffix(".json").read_text())
    c = rep["contexts"]["300"]
    assert rep["lynx_equals_full_tier"] and c["lynx_equals_full"] == c["n"] == 2
    assert set(c["rows"]) == {"bf16", "int8", "int4", "kivi2", "cachegen", "anchor", "lynx"}
    assert c["rows"]["bf16"]["agreement_bf16"] == 1.0
    assert c["rows"]["int8"]["kl"] < c["rows"]["int4"]["kl"] < c["rows"]["kivi2"]["kl"]
    assert c["rows"]["anchor"]["bits_per_value"] <= 4.6 and c["rows"]["lynx"]["bits_per_value"] <= 8.6
    assert c["rows"]["cachegen"]["bits_per_value"] < 4.5
    cell = rep["ruler"]["cells"]["niah_single_1@1024"]  # lm-eval's RULER task, offline, on the embedded tokenizer
    assert cell["n"] == cell["lynx_equals_full"] == 2 and set(cell["rows"]) == {"bf16", "int8", "int4", "kivi2",
                                                                                 "cachegen", "anchor", "lynx", "full"}
    assert cell["rows"]["bf16"]["accuracy"] == 1.0  # the 135M model finds the needle at 1K (10 of 10 measured)
    text = results_md.read_text()
    assert "| Lynx |" in text and "2 of 2" in text and "lynx-hf results --questions 2 --contexts 300" in text
    assert "| CacheGen |" in text and "RULER niah_single_1 1K" in text


def test_card_folder_and_custom_generate(results_md, tmp_path, model_and_tok):
    from huggingface_hub import ModelCard

    cfg_dir = tmp_path / "cal"
    LynxQuantConfig(alpha=1.0).save_pretrained(cfg_dir, {"kl_anchor": 0.01})
    out = tmp_path / "card"
    _cli("card", "--out", str(out), "--results", str(results_md), "--lynx-config", str(cfg_dir),
         "--residual-after", "3")
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct" and "custom_generate" in card.data.tags
    assert len(card.data.eval_results) == 7 and {r.metric_type for r in card.data.eval_results} == {"accuracy"}
    assert LynxQuantConfig.from_pretrained(out) == LynxQuantConfig(alpha=1.0)
    assert json.loads((out / "lynx_config.json").read_text())["calibration"] == {"kl_anchor": 0.01}
    assert (out / "custom_generate" / "requirements.txt").read_text().split()[0].startswith("torch")
    body = (out / "README.md").read_text()
    for says in ("cache=", "residual_after_steps", "lynx_streamer=", "num_beams"):
        assert says in body, says  # what its generate adds and refuses
    assert "pip install lynx-hf" not in body and (out / "results.md").exists()  # no pointer to what is not there
    assert {r.dataset_args["config"] for r in card.data.eval_results} == {"default"}  # a config MMLU-Pro has

    model, tok = model_and_tok
    ids = tok(["To be, or not to be, that is the question:"], return_tensors="pt").input_ids
    got = model.generate(ids, custom_generate=str(out), trust_remote_code=True, max_new_tokens=16, do_sample=False)
    assert torch.equal(got, _full_tier_greedy(model, ids, 16, LynxQuantConfig(alpha=1.0)))
    allowed = lambda b, s: [int(t) for t in range(40, 60)]  # noqa: E731 — the callable path takes it: so does this
    got = model.generate(ids, custom_generate=str(out), trust_remote_code=True, max_new_tokens=4, do_sample=False,
                         prefix_allowed_tokens_fn=allowed)
    assert got.tolist() == model.generate(ids, max_new_tokens=4, do_sample=False,
                                          prefix_allowed_tokens_fn=allowed).tolist()
    with pytest.raises(ValueError, match="assistant|assisted"):
        model.generate(ids, custom_generate=str(out), trust_remote_code=True, max_new_tokens=2,
                       assistant_model=model)


def test_the_cards_model_index_has_one_task_per_context_length():
    """huggingface_hub groups EvalResults into model-index tasks by (task type, dataset, config, split, revision):
    two context lengths must come back, through its own writer and parser, as two tasks with their own metrics
    (before: one task holding both lengths' accuracies under one name each, twice)."""
    from huggingface_hub import ModelCardData
    from huggingface_hub.repocard_data import model_index_to_eval_results

    from lynx_hf.eval.tools.card import eval_results

    rows = {m: {"accuracy": a} for m, a in (("bf16", 0.5), ("lynx", 0.4))}
    report = {"contexts": {"512": {"rows": rows}, "1024": {"rows": {m: {"accuracy": a / 2} for m, a in
                                                                     (("bf16", 0.5), ("lynx", 0.4))}}}}
    data = ModelCardData(model_name="m-lynx", eval_results=eval_results(report)).to_dict()
    tasks = data["model-index"][0]["results"]
    assert len(tasks) == 2
    for t in tasks:
        names = [m["name"] for m in t["metrics"]]
        assert len(names) == len(set(names)) == 2
    _, parsed = model_index_to_eval_results(data["model-index"])
    by_task = {(r.task_name, r.metric_name): r.metric_value for r in parsed}
    assert by_task[("MMLU-Pro, many-shot 1024-token context", "accuracy, KV Lynx")] == 0.2
    assert by_task[("MMLU-Pro, many-shot 512-token context", "accuracy, KV BF16")] == 0.5


# -- calibration and the config file -----------------------------------------------------------------------------------
def test_search_finds_the_separable_optimum_within_budget():
    from lynx_hf.eval.tools.calibrate import search

    want = {"alpha": 2.0, "chunk_size": 32, "value_axis": "channel"}
    calls = []

    def score(cfg):
        calls.append(cfg)
        miss = sum(getattr(cfg, k) != v for k, v in want.items())
        return {"objective": (miss, 0.0)}

    best, s, hist = search(score, LynxQuantConfig(), budget=100)
    assert all(getattr(best, k) == v for k, v in want.items()) and s["objective"][0] == 0
    assert len(calls) == len(hist) == len({json.dumps(c.to_dict(), sort_keys=True) for c in calls})  # no repeats
    _, _, hist = search(score, LynxQuantConfig(), budget=3)
    assert len(hist) == 3


@pytest.mark.slow  # subprocess / spawned processes
def test_calibrate_cli_writes_a_loadable_config(tmp_path):
    p = _cli("calibrate", "--budget", "3", "--contexts", "64", "96", "--gen", "4", "--text", TEXT,
             "--out", str(tmp_path), "--json")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["evaluated"] == 3 and r["kl_anchor"] <= r["default"]["kl_anchor"]
    assert r["kept"] in ("searched", "default") and set(r["held_out"]) == {"searched", "default"}
    if r["kept"] == "default":  # the searched setting lost on the held-out text
        assert r["config"] == LynxQuantConfig().to_dict()
        assert r["held_out"]["searched"]["kl_anchor"] >= r["held_out"]["default"]["kl_anchor"] or \
            r["held_out"]["searched"]["accepted_prefix"] < r["held_out"]["default"]["accepted_prefix"]
    assert LynxQuantConfig.from_pretrained(tmp_path).to_dict() == r["config"]


def test_config_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no lynx_config.json"):
        LynxQuantConfig.from_pretrained(tmp_path / "nothing")
    (tmp_path / "lynx_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        LynxQuantConfig.from_pretrained(tmp_path)
    (tmp_path / "lynx_config.json").write_text(json.dumps({"alpha": 1.0, "wings": 2}))
    with pytest.raises(ValueError, match="unknown fields"):
        LynxQuantConfig.from_pretrained(tmp_path)


def test_the_paired_bootstrap_says_which_code_is_lower():
    from lynx_hf.eval.quality.anchor_widths import p_le

    lo, hi = [0.1 * (i % 3) for i in range(30)], [0.1 * (i % 3) + 0.05 for i in range(30)]
    assert p_le(lo, hi) == 1.0 and p_le(hi, lo) == 0.0
    assert p_le(lo, lo) == 0.5  # the same values: every resample a tie
    assert 0.3 < p_le(lo, lo[::-1]) < 0.7  # the same values in another order: a tie the data cannot split
