"""The proxy against scripted upstreams (two aiohttp apps answering as vLLM's OpenAI server does): what an
operator's tools see — a streamed request's final usage chunk (stream_options.include_usage, as vLLM and OpenAI send
it), the prefill instance's /tokenize and /v1/models forwarded, text exactly the tokens generated."""
import asyncio
import json
import socket
import time

from aiohttp import ClientSession, web

from lynx_hf.vllm.serve.proxy import Proxy, app

PROMPT_IDS = list(range(10, 22))


def _prefill() -> web.Application:
    async def completions(request):
        body = await request.json()
        assert body["max_tokens"] == 1 and body["prompt"] == PROMPT_IDS
        return web.json_response({"choices": [{"text": " A", "token_ids": [7], "finish_reason": "length"}]})

    a = web.Application()
    a.router.add_post("/v1/completions", completions)
    async def tokenize(request):
        return web.json_response({"tokens": PROMPT_IDS, "count": len(PROMPT_IDS)})

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    a.router.add_post("/tokenize", tokenize)
    a.router.add_get("/v1/models", models)
    return a


def _decode(seen: list) -> web.Application:
    async def completions(request):
        body = await request.json()
        seen.append(body)
        tier = ((body.get("kv_transfer_params") or {}).get("lynx") or {}).get("tier")
        body["_peer"] = request.transport.get_extra_info("peername")[1]  # (the proxy's end of the connection)
        if tier == "anchor":  # a shadow, priced out: vLLM fails it
            return web.json_response({"error": {"message": "priced out"}}, status=500)
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": " B C", "finish_reason": "length"}],
                                      "usage": {"prompt_tokens": 13, "completion_tokens": 2}})
        if tier == "full":
            await asyncio.sleep(0.05)  # (its shadows, sent beside it, arrive first)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for text, fin in ((" B", None), (" C D", "length")):  # (a spec-decoding step: two tokens in one chunk)
            await out.write(f"data: {json.dumps({'choices': [{'index': 0, 'text': text, 'finish_reason': fin}]})}\n\n"
                            .encode())
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 13, "completion_tokens": 3, "total_tokens": 16}
            await out.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
        return out

    a = web.Application()
    a.router.add_post("/v1/completions", completions)
    return a


async def _serve(a: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(a)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


async def _events(resp) -> list:
    return [json.loads(line[6:]) for line in (await resp.text()).splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def _closing_idle(keep_alive_s: float):
    """Middleware: a request arriving on a connection idle longer than keep_alive_s is dropped unanswered — what a
    client sees when it reuses a connection the server closes at that moment (uvicorn's keep-alive, vLLM's 5 s)."""
    last = {}

    @web.middleware
    async def mw(request, handler):
        t, now = request.transport, time.monotonic()
        if t in last and now - last[t] > keep_alive_s:
            t.close()
            raise ConnectionResetError("closed while idle")
        try:
            return await handler(request)
        finally:
            last[t] = time.monotonic()

    return mw


def _run(check, method: str = "int8", keep_alive_s: float | None = None, decode_url: str | None = None):
    async def go():
        seen = []
        runners = []
        for a in (_prefill(), _decode(seen)):
            if keep_alive_s is not None:
                a.middlewares.append(_closing_idle(keep_alive_s))
            r, url = await _serve(a)
            runners.append((r, url))
        kw = {} if keep_alive_s is None else {"upstream_keep_alive_s": keep_alive_s}
        px = Proxy(runners[0][1], decode_url or runners[1][1], "127.0.0.1", 7411, method=method, **kw)
        pr, purl = await _serve(app(px))
        try:
            async with ClientSession() as http:
                await check(http, purl, seen)
        finally:
            for r in [pr] + [r for r, _ in runners]:
                await r.cleanup()

    asyncio.run(go())


def test_a_streamed_request_ends_with_the_usage_chunk_it_asked_for_counting_every_token():
    async def check(http, url, seen):
        body = {"model": "m", "prompt": "hello", "max_tokens": 4, "stream": True}
        async with http.post(f"{url}/v1/completions", json={**body, "stream_options": {"include_usage": True}}) as r:
            ev = await _events(r)
        assert "".join(e["choices"][0]["text"] for e in ev if e["choices"]) == " A B C D"
        assert ev[-1]["choices"] == [] and ev[-1]["usage"] == {"prompt_tokens": 12, "completion_tokens": 4,
                                                               "total_tokens": 16}
        assert all(e["choices"] for e in ev[:-1])
        async with http.post(f"{url}/v1/completions", json=body) as r:  # not asked: no usage chunk
            assert all(e["choices"] for e in await _events(r))
        async with http.post(f"{url}/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            ev = await _events(r)
        assert ev[-1]["object"] == "chat.completion.chunk" and ev[-1]["usage"]["completion_tokens"] == 4
        assert all(b["stream_options"] == {"include_usage": True} for b in seen)

    _run(check)


def test_tokenize_and_the_model_list_come_from_the_prefill_instance():
    async def check(http, url, seen):
        async with http.get(f"{url}/v1/models") as r:
            assert r.status == 200 and (await r.json())["data"][0]["id"] == "m"
        async with http.post(f"{url}/tokenize", json={"model": "m", "prompt": "hello"}) as r:
            assert r.status == 200 and (await r.json())["tokens"] == PROMPT_IDS
        async with http.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 4,
                                                            "stream_options": 3, "stream": True}) as r:
            assert r.status == 400 and "stream_options" in await r.text()

    _run(check)


def test_a_real_request_never_gets_a_connection_a_shadow_used():
    """A shadow ends by a failed answer (priced out) or by being cancelled mid-answer; a real request handed the
    connection such an end left behind would fail ("Server disconnected"). The shadows' connections are their own."""
    async def check(http, url, seen):
        for _ in range(4):
            async with http.post(f"{url}/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 4,
                                                                "stream": True}) as r:
                assert "".join(e["choices"][0]["text"] for e in await _events(r)) == " A B C D"
            await asyncio.sleep(0.05)  # (the shadows answered)
        tiers = [b["kv_transfer_params"]["lynx"]["tier"] for b in seen]
        assert tiers.count("anchor") == 8 and tiers.count("full") == 4
        shadow = {b["_peer"] for b in seen if b["kv_transfer_params"]["lynx"]["tier"] == "anchor"}
        real = {b["_peer"] for b in seen if b["kv_transfer_params"]["lynx"]["tier"] == "full"}
        assert not shadow & real and len(real) == 1  # the real requests' pooled connection, reused

    _run(check, method="lynx")


def test_the_proxy_never_reuses_a_connection_the_instance_may_be_closing():
    """vLLM closes a connection idle 5 s; a request sent on it as it closes fails unanswered ("Server disconnected",
    once a 500 in CI). The proxy reuses a connection for half the instances' keep-alive at most: with requests spaced
    past it, each goes on a fresh connection and every one is answered."""
    async def check(http, url, seen):
        for _ in range(3):
            async with http.post(f"{url}/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 4,
                                                                "stream": True}) as r:
                assert r.status == 200 and "".join(e["choices"][0]["text"] for e in await _events(r)) == " A B C D"
            async with http.post(f"{url}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 3}) as r:
                assert r.status == 200, await r.text()
            await asyncio.sleep(0.5)  # (past the instances' keep-alive: what they held is closing)
        assert len(seen) == 6

    _run(check, keep_alive_s=0.3)


def test_an_unreachable_decode_instance_is_a_502_naming_it_not_a_bare_500():
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sk.getsockname()[1]}"  # (bound, never listening: the connection is refused)

        async def check(http, url, seen):
            async with http.post(f"{url}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 3}) as r:
                body = await r.json()
                assert r.status == 502 and "upstream instance failed" in body["error"]["message"], body
            async with http.post(f"{url}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 3,
                                                                "stream": True}) as r:
                ev = await _events(r)  # (the first token went out before the decode instance was asked)
                assert r.status == 200 and ev[0]["choices"][0]["text"] == " A"
                assert "decode instance failed" in ev[-1]["error"]["message"], ev

        _run(check, decode_url=dead)
