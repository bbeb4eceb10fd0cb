"""A chat UI's threaded streamer ends however speculative_generate ends (issue 53): EOS at the first, a middle or
the last allowed token, max_new_tokens, a stop string, a residual that never comes, an exception. Each case runs
generate in a thread while this thread iterates a `TextIteratorStreamer` (timeout 30 s): the loop must end,
`end()` must have been called exactly once, and where the run completes the text equals plain `generate`'s
(identity codec: drafting and the full tier are the model's own KV). Two ways in: `model.generate(...,
custom_generate=speculative_generate, lynx_streamer=st)` and the Hub folder's `generate(..., streamer=st)`."""
import threading

import pytest
import torch
import transformers as tf
from transformers import TextIteratorStreamer

import lynx_hf
from lynx_hf import LoaderError, LynxCache, LynxQuantConfig
from test_exactness import word_tokenizer

P, N = 24, 8
IDENTITY = LynxQuantConfig(method="identity")


class Counted(TextIteratorStreamer):
    def __init__(self, tok):
        super().__init__(tok, skip_prompt=True, timeout=30)
        self.ends = 0

    def end(self):
        self.ends += 1
        super().end()


def chat(model, tok, ids, route: str, after=3, stuck=False, **gen):
    """(text the consumer's loop read, end() calls, the generate thread's error or None)."""
    st = Counted(tok)
    errors = []

    def run():
        try:
            if route == "hub":
                from lynx_hf.hub import hub_generate

                hub_generate(model, IDENTITY.to_dict(), ids, residual_after_steps=after, streamer=st, **gen)
                return
            config = LynxQuantConfig() if stuck else IDENTITY  # (the identity codec sends no residual)
            cache, _ = LynxCache.from_prefill(model, ids, config, residual_after_steps=after)
            if stuck:  # the residual never comes: the wait for it times out
                cache.loader._released, cache.timeout_s = True, 0.5
            model.generate(ids, cache=cache, custom_generate=lynx_hf.speculative_generate, lynx_streamer=st, **gen)
        except Exception as e:  # noqa: BLE001 — handed to the test
            errors.append(e)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    text = "".join(st)  # raises queue.Empty after 30 s if end() never comes
    th.join(30)
    assert not th.is_alive()
    return text, st.ends, errors[0] if errors else None


def plain_text(model, tok, ids, **gen) -> str:
    return tok.decode(model.generate(ids, **gen)[0, P:])


@pytest.fixture(scope="module")
def setup(tiny):
    tok = word_tokenizer(96)  # the tiny model's vocabulary; decoding concatenates
    ids = torch.randint(3, 96, (1, P), generator=torch.Generator().manual_seed(11))
    gen = tiny.generate(ids, max_new_tokens=N, do_sample=False, eos_token_id=None)[0, P:].tolist()
    return tok, ids, gen


def _eos_cases(gen):
    """EOS ids that end generation at the first, a middle and the last allowed token (each its first occurrence)."""
    first_at = {}
    for i, t in enumerate(gen):
        first_at.setdefault(t, i)
    at = sorted(first_at.values())
    return {"first": gen[at[0]], "middle": gen[at[len(at) // 2]], "last": gen[at[-1]]}


@pytest.mark.parametrize("route", ["lynx_streamer", "hub"])
@pytest.mark.parametrize("after", [0, 3, 100])
def test_eos_at_any_step_and_max_new_tokens_end_the_loop_once_with_plain_generates_text(tiny, setup, route, after):
    tok, ids, gen = setup
    cases = {"max_new_tokens": None, **_eos_cases(gen)}
    assert gen.index(cases["last"]) == N - 1 or len(set(gen)) < N  # the last case is EOS at the last allowed token
    for name, eos in cases.items():
        kw = dict(max_new_tokens=N, do_sample=False, eos_token_id=eos, pad_token_id=0)
        text, ends, err = chat(tiny, tok, ids, route, after=after, **kw)
        assert err is None and ends == 1, (name, err, ends)
        assert text == plain_text(tiny, tok, ids, **kw) and text, name


@pytest.mark.parametrize("route", ["lynx_streamer", "hub"])
def test_a_stop_string_ends_the_loop_once_where_plain_generate_stops(tiny, setup, route):
    tok, ids, gen = setup
    stop = tok.convert_ids_to_tokens(gen[3])
    want = plain_text(tiny, tok, ids, max_new_tokens=N, do_sample=False, eos_token_id=None, stop_strings=[stop],
                      tokenizer=tok)
    kw = dict(max_new_tokens=N, do_sample=False, eos_token_id=None)
    full = plain_text(tiny, tok, ids, **kw)
    if route == "hub":
        kw.update(stop_strings=[stop], tokenizer=tok)
    else:
        kw["stopping_criteria"] = tf.StoppingCriteriaList([tf.StopStringCriteria(tok, [stop])])
    text, ends, err = chat(tiny, tok, ids, route, **kw)
    assert err is None and ends == 1 and text == want and len(want) < len(full)


def test_refused_stop_strings_a_residual_that_never_comes_and_an_exception_end_the_loop_once(tiny, setup):
    tok, ids, gen = setup
    kw = dict(max_new_tokens=N, do_sample=False, eos_token_id=None)
    # refused before the first token: stop_strings need a tokenizer a callable custom_generate is never handed
    text, ends, err = chat(tiny, tok, ids, "lynx_streamer", stop_strings=["w5"], tokenizer=tok, **kw)
    assert isinstance(err, ValueError) and "StopStringCriteria" in str(err) and ends == 1 and text == ""
    # the Hub folder's refusals before speculative_generate takes the streamer
    text, ends, err = chat(tiny, tok, ids, "hub", assistant_model=tiny, **kw)
    assert isinstance(err, ValueError) and "assistant_model" in str(err) and ends == 1 and text == ""
    text, ends, err = chat(tiny, tok, ids, "hub", stop_strings=["w5"], **kw)
    assert isinstance(err, ValueError) and "tokenizer=" in str(err) and ends == 1 and text == ""
    # drafts on the anchor tier, then the residual never comes: the wait times out, the loop ends
    text, ends, err = chat(tiny, tok, ids, "lynx_streamer", after=3, stuck=True, **kw)
    assert isinstance(err, LoaderError) and "timed out" in str(err) and ends == 1
    assert plain_text(tiny, tok, ids, **kw).startswith(text)  # at most the first token: drafts are never final

    class Boom(tf.StoppingCriteria):  # raises once three tokens are out
        def __call__(self, input_ids, scores, **k):
            if input_ids.shape[1] >= P + 3:
                raise RuntimeError("boom")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    for route in ("lynx_streamer", "hub"):
        text, ends, err = chat(tiny, tok, ids, route, stopping_criteria=tf.StoppingCriteriaList([Boom()]), **kw)
        assert isinstance(err, RuntimeError) and "boom" in str(err) and ends == 1, route
        assert plain_text(tiny, tok, ids, **kw).startswith(text), route
