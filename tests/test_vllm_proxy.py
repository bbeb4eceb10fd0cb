"""The proxy against scripted upstreams (two aiohttp apps answering as vLLM's OpenAI server does): what an
operator's tools see — a streamed request's final usage chunk (stream_options.include_usage, as vLLM and OpenAI send
it), the prefill instance's /tokenize and /v1/models forwarded, text exactly the tokens generated."""
import asyncio
import json

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


def _run(check, method: str = "int8"):
    async def go():
        seen = []
        runners = []
        for a in (_prefill(), _decode(seen)):
            r, url = await _serve(a)
            runners.append((r, url))
        px = Proxy(runners[0][1], runners[1][1], "127.0.0.1", 7411, method=method)
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
