"""Which implementation of the codec's four hot ops (`lynx.Kernels`) runs where.

CUDA: the Triton kernels for encode_codes / dequantize_codes (the range passes stay torch, on the GPU).
CPU, by path (`use(path)`, or LYNX_CPU_CODEC=path in the environment):
  "auto"      the C kernels (kernels/codec_cpu.c, built once per machine), else torch.compile for tensors of at
              least COMPILE_MIN_NUMEL elements, else eager torch (the default);
  "c" / "compiled" / "eager"   that path only (bench codec compares them).
A path that cannot run here (no C compiler, a compiler failure inside torch.compile) warns once and hands over to
the next one down; every path gives bit-identical codes (tests/test_kernels.py)."""
from __future__ import annotations

import dataclasses
import os
import warnings

import torch

from . import lynx

PATHS = ("auto", "c", "compiled", "eager")
COMPILE_MIN_NUMEL = 1 << 18
_state = {"path": os.environ.get("LYNX_CPU_CODEC", "auto"), "c_broken": False}
if _state["path"] not in PATHS:
    raise ValueError(f"LYNX_CPU_CODEC must be one of {PATHS}, got {_state['path']!r}")
_compiled: dict = {}
_compile_broken: set = set()  # ops whose compiled form failed where the eager one did not


def use(path: str = "auto") -> None:
    """Select the CPU path for this process (see the module docstring)."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    _state["path"] = path


def current() -> str:
    return _state["path"]


def _c_kernels() -> lynx.Kernels | None:
    if _state["c_broken"]:
        return None
    try:
        from lynx_hf.kernels import cpu
    except ImportError:  # a copy of the runtime without the kernels (the Hub folder): the torch twin, same codes
        _state["c_broken"] = True
        return None
    ok, why = cpu.available()
    if not ok:
        _state["c_broken"] = True
        warnings.warn(f"the Lynx C kernels are unavailable ({why}); using torch on the CPU")
        return None
    return lynx.Kernels(cpu.minmax_cpu, cpu.range_stats_cpu, cpu.encode_codes_cpu, cpu.dequantize_codes_cpu)


def _guarded(name: str):
    """The op through torch.compile. When the compiled op raises, the eager op runs on the same arguments: if it
    raises too, the arguments were at fault and its error propagates (compiling stays on); if it succeeds, the
    compiler is broken for this op, which stays eager from then on (one warning)."""
    def op(*args, **kwargs):
        eager = getattr(lynx, name)
        if name in _compile_broken:
            return eager(*args, **kwargs)
        try:
            if name not in _compiled:
                _compiled[name] = torch.compile(eager, dynamic=True)
            return _compiled[name](*args, **kwargs)
        except Exception as e:  # noqa: BLE001 — classified by the eager run below
            out = eager(*args, **kwargs)
            _compile_broken.add(name)
            warnings.warn(f"torch.compile of the Lynx codec's {name} failed ({type(e).__name__}: {e}); "
                          f"using eager torch for it")
            return out

    return op


COMPILED = lynx.Kernels(encode_codes=_guarded("encode_codes"), dequantize_codes=_guarded("dequantize_codes"))


def prepare(device) -> str:
    """Build what the codec on `device` needs now (the C kernels on the CPU), so that a server pays for it at start
    rather than inside its first request. Returns the path that will run."""
    device = torch.device(device)
    if device.type == "cuda":
        return "triton"
    k = kernels(device)
    return "c" if k is not COMPILED and k is not lynx.REFERENCE else _state["path"]


def kernels(device: torch.device, numel: int = 0, path: str | None = None) -> lynx.Kernels:
    """The four ops for a tensor of `numel` elements on `device` (CPU: by `path`, default the selected one)."""
    if device.type == "cuda":
        try:
            from lynx_hf.kernels import dequantize_codes_triton, encode_codes_triton
        except ImportError:  # no Triton here, or the Hub folder (no kernels): the torch twin on the GPU
            return lynx.REFERENCE
        return dataclasses.replace(lynx.REFERENCE, encode_codes=encode_codes_triton,
                                   dequantize_codes=dequantize_codes_triton)
    path = path or _state["path"]
    if path in ("auto", "c"):
        k = _c_kernels()
        if k is not None:
            return k
    if path == "compiled" or (path in ("auto", "c") and numel >= COMPILE_MIN_NUMEL):
        return COMPILED
    return lynx.REFERENCE
