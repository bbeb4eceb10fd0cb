"""Decode side: `NetworkLoader` (the LynxCache loader that a receiving thread drives) and `DecodeClient`, which
sends a request to a prefill server, builds the LynxCache from the KV handshake, and generates."""
from __future__ import annotations

import threading
import time

import torch

from ..cache import LynxCache
from ..config import LynxQuantConfig, SpecConfig
from .serde import check_residual, to_split, unpack_chunk
from .session import Channel, client_handshake, fingerprint, resolve_secret
from .transport import TcpTransport
from .wire import FrameType, Stream, WireError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class NetworkLoader:
    """Receives one request's frames after PROMPT: checks each, writes it into the cache; FIRST and END too.
    Any failure (peer gone, bad frame, timeout) is handed to the cache, so the decoder raises instead of emitting
    unverified tokens."""

    def __init__(self, ch: Channel, prompt: dict, rid: int, timeout_s: float = 30.0):
        self.ch, self.p, self.rid, self.timeout = ch, prompt, rid, timeout_s
        self.first: int | None = None
        self.prefill_s: float | None = None
        self.first_evt, self.done = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self.cache = None

    def attach(self, cache: LynxCache) -> "NetworkLoader":
        self.cache = cache
        cache.loader = self
        threading.Thread(target=self._run, name="lynx-receiver", daemon=True).start()
        return self

    def _run(self) -> None:
        p, cfg = self.p, self.cache.quant_config
        B, H, D, dtype = p["batch"], p["kv_heads"], p["head_dim"], DTYPES[p["dtype"]]
        try:
            while True:
                f = self.ch.recv(self.timeout)
                if f.request_id != self.rid:
                    raise WireError(f"frame for request {f.request_id} inside request {self.rid}")
                if f.type == FrameType.CHUNK:
                    layer, kind, axis, start, count, tensors = unpack_chunk(f.payload)
                    if not (0 <= layer < p["num_layers"] and 0 < count and start + count <= p["prompt_len"]):
                        raise WireError(f"chunk layer {layer} tokens [{start}, {start + count}) out of range")
                    shape = (B, H, count, D)
                    if f.stream == Stream.ANCHOR:
                        self.cache.put_anchor(layer, kind, start, to_split(tensors, cfg, kind, axis, shape, dtype))
                    elif f.stream == Stream.RESIDUAL:
                        self.cache.put_residual(layer, kind, start, check_residual(tensors, cfg, kind, axis, shape, dtype))
                    else:
                        raise WireError("chunk on the control stream")
                elif f.type == FrameType.FIRST:
                    j = f.json()
                    tok = j.get("token")
                    if not isinstance(tok, int):
                        raise WireError("FIRST without an integer token")
                    self.first, self.prefill_s = tok, j.get("prefill_s")
                    self.first_evt.set()
                elif f.type == FrameType.END:
                    j = f.json()
                    if (j.get("anchor_frames"), j.get("residual_frames")) != (
                            self.ch.checker.next[Stream.ANCHOR], self.ch.checker.next[Stream.RESIDUAL]):
                        raise WireError(f"END counts {j} do not match the frames received")
                    if self.first is None or not self.cache.residual_ready():
                        raise WireError("END before the whole prompt KV arrived")
                    self.done.set()
                    return
                else:
                    raise WireError(f"unexpected {f.type.name} frame during a transfer")
        except BaseException as e:  # noqa: BLE001 — delivered to the decoding thread
            self.error = e
            self.cache.fail(e)
            self.first_evt.set()

    def wait_first(self, timeout: float) -> int:
        if not self.first_evt.wait(timeout):
            raise TimeoutError(f"no first token from the prefill side within {timeout} s")
        if self.first is None:
            raise self.error if self.error else WireError("transfer failed")
        return self.first

    def on_draft(self, n: int) -> None:
        pass

    def on_wait(self) -> None:
        pass

    def close(self) -> None:
        pass


class DecodeClient:
    """The decode process's side of one connection to a prefill server."""

    def __init__(self, model, host: str, port: int, secret: str | None = None, timeout_s: float = 30.0):
        self.model, self.timeout = model, timeout_s
        self.ch = Channel(TcpTransport.connect(host, port))
        self._rid = 0
        client_handshake(self.ch, resolve_secret(secret), fingerprint(model))

    def generate(self, input_ids: list[int], quant_config: LynxQuantConfig | None = None, max_new_tokens: int = 32,
                 speculative: bool = True, spec_config: SpecConfig | None = None, **gen_kwargs) -> dict:
        from ..generate import speculative_generate

        self._rid += 1
        rid, cfg = self._rid, quant_config or LynxQuantConfig()
        t0 = time.perf_counter()
        self.ch.send_json(FrameType.REQUEST, {"input_ids": list(map(int, input_ids)), "quant_config": cfg.to_dict()}, rid)
        p = self.ch.recv(self.timeout, FrameType.PROMPT).json()
        if p.get("prompt_len") != len(input_ids) or p.get("dtype") not in DTYPES:
            raise WireError(f"KV handshake does not match the request: {p}")
        try:
            srv_cfg = LynxQuantConfig.from_dict(p.get("quant_config"))
        except (ValueError, TypeError) as e:
            raise WireError(f"bad codec config in handshake: {e}") from None
        if srv_cfg != cfg:
            raise WireError("the prefill side chose a different codec config")
        spec = spec_config or SpecConfig(max_draft_tokens=64 if speculative else 0)
        cache = LynxCache(p["num_layers"], p["prompt_len"], cfg, spec, dtype=DTYPES[p["dtype"]], timeout_s=self.timeout)
        loader = NetworkLoader(self.ch, p, rid, self.timeout).attach(cache)
        first = loader.wait_first(self.timeout + 600)
        t_first = time.perf_counter()
        ids = torch.tensor([list(input_ids) + [first]])
        out = self.model.generate(ids, cache=cache, custom_generate=speculative_generate,
                                  max_new_tokens=max_new_tokens, do_sample=False, **gen_kwargs)
        loader.done.wait(self.timeout)
        if loader.error is not None:
            raise loader.error
        gen = [t - t0 for t, k in cache.timeline if k in ("draft", "verified")]
        ver = [t - t0 for t, k in cache.timeline if k == "verified"]
        return {"tokens": out[0, len(input_ids):].tolist(), "t0": t0, "first_token_at": t_first - t0,
                # from sending the request (= its arrival at the prefill process, on loopback) to the first token
                # this process generated (a draft for Lynx), the first verified one, and the 32nd verified one
                "ttft_s": gen[0], "ttft_verified_s": ver[0], "tt32t_s": ver[min(32, len(ver)) - 1],
                "prefill_s": loader.prefill_s, "stats": dict(cache.stats), "events": list(cache.events),
                "timeline": list(cache.timeline), "bytes": self._bytes(cache)}

    @staticmethod
    def _bytes(cache: LynxCache) -> int:
        return sum(s.nbytes("full") for l in cache.layers for kind in l.segments for s in l.segments[kind].values())

    def close(self) -> None:
        self.ch.close()
