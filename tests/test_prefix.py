"""Conversations over the wire: the prefill server's prefix cache (chained block hashes, LRU under a byte budget,
shared by connections), a REQUEST that says what the decode side holds (ships only the new range; a digest that
does not match ships everything and says so), hostile held/digest claims, and sessions whose turns equal the same
conversation re-shipped whole. The tiny 2-layer model; loopback servers in this process."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from lynx_hf import LynxQuantConfig as Q, SpecConfig
from lynx_hf.arch import fingerprint
from lynx_hf.transfer import server as S
from lynx_hf.transfer.decode import DecodeClient
from lynx_hf.transfer.prefix_cache import BLOCK, PrefixCache, layer_kv, token_digest
from lynx_hf.transfer.wire import FrameType, WireError

SECRET = "prefix-secret"


def ids(n, seed):
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def kv(n, layers=2, fill=None):
    """Per layer (K, V) [1, 2, n, 4], positions numbered so that a slice says where it came from."""
    pos = torch.arange(n, dtype=torch.float32)[None, None, :, None].expand(1, 2, n, 4)
    return [(pos + 1000 * i, -pos - 1000 * i) for i in range(layers)]


# -- the prefix cache alone ------------------------------------------------------------------------------------------
def test_lookup_returns_the_longest_cached_whole_block_prefix_bit_exact():
    pc = PrefixCache(1 << 30, "fp")
    a = ids(3 * BLOCK + 10, 1)
    pc.insert(a, 0, kv(len(a)))
    n, blocks = pc.lookup(a, len(a) - 1)
    got = [layer_kv(blocks, i) for i in range(2)]
    assert n == 3 * BLOCK
    assert all(torch.equal(g[0], k[:, :, :n]) and torch.equal(g[1], v[:, :, :n]) for g, (k, v) in zip(got, kv(len(a))))
    again = pc.lookup(a, len(a))[1]  # a hit hands out the cache's own tensors: never a copy per request
    assert all(x[0][0] is y[0][0] for x, y in zip(blocks, again))
    assert pc.lookup(a, 2 * BLOCK + 5)[0] == 2 * BLOCK       # within the limit (a prompt's last token is computed)
    b = a[:BLOCK] + [int(t) % 90 + 3 for t in a[BLOCK:BLOCK + 1]] + a[BLOCK + 1:]
    assert pc.lookup(b, len(b))[0] == BLOCK                   # diverges in block 1: only block 0 is shared
    assert pc.lookup(ids(600, 2), 600) == (0, [])
    assert pc.stats()["hits"] == 4 and pc.stats()["misses"] == 1


def test_keys_chain_the_whole_prefix_and_a_collision_cannot_serve_other_tokens():
    pc = PrefixCache(1 << 30, "fp")
    a, b = ids(2 * BLOCK, 3), ids(2 * BLOCK, 4)
    b2 = b[:BLOCK] + a[BLOCK:]  # same second block after another first one: another key
    pc.insert(a, 0, kv(2 * BLOCK))
    assert pc.lookup(b2, 2 * BLOCK)[0] == 0
    # a forged entry under a's key but holding other ids (what a hash collision would be) is not served
    key = pc._keys(a, 1)[0][0]
    pc._entries[key].ids = b"\0" * 8 * BLOCK
    assert pc.lookup(a, 2 * BLOCK)[0] == 0
    # another model or dtype: another root
    other = PrefixCache(1 << 30, "fp2")
    other.insert(a, 0, kv(2 * BLOCK))
    assert other._keys(a, 1)[0][0] != pc._keys(a, 1)[0][0]


BLOCK_BYTES = 2 * 2 * (2 * BLOCK * 4 * 4)  # layers x (K, V) x [1, 2, 256, 4] float32


def test_the_budget_bounds_bytes_and_evicts_a_chains_tail_first():
    pc = PrefixCache(3 * BLOCK_BYTES, "fp")
    a, b = ids(2 * BLOCK, 5), ids(2 * BLOCK, 6)
    pc.insert(a, 0, kv(2 * BLOCK))
    assert pc.lookup(a, 2 * BLOCK)[0] == 2 * BLOCK
    pc.insert(b, 0, kv(2 * BLOCK))                  # 4 blocks > 3: a's last block goes, its head stays
    st = pc.stats()
    assert st["bytes"] <= st["budget"] and st["evictions"] == 1 and st["entries"] == 3 and st["unreachable"] == 0
    assert pc.lookup(b, 2 * BLOCK)[0] == 2 * BLOCK
    assert pc.lookup(a, 2 * BLOCK)[0] == BLOCK      # a still hits its head
    assert PrefixCache(0, "fp").lookup(a, 2 * BLOCK) == (0, [])  # 0: off
    with pytest.raises(ValueError, match="budget"):
        PrefixCache(-1, "fp")


def test_two_long_prompts_alternating_under_a_small_budget_keep_hitting_their_heads():
    """Two 8-block prompts under a 12-block budget, each sent in turn (miss, compute, insert): evicting tails keeps
    every later request hitting (12 - 8 =) 4 blocks of its prompt — not a cache full of unreachable entries."""
    pc = PrefixCache(12 * BLOCK_BYTES, "fp")
    a, b = ids(8 * BLOCK + 5, 20), ids(8 * BLOCK + 5, 21)
    hits = []
    for p in (a, b) * 4:
        n, _ = pc.lookup(p, len(p) - 1)
        hits.append(n // BLOCK)
        pc.insert(p, n, [(k[:, :, n:], v[:, :, n:]) for k, v in kv(len(p))])
        assert pc.stats()["unreachable"] == 0 and pc.stats()["bytes"] <= pc.budget
    assert hits == [0, 0] + [4] * 6


def test_a_prompt_larger_than_the_budget_keeps_its_head():
    pc = PrefixCache(3 * BLOCK_BYTES, "fp")
    a = ids(6 * BLOCK, 22)
    assert pc.insert(a, 0, kv(6 * BLOCK)) == 3
    assert pc.lookup(a, len(a))[0] == 3 * BLOCK       # sent again: its first 3 blocks hit
    n, blocks = pc.lookup(a, len(a))
    assert torch.equal(layer_kv(blocks, 1)[0], kv(6 * BLOCK)[1][0][:, :, :n])
    assert pc.stats()["entries"] == 3 and pc.stats()["unreachable"] == 0


def test_a_block_whose_prefix_is_gone_is_never_inserted():
    pc = PrefixCache(1 << 30, "fp")
    a = ids(3 * BLOCK, 23)
    assert pc.insert(a, BLOCK, [(k[:, :, BLOCK:], v[:, :, BLOCK:]) for k, v in kv(3 * BLOCK)]) == 0  # no block 0
    assert pc.stats()["entries"] == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 6), st.booleans()), min_size=1, max_size=30),
       st.integers(1, 10))
def test_random_inserts_and_lookups_never_leave_an_unreachable_entry(ops, budget_blocks):
    """Prompts drawn from 6 families sharing prefixes (family f's block j depends on f // 2 up to block 2), inserted
    from their hit on or looked up, under a budget of 1-10 blocks: every entry stays reachable, bytes within the
    budget, and a hit's KV is bit-exact."""
    pc = PrefixCache(budget_blocks * BLOCK_BYTES, "fp")
    fam = lambda f, n: (ids(2 * BLOCK, f // 2) + ids(4 * BLOCK, 100 + f))[:n * BLOCK]
    for f, n, insert in ops:
        p = fam(f, n)
        hit, blocks = pc.lookup(p, len(p))
        if blocks:
            assert torch.equal(layer_kv(blocks, 0)[0], kv(hit)[0][0])
        if insert:
            pc.insert(p, hit, [(k[:, :, hit:], v[:, :, hit:]) for k, v in kv(len(p))])
        st_ = pc.stats()
        assert st_["unreachable"] == 0 and st_["bytes"] <= st_["budget"]
        assert st_["bytes"] == sum(e.nbytes for e in pc._entries.values())
        assert all(e.children == sum(c.parent == k for c in pc._entries.values()) for k, e in pc._entries.items())


def test_insert_from_a_hit_keeps_only_the_computed_blocks():
    pc = PrefixCache(1 << 30, "fp")
    a = ids(3 * BLOCK, 7)
    pc.insert(a, 0, kv(BLOCK))
    pc.insert(a, BLOCK, [(k[:, :, BLOCK:], v[:, :, BLOCK:]) for k, v in kv(3 * BLOCK)])
    n, blocks = pc.lookup(a, 3 * BLOCK)
    assert n == 3 * BLOCK and torch.equal(layer_kv(blocks, 1)[0], kv(3 * BLOCK)[1][0])


# -- over the wire ----------------------------------------------------------------------------------------------------
@pytest.fixture()
def server(tiny):
    srv = S.PrefillServer(tiny, secret=SECRET, prefix_cache_mb=64).start()
    yield srv
    srv.close()


def conversation(cli_or_session, turns, first=300, new=270, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    conv, out = torch.randint(3, 96, (first,), generator=g).tolist(), []
    for _ in range(turns):
        r = cli_or_session.generate(conv, **kw)
        out.append(r)
        conv = conv + r["tokens"] + torch.randint(3, 96, (new,), generator=g).tolist()
    return out


def test_a_session_ships_only_new_positions_and_equals_the_whole_history(tiny, server):
    cli = DecodeClient(tiny, *server.address, secret=SECRET)
    kw = dict(quant_config=Q(method="int8"), max_new_tokens=8)
    whole = conversation(cli, 3, **kw)                 # no cache: the whole conversation every turn
    sess = conversation(cli.session(), 3, **kw)
    assert [r["tokens"] for r in sess] == [r["tokens"] for r in whole]
    assert sess[0]["bytes"] == whole[0]["bytes"] and sess[0]["held_tokens"] == 0
    for t in (1, 2):
        L = whole[t]["cache"].prompt_len
        assert sess[t]["held_tokens"] == whole[t - 1]["cache"].prompt_len + 7  # all but the last reply token
        per_token = whole[t]["bytes"] / L
        assert sess[t]["bytes"] / (L - sess[t]["held_tokens"]) == pytest.approx(per_token, rel=0.02)
        assert sess[t]["prefix_hit"] >= BLOCK  # the prefill side started past its cached prefix
    cli.close()


def test_two_long_prompts_alternating_through_a_small_server_cache_keep_hitting(tiny):
    """Through the server: two 7-block prompts under a 10-block budget (the tiny model: 512 B a token) — every
    request after the first two hits its prompt's head (before: the chains lost their heads first, and every
    request missed), and the output is the unbounded server's."""
    block = BLOCK * 2 * 2 * 2 * 16 * 4  # tokens x layers x (K, V) x kv heads x head dim x fp32
    srv = S.PrefillServer(tiny, secret=SECRET, prefix_cache_mb=10 * block / 2**20).start()
    ref = S.PrefillServer(tiny, secret=SECRET, prefix_cache_mb=0).start()
    try:
        cli, plain = (DecodeClient(tiny, *s.address, secret=SECRET) for s in (srv, ref))
        a, b = ids(7 * BLOCK + 5, 30), ids(7 * BLOCK + 5, 31)
        hits = []
        for p in (a, b) * 2:
            r = cli.generate(p, Q(), max_new_tokens=3)
            hits.append(r["prefix_hit"] // BLOCK)
            assert r["tokens"] == plain.generate(p, Q(), max_new_tokens=3)["tokens"]
        assert hits == [0, 0, 3, 3] and srv.prefix.stats()["unreachable"] == 0
        for c in (cli, plain):
            c.close()
    finally:
        srv.close()
        ref.close()


def test_a_shared_system_prompt_is_prefilled_once_for_every_connection(tiny, server):
    system = ids(2 * BLOCK + 40, 8)
    a, b = (DecodeClient(tiny, *server.address, secret=SECRET) for _ in range(2))
    ra = a.generate(system + ids(30, 9), Q(), max_new_tokens=4)
    rb = b.generate(system + ids(50, 10), Q(), max_new_tokens=4)
    assert ra["prefix_hit"] == 0 and rb["prefix_hit"] == 2 * BLOCK
    ref = DecodeClient(tiny, *S.PrefillServer(tiny, secret=SECRET, prefix_cache_mb=0).start().address, secret=SECRET)
    assert rb["tokens"] == ref.generate(system + ids(50, 10), Q(), max_new_tokens=4)["tokens"]
    for c in (a, b, ref):
        c.close()


def test_a_digest_that_does_not_match_ships_the_whole_prompt_and_says_so(tiny, server, monkeypatch):
    from lynx_hf.transfer import decode

    cli = DecodeClient(tiny, *server.address, secret=SECRET)
    sess = cli.session(quant_config=Q(method="int8"), max_new_tokens=6)
    conv = ids(300, 11)
    r1 = sess.generate(conv)
    conv = conv + r1["tokens"] + ids(40, 12)
    monkeypatch.setattr(decode, "token_digest", lambda *a: "0" * 64)  # e.g. a codec or model the server does not run
    r2 = sess.generate(conv)
    assert r2["stats"]["held_refused"].startswith("held_digest does not match the prompt's first")
    assert r2["stats"]["held_tokens"] == 0 and r2["cache"] is not r1["cache"]
    assert r2["bytes"] == cli.generate(conv, Q(method="int8"), max_new_tokens=6)["bytes"]  # the whole prompt
    monkeypatch.undo()
    r3 = sess.generate(conv + r2["tokens"] + ids(20, 13))  # the new cache goes on as a session
    assert r3["held_tokens"] == len(conv) + 5 and r3["stats"]["held_refused"] is None
    cli.close()


def _raw_request(cli, req):
    cli._rid += 1
    cli.ch.send_json(FrameType.REQUEST, req, cli._rid)
    return cli.ch.recv(10)


@pytest.mark.parametrize("held", [300, 301, -1, 2.5, "5", True, None])
def test_server_hostile_peers_held_claims_are_refused_in_one_line(tiny, server, held):
    cli = DecodeClient(tiny, *server.address, secret=SECRET)
    prompt = ids(300, 14)
    req = {"input_ids": prompt, "quant_config": Q().to_dict(), "held": held,
           "held_digest": token_digest(fingerprint(tiny), Q().to_dict(), prompt[:299])}
    if held is None:
        req.pop("held")
        assert _raw_request(cli, req).json()["start"] == 0  # no claim: the whole prompt
        return
    with pytest.raises(WireError, match=r"held must be an int in \[0, 300\)"):
        _raw_request(cli, req)
    cli.close()


def test_a_forged_digest_never_yields_kv_of_other_tokens(tiny, server):
    """Another client's conversation is in the prefix cache; a claim of holding its prefix with a made-up digest (or
    the digest of other ids) gets the whole prompt shipped — KV of the ids this request sent, nothing else."""
    victim = DecodeClient(tiny, *server.address, secret=SECRET)
    secret_conv = ids(2 * BLOCK + 20, 15)
    victim.generate(secret_conv, Q(), max_new_tokens=2)
    probe = DecodeClient(tiny, *server.address, secret=SECRET)
    mine = ids(2 * BLOCK + 20, 16)
    for hit, digest in ((0, "f" * 64), (2 * BLOCK, token_digest(fingerprint(tiny), Q().to_dict(),
                                                                 secret_conv[:2 * BLOCK]))):
        p = _raw_request(probe, {"input_ids": mine, "quant_config": Q().to_dict(), "held": 2 * BLOCK,
                                 "held_digest": digest}).json()
        # shipped from 0; the only prefix hit is of these very ids (prefilled by the first probe), never the victim's
        assert p["start"] == 0 and "does not match" in p["refused"] and p["prefix_hit"] == hit
        while probe.ch.recv(10).type != FrameType.END:
            pass
    for c in (victim, probe):
        c.close()


def test_an_old_client_gets_a_clear_refusal():
    import struct
    import zlib

    from lynx_hf.transfer.wire import HEADER, MAGIC, parse_frame

    head = HEADER.pack(MAGIC, 7, int(FrameType.HELLO), 0, 0, 0, 0, 2, 0)
    frame = head[:-4] + struct.pack("<I", zlib.crc32(b"{}", zlib.crc32(head))) + b"{}"
    with pytest.raises(WireError, match="protocol version 7 is not supported .this side speaks 8"):
        parse_frame(frame)


@pytest.mark.slow  # a serve-prefill child process and the default model
def test_three_turns_between_two_processes_with_the_prefix_cache(model_and_tok):
    """`lynx-hf serve-prefill` in its own process behind a 200 Mbit/s link, the default model on both sides: three
    turns of a session; each turn ships only its new positions (bytes per shipped token = the whole history's),
    the server computes only past its prefix hit, and every Lynx turn's tokens equal the same KV decoded without
    drafts and the same conversation re-shipped whole."""
    from lynx_hf.eval.benches.bench_session import Chat, no_draft_reference
    from lynx_hf.eval.benches.demo import default_prompt_text, prefill_child

    model, tok = model_and_tok
    chat = Chat(tok)
    text = chat.ids(default_prompt_text())
    system = chat.message("system", tok.decode(text[:300]))
    news = [chat.message("user", tok.decode(text[300 + 200 * t: 500 + 200 * t])) + chat.reply_start() for t in range(3)]
    gen = dict(max_new_tokens=12, min_new_tokens=12, spec_config=SpecConfig(max_draft_steps=64))
    with prefill_child(model, 200e6, system[:32], server_args=("--prefix-cache-mb", "256")) as cli:
        sess, conv, whole_conv, rows = cli.session(), list(system), list(system), []
        for new in news:
            ids = conv + new
            r = sess.generate(ids, **gen)
            w = cli.generate(whole_conv + new, keep_cache=True, **gen)
            ref = no_draft_reference(model, r["cache"], ids, r["tokens"])
            rows.append((r, w, ref == r["tokens"], len(ids)))
            conv = ids + ref + chat.reply_end()
            whole_conv = whole_conv + new + w["tokens"] + chat.reply_end()
    for t, (r, w, identical, L) in enumerate(rows):
        assert identical and r["tokens"] == w["tokens"]
        shipped = L - r["held_tokens"]
        assert (r["held_tokens"] > 0) == (t > 0) and (t == 0 or shipped < L / 1.5)
        assert r["bytes"] / shipped == pytest.approx(w["bytes"] / L, rel=0.03)
        assert t == 0 or r["prefix_hit"] >= BLOCK


def test_bench_session_arms_never_share_a_prefix_block(model_and_tok):
    """Each arm of `bench session` is its own conversation from its first block (before, all arms shared one prefix
    cache over one conversation, so every arm after the first computed ~200 tokens a turn instead of ~700); the tool
    outputs are the same in every arm."""
    from lynx_hf.eval.benches.bench_session import conversation

    _, tok = model_and_tok
    a, b = (conversation(tok, 2, 0, tag=f"Session {n}. ") for n in ("lynx/delta", "int4/delta"))
    assert a[0][:BLOCK] != b[0][:BLOCK] and a[1] == b[1] and len(a[0]) > BLOCK
