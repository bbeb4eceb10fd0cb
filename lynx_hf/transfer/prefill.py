"""Prefill side: layer-wise sending overlapped with the forward pass, and the server process.

`StreamingCache.update` is called by every attention layer during prefill; it stores the layer's KV (as a
DynamicCache does), encodes it, and queues the anchor chunks (priority 0) and residual chunks (priority 1) at once,
so the link carries layer i while layer i+1 computes."""
from __future__ import annotations

import logging
import socket
import threading
import time

import torch
from transformers import DynamicCache

from ..config import LynxQuantConfig
from ..quant import encode
from .serde import pack_chunk
from .session import Channel, fingerprint, resolve_secret, server_handshake
from .transport import PRIO_ANCHOR, PRIO_END, PRIO_RESIDUAL, LinkEmulator, TcpTransport
from .wire import FrameType, Stream, WireError

log = logging.getLogger("lynx_hf.prefill")
MAX_PROMPT = 131072
SEGMENT = 256  # tokens per chunk frame: small frames keep strict priority responsive


class StreamingCache(DynamicCache):
    def __init__(self, config, on_layer, prompt_len: int):
        super().__init__(config=config)
        self.on_layer, self.prompt_len = on_layer, prompt_len

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if key_states.shape[-2] == self.prompt_len:
            self.on_layer(layer_idx, key_states, value_states)
        return out


def send_layer(ch: Channel, rid: int, cfg: LynxQuantConfig, layer: int, k: torch.Tensor, v: torch.Tensor,
               segment: int = SEGMENT) -> list:
    futs = []
    S = k.shape[2]
    for kind, x in (("key", k), ("value", v)):
        for start in range(0, S, segment):
            s = encode(x[:, :, start:start + segment].contiguous(), cfg, kind)
            futs.append(ch.send_chunk(Stream.ANCHOR, rid, pack_chunk(layer, kind, start, s, False), PRIO_ANCHOR))
            if s.residual is not None:
                futs.append(ch.send_chunk(Stream.RESIDUAL, rid, pack_chunk(layer, kind, start, s, True), PRIO_RESIDUAL))
    return futs


@torch.no_grad()
def serve_request(model, ch: Channel, req: dict, rid: int) -> dict:
    """Validate a REQUEST, announce the KV (PROMPT), prefill while streaming, then FIRST and END."""
    ids = req.get("input_ids")
    if not (isinstance(ids, list) and 0 < len(ids) <= MAX_PROMPT and all(isinstance(i, int) for i in ids)):
        raise WireError(f"input_ids must be a list of 1..{MAX_PROMPT} ints")
    vocab = model.config.vocab_size
    if min(ids) < 0 or max(ids) >= vocab:
        raise WireError(f"token id out of range [0, {vocab})")
    try:
        cfg = LynxQuantConfig.from_dict(req.get("quant_config") or {})
    except (ValueError, TypeError) as e:
        raise WireError(f"bad quant_config: {e}") from None
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    ch.send_json(FrameType.PROMPT, {"request_id": rid, "num_layers": c.num_hidden_layers, "batch": 1,
                                    "kv_heads": c.num_key_value_heads, "head_dim": head_dim, "dtype": dtype,
                                    "prompt_len": len(ids), "segment": SEGMENT, "quant_config": cfg.to_dict()},
                 rid)
    t0 = time.perf_counter()
    futs = []
    cache = StreamingCache(model.config, lambda i, k, v: futs.extend(send_layer(ch, rid, cfg, i, k, v)), len(ids))
    out = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=1)
    first = int(out.logits[0, -1].argmax())
    prefill_s = time.perf_counter() - t0
    ch.send_json(FrameType.FIRST, {"token": first, "prefill_s": prefill_s}, rid, wait=False)
    end = ch.send_json(FrameType.END, {"anchor_frames": ch.out_seq[Stream.ANCHOR],
                                       "residual_frames": ch.out_seq[Stream.RESIDUAL]}, rid, PRIO_END, wait=False)
    end.result(600)
    return {"prompt_len": len(ids), "prefill_s": prefill_s, "sent_s": time.perf_counter() - t0}


class PrefillServer:
    """Accepts decode peers; each connection: handshake, then requests until the peer closes. A bad client only
    ever costs its own connection."""

    def __init__(self, model, host: str = "127.0.0.1", port: int = 0, secret: str | None = None,
                 bandwidth_bps: float | None = None, latency_s: float = 0.0, handshake_timeout: float = 10.0):
        self.model, self.secret, self.fp = model, resolve_secret(secret), fingerprint(model)
        self.bw, self.latency, self.hs_timeout = bandwidth_bps, latency_s, handshake_timeout
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.address = self.sock.getsockname()[:2]
        self._compute = threading.Lock()  # one prefill at a time: the CPU is the bottleneck anyway
        self._stop = threading.Event()

    def serve_forever(self) -> None:
        self.sock.settimeout(0.5)
        while not self._stop.is_set():
            try:
                conn, addr = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            threading.Thread(target=self._handle, args=(conn, addr), daemon=True).start()

    def start(self) -> "PrefillServer":
        threading.Thread(target=self.serve_forever, name="lynx-prefill-server", daemon=True).start()
        return self

    def _handle(self, conn: socket.socket, addr) -> None:
        ch = Channel(TcpTransport(conn, LinkEmulator(self.bw, self.latency)))
        try:
            server_handshake(ch, self.secret, self.fp, self.hs_timeout)
            while True:
                try:
                    f = ch.recv(timeout=3600, expect=FrameType.REQUEST)
                except WireError as e:
                    if "closed" in str(e):
                        return
                    raise
                req = f.json()
                with self._compute:
                    info = serve_request(self.model, ch, req, f.request_id)
                log.info("request %s from %s: %s", f.request_id, addr, info)
        except (WireError, ConnectionError, TimeoutError, OSError) as e:
            log.warning("client %s dropped: %s", addr, e)
            try:
                ch.send_json(FrameType.ERROR, {"error": str(e)[:500]}, wait=False).result(1)
            except Exception:  # noqa: BLE001 — the peer may be gone already
                pass
        except Exception as e:  # noqa: BLE001 — never let one request take the server down
            log.exception("request from %s failed: %s", addr, e)
        finally:
            ch.close()

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
