"""The end-to-end Lynx path over `torch.distributed`: rank 0 is the prefill process (`serve_channel`), rank 1 the
decode process (`DecodeClient` over a `DistTransport`), each with its own copy of the model. Rank 1 decodes one
prompt with INT8 and with Lynx (drafting, and waiting for the full tier as the reference) and prints one JSON line.

    python -m lynx_hf.eval.benches.dist_pair [--backend nccl|gloo] [--device cuda|cpu] [--tokens 1024]

NCCL needs one GPU per rank (it refuses two ranks on one device); on a single GPU use gloo for the transport with
the models on CUDA (the default picks that)."""
from __future__ import annotations

import argparse
import secrets

import torch

from lynx_hf.eval.lib.harness import final_line, free_port


def _rank(rank: int, port: int, backend: str, device: str, tokens: int, new_tokens: int, secret: str, q) -> None:
    import torch.distributed as dist

    import lynx_hf
    from lynx_hf import LynxQuantConfig
    # internal: the prefill side without a PrefillServer (its request loop on one channel), over a transport the
    # server does not listen on (torch.distributed), and the handshake and model geometry that channel needs
    from lynx_hf.arch import fingerprint, head_dim
    from lynx_hf.transfer.decode import DecodeClient
    from lynx_hf.transfer.prefill import serve_channel
    from lynx_hf.transfer.auth import Channel, resolve_secret, server_handshake
    from lynx_hf.transfer.transport import DistTransport

    try:
        dev = f"cuda:{rank % torch.cuda.device_count()}" if device == "cuda" else "cpu"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        model, tok = lynx_hf.load_default_model(device=dev)
        t = DistTransport(peer=1 - rank, device=dev if backend == "nccl" else "cpu")
        if rank == 0:
            ch = Channel(t)
            server_handshake(ch, resolve_secret(secret), fingerprint(model))
            serve_channel(model, ch)
            return
        text = open(torch.__file__.replace("__init__.py", "functional.py")).read()
        ids = tok(text, add_special_tokens=False).input_ids[:tokens]
        cli = DecodeClient(model, secret=secret, transport=t, timeout_s=120)
        runs = {"INT8": cli.generate(ids, LynxQuantConfig(method="int8"), new_tokens),
                "Lynx": cli.generate(ids, LynxQuantConfig(), new_tokens),
                "Lynx, full tier only": cli.generate(ids, LynxQuantConfig(), new_tokens, speculative=False)}
        cli.close()
        # PCIe: what the decode process moved host → GPU for the prompt's KV (the cache's stores are the one place),
        # next to what the dequantized KV would have been
        c = model.config
        kv_float = 2 * c.num_hidden_layers * c.num_key_value_heads * len(ids) * head_dim(c) * \
            next(model.parameters()).element_size()
        out = {k: {m: r[m] for m in ("ttft_s", "ttft_verified_s", "tt32t_s", "bytes", "h2d_bytes")} | {
            "drafted": r["stats"]["drafted"], "accepted": r["stats"]["accepted"]} for k, r in runs.items()}
        out["identical_to_full"] = runs["Lynx"]["tokens"] == runs["Lynx, full tier only"]["tokens"]
        out["backend"], out["device"], out["tokens"] = backend, dev, len(ids)
        out["kv_float_bytes"] = kv_float
        q.put(out)
    except BaseException as e:  # noqa: BLE001 — reported by the parent
        q.put({"error": f"rank {rank}: {type(e).__name__}: {e}"})
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(backend: str | None = None, device: str | None = None, tokens: int = 1024, new_tokens: int = 32) -> dict:
    import torch.multiprocessing as mp

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    backend = backend or ("nccl" if device == "cuda" and torch.cuda.device_count() >= 2 else "gloo")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    args = (free_port(), backend, device, tokens, new_tokens, secrets.token_hex(16), q)
    procs = [ctx.Process(target=_rank, args=(r, *args)) for r in (0, 1)]
    for p in procs:
        p.start()
    res = q.get(timeout=900)
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
    if "error" in res:
        raise RuntimeError(res["error"])
    return final_line(res)


if __name__ == "__main__":
    from lynx_hf.flags import tokens  # internal: the one validator of every numeric flag

    a = argparse.ArgumentParser(description=__doc__)
    a.add_argument("--backend", choices=["nccl", "gloo"])
    a.add_argument("--device", choices=["cuda", "cpu"])
    a.add_argument("--tokens", type=tokens(), default=1024)
    a.add_argument("--new-tokens", type=tokens(hi=4096), default=32)
    o = a.parse_args()
    run(o.backend, o.device, o.tokens, o.new_tokens)
