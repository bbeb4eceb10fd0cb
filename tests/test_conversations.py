"""What an agent framework relies on in a conversation over the network (issue 40): a refused request — by this side
before sending, by Transformers' generate, by the prefill server — leaves the connection and the conversation
usable; threads share one DecodeClient (its requests take turns); generation stops where the model's context ends,
saying so; a Session forks, rolls back turns, and takes chat messages; a held LynxCache crops back into its
transferred prompt. The tiny model; loopback servers in this process."""
import threading

import pytest
import torch
from conftest import LOOPBACK_SECRET as SECRET, tiny_ids as ids

from lynx_hf import LynxQuantConfig as Q
from lynx_hf.arch import context_budget
from lynx_hf.transfer import server as S
from lynx_hf.transfer.decode import DecodeClient
from lynx_hf.transfer.wire import RequestRefused

KW = dict(quant_config=Q(method="identity"), max_new_tokens=6)


@pytest.fixture()
def server(loopback_server):
    return loopback_server


def whole(tiny, server, conv, **kw):
    """The same conversation sent whole, on a connection of its own: what any continued turn must equal."""
    fresh = DecodeClient(tiny, *server.address, secret=SECRET)
    try:
        return fresh.generate(conv, **{**KW, **kw})["tokens"]
    finally:
        fresh.close()


def test_the_servers_refusal_of_one_request_leaves_the_connection_usable(tiny, server, monkeypatch):
    cli = DecodeClient(tiny, *server.address, secret=SECRET)
    sess = cli.session(**KW)
    conv = ids(120, 1)
    r1 = sess.generate(conv)
    monkeypatch.setattr(server.node, "context", 100)  # smaller than the client's: only the server refuses
    with pytest.raises(RequestRefused, match="exceeds this model's context of 100 tokens"):
        sess.generate(conv + r1.tokens + ids(10, 2))
    monkeypatch.undo()
    assert not cli.broken
    conv2 = conv + r1.tokens + ids(10, 3)
    r2 = sess.generate(conv2)  # the same connection, the same conversation
    assert r2.held_tokens == len(conv) + len(r1.tokens) - 1 and r2.tokens == whole(tiny, server, conv2)
    cli.close()


def test_an_option_generate_refuses_leaves_the_connection_usable(tiny, server):
    """stop_strings without a tokenizer: Transformers refuses it after the request was sent; the stream is
    cancelled and read to its end, and the connection goes on."""
    cli = DecodeClient(tiny, *server.address, secret=SECRET)
    sess = cli.session(**KW)
    conv = ids(80, 4)
    sess.generate(conv)
    before = sess.held_ids
    with pytest.raises(ValueError, match="tokenizer"):
        sess.generate(conv + ids(5, 5), stop_strings=["x"])
    assert not cli.broken and sess.held_ids == before
    conv2 = before + ids(8, 6)
    assert sess.generate(conv2).tokens == whole(tiny, server, conv2)
    cli.close()


def test_threads_share_one_client(tiny, server):
    """4 threads x 3 turns, a Session each, on one DecodeClient: every turn equals its conversation sent whole."""
    cli = DecodeClient(tiny, *server.address, secret=SECRET)
    got, errors = {}, []

    def chat(k):
        try:
            sess, conv = cli.session(**KW), ids(60 + 10 * k, 10 + k)
            for t in range(3):
                r = sess.generate(conv)
                got[(k, t)] = (list(conv), r.tokens, r.held_tokens)
                conv = conv + r.tokens + ids(7, 20 * k + t)
        except Exception as e:  # noqa: BLE001 — reported below
            errors.append(e)

    threads = [threading.Thread(target=chat, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors and len(got) == 12 and not cli.broken
    for (k, t), (conv, tokens, held) in got.items():
        assert (held > 0) == (t > 0)
        assert tokens == whole(tiny, server, conv), (k, t)
    cli.close()


def test_the_context_is_one_rule_and_generation_stops_where_it_ends(tiny, server):
    assert context_budget(100, 90, 32) == 10 and context_budget(100, 100, 5) == 1 and context_budget(100, 10, 5) == 5
    assert context_budget(100, 99, 5) == 1
    with pytest.raises(ValueError, match="101 tokens exceeds this model's context of 100"):
        context_budget(100, 101, 1)
    cli = DecodeClient(tiny, *server.address, secret=SECRET)
    limit = cli.context
    kw = {**KW, "max_new_tokens": 16}
    r = cli.generate(ids(limit - 4, 7), eos_token_id=None, **{k: v for k, v in kw.items()})
    assert len(r.tokens) == 4 and r.finish_reason == "context"  # the sequence fills the context
    r = cli.generate(ids(limit, 8), eos_token_id=None, **kw)
    assert len(r.tokens) == 1 and r.finish_reason == "context"
    r = cli.generate(ids(20, 9), eos_token_id=None, **kw)
    assert len(r.tokens) == 16 and r.finish_reason == "length"
    cli.close()


def test_fork_and_rollback(tiny, server):
    cli = DecodeClient(tiny, *server.address, secret=SECRET)
    sess = cli.session(**KW)
    conv1 = ids(90, 11)
    r1 = sess.generate(conv1)
    conv2 = conv1 + r1.tokens + ids(12, 12)
    r2 = sess.generate(conv2)
    branch = sess.fork()
    conv3 = conv2 + r2.tokens + ids(9, 13)
    r3 = sess.generate(conv3)
    other = conv2 + r2.tokens + ids(9, 14)  # the branch answers something else, unaffected by the main line's turn
    assert branch.generate(other).tokens == whole(tiny, server, other)
    assert sess.held_ids == (conv3 + r3.tokens)[:-1]
    sess.rollback(2)  # back to the end of turn 1: the transferred prompt's tail positions are gone too
    assert sess.held_ids == (conv1 + r1.tokens)[:-1]
    retry = conv1 + r1.tokens + ids(15, 15)
    r = sess.generate(retry)
    assert r.held_tokens == len(conv1) + len(r1.tokens) - 1 and r.tokens == whole(tiny, server, retry)
    sess.rollback(2)
    assert sess.cache is None and sess.generate(conv1).tokens == r1.tokens
    with pytest.raises(ValueError, match="rollback takes 1 to 1 turns"):
        sess.rollback(2)
    cli.close()


def test_a_held_cache_crops_into_its_transferred_prompt(tiny, server):
    cli = DecodeClient(tiny, *server.address, secret=SECRET)
    conv = ids(100, 16)
    r = cli.generate(conv, keep_cache=True, **KW)
    cache = r.cache
    cache.crop(-(len(r.tokens) - 1 + 30))  # the reply's KV and the prompt's last 30 positions
    assert cache.get_seq_length() == 70 and cache.held_ids[0].tolist() == conv[:70]
    turn = conv[:70] + ids(10, 17)
    r2 = cli.generate(turn, cache=cache, **KW)
    assert r2.held_tokens == 70 and r2.tokens == whole(tiny, server, turn)
    with pytest.raises(ValueError, match="rewind to 0 tokens"):
        r2.cache.crop(-r2.cache.get_seq_length())
    cli.close()


class ChatTokenizer:
    """A chat template in miniature (role marks, then the content's characters as ids), recording its calls."""

    def __init__(self):
        self.calls = []

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=False, tokenize=True):
        self.calls.append((len(messages), tools, add_generation_prompt))
        out = []
        for m in messages:
            out += [3 if m["role"] == "system" else 4 if m["role"] == "user" else 5 if m["role"] == "tool" else 6]
            out += [7 + ord(c) % 80 for c in m["content"]]
        return {"input_ids": out + [6] * add_generation_prompt}


def test_a_session_takes_chat_messages(tiny, server):
    tok = ChatTokenizer()
    cli = DecodeClient(tiny, *server.address, secret=SECRET)
    sess = cli.session(tokenizer=tok, **KW)
    msgs = [{"role": "system", "content": "You call tools." * 4}, {"role": "user", "content": "What is 2+2?" * 3}]
    tools = [{"type": "function", "function": {"name": "add"}}]
    r1 = sess.generate(msgs, tools=tools)
    assert tok.calls[-1] == (2, tools, True)
    msgs += [{"role": "assistant", "content": "call add"}, {"role": "tool", "content": "4" * 30}]
    r2 = sess.generate(msgs, tools=tools)
    rendered = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True)["input_ids"]
    assert r2.held_tokens > 0 and r2.tokens == whole(tiny, server, rendered)
    assert r1.tokens == whole(tiny, server, tok.apply_chat_template(msgs[:2], add_generation_prompt=True)["input_ids"])
    with pytest.raises(ValueError, match="need a tokenizer"):
        cli.session(**KW).generate(msgs)
    with pytest.raises(ValueError, match="tools= goes with chat messages"):
        sess.generate(rendered, tools=tools)
    cli.close()


def test_a_copy_or_fork_during_a_running_generate_is_refused_at_once_or_is_whole(tiny):
    """A thread copies and forks the cache as fast as it can while another continues the conversation in this
    process (a turn whose new positions are computed here, then decoded): every copy either is refused at once or
    holds the conversation exactly as it was before the turn or after it, never half of it. Before, a copy made
    while the turn extended the KV came back broken (a later "size of tensor a (467) must match ... (735)")."""
    import copy
    import time

    import lynx_hf
    from lynx_hf import LynxCache

    conv = torch.tensor([ids(150, 30)])
    cache, _ = LynxCache.from_prefill(tiny, conv, quant_config=Q(method="identity"))
    out = tiny.generate(conv, cache=cache, custom_generate=lynx_hf.speculative_generate, max_new_tokens=4,
                        do_sample=False)
    turn = torch.cat([out, torch.tensor([ids(200, 31)])], 1)
    before = cache.held_ids.clone()
    copies, refused, done = [], [], threading.Event()

    def copier():
        while not done.is_set():
            try:
                copies.append(copy.deepcopy(cache) if len(copies) % 2 else cache.fork())
            except ValueError as e:
                assert "in use by a generate call" in str(e)
                refused.append(time.monotonic())
            time.sleep(0.002)

    # each forward of the turn takes 0.1 s between its layers: the first layer's KV is written, the second's not yet
    slow = tiny.model.layers[1].register_forward_pre_hook(lambda *_: time.sleep(0.1))
    th = threading.Thread(target=copier)
    th.start()
    try:
        out2 = tiny.generate(turn, cache=cache, custom_generate=lynx_hf.speculative_generate, max_new_tokens=4,
                             do_sample=False)
    finally:
        done.set()
        th.join(60)
        slow.remove()
    after = cache.held_ids
    assert refused and copies
    nxt = ids(9, 32)
    for c in copies[:: max(1, len(copies) // 6)]:
        held = c.held_ids
        assert torch.equal(held, before) or torch.equal(held, after)
        assert c.get_seq_length() == held.shape[1]
        base = out if torch.equal(held, before) else out2  # the copy goes on from where it stands
        again = torch.cat([base, torch.tensor([nxt])], 1)
        dc = tiny.generate(again, max_new_tokens=3, do_sample=False)
        got = tiny.generate(again, cache=c, custom_generate=lynx_hf.speculative_generate, max_new_tokens=3,
                            do_sample=False)
        assert torch.equal(got, dc)


@pytest.mark.parametrize("where", ["local", "network"])
def test_one_session_in_process_and_over_the_network(tiny, server, where):
    """The same Session API on either link: three turns, a fork, a rollback, the context rule, each turn equal
    to its conversation sent whole over a connection of its own."""
    import lynx_hf

    link = lynx_hf.LocalLink(tiny) if where == "local" else DecodeClient(tiny, *server.address, secret=SECRET)
    sess = lynx_hf.Session(tiny if where == "local" else link, **KW)
    conv = ids(70, 40)
    for t in range(3):
        r = sess.generate(conv)
        assert r.tokens == whole(tiny, server, conv) and (r.held_tokens > 0) == (t > 0), t
        assert r.finish_reason in ("length", "stop") and r.ttft_s is not None
        conv = conv + r.tokens + ids(6, 41 + t)
    branch = sess.fork()
    sess.rollback(1)
    assert branch.held_ids != sess.held_ids and len(sess.turn_ends) == 2
    long_turn = sess.held_ids + ids(tiny.config.max_position_embeddings - len(sess.held_ids) - 2, 50)
    r = sess.generate(long_turn, max_new_tokens=8, eos_token_id=None)
    assert len(r.tokens) == 2 and r.finish_reason == "context"
    assert branch.generate(conv).tokens == whole(tiny, server, conv)
    if where == "network":
        link.close()


def test_serve_decode_session_lines_take_roles():
    from lynx_hf.transfer.commands import turn_messages

    assert turn_messages("hello", None) == ([{"role": "user", "content": "hello"}], None)
    sys_user = '[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]'
    assert turn_messages(sys_user, None)[0][0] == {"role": "system", "content": "be brief"}
    tools = [{"type": "function", "function": {"name": "f"}}]
    import json

    line = json.dumps({"messages": [{"role": "tool", "content": "42"}], "tools": tools})
    assert turn_messages(line, None) == ([{"role": "tool", "content": "42"}], tools)
    assert turn_messages('{"role": "user", "content": "x"}', tools)[1] == tools  # tools stay until changed
    for bad, says in (('{"role": "boss", "content": "x"}', "takes messages"), ("[]", "takes messages"),
                      ('{"role": "user"}', "takes messages"), ("{oops", "must be JSON"),
                      ('{"messages": [{"role": "user", "content": "x"}], "tools": 3}', "must be a list")):
        with pytest.raises(ValueError, match=says):
            turn_messages(bad, None)


def test_serve_decode_session_with_roles_end_to_end(model_and_tok, monkeypatch, capsys):
    """An agent's turns through `serve-decode --session`: a system prompt and a user message, then a tool result;
    each line one JSON answer, the second turn continuing the first's KV (held_tokens > 0), its reply equal to the
    whole conversation rendered and sent on a connection of its own."""
    import io
    import json

    import lynx_hf
    from lynx_hf.cli import main

    model, tok = model_and_tok
    srv = S.PrefillServer(model, secret=SECRET).start()
    monkeypatch.setattr(lynx_hf, "load_default_model", lambda *a, **k: (model, tok))
    turns = [[{"role": "system", "content": "You are a calculator."}, {"role": "user", "content": "What is 6*7?"}],
             {"messages": [{"role": "tool", "content": "42"}]}]
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("\n".join(map(json.dumps, turns)).encode())))
    host, port = srv.address
    try:
        main(["serve-decode", "--prefill", f"{host}:{port}", "--secret", SECRET, "--session", "--method", "identity",
              "--max-new-tokens", "6"])
        out = [json.loads(l) for l in capsys.readouterr().out.splitlines() if l.startswith("{")]
        assert len(out) == 2 and all("error" not in o for o in out), out
        assert out[0]["held_tokens"] == 0 and out[1]["held_tokens"] > 0
        msgs = turns[0] + [{"role": "assistant", "content": out[0]["text"]}] + turns[1]["messages"]
        rendered = lynx_hf.Session(model, tokenizer=tok).render(msgs)
        cli = DecodeClient(model, host, port, secret=SECRET)
        assert out[1]["tokens"] == cli.generate(rendered, Q(method="identity"), max_new_tokens=6).tokens
        cli.close()
    finally:
        srv.close()


def test_placement_picks_the_node_expected_to_answer_sooner():
    from lynx_hf.session import Placement

    p = Placement("auto")
    assert p.choose(50, 0) == "prefill"                                  # a first turn: nothing held here
    assert p.choose(50, 100, probe=lambda: 1e-3) == "prefill"            # no remote rate measured yet
    p.observe("prefill", 200, 2.0)                                       # 10 ms a position, link and queue included
    assert p.choose(50, 100, probe=lambda: 1e-3) == "decode" and p.local_s_per_token == 1e-3
    p.observe("decode", 50, 1.0)                                         # this node turned out slower: 20 ms
    assert p.choose(50, 400) == "prefill"
    assert p.choose(50, 400, mode="decode") == "decode" and Placement("decode").choose(5, 0) == "prefill"
    with pytest.raises(ValueError, match="prefill_on must be one of auto, prefill, decode"):
        Placement("gpu")


def test_a_continued_turn_computed_on_the_decode_node(tiny, server):
    """prefill_on="decode": the new positions are computed here (nothing crosses the link); "auto" goes where the
    measured rates say; either way the tokens equal the conversation sent whole."""
    cli = DecodeClient(tiny, *server.address, secret=SECRET, prefill_on="auto")
    sess = cli.session(**KW)
    conv = ids(90, 60)
    r = sess.generate(conv)
    assert r.prefilled_on == "prefill" and cli.placement.remote_s_per_token > 0
    conv = conv + r.tokens + ids(20, 61)
    r = sess.generate(conv, prefill_on="decode")
    assert r.prefilled_on == "decode" and r.bytes == 0 and r.held_tokens > 0 and r.tokens == whole(tiny, server, conv)
    for slow_server, where in ((10.0, "decode"), (1e-12, "prefill")):
        cli.placement.remote_s_per_token = slow_server
        conv = conv + r.tokens + ids(15, 62)
        r = sess.generate(conv)
        assert r.prefilled_on == where and r.tokens == whole(tiny, server, conv)
    with pytest.raises(ValueError, match="prefill_on must be one of"):
        sess.generate(conv, prefill_on="elsewhere")
    assert not cli.broken
    cli.close()


def test_in_process_links_stop_where_the_context_ends():
    """A Session in this process follows the network's rule (a 64-position context: a 60-token prompt gets 4 tokens,
    the first 4 of what plain generate gives past the context). `speculative_generate` itself equals plain
    `generate`, which runs on past the context (RoPE scaling may extend it; tests/test_exactness.py)."""
    import sys
    from pathlib import Path

    import lynx_hf

    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import make_tiny

    small = make_tiny(max_position_embeddings=64)
    prompt = ids(60, 70)
    r = lynx_hf.Session(small, quant_config=Q(method="identity")).generate(prompt, max_new_tokens=20, eos_token_id=None)
    plain = small.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None)
    assert r.tokens == plain[0, 60:64].tolist() and r.finish_reason == "context"
    with pytest.raises(ValueError, match="65 tokens exceeds this model's context of 64"):
        lynx_hf.Session(small).generate(ids(65, 71))


def test_a_padded_batch_row_is_refused_with_the_way_out_and_an_unpadded_row_goes_on(tiny):
    """A left-padded batch, generated, then each row on its own cache (deepcopy + batch_select_indices): the padded
    row's next turn is refused — with its mask or without, where it silently attended to its pads before — saying
    how to prefill it unpadded; the full-length row goes on and equals the same conversation never batched."""
    import copy

    import lynx_hf
    from lynx_hf import LynxCache

    a, b = ids(40, 80), ids(25, 81)
    batch = torch.tensor([a, [0] * 15 + b])
    mask = torch.tensor([[1] * 40, [0] * 15 + [1] * 25])
    kw = dict(custom_generate=lynx_hf.speculative_generate, max_new_tokens=4, do_sample=False, eos_token_id=None)
    cache, _ = LynxCache.from_prefill(tiny, batch, quant_config=Q(method="identity"), attention_mask=mask)
    out = tiny.generate(batch, attention_mask=mask, cache=cache, **kw)
    rows = []
    for r in (0, 1):
        c = copy.deepcopy(cache)
        c.batch_select_indices([r])
        rows.append(c)
    turn = torch.cat([out[1:], torch.tensor([ids(6, 82)])], 1)
    for m in (None, torch.cat([mask[1:], torch.ones(1, turn.shape[1] - 40, dtype=torch.long)], 1)):
        with pytest.raises(ValueError, match="holds 15 positions of padding .* LynxCache.from_prefill"):
            tiny.generate(turn, attention_mask=m, cache=rows[1], **kw)
    turn0 = torch.cat([out[:1], torch.tensor([ids(6, 83)])], 1)
    got = tiny.generate(turn0, cache=rows[0], **kw)
    assert torch.equal(got, tiny.generate(turn0, max_new_tokens=4, do_sample=False, eos_token_id=None))
