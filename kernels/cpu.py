"""The Lynx codec's CPU kernels: codec_cpu.c, built once per machine, called through ctypes over row ranges on
torch's thread count (ctypes releases the GIL, so the ranges run in parallel).

Four ops, each with the signature of its pure-torch twin in `lynx_hf.quant.lynx` and its exact results (same fp32
operations in the same order, -ffp-contract=off; asserted with tolerance 0 in tests/test_kernels.py):
  minmax_cpu        ≡ lynx.minmax         (one pass: per-chunk-channel and per-token min / max, NaN propagates)
  range_stats_cpu   ≡ lynx.range_stats    (fp16 mid-range μ and outward-rounded half-range σ)
  encode_codes_cpu  ≡ lynx.encode_codes   (normalise, code, split, pack)
  dequantize_codes_cpu  ≡ lynx.dequantize_codes   (unpack, look up, de-normalise; anchor or full tier)

Build: `cc -O3 -march=native -ffp-contract=off` (CC overrides the compiler) into $LYNX_CACHE/kernels, else
$XDG_CACHE_HOME/lynx-hf/kernels or ~/.cache/lynx-hf/kernels, keyed by a hash of the source, the flags and the CPU's
model and features; `available()` says whether it built, and the reason if not (no compiler: the torch paths run
instead, see quant/dispatch.py)."""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import math
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("codec_cpu.c")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-std=gnu11", "-shared", "-fPIC"]
MAX_D = 1024  # LYNX_MAX_D in codec_cpu.c
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
MIN_ROWS_PER_THREAD = 256  # below this a second thread costs more than it saves

ABI = 3  # LYNX_ABI in codec_cpu.c
BUILD_TIMEOUT_S = 180
_i64, _int, _f32, _p = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p


class EncodeArgs(ctypes.Structure):
    """lynx_encode_args, field for field (codec_cpu.c)."""
    _fields_ = [("x", _p), ("dtype", _i64), ("S", _i64), ("D", _i64),
                ("gmin", _p), ("gscale", _p), ("NP", _i64), ("page", _i64),
                ("mu", _p), ("rho", _p), ("stat_u8", _i64), ("token_axis", _i64), ("NC", _i64), ("chunk", _i64),
                ("thr", _p), ("nthr", _i64), ("sign_mag", _i64), ("alpha", _f32), ("inv_l", _f32),
                ("poly", _p), ("npoly", _i64),
                ("grid", _p), ("ngrid", _i64), ("grid_lo", _f32), ("grid_scale", _f32),
                ("anchor", _p), ("residual", _p), ("anchor_bits", _i64)]


class DequantizeArgs(ctypes.Structure):
    """lynx_dequantize_args, field for field (codec_cpu.c)."""
    _fields_ = [("anchor", _p), ("residual", _p),
                ("gmin", _p), ("gscale", _p), ("NP", _i64), ("page", _i64),
                ("mu", _p), ("rho", _p), ("stat_u8", _i64), ("token_axis", _i64), ("chunk", _i64),
                ("lut", _p), ("S", _i64), ("D", _i64), ("out_dtype", _i64),
                ("out", _p), ("out_bh_stride", _i64), ("anchor_bits", _i64)]


_SIGNATURES = {
    "lynx_abi": ([], _int),
    "lynx_sizeof_encode_args": ([], _i64),
    "lynx_sizeof_dequantize_args": ([], _i64),
    "lynx_minmax": ([_p, _int, _i64, _i64, _i64, _i64, _i64, _p, _p, _p, _p], None),
    "lynx_range_stats": ([_p, _p, _i64, _p, _p], None),
    "lynx_encode_rows": ([ctypes.POINTER(EncodeArgs), _i64, _i64], None),
    "lynx_dequantize_rows": ([ctypes.POINTER(DequantizeArgs), _i64, _i64], None),
}
_state: dict = {}
_build_lock = threading.Lock()


def _cache_dir() -> Path:
    """$LYNX_CACHE/kernels, else $XDG_CACHE_HOME/lynx-hf/kernels, else ~/.cache/lynx-hf/kernels (the one cache root
    lynx-hf uses, as lynx_hf.model.cache_root)."""
    base = os.environ.get("LYNX_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lynx-hf"
    return Path(base) / "kernels"


def _cpu_id() -> str:
    """What -march=native depends on: the CPU model and feature flags (a cache folder shared between machines
    must not hand an AVX-512 build to a CPU without it)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "|".join(sorted({l for l in lines if l.startswith(("model name", "flags", "Features", "CPU part"))}))
    except OSError:
        return platform.processor()


def _compiler() -> list[str]:
    """The compiler command: $CC split as a shell would ("ccache gcc" works), else cc / gcc / clang."""
    cc = os.environ.get("CC")
    if cc:
        return shlex.split(cc)
    found = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not found:
        raise RuntimeError("no C compiler found (set CC)")
    return [found]


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive lock across processes (two processes starting at once compile once, not twice)."""
    with open(path, "a+") as f:
        try:
            import fcntl

            fcntl.flock(f, fcntl.LOCK_EX)
        except ImportError:  # not POSIX: the atomic rename below still keeps the result whole
            pass
        yield


def _build(extra_flags: list[str] | None = None) -> ctypes.CDLL:
    cc = _compiler()
    flags = FLAGS + list(extra_flags or [])
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join([*cc, *flags, platform.machine(), _cpu_id()]).encode())
    out = _cache_dir() / f"codec_cpu-{key.hexdigest()[:16]}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with _file_lock(out.with_suffix(".lock")):
            if not out.exists():  # another process may have built it while we waited
                with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
                    so = Path(tmp) / out.name
                    try:
                        p = subprocess.run([*cc, *flags, str(SOURCE), "-o", str(so)], capture_output=True, text=True,
                                           timeout=BUILD_TIMEOUT_S)
                    except subprocess.TimeoutExpired:
                        raise RuntimeError(f"{cc[-1]} took over {BUILD_TIMEOUT_S} s on {SOURCE.name}") from None
                    except OSError as e:
                        raise RuntimeError(f"cannot run the C compiler {cc}: {e}") from None
                    if p.returncode != 0:
                        raise RuntimeError(f"{cc[-1]} failed on {SOURCE.name}: {p.stderr.strip()[-400:]}")
                    os.replace(so, out)  # atomic: readers never see half a library
    lib = ctypes.CDLL(str(out))
    for name, (args, res) in _SIGNATURES.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = res
    sizes = (lib.lynx_sizeof_encode_args(), lib.lynx_sizeof_dequantize_args())
    if lib.lynx_abi() != ABI or sizes != (ctypes.sizeof(EncodeArgs), ctypes.sizeof(DequantizeArgs)):
        raise RuntimeError(f"{out.name}: ABI {lib.lynx_abi()} with argument structs of {sizes} bytes, expected ABI "
                           f"{ABI} and {(ctypes.sizeof(EncodeArgs), ctypes.sizeof(DequantizeArgs))}")
    return lib


def _lib() -> ctypes.CDLL:
    if "lib" not in _state:
        with _build_lock:  # one build per process, however many threads ask first
            if "lib" not in _state:
                _state["lib"] = _build()
    return _state["lib"]


def available() -> tuple[bool, str]:
    """(True, "") when the library is built and loaded (and the thread pool started), else (False, why)."""
    try:
        _lib()
        _pool()
        return True, ""
    except (OSError, RuntimeError) as e:
        return False, str(e)


def _pool() -> ThreadPoolExecutor:
    """One pool per process (a forked child has none of its parent's threads), as wide as the machine, its threads
    all started at once (a server's thread count does not grow inside requests); each call uses torch's thread
    count of it."""
    if _state.get("pool_pid") != os.getpid():
        n = os.cpu_count() or 1
        pool = ThreadPoolExecutor(n, thread_name_prefix="lynx-codec")
        barrier = threading.Barrier(n)
        for f in [pool.submit(barrier.wait, 10) for _ in range(n)]:  # n tasks that wait for each other: n threads
            f.result()
        _state["pool"], _state["pool_pid"] = pool, os.getpid()
    return _state["pool"]


def _parallel(fn, n: int, min_per_thread: int) -> None:
    """fn(start, end) over [0, n) split into contiguous ranges, one per thread (torch's thread count)."""
    threads = max(1, min(torch.get_num_threads(), n // max(1, min_per_thread)))
    if threads == 1:
        fn(0, n)
        return
    bounds = [n * i // threads for i in range(threads + 1)]
    for f in [_pool().submit(fn, a, b) for a, b in zip(bounds, bounds[1:]) if b > a]:
        f.result()


HUGE = 1 << 21  # 2 MiB transparent huge pages


def _madvise():
    if "madvise" not in _state:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [_p, ctypes.c_size_t, _int]
            _state["madvise"] = libc.madvise
        except (OSError, AttributeError):
            _state["madvise"] = None
    return _state["madvise"]


def _empty(shape, dtype) -> torch.Tensor:
    """torch.empty, with the 2 MiB-aligned interior of a large output advised as huge pages (Linux
    MADV_HUGEPAGE): a fresh output otherwise costs one page fault per 4 KiB, and those faults, not the codec, bound
    decoding (measured: first writes to a fresh 189 MB tensor at 2.2 GB/s, 9.8 GB/s with the advice)."""
    out = torch.empty(shape, dtype=dtype)
    nbytes = out.numel() * out.element_size()
    madvise = _madvise() if nbytes >= 2 * HUGE and platform.system() == "Linux" else None
    if madvise is not None:
        start = -(-out.data_ptr() // HUGE) * HUGE
        end = (out.data_ptr() + nbytes) // HUGE * HUGE
        if end > start:
            madvise(start, end - start, 14)  # MADV_HUGEPAGE; a refusal only costs speed
    return out


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _check_width(D: int, bits: int) -> None:
    """The anchor widths codec_cpu.c packs (2, 3, 4 bits; the residual the rest), D in whole packed groups."""
    if bits not in (2, 3, 4) or D % (8 if bits == 3 else 4 if bits == 2 else 2):
        raise ValueError(f"the C kernels pack anchors of 2, 3 or 4 bits over whole groups of channels; got "
                         f"{bits} bits for head_dim {D}")


def _check(x: torch.Tensor, name: str) -> None:
    if x.device.type != "cpu" or x.dtype not in DTYPE_CODE or x.shape[-1] > MAX_D or x.shape[-1] % 2:
        raise ValueError(f"{name}: the CPU kernel takes float32/16/bf16 CPU tensors with an even last dim "
                         f"<= {MAX_D}, got {x.dtype} {tuple(x.shape)} on {x.device}")


def minmax_cpu(x: torch.Tensor, chunk: int, channel: bool = True, token: bool = True):
    """Same contract as lynx_hf.quant.lynx.minmax."""
    _check(x, "minmax_cpu")
    B, H, S, D = x.shape
    x = x.contiguous()
    NC = -(-S // chunk)
    lo_c = torch.empty(B, H, NC, D)
    hi_c = torch.empty_like(lo_c)
    lo_t = torch.empty(B, H, S) if token else None
    hi_t = torch.empty_like(lo_t) if token else None
    lib, code = _lib(), DTYPE_CODE[x.dtype]
    _parallel(lambda a, b: lib.lynx_minmax(x.data_ptr(), code, S, D, chunk, a, b, lo_c.data_ptr(), hi_c.data_ptr(),
                                           _ptr(lo_t), _ptr(hi_t)), B * H * NC, MIN_ROWS_PER_THREAD // chunk + 1)
    return (lo_c, hi_c) if channel else (None, None), (lo_t, hi_t)


def range_stats_cpu(lo: torch.Tensor, hi: torch.Tensor):
    """Same contract as lynx_hf.quant.lynx.range_stats."""
    lo, hi = lo.float().contiguous(), hi.float().contiguous()
    mu = torch.empty(lo.shape, dtype=torch.float16)
    sigma = torch.empty_like(mu)
    lib = _lib()
    _parallel(lambda a, b: lib.lynx_range_stats(lo.data_ptr() + 4 * a, hi.data_ptr() + 4 * a, b - a,
                                                mu.data_ptr() + 2 * a, sigma.data_ptr() + 2 * a),
              lo.numel(), 1 << 16)
    return mu, sigma


@functools.lru_cache(maxsize=16)
def _grid(thr_key: bytes) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """(thresholds + two +inf, grid, lo, scale): grid[i] = #thresholds <= the lower edge of bin i − δ, on the
    coarsest power-of-two grid over [thr[0] − 1/8, thr[-1] + 1/8] in which every bin, widened by δ on both sides
    (more than the fp32 rounding of the bin index), holds at most two thresholds."""
    thr = torch.frombuffer(bytearray(thr_key), dtype=torch.float32).double()
    lo, hi, delta = float(thr[0]) - 0.125, float(thr[-1]) + 0.125, 1e-5
    n = 64
    while True:
        scale = (n - 1) / (hi - lo)
        edges = lo + torch.arange(n + 1, dtype=torch.float64) / scale
        below = torch.searchsorted(thr, edges - delta, right=True)          # #thr <= edge − δ
        above = torch.searchsorted(thr, edges[1:] + delta, right=True)      # #thr <= next edge + δ
        if int((above - below[:-1]).max()) <= 2:
            break
        n *= 2
        if n > 1 << 20:
            raise ValueError("encode_codes_cpu: thresholds too close together for the code grid")
    padded = torch.cat([thr.float(), torch.full((2,), float("inf"))])
    return padded, below[:-1].to(torch.int32).contiguous(), lo, scale


POLY_TOL = 3e-7  # max |error| of the fp32 polynomial in y; codes16's edge margin (1e-3 in p = 240·y) covers it


@functools.lru_cache(maxsize=16)
def _poly(alpha: float) -> torch.Tensor | None:
    """fp32 coefficients c of y(|u|) = ln(1 + α|u|)/ln(1 + α) ≈ Σ c_i (2|u| − 1)^i on |u| ∈ [0, 1], the lowest
    degree < 16 whose fp32 Horner evaluation stays within POLY_TOL on a dense grid (degree 6 for the default
    α = 0.5); None when none does (α above ~3: the kernel takes the logarithm instead)."""
    import numpy as np

    t = np.linspace(-1.0, 1.0, 200001)
    y = np.log1p(alpha * (t + 1) / 2) / math.log1p(alpha)
    t32 = t.astype(np.float32)
    for deg in range(2, 16):
        c = np.polynomial.Chebyshev.fit(t, y, deg, domain=[-1, 1]).convert(kind=np.polynomial.Polynomial).coef
        c = c.astype(np.float32)
        acc = np.full_like(t32, c[-1])
        for ci in c[-2::-1]:
            acc = (acc * t32 + ci).astype(np.float32)
        if np.abs(acc.astype(np.float64) - y).max() < POLY_TOL:
            return torch.from_numpy(c.copy())
    return None


def encode_codes_cpu(x, gmin, gscale, mu, rho, thr, *, axis: str, page: int, chunk: int, sign_magnitude: bool,
                     alpha: float | None = None, anchor_bits: int = 4):
    """Same contract as lynx_hf.quant.lynx.encode_codes. x: [B, H, S, D] → (anchor [B, H, S, D·b/8], residual
    [B, H, S, D·(8−b)/8]) uint8, b = anchor_bits. With alpha (AVX-512, b = 4) codes come from the companded
    position, the lanes next to a code edge from the threshold grid; else the grid for every value."""
    _check(x, "encode_codes_cpu")
    B, H, S, D = x.shape
    _check_width(D, anchor_bits)
    x = x.contiguous()
    thr_p, grid, glo, gscale_ = _grid(thr.float().contiguous().numpy().tobytes())
    anchor = _empty((B, H, S, D * anchor_bits // 8), torch.uint8)
    residual = _empty((B, H, S, D * (8 - anchor_bits) // 8), torch.uint8)
    gmin_c, gscale_c = (None, None) if gmin is None else (gmin.contiguous(), gscale.contiguous())
    mu, rho = mu.contiguous(), rho.contiguous()
    NP = 1 if gmin is None else gmin_c.shape[2]
    NC = 1 if axis == "token" else mu.shape[2]
    a_ = -1.0 if alpha is None else float(alpha)  # < 0: the threshold search only
    inv_l = 1.0 / math.log1p(a_) if a_ > 0 else 1.0
    poly = _poly(a_) if a_ > 0 else None
    args = EncodeArgs(x.data_ptr(), DTYPE_CODE[x.dtype], S, D, _ptr(gmin_c), _ptr(gscale_c), NP, page,
                      mu.data_ptr(), rho.data_ptr(), int(mu.dtype == torch.uint8), int(axis == "token"), NC, chunk,
                      thr_p.data_ptr(), thr.numel(), int(sign_magnitude), a_, inv_l,
                      _ptr(poly), 0 if poly is None else poly.numel(),
                      grid.data_ptr(), grid.numel(), glo, gscale_, anchor.data_ptr(), residual.data_ptr(),
                      anchor_bits)
    lib = _lib()
    _parallel(lambda a, b: lib.lynx_encode_rows(ctypes.byref(args), a, b), B * H * S, MIN_ROWS_PER_THREAD)
    return anchor, residual


def dequantize_codes_cpu(anchor, residual, gmin, gscale, mu, rho, lut, *, axis: str, page: int, chunk: int,
                         out_dtype: torch.dtype, out: torch.Tensor | None = None, anchor_bits: int = 4) -> torch.Tensor:
    """Same contract as lynx_hf.quant.lynx.dequantize_codes; a given `out` whose rows are contiguous (a slice of a
    cache's [B, H, T, D] buffer along T, say) is written in place, any other through a copy."""
    B, H, S, HD = anchor.shape
    D = 8 * HD // anchor_bits
    _check_width(D, anchor_bits)
    if out_dtype not in DTYPE_CODE or D > MAX_D:
        raise ValueError(f"dequantize_codes_cpu: unsupported out_dtype {out_dtype} or head_dim {D}")
    if out is not None:
        from .contract import check_out

        check_out(out, anchor, out_dtype, anchor_bits)
        st = out.stride()
        if not (st[3] == 1 and st[2] == D and (B == 1 or st[0] == H * st[1])):
            return out.copy_(dequantize_codes_cpu(anchor, residual, gmin, gscale, mu, rho, lut, axis=axis, page=page,
                                                  chunk=chunk, out_dtype=out_dtype, anchor_bits=anchor_bits))
        dst, bh_stride = out, st[1]
    else:
        dst, bh_stride = _empty((B, H, S, D), out_dtype), S * D
    anchor = anchor.contiguous()
    residual = None if residual is None else residual.contiguous()
    gmin_c, gscale_c = (None, None) if gmin is None else (gmin.contiguous(), gscale.contiguous())
    mu, rho, lut = mu.contiguous(), rho.contiguous(), lut.float().contiguous()
    NP = 1 if gmin is None else gmin_c.shape[2]
    args = DequantizeArgs(anchor.data_ptr(), _ptr(residual), _ptr(gmin_c), _ptr(gscale_c), NP, page, mu.data_ptr(),
                      rho.data_ptr(), int(mu.dtype == torch.uint8), int(axis == "token"), chunk, lut.data_ptr(), S, D,
                      DTYPE_CODE[out_dtype], dst.data_ptr(), bh_stride, anchor_bits)
    lib = _lib()
    _parallel(lambda a, b: lib.lynx_dequantize_rows(ctypes.byref(args), a, b), B * H * S, MIN_ROWS_PER_THREAD)
    return dst
