"""The prefill server's memory against what it declares (issue: declared, enforced memory), through the CLI: a
`serve-prefill --prefix-cache-mb 64 --max-inflight-mb 8 --max-concurrent-prefills 2` child on the default model, one
6K-token miss, then 4 raw clients sending the same prompt that never read a frame while a well-behaved client is
served (its tokens equal the miss's); the child's VmRSS stays under baseline + 64 MB + 4 x (8 MB + one layer's
frames) + the working-set and forward-pass bounds + 200 MB of slack, and returns within that slack of baseline +
the prefix cache once the raw clients are gone. The measurement is `lynx-hf bench server-memory`."""
import sys

import pytest


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmRSS from /proc")
def test_the_servers_memory_stays_within_its_declared_bounds(model_and_tok):
    from lynx_hf.eval.benches.bench_server_memory import run

    r = run(tokens=6000, stalled=4, prefix_cache_mb=64, max_inflight_mb=8, slots=2, send_timeout_s=10, as_json=True)
    assert r["served_meanwhile_identical"], r
    assert max(r["peak_miss_mb"], r["peak_stalled_mb"]) <= r["bound_mb"], r
    assert r["rss_idle_mb"] <= r["idle_bound_mb"], r
