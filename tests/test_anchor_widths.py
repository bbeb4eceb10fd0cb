"""Anchors of 4, 3 and 2 bits (`LynxQuantConfig(anchor_bits=b)`): on the real model every width's drafted output
equals its full tier decoded without drafts — in process (HF path), over the network, and across a session's turns;
the width travels in the codec config the server echoes, and a peer's other width is refused. (Packing and the
kernel twins at every width: test_quant.py, test_kernels.py.)"""
import pytest
import torch

import lynx_hf
from lynx_hf import LynxCache, LynxQuantConfig as Q
from lynx_hf.cache.store import PromptStore
from lynx_hf.quant import encode
from lynx_hf.transfer.decode import DecodeClient
from lynx_hf.transfer.wire import WireError

WIDTHS = (4, 3, 2)


from test_transfer import server  # noqa: E402,F401  (the real model's loopback server, secret "s3cret")


def no_drafts(model, cache, ids: list[int], tokens: list[int]) -> list[int]:
    """The turn again from the same KV in one-token steps on the full tier (its first token: the prefill's)."""
    start = torch.tensor([ids + tokens[:1]])
    out = model.generate(start, cache=cache, max_new_tokens=len(tokens) - 1, min_new_tokens=len(tokens) - 1,
                         do_sample=False)
    return tokens[:1] + out[0, start.shape[1]:].tolist()


@pytest.mark.parametrize("bits", WIDTHS)
def test_every_width_drafts_and_equals_its_full_tier_in_process(model_and_tok, shakespeare_ids, bits):
    model, _ = model_and_tok
    ids = shakespeare_ids[:, :300]
    cache, first = LynxCache.from_prefill(model, ids, quant_config=Q(anchor_bits=bits), residual_after_steps=12)
    out = model.generate(torch.cat([ids, first], 1), cache=cache, custom_generate=lynx_hf.speculative_generate,
                         max_new_tokens=15, do_sample=False)
    got = [int(first)] + out[0, ids.shape[1] + 1:].tolist()
    assert cache.stats["drafted"] > 0
    assert got == no_drafts(model, cache, ids[0].tolist(), got)


@pytest.mark.parametrize("bits", (3, 2))
def test_a_narrow_anchor_over_the_network_and_in_a_session(model_and_tok, shakespeare_ids, server,  # noqa: F811
                                                           bits):
    model, _ = model_and_tok
    cfg = Q(anchor_bits=bits)
    prompt = shakespeare_ids[0, :300].tolist()
    cli = DecodeClient(model, *server.address, secret="s3cret")
    try:
        spec = cli.generate(prompt, cfg, max_new_tokens=12)
        ref = cli.generate(prompt, cfg, max_new_tokens=12, speculative=False)
        assert spec["tokens"] == ref["tokens"] and len(spec["tokens"]) == 12
        wide = cli.generate(prompt, Q(), max_new_tokens=2)
        assert spec["anchor_bytes"] < wide["anchor_bytes"] and spec["bytes"] == pytest.approx(wide["bytes"], rel=0.01)
        sess, conv = cli.session(quant_config=cfg), list(prompt)
        for turn in range(2):
            conv += shakespeare_ids[0, 400 + 60 * turn: 440 + 60 * turn].tolist()
            r = sess.generate(conv, max_new_tokens=10)
            assert r["held_tokens"] > 0 if turn else r["held_tokens"] == 0
            assert r["tokens"] == no_drafts(model, r["cache"], conv, r["tokens"])
            conv += r["tokens"]
    finally:
        cli.close()


def test_the_width_is_negotiated_and_another_is_refused(model_and_tok):
    model, _ = model_and_tok
    cli = DecodeClient.__new__(DecodeClient)  # the handshake check alone: no connection needed
    from lynx_hf.arch import kv_geometry

    cli.geometry = kv_geometry(model)
    p = {**cli.geometry, "prompt_len": 10, "quant_config": Q().to_dict()}
    with pytest.raises(WireError, match="different codec config"):
        cli._check_handshake(p, 10, Q(anchor_bits=3))
    cli._check_handshake({**p, "quant_config": Q(anchor_bits=3).to_dict()}, 10, Q(anchor_bits=3))
    # a residual of another width than its anchor's config is refused before it is stored
    s3, s4 = (encode(torch.randn(1, 3, 16, 64), Q(anchor_bits=b), "key") for b in (3, 4))
    store = PromptStore(16, 0, torch.device("cpu"))
    store.put_anchor("key", 0, type(s3)(s3.config, "key", s3.shape, s3.dtype, s3.anchor, None, s3.meta, s3.axis))
    with pytest.raises(ValueError, match="residual shape"):
        store.put_residual("key", 0, s4.residual)
    store.put_residual("key", 0, s3.residual)
