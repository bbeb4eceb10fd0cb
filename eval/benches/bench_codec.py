"""`lynx-hf bench codec`: encode / dequantize throughput of each implementation next to `copy_` bandwidth, measured in
one run on the same tensors: KV-shaped fp32 tensors [1, 2 × layers × heads, S, 64] from ~1 MB to `max_mb`, medians
over `reps` repeats. CPU paths: "c" (the C kernels, the default), "compiled" (torch.compile of the torch ops),
"eager" (torch ops); CUDA: "triton" (the kernels) and "eager". Encode is the whole encode (range pass, statistics,
codes) into fresh outputs. Decode is measured two ways: into an existing buffer (`decode(..., out=)`, as LynxCache
upgrades the anchor tier to the full tier in place, and as `copy_` writes into an existing dst: the like-for-like
ratio) and into a fresh tensor (which adds the kernel's page faults for new memory: "fresh" columns). GB/s counts
the fp32 input bytes once. Prints a table and one JSON line whose `copy_gbps` and `paths` are those of the headline
size (the whole KV of a 4K-token prompt of the default model, 189 MB); `sizes` has every size."""
from __future__ import annotations

import statistics
import time

from tqdm import tqdm

from lynx_hf import LynxQuantConfig

from lynx_hf.eval.lib.harness import final_line, printer

HEADLINE_TOKENS = 4096  # torch and the codec load when measuring: registering `bench codec` imports neither


def _median(fn, reps: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _paths(device: str):
    """name → (encode(x) -> SplitKV, decode(split, tier, out=None) -> Tensor), each through one implementation."""
    import torch

    from lynx_hf.quant import dispatch, lynx  # internal: each implementation on its own, not the dispatch's pick

    cfg = LynxQuantConfig()
    names = ("triton", "eager") if device == "cuda" else ("c", "compiled", "eager")
    out = {}
    for name in names:
        k = lynx.REFERENCE if name == "eager" else dispatch.kernels(torch.device(device), 1 << 30, name)
        out[name] = (lambda x, k=k: lynx.encode(x, cfg, "key", k),
                     lambda s, t, o=None, k=k: lynx.dequantize(s, t, k, out=o))
    return out


def measure(tokens: int, device: str = "cpu", heads: int = 3, layers: int = 30, reps: int = 5) -> dict:
    import torch

    torch.manual_seed(0)
    x = torch.randn(1, 2 * heads * layers, tokens, 64, device=device)
    x[:, :, 0] *= 30  # an attention-sink-like outlier token
    nbytes = x.numel() * x.element_size()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    dst = torch.empty_like(x)
    row = {"tokens": tokens, "mb": nbytes / 1e6, "copy_gbps": nbytes / _median(lambda: dst.copy_(x), reps, sync) / 1e9,
           "paths": {}}
    for name, (enc, dec) in _paths(device).items():
        split = enc(x)
        gbps = lambda fn: nbytes / _median(fn, reps, sync) / 1e9
        row["paths"][name] = {
            "encode_gbps": gbps(lambda: enc(x)),
            "decode_anchor_gbps": gbps(lambda: dec(split, "anchor", dst)),
            "decode_full_gbps": gbps(lambda: dec(split, "full", dst)),
            "decode_anchor_fresh_gbps": gbps(lambda: dec(split, "anchor")),
            "decode_full_fresh_gbps": gbps(lambda: dec(split, "full"))}
    return row


def run(tokens: int = HEADLINE_TOKENS, as_json: bool = False, device: str = "cpu", max_mb: float = 1200,
        reps: int = 5) -> dict:
    import torch

    say = printer(as_json)
    sizes = sorted({t for t in (32, 256, 2048, tokens, 16384, 24576) if t * 2 * 3 * 30 * 64 * 4 / 1e6 <= max_mb}
                   | {tokens})
    say(f"device {device}, threads {torch.get_num_threads()}; GB/s of fp32 input (median of {reps}); % of copy_")
    cols = (("encode_gbps", "encode"), ("decode_anchor_gbps", "dec anchor"), ("decode_full_gbps", "dec full"),
            ("decode_anchor_fresh_gbps", "anchor fresh"), ("decode_full_fresh_gbps", "full fresh"))
    say(f"{'MB':>8s} {'copy_':>7s}  {'path':9s} " + " ".join(f"{c:>13s}" for _, c in cols))
    rows = {}
    for t in tqdm(sizes, desc="sizes", disable=as_json, leave=False):
        r = rows[t] = measure(t, device, reps=reps)
        for name, v in r["paths"].items():
            say(f"{r['mb']:8.1f} {r['copy_gbps']:7.2f}  {name:9s} " +
                " ".join(f"{v[k]:6.2f} ({100 * v[k] / r['copy_gbps']:3.0f}%)" for k, _ in cols))
    head = rows[tokens]
    out = {"copy_gbps": head["copy_gbps"], "paths": head["paths"], "bytes": int(head["mb"] * 1e6), "device": device,
           "sizes": {str(r["tokens"]): r for r in rows.values()}}
    return final_line(out)


def register(bench) -> None:
    """`lynx-hf bench codec` and its flags (`bench`: the subcommands of `lynx-hf bench`)."""
    # internal: the command line's own parts (its subcommand helper and help texts, the numeric validators)
    from lynx_hf.flags import JSON_HELP, subcommand
    from lynx_hf.flags import count, megabytes, tokens

    p = subcommand(bench, "codec", "encode / dequantize throughput of each implementation next to copy_ bandwidth")
    p.add_argument("--tokens", type=tokens(), default=HEADLINE_TOKENS,
                   help="headline size, the KV of this many tokens")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the tensors and kernels run")
    p.add_argument("--max-mb", type=megabytes(), default=1200, help="largest tensor of the size sweep")
    p.add_argument("--reps", type=count(1000), default=5, help="timed repetitions per size (the median is reported)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(fn=_command)


def _command(a) -> None:
    run(tokens=a.tokens, as_json=a.json, device=a.device, max_mb=a.max_mb, reps=a.reps)
