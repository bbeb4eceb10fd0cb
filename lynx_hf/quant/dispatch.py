"""Which implementation of the two hot ops runs where: Triton on CUDA, torch.compile on CPU (opt-in through
LYNX_COMPILE=1 or `enable_compile()`, since compiling costs seconds once), else None (= the eager reference)."""
from __future__ import annotations

import os

import torch

_compiled: dict = {}
_compile_on = os.environ.get("LYNX_COMPILE", "0") == "1"


def enable_compile(on: bool = True) -> None:
    global _compile_on
    _compile_on = on


def _compiled_ops():
    if not _compiled:
        from . import lynx

        _compiled["enc"] = torch.compile(lynx.encode_codes, dynamic=True)
        _compiled["dec"] = torch.compile(lynx.decode_codes, dynamic=True)
    return _compiled


def fused_encode_op(device: torch.device):
    if device.type == "cuda":
        from lynx_hf.kernels import encode_codes_triton

        return encode_codes_triton
    return _compiled_ops()["enc"] if _compile_on else None


def fused_decode_op(device: torch.device):
    if device.type == "cuda":
        from lynx_hf.kernels import decode_codes_triton

        return decode_codes_triton
    return _compiled_ops()["dec"] if _compile_on else None
