"""`lynx-hf bench kernels --gpu-compile`: every Triton kernel launch the codec's dispatch can make, compiled ahead of
time for NVIDIA sm_80 (A100) and sm_90 (H100/H200) on this machine — no GPU, no driver — with the registers and
spills ptxas reports and the bytes each launch moves per token and layer.

The launches are not a hand-kept list: `launches()` drives `lynx_hf.quant.encode` / `dequantize` through the CUDA
branch of `quant.dispatch` for every codec that runs on the Triton kernels (`quant.CODECS`), every input dtype
(`quant.DTYPES`), axis (`config.AXES`) and tier (`quant.TIERS`), with each `@triton.jit` kernel replaced by a
recorder that keeps what its launch wrapper passes (pointer dtypes, scalars, constexprs). A new kernel, option or
dtype in the dispatch is thereby compiled too. `compile_launch` compiles one for one target and reads
`ptxas -v`. The Triton interpreter (`TRITON_INTERPRET=1`, the CPU tests) accepts code the GPU compiler rejects and
the reverse; this is the check that the GPU compiler takes every kernel."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import subprocess
import tempfile
from concurrent.futures import ProcessPoolExecutor

from lynx_hf.eval.lib.harness import final_line, printer

TARGETS = (80, 90)       # sm_80: A100; sm_90: H100 / H200
HEAD_DIMS = (64, 128)    # SmolLM2-135M's, Llama-3.1-8B's: the kernels' HALF_D block differs
TOKENS = 96              # long enough for a page, a chunk and a partial block


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel specialization as its launch wrapper passes it."""
    module: str                    # the kernel's module, e.g. "lynx_hf.kernels.dequantize"
    kernel: str                    # its name there, e.g. "_dequantize_kernel"
    signature: tuple               # ((arg name, Triton type: "*fp16", "i32", "constexpr"), ...)
    constexprs: tuple              # ((name, value), ...)
    bytes_per_value: float         # bytes this launch reads + writes per K or V value (what the roofline uses)
    what: str                      # a short label

    def label(self) -> str:
        return f"{self.kernel.strip('_')} {self.what}"


# torch dtype (by name: registering `bench kernels` imports no torch) → Triton's pointer type
_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "uint8": "u8", "int32": "i32", "int64": "i64"}


class _Recorder:
    """Stands in for a `@triton.jit` kernel: `kernel[grid](*args, **constexprs)` records the call."""

    def __init__(self, fn, module: str, name: str, calls: list):
        self.fn, self.module, self.name, self.calls = fn, module, name, calls

    def __getitem__(self, grid):
        import torch

        def launch(*args, **kw):
            names = self.fn.arg_names
            sig, moved, ptrs = [], 0.0, set()
            for n, a in zip(names, args):
                if isinstance(a, torch.Tensor):
                    sig.append((n, "*" + _TYPES[str(a.dtype).removeprefix("torch.")]))
                    if a.data_ptr() not in ptrs:  # a placeholder passes another argument again: never read
                        ptrs.add(a.data_ptr())
                        moved += a.numel() * a.element_size()
                elif isinstance(a, bool):
                    sig.append((n, "i1"))
                elif isinstance(a, int):
                    sig.append((n, "i32"))
                else:
                    sig.append((n, "fp32"))
            sig += [(n, "constexpr") for n in names[len(args):]]
            self.calls.append((self.module, self.name, tuple(sig), tuple(sorted(kw.items())), moved))
        return launch


def _record(cfg, D: int, dtype, g, calls: list, seen: set, out: list, tag: str) -> None:
    """Encode and dequantize (both tiers) one config, dtype and head dim at two lengths; each new distinct launch
    into `out` with its bytes moved per value (the slope between the lengths: tables aside)."""
    import torch

    from lynx_hf import quant

    runs = []
    for S in (TOKENS, 2 * TOKENS):
        x = torch.randn(1, 2, S, D, generator=g).to(dtype)
        n0 = len(calls)
        split = quant.encode(x, cfg, "key")
        split.anchor.zero_()  # the recorder wrote no codes: give the decode pass valid ones
        if split.residual is not None:
            split.residual.zero_()
        for tier in quant.TIERS:
            quant.dequantize(split, tier)
        runs.append((x.numel(), calls[n0:]))
    tags = [f"{tag} encode"] + [f"{tag} decode {t}" for t in quant.TIERS]
    (n1, c1), (n2, c2) = runs
    for a, b, t in zip(c1, c2, tags):
        mod, name, sig, ce, moved = a
        key = (mod, name, sig, ce)
        if key not in seen:
            seen.add(key)
            out.append(Launch(mod, name, sig, ce, (b[4] - moved) / (n2 - n1), t))


def launches() -> list[Launch]:
    """Every distinct Triton launch the dispatch makes for the codecs that run on the Triton kernels."""
    import torch

    from lynx_hf import LynxQuantConfig, quant
    # internal: the axes a config may name, the Triton kernels themselves, and the dispatch that picks them (driven
    # here through its CUDA branch on CPU tensors)
    from lynx_hf.config import ANCHOR_BITS, AXES
    from lynx_hf.kernels import dequantize as kdec, encode as kenc
    from lynx_hf.quant import dispatch

    calls: list = []
    jitted = [(m, n) for m in (kenc, kdec) for n, v in vars(m).items() if hasattr(v, "arg_names") and
              hasattr(v, "fn")]
    if not jitted:
        raise RuntimeError("no @triton.jit kernel found in lynx_hf.kernels")
    cuda = dispatch.kernels(torch.device("cuda"))
    triton_codecs = [m for m, c in quant.CODECS.items() if c is quant.CODECS["lynx"]]  # the codecs on these kernels
    out, seen = [], set()
    with contextlib.ExitStack() as stack:
        for m, n in jitted:
            orig = getattr(m, n)
            setattr(m, n, _Recorder(orig, m.__name__, n, calls))
            stack.callback(setattr, m, n, orig)
        orig_kernels = dispatch.kernels
        dispatch.kernels = lambda device, numel=0, path=None: cuda  # the CUDA branch, on CPU tensors
        stack.callback(setattr, dispatch, "kernels", orig_kernels)
        g = torch.Generator().manual_seed(0)
        for method in triton_codecs:
            for axis in [a for a in AXES if a != "auto"]:
                for bits in ANCHOR_BITS:  # a 4-bit anchor packs nibbles, 3 and 2 bits groups of 8 (other kernels)
                    cfg = LynxQuantConfig(method=method, key_axis=axis, value_axis=axis, anchor_bits=bits)
                    for D in HEAD_DIMS if bits == 4 else HEAD_DIMS[:1]:  # (narrow: one head dim, fp32 / bf16)
                        for dtype in quant.DTYPES if bits == 4 else (torch.float32, torch.bfloat16):
                            _record(cfg, D, dtype, g, calls, seen, out, f"{method} {axis} {bits}-bit D={D} "
                                                                        f"{str(dtype)[6:]}")
    if not out:
        raise RuntimeError("the dispatch launched no Triton kernel")
    return out


def _ptxas(ptx: str, arch: int) -> dict:
    """Registers and spill bytes of the PTX's kernel, from `ptxas -v` (the ptxas that ships with Triton)."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        target = re.search(r"^\.target\s+(sm_\w+)", ptx, re.M)  # Triton writes sm_90a for Hopper
        p = subprocess.run([get_ptxas(arch).path, f"-arch={target.group(1) if target else f'sm_{arch}'}", "-v", src,
                            "-o", os.path.join(d, "k.cubin")],
                           capture_output=True, text=True, timeout=120)
    if p.returncode:
        raise RuntimeError(f"ptxas failed for sm_{arch}: {p.stderr.strip()[-400:]}")
    regs = re.search(r"Used (\d+) registers", p.stderr)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", p.stderr)]
    return {"registers": int(regs.group(1)) if regs else None, "spill_bytes": sum(spills)}


def compile_launch(launch: Launch, arch: int, fn=None) -> dict:
    """Compile one launch for sm_`arch` (PTX and cubin) and read its registers and spills; raises what the compiler
    raises. `fn`: another @triton.jit function with the same parameters (the test of this check uses a broken one)."""
    import importlib
    import importlib.util

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said explicitly
    if fn is None and launch.module.endswith(".py"):  # a kernel file outside the package (the check's own test)
        spec = importlib.util.spec_from_file_location(os.path.basename(launch.module)[:-3], launch.module)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        fn = getattr(mod, launch.kernel)
    fn = fn or getattr(importlib.import_module(launch.module), launch.kernel)
    if not hasattr(fn, "cache_key"):
        raise RuntimeError("compile_launch needs real @triton.jit kernels: run it where TRITON_INTERPRET is unset "
                           "(compile_all does, in worker processes)")
    src = ASTSource(fn=fn, signature=dict(launch.signature), constexprs=dict(launch.constexprs))
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32))
    return {"kernel": launch.label(), "arch": f"sm_{arch}", **_ptxas(k.asm["ptx"], arch),
            "shared_bytes": k.metadata.shared, "num_warps": k.metadata.num_warps,
            "bytes_per_value": round(launch.bytes_per_value, 4)}


def _one(args):
    launch, arch = args
    try:
        return compile_launch(launch, arch)
    except Exception as e:  # noqa: BLE001 — reported per launch, the caller decides
        why = " ".join(str(e).split())  # Triton's message: the kernel's source, then the reason at its end
        return {"kernel": launch.label(), "arch": f"sm_{arch}", "error": f"{type(e).__name__}: …{why[-300:]}"}


def _worker_init() -> None:
    os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be real @triton.jit functions to compile


def compile_all(todo: list[Launch] | None = None, workers: int | None = None) -> list[dict]:
    """Every launch (default: `launches()`) for every target, compiled in fresh worker processes (compiling is
    CPU-bound, and a process that set TRITON_INTERPRET=1 — the test suite — holds interpreted kernels)."""
    import multiprocessing

    jobs = [(l, a) for l in (launches() if todo is None else todo) for a in TARGETS]
    workers = workers or max(1, min(len(jobs), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init) as ex:
        return list(ex.map(_one, jobs))


def backend_missing() -> str | None:
    """Why this Triton cannot compile for CUDA here (None: it can)."""
    try:
        import triton  # noqa: F401
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(90).path
    except Exception as e:  # noqa: BLE001
        return f"the installed Triton has no CUDA backend ({type(e).__name__}: {e})"
    return None if path and os.path.exists(path) else "the installed Triton ships no ptxas"


def run(as_json: bool = False) -> dict:
    say = printer(as_json, stderr=True)
    why = backend_missing()
    if why:
        raise RuntimeError(f"bench kernels --gpu-compile: {why}")
    rows = compile_all()
    say(f"{'kernel':48s} {'arch':6s} {'regs':>5s} {'spill B':>8s} {'smem B':>7s} {'warps':>5s} {'B/value':>8s}")
    for r in rows:
        if "error" in r:
            say(f"{r['kernel']:48s} {r['arch']:6s} ERROR {r['error']}")
        else:
            say(f"{r['kernel']:48s} {r['arch']:6s} {r['registers']:5d} {r['spill_bytes']:8d} {r['shared_bytes']:7d} "
                f"{r['num_warps']:5d} {r['bytes_per_value']:8.3f}")
    ok = [r for r in rows if "error" not in r]
    res = {"launches": len(rows) // len(TARGETS), "targets": [f"sm_{a}" for a in TARGETS],
           "compiled": len(ok), "failed": len(rows) - len(ok), "spilling": sum(r["spill_bytes"] > 0 for r in ok),
           "max_registers": {f"sm_{a}": max((r["registers"] for r in ok if r["arch"] == f"sm_{a}"), default=None)
                             for a in TARGETS},
           "bytes_per_value": {r["kernel"]: r["bytes_per_value"] for r in ok}}
    say(f"{res['compiled']} of {len(rows)} compiled; {res['spilling']} spill")
    return final_line(res)


def register(bench) -> None:
    """`lynx-hf bench kernels --gpu-compile` (`bench`: the subcommands of `lynx-hf bench`)."""
    # internal: the command line's own parts (its subcommand helper and help texts)
    from lynx_hf.flags import JSON_HELP, subcommand

    p = subcommand(bench, "kernels", "every Triton launch compiled for sm_80 and sm_90 here (--gpu-compile): "
                                     "registers, spills, bytes moved")
    p.add_argument("--gpu-compile", action="store_true",
                   help="compile ahead of time for NVIDIA sm_80 / sm_90 (no GPU needed)")
    p.add_argument("--json", action="store_true", help=JSON_HELP)
    p.set_defaults(fn=_command)


def _command(a) -> None:
    if not a.gpu_compile:
        raise SystemExit("lynx-hf bench kernels: pass --gpu-compile (compile every Triton launch for sm_80 and "
                         "sm_90; the only kernel benchmark that runs without a GPU)")
    try:
        run(a.json)
    except RuntimeError as e:
        raise SystemExit(str(e))
