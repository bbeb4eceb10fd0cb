"""`python -m lynx_hf.vllm.serve.proxy` (or `bash bootstrap.sh vllm-proxy ...`): an OpenAI-compatible front for two
`vllm serve` instances running `LynxConnector` — a prefill one (kv_producer) and a decode one (kv_consumer, with
`LynxProposer`) — as vLLM's own disaggregated-serving proxies do.

Per request (`/v1/completions`, `/v1/chat/completions`, streaming or not): the prompt is tokenized by the prefill
instance (`/tokenize`, chat template included); the prefill instance runs it with max_tokens=1 and publishes its KV
(its first token goes to the client at once); the decode instance gets the shadow (anchor tier, its own cache
salt, output discarded, closed when the real request ends; two, as LynxPD sends them) and the real request (full
tier), whose tokens are streamed back. Concurrent requests are batched by vLLM. A failed upstream request ends the
client's request with an error naming it; the proxy serves on. `logprobs` (an int, /v1/completions) comes back for
every token, the prefill's first one included. A shadow samples as its real request does, with a seed of its own
where the request names one (a draft must not share the randomness that verifies it). `--shadows 0` turns drafting off.
Every answer names its transfer in the `X-Lynx-Xfer` header, the key of the decode instance's `transfer_log` lines
(connector.py): what the request shipped, for an operator's accounting and vllm-bench's.

The proxy's pooled connections to the instances idle at most half the instances' keep-alive (vLLM closes a connection
idle VLLM_HTTP_TIMEOUT_KEEP_ALIVE s, 5 by default; `--upstream-keep-alive`): a request sent on a connection the
instance is closing at that moment would fail with "Server disconnected" before the instance saw it."""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import secrets
import time

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web

from ..fixes import topk_only_broken, topk_only_refusal
from ..scheduler import full_salt
from .pd import shadow_seed

XFER_HEADER = "X-Lynx-Xfer"
UPSTREAM_KEEP_ALIVE_S = 5.0  # vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE default (uvicorn's timeout_keep_alive)
PASS = ("temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "repetition_penalty",
        "presence_penalty", "frequency_penalty", "min_tokens", "return_tokens_as_token_ids")


def upstream_connector(keep_alive_s: float = UPSTREAM_KEEP_ALIVE_S, **kw) -> TCPConnector:
    """aiohttp's connector for a client of `vllm serve`: an idle connection is reused for half the server's
    keep-alive at most (aiohttp's default, 15 s, outlives vLLM's 5 s: a request could go out on a connection the
    server is closing, and fail unanswered)."""
    return TCPConnector(keepalive_timeout=keep_alive_s / 2, **kw)


def _topk_only(sampling: dict) -> str | None:
    """fixes.topk_only_refusal for a request's sampling fields (absent or null: vLLM's defaults; the decode instance
    refuses such a request too, saying why in its log, where the client would hear only that its transfer failed)."""
    get = lambda k, d: d if sampling.get(k) is None else sampling[k]  # noqa: E731
    try:
        return topk_only_refusal(float(get("temperature", 1.0)), int(get("top_k", 0)), float(get("top_p", 1.0)),
                                 1 << 62)
    except (TypeError, ValueError):
        return None  # (vLLM answers a malformed field itself)


class Upstream(Exception):
    """An upstream instance refused or failed a request."""


class Proxy:
    def __init__(self, prefill: str, decode: str, kv_host: str, kv_port: int, method: str = "lynx",
                 draft_budget: int = 31, timeout_s: float = 600.0, release: tuple = (0.0, 0.5),
                 upstream_keep_alive_s: float = UPSTREAM_KEEP_ALIVE_S):
        """release: one entry per shadow, the fraction of the residual placed before it starts (() : no shadows);
        upstream_keep_alive_s: how long the instances keep an idle connection open (the proxy reuses one for half
        that at most)."""
        if not upstream_keep_alive_s > 0:
            raise ValueError(f"upstream_keep_alive_s must be > 0, got {upstream_keep_alive_s!r}")
        self.prefill, self.decode, self.release = prefill.rstrip("/"), decode.rstrip("/"), release
        self.kv_host, self.kv_port, self.method, self.budget = kv_host, kv_port, method, draft_budget
        self.timeout = ClientTimeout(total=timeout_s)
        self.keep_alive_s = upstream_keep_alive_s
        self.http: ClientSession | None = None
        self.shadow_http: ClientSession | None = None  # the shadows' own: see `app`
        self.topk_broken = False  # vLLM's top-k-only defect here (fixes.py), probed when the app starts

    async def _post(self, url: str, body: dict) -> dict:
        async with self.http.post(url, json=body) as r:
            text = await r.text()
            if r.status != 200:
                hint = " (the decode instance fails a request whose KV transfer failed or was refused: its log names " \
                       "the reason)" if url.startswith(self.decode) and r.status >= 500 else ""
                raise Upstream(f"{url} answered {r.status}: {text[:300]}{hint}")
            return json.loads(text)

    async def _ids(self, body: dict, chat: bool) -> list:
        if chat:
            req = {"messages": body["messages"], "add_generation_prompt": True}
            if body.get("tools"):
                req["tools"] = body["tools"]
        elif isinstance(body.get("prompt"), list) and all(isinstance(t, int) for t in body["prompt"]):
            return body["prompt"]
        elif isinstance(body.get("prompt"), str):
            req = {"prompt": body["prompt"]}
        else:
            raise web.HTTPBadRequest(text="prompt must be a string or a list of token ids (one prompt per request)")
        return (await self._post(f"{self.prefill}/tokenize", {"model": body.get("model"), **req}))["tokens"]

    async def forward(self, request: web.Request) -> web.Response:
        """What operators' tools ask besides completions (the model list, the tokenizer), answered by the prefill
        instance as it would answer them."""
        url = f"{self.prefill}{request.path}"
        data = await request.read() if request.method == "POST" else None
        async with self.http.request(request.method, url, data=data,
                                     headers={"Content-Type": request.headers.get("Content-Type",
                                                                                  "application/json")}) as r:
            return web.Response(body=await r.read(), status=r.status,
                                content_type=r.content_type or "application/json")

    async def _shadow(self, body: dict) -> None:
        try:
            async with self.shadow_http.post(f"{self.decode}/v1/completions", json=body) as r:
                await r.read()  # drafts only: never forwarded
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 — closing it aborts it on the decode side
            pass

    async def handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            raise web.HTTPBadRequest(text="the body is not JSON") from None
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens", 16))
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise web.HTTPBadRequest(text=f"max_tokens must be an int >= 1, got {max_tokens!r}")
        model, stream = body.get("model"), bool(body.get("stream", False))
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise web.HTTPBadRequest(text="stream_options must be an object")
        usage = stream and bool(opts.get("include_usage"))
        sampling = {k: body[k] for k in PASS if k in body}
        logprobs = body.get("logprobs")
        if logprobs is not None and (chat or isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= 20):
            raise web.HTTPBadRequest(text="logprobs through the proxy: an int in [0, 20], on /v1/completions only")
        if logprobs is not None:
            sampling["logprobs"] = logprobs
        why = self.topk_broken and _topk_only(sampling)
        if why:
            raise web.HTTPBadRequest(text=why)
        ids = await self._ids(body, chat)
        xfer = secrets.token_hex(8)
        first = await self._post(f"{self.prefill}/v1/completions", {
            "model": model, "prompt": ids, "max_tokens": 1, "return_token_ids": True, **sampling,
            "kv_transfer_params": {"lynx": {"role": "produce", "xfer": xfer, "method": self.method}}})
        c0 = first["choices"][0]
        first_id, first_text = c0["token_ids"][0], c0["text"]
        kv = {"role": "consume", "xfer": xfer, "method": self.method, "host": self.kv_host, "port": self.kv_port,
              "prompt_len": len(ids), "shadow": self.method in ("lynx", "paper") and bool(self.release)}
        ids1, shadows = ids + [first_id], []
        for i, release in enumerate(self.release if kv["shadow"] and max_tokens > 1 else ()):  # as LynxPD does
            own = {k: v for k, v in sampling.items() if k != "logprobs"}
            if isinstance(own.get("seed"), int):
                own["seed"] = shadow_seed(own["seed"], i)
            shadows.append(asyncio.create_task(self._shadow({
                "model": model, "prompt": ids1, "max_tokens": self.budget, **own,
                "cache_salt": f"lynx-anchor-{xfer}",
                "kv_transfer_params": {"lynx": {**kv, "tier": "anchor", "release": release}}})))
        real = {"model": model, "prompt": ids1, "max_tokens": max_tokens - 1, "stream": stream, **sampling,
                "cache_salt": full_salt(self.method), "kv_transfer_params": {"lynx": {**kv, "tier": "full"}}}
        try:
            head = {XFER_HEADER: xfer}  # (the decode instance's transfer_log names it: what this answer shipped)
            if max_tokens == 1:
                return web.json_response(_whole(chat, model, first_text, c0.get("finish_reason"), len(ids), 1,
                                                c0.get("logprobs")), headers=head)
            if not stream:
                r = await self._post(f"{self.decode}/v1/completions", real)
                c = r["choices"][0]
                return web.json_response(_whole(chat, model, first_text + c["text"], c["finish_reason"], len(ids),
                                                1 + r.get("usage", {}).get("completion_tokens", 0),
                                                _joined(c0.get("logprobs"), c.get("logprobs"), len(first_text))),
                                         headers=head)
            real["stream_options"] = {"include_usage": True}  # (R's token count, for the client's usage chunk)
            return await self._stream(request, chat, model, c0, real, len(ids) if usage else None, head)
        finally:
            for t in shadows:
                t.cancel()

    async def _stream(self, request, chat: bool, model, c0: dict, real: dict,
                      prompt_tokens: int | None, head: dict) -> web.StreamResponse:
        """prompt_tokens: the client asked for a usage chunk (stream_options.include_usage): it comes last, as vLLM
        and OpenAI send it, counting the prefill's token and R's."""
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **head})
        await out.prepare(request)
        send = lambda obj: out.write(f"data: {json.dumps(obj)}\n\n".encode())  # noqa: E731
        await send(_chunk(chat, model, c0["text"], None, first=True, logprobs=c0.get("logprobs")))
        completion = 1
        try:
            async with self.http.post(f"{self.decode}/v1/completions", json=real) as r:
                if r.status != 200:
                    await send({"error": {"message": f"decode instance answered {r.status}: "
                                                     f"{(await r.text())[:300]}"}})
                else:
                    async for c in sse(r.content):
                        if "error" in c:
                            await send(c)
                            break
                        if not c.get("choices"):  # R's usage chunk
                            completion += int((c.get("usage") or {}).get("completion_tokens") or 0)
                            continue
                        ch = c["choices"][0]
                        await send(_chunk(chat, model, ch.get("text", ""), ch.get("finish_reason"),
                                          logprobs=ch.get("logprobs")))
        except (ClientError, asyncio.TimeoutError) as e:  # (the headers went out: the error is the stream's event)
            await send({"error": {"message": f"the decode instance failed: {e!r}", "type": "upstream_error"}})
        if prompt_tokens is not None:
            await send({"object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
                        "model": model, "choices": [], "usage": _usage(prompt_tokens, completion)})
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


async def sse(content):
    """An OpenAI-style event stream (an aiohttp response's `content`) → its JSON events, up to `data: [DONE]`."""
    async for line in content:
        line = line.strip()
        if line == b"data: [DONE]":
            return
        if line.startswith(b"data: "):
            yield json.loads(line[6:])


def _joined(first: dict | None, rest: dict | None, offset: int) -> dict | None:
    """The prefill's first-token logprobs and the decode's, as one completions `logprobs` object."""
    if first is None or rest is None:
        return first or rest
    out = {k: first[k] + rest[k] for k in ("tokens", "token_logprobs", "top_logprobs")}
    out["text_offset"] = first["text_offset"] + [o + offset for o in rest["text_offset"]]
    return out


def _chunk(chat: bool, model, text: str, finish, first: bool = False, logprobs=None) -> dict:
    if chat:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    choice = {"index": 0, "text": text, "finish_reason": finish}
    if logprobs is not None:
        choice["logprobs"] = logprobs
    return {"object": "text_completion", "created": int(time.time()), "model": model, "choices": [choice]}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _whole(chat: bool, model, text: str, finish, prompt_tokens: int, completion_tokens: int,
           logprobs: dict | None = None) -> dict:
    usage = _usage(prompt_tokens, completion_tokens)
    if chat:
        return {"object": "chat.completion", "created": int(time.time()), "model": model, "usage": usage,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}]}
    choice = {"index": 0, "text": text, "finish_reason": finish}
    if logprobs is not None:
        choice["logprobs"] = logprobs
    return {"object": "text_completion", "created": int(time.time()), "model": model, "usage": usage,
            "choices": [choice]}


def app(proxy: Proxy) -> web.Application:
    async def start(_):
        proxy.http = ClientSession(timeout=proxy.timeout, connector=upstream_connector(proxy.keep_alive_s))
        # A shadow's connection is never pooled: a shadow ends by an answer the decode instance fails (priced out,
        # its tier gone) or by being cancelled mid-answer, and a real request must never be handed the connection
        # such an end left behind (aiohttp reusing it: "Server disconnected" on the real request).
        proxy.shadow_http = ClientSession(timeout=proxy.timeout, connector=TCPConnector(force_close=True))
        proxy.topk_broken = topk_only_broken()  # the proxy runs beside the engines, from their environment

    async def stop(_):
        await proxy.http.close()
        await proxy.shadow_http.close()

    async def route(request, chat):
        try:
            return await proxy.handle(request, chat)
        except Upstream as e:
            return web.json_response({"error": {"message": str(e), "type": "upstream_error"}}, status=502)
        except (ClientError, asyncio.TimeoutError) as e:  # (an instance unreachable, gone mid-answer, or too slow)
            return web.json_response({"error": {"message": f"an upstream instance failed: {e!r}",
                                                "type": "upstream_error"}}, status=502)
        except (KeyError, IndexError, TypeError) as e:
            return web.json_response({"error": {"message": f"malformed request or upstream answer: {e!r}"}},
                                     status=400)

    async def health(_):
        return web.Response(text="ok")

    a = web.Application()
    a.router.add_post("/v1/completions", functools.partial(route, chat=False))
    a.router.add_post("/v1/chat/completions", functools.partial(route, chat=True))
    a.router.add_get("/health", health)
    for method, path in (("GET", "/v1/models"), ("POST", "/tokenize"), ("POST", "/detokenize")):
        a.router.add_route(method, path, proxy.forward)  # the prefill instance's (the same model and tokenizer)
    a.on_startup.append(start)
    a.on_cleanup.append(stop)
    return a


def main(argv=None) -> None:
    from ...flags import count, seconds

    ap = argparse.ArgumentParser(prog="lynx-hf vllm-proxy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", required=True, help="the prefill vllm serve, e.g. http://127.0.0.1:8100")
    ap.add_argument("--decode", required=True, help="the decode vllm serve, e.g. http://127.0.0.1:8200")
    ap.add_argument("--kv-host", default="127.0.0.1", help="the prefill instance's KV stream host (its extra config)")
    ap.add_argument("--kv-port", type=count(65535), default=7411, help="... and port")
    ap.add_argument("--method", default="lynx", help="the codec (lynx; int8, kivi4, bf16 ship whole)")
    ap.add_argument("--draft-budget", type=count(4096), default=31, help="tokens the shadow drafts")
    ap.add_argument("--shadows", type=count(2, lo=0), default=2,
                    help="shadow requests per Lynx request (released at 0 and half of the residual; 0: no drafts)")
    ap.add_argument("--upstream-keep-alive", type=seconds(), default=None, metavar="S",
                    help="seconds the instances keep an idle connection open (default: VLLM_HTTP_TIMEOUT_KEEP_ALIVE "
                         f"where set, else {UPSTREAM_KEEP_ALIVE_S:g}, vLLM's default)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=count(65535), default=8000)
    a = ap.parse_args(argv)
    keep_alive = a.upstream_keep_alive
    if keep_alive is None:
        try:
            keep_alive = seconds()(os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", str(UPSTREAM_KEEP_ALIVE_S)))
        except argparse.ArgumentTypeError as e:
            ap.error(f"VLLM_HTTP_TIMEOUT_KEEP_ALIVE (the instances' keep-alive, seconds) {e}")
    from ...config import LynxQuantConfig

    LynxQuantConfig(method=a.method)
    if not 1 <= a.draft_budget <= 4096:
        ap.error(f"--draft-budget must be in [1, 4096], got {a.draft_budget}")
    proxy = Proxy(a.prefill, a.decode, a.kv_host, a.kv_port, a.method, a.draft_budget,
                  release=(0.0, 0.5)[:a.shadows], upstream_keep_alive_s=keep_alive)
    web.run_app(app(proxy), host=a.host, port=a.port, print=None)


if __name__ == "__main__":
    main()
