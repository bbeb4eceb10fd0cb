"""Fused kernels for the Lynx codec, installed as `lynx_hf.kernels` (never as a bare top-level `kernels`).

Each op has the signature and the results of its pure-torch twin in `lynx_hf.quant.lynx` (`lynx.Kernels`):
  encode.py  encode_codes_triton  ≡ lynx.encode_codes   (GPU: normalise, compand, split, pack)
  dequantize.py  dequantize_codes_triton  ≡ lynx.dequantize_codes   (GPU: unpack, look up, de-normalise; anchor or
                                                                     full tier)
  cpu.py     minmax_cpu, range_stats_cpu, encode_codes_cpu, dequantize_codes_cpu   (CPU, C through ctypes: codec_cpu.c)
Tolerances (asserted in tests/test_kernels.py): codes and packed bytes equal exactly everywhere; the C kernels'
statistics and decoded values equal exactly too (same fp32 operations, no contraction); the Triton kernels' decoded
floats within 1e-6 relative + 1e-7 absolute of the twin (one rounding of an fp32 multiply-add). Triton kernels
upcast to fp32 inside, so bf16 / fp16 inputs run under TRITON_INTERPRET=1 too. Triton is imported only when a
Triton op is asked for.

Imported under the bare name `kernels` — Python run from a checkout puts its root on sys.path, where this folder
shadows Hugging Face's `kernels` package, which Transformers >= 5.25 imports — it steps aside: the installed
`kernels` distribution takes the name (Transformers then imports as it would anywhere else); where none is
installed, this folder answers (no `__version__`: Transformers' version probe finds no usable `kernels`)."""
import sys as _sys

if __name__ == "kernels":  # not lynx_hf.kernels: the bare name belongs to the installed `kernels` distribution
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _path = [p for p in _sys.path if _os.path.abspath(p or _os.getcwd()) != _root]
    _spec = _machinery.PathFinder.find_spec("kernels", _path)
    if _spec is not None:
        _module = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _module  # what `import kernels` returns once this file has run
        _spec.loader.exec_module(_module)

__all__ = ["encode_codes_triton", "dequantize_codes_triton"]


def __getattr__(name):
    if name == "encode_codes_triton":
        from .encode import encode_codes_triton

        return encode_codes_triton
    if name == "dequantize_codes_triton":
        from .dequantize import dequantize_codes_triton

        return dequantize_codes_triton
    raise AttributeError(name)
