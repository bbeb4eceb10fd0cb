"""A conversation's turn over the network is transactional: its arguments are checked before any byte is sent or
the cache touched (empty ids, a prompt over the model's context, max_new_tokens < 1), and whatever fails later — the
server refuses, the peer goes away mid-stream, the client times out, the generate is cancelled — the Session's cache
is exactly what it was (positions, held ids, tiers, KV), so the next turn, here or over a new connection, equals the
same conversation sent whole; a refusal leaves the connection usable too (tests/test_conversations.py). The tiny
model; loopback servers in this process."""
import threading
import time

import pytest
import torch
from conftest import LOOPBACK_SECRET as SECRET, tiny_ids as ids

from lynx_hf import LynxQuantConfig as Q
from lynx_hf.loader import LoaderError
from lynx_hf.transfer import prefill as P
from lynx_hf.transfer.decode import DecodeClient
from lynx_hf.transfer.wire import WireError

KW = dict(quant_config=Q(method="identity"), max_new_tokens=6)


@pytest.fixture()
def server(loopback_server):
    return loopback_server


def snapshot(cache):
    """What a conversation's cache holds: ids, per layer its span, tier and KV (a turn may seal it first — drop the
    codes of a tier that has landed — which changes none of these)."""
    return (cache.held_ids.clone(), [(l.offset, l.end, l.tier, l.keys.clone(), l.values.clone())
                                     for l in cache.layers])


def same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and all(x[:3] == y[:3] and torch.equal(x[3], y[3]) and torch.equal(x[4], y[4])
                                           for x, y in zip(a[1], b[1]))


def first_turn(tiny, server):
    cli = DecodeClient(tiny, *server.address, secret=SECRET)
    sess = cli.session(**KW)
    conv = ids(300, 1)
    r = sess.generate(conv)
    return cli, sess, conv + r["tokens"] + ids(40, 2)


def next_turn_equals_the_whole_conversation(tiny, server, sess, conv):
    """The next turn (on the session's connection, or a new one if it broke) equals the conversation sent whole."""
    if sess.client.broken:
        sess.reconnect(DecodeClient(tiny, *server.address, secret=SECRET))
    r = sess.generate(conv)
    assert r["held_tokens"] > 0  # continued from what the cache held, not re-shipped
    fresh = DecodeClient(tiny, *server.address, secret=SECRET)
    assert r["tokens"] == fresh.generate(conv, **KW)["tokens"]
    fresh.close()


@pytest.mark.parametrize("bad, says", [([], "non-empty list of token ids"), ("abc", "non-empty list of token ids"),
                                       ([1.5, 2.0], "non-empty list of token ids"), ([5, 999], "out of range"),
                                       (None, "non-empty list")])
def test_a_bad_turn_is_refused_locally_and_the_conversation_goes_on(tiny, server, bad, says):
    cli, sess, conv = first_turn(tiny, server)
    before, rid = snapshot(sess.cache), cli._rid
    with pytest.raises((ValueError, TypeError), match=says):
        sess.generate(bad)
    assert same(snapshot(sess.cache), before) and cli._rid == rid and not cli.broken  # nothing was sent
    next_turn_equals_the_whole_conversation(tiny, server, sess, conv)
    cli.close()


def test_an_over_long_turn_and_max_new_tokens_0_are_refused_before_anything_is_sent(tiny, server):
    cli, sess, conv = first_turn(tiny, server)
    before = snapshot(sess.cache)
    limit = P.max_prompt_tokens(tiny)
    with pytest.raises(ValueError, match=f"exceeds this model's context of {limit} tokens"):
        sess.generate(conv + ids(limit, 3))
    for n in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
            sess.generate(conv, max_new_tokens=n)
    assert same(snapshot(sess.cache), before) and not cli.broken
    next_turn_equals_the_whole_conversation(tiny, server, sess, conv)
    cli.close()


def failure(kind: str, monkeypatch, cli, server):
    """Make the next turn fail as `kind` says; returns (the exception, what it says, a hook run after it)."""
    if kind == "refused":  # the server's context is smaller than the client's (the client checks its own)
        monkeypatch.setattr(server.node, "context", 200)
        return WireError, "exceeds this model's context of 200 tokens", None
    if kind == "peer gone":  # the connection breaks after the first layer's segments
        sent = P._Prefill.send_layer

        def dies(request, layer, *a, **k):
            if layer == 1:
                request.ch.t.sock.shutdown(2)
            return sent(request, layer, *a, **k)

        monkeypatch.setattr(P._Prefill, "send_layer", dies)
        return LoaderError, "peer closed the connection", None
    cli.timeout, hold, real = 0.5, threading.Event(), P.serve_request  # "timeout": a silent server
    monkeypatch.setattr(P, "serve_request", lambda *a, **k: hold.wait(10) and real(*a, **k))
    return TimeoutError, "within 0.5 s", hold.set


@pytest.mark.parametrize("kind", ["refused", "peer gone", "timeout"])
def test_a_failed_turn_leaves_the_conversation_for_a_new_connection(tiny, server, monkeypatch, kind):
    cli, sess, conv = first_turn(tiny, server)
    before = snapshot(sess.cache)
    exc, says, after = failure(kind, monkeypatch, cli, server)
    t0 = time.monotonic()
    with pytest.raises(exc, match=says):
        sess.generate(conv)
    assert time.monotonic() - t0 < 10
    if after is not None:
        after()
    monkeypatch.undo()
    assert same(snapshot(sess.cache), before) and cli.broken == (kind != "refused")  # a refusal: one request's
    next_turn_equals_the_whole_conversation(tiny, server, sess, conv)


def test_a_cancelled_generate_leaves_the_conversation_intact(tiny, server):
    """A streamer that raises part-way (how a caller stops a generate it no longer wants)."""
    cli, sess, conv = first_turn(tiny, server)
    before = snapshot(sess.cache)

    class Stop(Exception):
        pass

    class Cancel:
        n = 0

        def put(self, value):
            self.n += 1
            if self.n == 3:
                raise Stop()

        def end(self):
            pass

    with pytest.raises(Stop):
        sess.generate(conv, streamer=Cancel())
    assert same(snapshot(sess.cache), before)
    next_turn_equals_the_whole_conversation(tiny, server, sess, conv)
    cli.close()
