"""Which implementation of the two hot ops runs where: Triton on CUDA; on CPU a fused torch.compile path for
tensors of at least COMPILE_MIN_NUMEL elements (compiling costs seconds once, so small tensors stay eager), or
always/never with LYNX_COMPILE=1/0 or `enable_compile(True/False)`. If compilation fails (no C++ compiler, an
unsupported platform), the eager reference takes over for the rest of the process, with one warning."""
from __future__ import annotations

import os
import warnings

import torch

COMPILE_MIN_NUMEL = 1 << 18
_compiled: dict = {}
_mode = {"1": True, "0": False}.get(os.environ.get("LYNX_COMPILE", ""), None)  # None = by size
_broken = False


def enable_compile(on: bool | None = True) -> None:
    """True: always compile on CPU; False: never; None: by tensor size (the default)."""
    global _mode
    _mode = on


def _compiled_ops():
    if not _compiled:
        from . import lynx

        _compiled["enc"] = torch.compile(lynx.encode_codes, dynamic=True)
        _compiled["dec"] = torch.compile(lynx.decode_codes, dynamic=True)
    return _compiled


def _guarded(name: str):
    def op(*args, **kwargs):
        global _broken
        from . import lynx

        eager = lynx.encode_codes if name == "enc" else lynx.decode_codes
        if not _broken:
            try:
                return _compiled_ops()[name](*args, **kwargs)
            except Exception as e:  # noqa: BLE001 — any compiler failure: fall back, once, loudly
                _broken = True
                warnings.warn(f"torch.compile of the Lynx codec failed ({type(e).__name__}: {e}); using eager torch")
        return eager(*args, **kwargs)

    return op


def _use_compile(numel: int) -> bool:
    return not _broken and (_mode if _mode is not None else numel >= COMPILE_MIN_NUMEL)


def fused_encode_op(device: torch.device, numel: int = 0):
    if device.type == "cuda":
        from lynx_hf.kernels import encode_codes_triton

        return encode_codes_triton
    return _guarded("enc") if _use_compile(numel) else None


def fused_decode_op(device: torch.device, numel: int = 0):
    if device.type == "cuda":
        from lynx_hf.kernels import decode_codes_triton

        return decode_codes_triton
    return _guarded("dec") if _use_compile(numel) else None
