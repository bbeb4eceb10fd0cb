"""Triton kernels for the Lynx codec, installed as `lynx_hf.kernels` (never as a bare top-level `kernels`).

One public op per module, each with the same signature as its pure-torch twin in `lynx_hf.quant.lynx`:
  encode.py  encode_codes_triton  ≡ lynx.encode_codes   (normalise, compand, split, pack)
  decode.py  decode_codes_triton  ≡ lynx.decode_codes   (unpack, look up, de-normalise; anchor or full tier)
Tolerances (asserted in tests/test_kernels.py): codes and packed bytes equal exactly; decoded floats within
1e-6 relative + 1e-7 absolute of the twin (one rounding of an fp32 multiply-add). Kernels upcast to fp32 inside,
so bf16 / fp16 inputs run under TRITON_INTERPRET=1 too."""
from .decode import decode_codes_triton
from .encode import encode_codes_triton

__all__ = ["encode_codes_triton", "decode_codes_triton"]
