"""speculative_generate's control flow with a scripted fake model whose next token depends on the KV tier, in
milliseconds: residual arriving mid-draft, EOS among drafts (rejected and accepted), length limits, one row
finishing early, a loader failing mid-draft, stats and the provisional stream."""
import threading
from types import SimpleNamespace

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList

from lynx_hf import LoaderError, LynxCache, LynxQuantConfig as Q, SpecConfig, SpeculativeStreamer, speculative_generate
from lynx_hf.local import InProcessLoader

P, V, EOS, PAD = 6, 16, 1, 0


class ScriptedLM:
    """Generated token g of row b is full[b][g] on the full tier and anchor[b][g] on the anchor tier (g = 0 is the
    prefill's first token), whatever came before: a fake causal LM over a one-layer LynxCache. An anchor entry
    (best, runner_up) is a near-tie (logits 10 and 9.9). Positions come from position_ids when given (tree passes)."""

    def __init__(self, full, anchor):
        self.full, self.anchor = full, anchor
        self.config = SimpleNamespace(_attn_implementation="sdpa")  # takes custom 4D masks (and ignores them)
        self.lynx_tree_inputs = True  # positions from position_ids: no probe (support.honours_tree_inputs)
        self.forwards = []  # (tier, number of new tokens)
        self.masks = []  # per forward: None, 2 (a padding mask) or 4 (the engine's own masks)

    def __call__(self, input_ids, cache, use_cache=True, logits_to_keep=1, **kw):
        B, n = input_ids.shape
        start = cache.get_seq_length()
        kv = torch.zeros(B, 1, n, 2)
        cache.update(kv, kv, 0)
        tier = cache.layers[0].tier
        script = self.full if tier == "full" else self.anchor
        self.forwards.append((tier, n))
        am = kw.get("attention_mask")
        self.masks.append(None if am is None else 4 if isinstance(am, dict) or am.dim() == 4 else 2)
        pos = kw.get("position_ids")  # tree passes: per-node positions
        logits = torch.full((B, n, V), -10.0)
        for b in range(B):
            for j in range(n):
                g = (int(pos[b, j]) if pos is not None else start + j) + 1 - P  # the generated index predicted
                top = script[b][g]
                if isinstance(top, tuple):  # (best, runner-up): a near-tie
                    logits[b, j, top[1]] = 9.9
                    top = top[0]
                logits[b, j, top] = 10.0
        return SimpleNamespace(logits=logits[:, -logits_to_keep:])


class FailingLoader(InProcessLoader):
    def on_draft(self, n):
        if n >= 2:
            self.cache.fail(ConnectionError("peer vanished mid-residual"))


CHAIN = SpecConfig(tree_width=1, tree_branch=1)


def generate(full, anchor, after, max_new, eos=None, streamer=None, loader=InProcessLoader, spec=None, model=None,
             do_sample=False):
    B = len(full)
    model = model or ScriptedLM(full, anchor)
    cache = LynxCache(1, P, Q(), timeout_s=5)
    g = torch.Generator().manual_seed(0)
    loader([(torch.randn(B, 1, P, 2, generator=g), torch.randn(B, 1, P, 2, generator=g))], Q(),
           residual_after_steps=after).attach(cache)
    cache.put_logits(torch.stack([torch.nn.functional.one_hot(torch.tensor(r[0]), V).float() * 20 for r in full]))
    gc = GenerationConfig(max_new_tokens=max_new, do_sample=do_sample, pad_token_id=PAD, eos_token_id=eos)
    gc._pad_token_tensor = torch.tensor(PAD)
    sc = StoppingCriteriaList([MaxLengthCriteria(P + max_new)] + ([EosTokenCriteria(eos)] if eos is not None else []))
    ids = torch.full((B, P), 5)
    out = speculative_generate(model, ids, LogitsProcessorList(), sc, gc, cache=cache, lynx_streamer=streamer,
                               spec_config=spec)
    return out[:, P:].tolist(), cache.stats, model


FULL = [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]


def test_residual_mid_draft_keeps_the_agreeing_prefix_and_corrects():
    anchor = [[2, 3, 9, 5, 6, 7, 8, 9, 10, 11, 12, 13]]  # wrong at g = 2
    got, st, m = generate([FULL], anchor, after=4, max_new=8)
    assert got == [FULL[:8]]
    assert (st["drafted"], st["accepted"], st["rounds"]) == (4, 1, 1)  # drafts g=1..4; g=1 stands, g=2 corrected
    assert st["draft_stop"] == "residual"  # the residual landed after the 4th step
    # one verification pass over [first token, 4 drafts], then one decode step per remaining token
    assert m.forwards == [("anchor", 1)] * 4 + [("full", 5)] + [("full", 1)] * 5


def test_all_drafts_accepted_gives_the_bonus_token():
    got, st, m = generate([FULL], [FULL], after=3, max_new=5)
    assert got == [FULL[:5]] and (st["drafted"], st["accepted"]) == (3, 3)
    assert m.forwards == [("anchor", 1)] * 3 + [("full", 4)]  # first + 3 drafts + bonus = 5: no decode step


def test_eos_drafted_on_the_anchor_tier_is_rejected():
    anchor = [[2, 3, EOS, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
    got, st, _ = generate([FULL], anchor, after=6, max_new=6, eos=EOS)
    assert got == [FULL[:6]]
    assert (st["drafted"], st["accepted"]) == (2, 1)  # drafting stopped at the EOS draft, which was rejected
    assert st["draft_stop"] == "drafted out"  # an EOS node is never expanded: no frontier left


def test_eos_accepted_as_the_last_draft_ends_generation_and_counts():
    full = [[2, 3, EOS, 5, 6, 7, 8, 9]]
    s = SpeculativeStreamer()
    got, st, _ = generate(full, full, after=6, max_new=8, eos=EOS, streamer=s)
    assert got == [[2, 3, EOS]]
    assert (st["drafted"], st["accepted"]) == (2, 2)
    assert s.final == [2, 3, EOS] and ("retract", []) in s.events and s.events[-1] == ("end", [])


def test_length_limit_bounds_the_drafts():
    got, st, _ = generate([FULL], [FULL], after=10, max_new=3)
    assert got == [FULL[:3]] and (st["drafted"], st["accepted"]) == (2, 2)


def test_max_new_tokens_one_needs_no_kv():
    got, st, m = generate([FULL], [FULL], after=10, max_new=1)
    assert got == [FULL[:1]] and m.forwards == [] and st["drafted"] == 0


def test_one_row_finishing_at_its_first_token_is_padded():
    full = [FULL, [EOS, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
    anchor = [[2, 3, 4, 9, 6, 7, 8, 9, 10, 11, 12, 13], full[1]]
    got, st, _ = generate(full, anchor, after=4, max_new=7, eos=EOS)
    assert got == [FULL[:7], [EOS] + [PAD] * 6]
    assert st["accepted"] == 2  # row 0 rejects g = 3; the finished row does not count


def test_provisional_stream_retracts_rejected_drafts():
    anchor = [[2, 3, 9, 9, 6, 7, 8, 9, 10, 11, 12, 13]]
    s = SpeculativeStreamer()
    got, _, _ = generate([FULL], anchor, after=3, max_new=6, streamer=s)
    assert s.final == got[0] == FULL[:6]  # the first generated token included
    assert [e for e in s.events if e[0] in ("provisional", "retract")] == [
        ("provisional", [3]), ("provisional", [9]), ("provisional", [9]), ("retract", [9, 9])]


def test_loader_failure_mid_draft_retracts_and_ends_the_stream():
    s = SpeculativeStreamer()
    with pytest.raises(LoaderError, match="peer vanished"):
        generate([FULL], [FULL], after=5, max_new=8, streamer=s, loader=FailingLoader)
    assert s.final == [FULL[0]]  # only the first token, from the prefill's logits, was ever final
    kinds = [e[0] for e in s.events]
    assert kinds[-2:] == ["retract", "end"] and s.events[-2] == ("retract", [3, 4])


def test_misuse_is_refused():
    cache = LynxCache(1, P, Q())
    gc = GenerationConfig(max_new_tokens=2)
    args = (ScriptedLM([FULL], [FULL]), torch.full((1, P + 2), 5), LogitsProcessorList(),
            StoppingCriteriaList([MaxLengthCriteria(P + 4)]), gc)
    with pytest.raises(ValueError, match="prompt tokens"):
        speculative_generate(*args, cache=cache)
    with pytest.raises(ValueError, match="num_return_sequences"):
        speculative_generate(*args[:4], GenerationConfig(num_return_sequences=2, do_sample=True), cache=cache)


def test_tree_keeps_a_near_tie_that_the_chain_loses():
    anchor = [[2, 3, 4, (9, 5), 6, 7, 8, 9, 10, 11, 12, 13]]  # g = 3: the anchor prefers 9, the full tier its runner-up
    got_c, st_c, _ = generate([FULL], anchor, after=6, max_new=9, spec=CHAIN)
    got_t, st_t, m = generate([FULL], anchor, after=6, max_new=9)
    assert got_c == got_t == [FULL[:9]]
    assert (st_c["drafted"], st_c["accepted"]) == (6, 2) and (st_t["drafted"], st_t["accepted"]) == (6, 6)
    full = [n for tier, n in m.forwards if tier == "full"]
    assert full[0] > 7 and full[1:] == [1]  # one pass over [first token, tree], then the one token left


def test_tree_rows_follow_their_own_branches():
    full = [FULL, [7, 8, 9, 10, 11, 12, 13, 2, 3, 4, 5, 6]]
    anchor = [[2, (9, 3), 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [7, 8, 9, 10, (2, 11), 12, 13, 2, 3, 4, 5, 6]]
    got, st, _ = generate(full, anchor, after=5, max_new=8)
    assert got == [r[:8] for r in full] and st["accepted"] == 5


@pytest.mark.parametrize("spec", [None, CHAIN], ids=["tree", "chain"])
def test_residual_before_any_draft_and_mid_draft_give_the_same_tokens(spec):
    anchor = [[2, 3, 9, 5, (6, 9), 7, 8, 9, 10, 11, 12, 13]]
    for after in (0, 1, 3, 7):
        assert generate([FULL], anchor, after=after, max_new=10, spec=spec)[0] == [FULL[:10]]


def test_residual_landing_before_the_first_tree_step(monkeypatch):
    """The residual can complete between the check that starts drafting and the first step: an empty tree is
    verified (the root alone) and decoding goes on, exact."""
    from lynx_hf.engine.policy import DraftPolicy

    monkeypatch.setattr(DraftPolicy, "another_step", lambda self, nodes=1: False)
    got, st, _ = generate([FULL], [[9] * 12], after=4, max_new=6)
    assert got == [FULL[:6]] and (st["drafted"], st["accepted"], st["rounds"]) == (0, 0, 1)


@pytest.mark.parametrize("spec", [None, CHAIN], ids=["tree", "chain"])
def test_rows_accept_independently(spec):
    """Row 0's anchor tier is wrong at g = 2, row 1's never: row 1 keeps all its drafts (ragged acceptance), row 0
    its first, and both equal the full tier."""
    full = [FULL, [7, 8, 9, 10, 11, 12, 13, 2, 3, 4, 5, 6]]
    anchor = [[2, 3, 9, 5, 6, 7, 8, 9, 10, 11, 12, 13], full[1]]
    got, st, _ = generate(full, anchor, after=5, max_new=9, spec=spec)
    assert got == [r[:9] for r in full]
    assert st["accepted_per_row"] == [1, 5] and st["accepted"] == 3.0


def test_lock_step_where_attention_takes_no_custom_mask():
    """An attention implementation that cannot take the engine's 4D masks: every row keeps what all accepted."""
    full = [FULL, [7, 8, 9, 10, 11, 12, 13, 2, 3, 4, 5, 6]]
    anchor = [[2, 3, 9, 5, 6, 7, 8, 9, 10, 11, 12, 13], full[1]]
    model = ScriptedLM(full, anchor)
    model.config._attn_implementation = "flash_attention_2"
    got, st, _ = generate(full, anchor, after=5, max_new=9, model=model)
    assert got == [r[:9] for r in full] and st["accepted_per_row"] == [1, 1]


def test_rows_finish_at_different_lengths_and_pad_like_plain_generate():
    """Row 1 accepts its EOS among the drafts while row 0 goes on: row 1 is padded from there, row 0 runs to the
    length limit, and the output is as long as lock-step generate's."""
    full = [FULL, [7, 8, EOS, 10, 11, 12, 13, 2, 3, 4, 5, 6]]
    got, st, _ = generate(full, full, after=4, max_new=8, eos=EOS)
    assert got == [FULL[:8], [7, 8, EOS] + [PAD] * 5]


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
def test_verify_pass_starts_before_the_residual_lands(do_sample):
    """Both drafters verify layer by layer: the verify pass is entered while the residual is still in flight (the
    loader releases it only once that pass has started) — the transfer/verify overlap, for sampling too."""
    started = threading.Event()

    class LateResidual(InProcessLoader):
        def on_wait(self):
            if not self._released:
                self._released = True
                threading.Thread(target=lambda: (started.wait(5), self._release())).start()

        def _release(self):
            self._released = False
            self._residual()

    class Watching(ScriptedLM):
        def __call__(self, input_ids, cache, **kw):
            if cache.layers[0].tier == "anchor" and input_ids.shape[1] > 1:  # the verify pass
                self.ready_at_verify = cache.residual_ready()
                started.set()
            return super().__call__(input_ids, cache, **kw)

    model = Watching([FULL], [FULL])
    got, st, _ = generate([FULL], [FULL], after=100, max_new=6, loader=LateResidual, model=model,
                          spec=CHAIN if do_sample else None, do_sample=do_sample)
    assert model.ready_at_verify is False and st["rounds"] == 1 and st["drafted"] >= 1
    assert got == [FULL[:6]]  # one-hot logits: sampling is exact here too


def test_lock_step_leaves_no_holes_when_a_row_is_done():
    """Without custom masks a parked row must not leave holes in the live row's tail: every later pass goes through
    the model's own (2D or no) mask."""
    full = [FULL, [EOS, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
    anchor = [[2, 3, 4, 9, 6, 7, 8, 9, 10, 11, 12, 13], full[1]]
    model = ScriptedLM(full, anchor)
    model.config._attn_implementation = "flash_attention_2"
    got, st, _ = generate(full, anchor, after=4, max_new=7, eos=EOS, model=model)
    assert got == [FULL[:7], [EOS] + [PAD] * 6] and st["accepted_per_row"] == [2, 0]
    assert 4 not in model.masks


def test_the_stats_say_what_ended_drafting():
    """`draft_stop`: the budget (max_draft_steps) before a residual that lands late, the residual itself."""
    got, st, _ = generate([FULL], [FULL], after=6, max_new=10, spec=SpecConfig(max_draft_steps=2))
    assert got == [FULL[:10]] and (st["drafted"], st["draft_stop"]) == (2, "budget")
    got, st, _ = generate([FULL], [FULL], after=2, max_new=10)
    assert got == [FULL[:10]] and (st["drafted"], st["draft_stop"]) == (2, "residual")
