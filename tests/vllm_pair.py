"""Run inside .venv-vllm by tests/test_vllm.py: one prefill + decode engine pair on the embedded model; prints one JSON
line of what it saw (the test asserts). Usage: python tests/vllm_pair.py MODEL_DIR PORT."""
import json
import sys
import time

import torch


def layout_matches_vllm_op() -> bool:
    """paged.gather/scatter against vLLM's own cpu_attn_reshape_and_cache (what the attention kernel reads)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from lynx_hf.vllm import paged

    ok, checked = True, 0
    for dt in (torch.float32, torch.bfloat16):
        for bs in (32, 128):
            NB, H, D, T, ids = 6, 3, 64, bs + 40, [4, 1, 3]
            if _get_attn_isa(dt, bs, D) not in ("vec", "vec16"):  # e.g. "amx" (bf16 on an AMX CPU): another block
                continue  # layout, which LynxConnector.register_kv_caches refuses by name
            checked += 1
            c = torch.zeros(NB, H, bs, 2 * D, dtype=dt)
            k, v = torch.randn(T, H, D).to(dt), torch.randn(T, H, D).to(dt)
            slots = torch.tensor([ids[p // bs] * bs + p % bs for p in range(T)])
            kc, vc = c.view(NB, H, 2 * bs, D).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, _get_attn_isa(dt, bs, D))
            k2, v2 = paged.gather(c, ids, T)
            c2 = torch.zeros_like(c)
            paged.scatter(c2, ids, 0, "key", k.transpose(0, 1)[None])
            paged.scatter(c2, ids, 0, "value", v.transpose(0, 1)[None])
            ok &= torch.equal(k2[0].transpose(0, 1), k) and torch.equal(v2[0].transpose(0, 1), v) \
                and torch.equal(c2[ids], c[ids])
    return bool(ok) and checked > 0


def main():
    from transformers import AutoTokenizer

    from lynx_hf.vllm.serve.pd import LynxPD, RequestFailed

    model, port = sys.argv[1], int(sys.argv[2])
    out = {"layout": layout_matches_vllm_op()}
    tok = AutoTokenizer.from_pretrained(model)
    counting = tok(", ".join(str(i) for i in range(1, 400))).input_ids[:600]  # predictable: drafts get accepted
    pd = LynxPD(model, bandwidth_mbps=10, port=port, num_speculative_tokens=8, timeout_s=30).start()
    try:
        free0 = pd.decode.free_blocks()
        ref = pd.generate(counting, 24, method="lynx", drafts=False)
        lynx = pd.generate(counting, 24, method="lynx")
        int8 = pd.generate(counting, 24, method="int8")
        out.update(identical=lynx.tokens == ref.tokens, accepted=lynx.accepted, drafted=lynx.drafted,
                   int8_accepted=int8.accepted, n=len(lynx.tokens),
                   bytes=lynx.bytes, anchor_before_full=lynx.anchor_at_s < lynx.full_at_s,
                   free_blocks_kept=pd.decode.free_blocks() == free0)
        try:
            pd.generate(counting, 4, method="no-such-codec")
            out["bad_method"] = "accepted"
        except Exception as e:  # noqa: BLE001
            out["bad_method"] = f"{type(e).__name__}: {e}"
        # the prefill engine dies mid-stream: the request fails in one line, the decode engine serves on
        import threading

        pd.decode.reset_prefix_cache()  # (else its cached blocks of the prompt leave little to stream)
        killer = threading.Timer(2.0, pd.prefill.kill)  # ~2 s into a ~5 s stream
        t = time.time()
        killer.start()
        try:
            pd.generate(counting, 8, method="lynx")
            out["killed"] = "no error"
        except RequestFailed as e:
            out["killed"] = str(e)
        out["killed_s"] = round(time.time() - t, 1)
        time.sleep(1.0)
        out["decode_alive"] = pd.decode.alive()
        out["free_blocks_after_kill"] = pd.decode.free_blocks() == free0
    finally:
        pd.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
