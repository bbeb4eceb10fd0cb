"""Triton kernels against their pure-torch twins (TRITON_INTERPRET=1 on CPU, set in conftest), and the
torch.compile CPU path. Tolerances: codes 0; decoded fp32 1e-6 rel + 1e-7 abs; bf16/fp16 one ulp of the output
dtype (the interpreter's casts round differently from torch's)."""
import os

import pytest
import torch

from lynx_hf import LynxQuantConfig as Q
from lynx_hf.quant import dispatch
from lynx_hf.quant import lynx as L

triton = pytest.importorskip("triton")
from lynx_hf.kernels import decode_codes_triton, encode_codes_triton  # noqa: E402

CFGS = [Q(), Q(key_axis="token"), Q.paper(), Q.paper(key_axis="token", page_size=64, chunk_size=16)]
ULP = {torch.float32: 0.0, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


DEVICE = os.environ.get("LYNX_TEST_DEVICE", "cpu")  # eval/gpu_check.sh runs these on "cuda" (real Triton)


def sample(S, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, S, 64, generator=g) * torch.linspace(0.3, 3, 64)
    x[:, :, 0] *= 20
    return x.to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("cfg", CFGS, ids=["lynx-ch", "lynx-tok", "paper-ch", "paper-tok"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("S", [1, 77])
def test_triton_matches_reference(cfg, dtype, S):
    x = sample(S, dtype)
    ref = L.encode(x, cfg, "key")
    tri = L.encode(x, cfg, "key", impl=encode_codes_triton)
    assert torch.equal(ref.anchor, tri.anchor) and torch.equal(ref.residual, tri.residual)
    for tier in ("anchor", "full"):
        a = L.decode(ref, tier).float()
        b = L.decode(ref, tier, impl=decode_codes_triton).float()
        tol = 1e-6 * a.abs() + 1e-7 + ULP[dtype] * a.abs()
        assert ((a - b).abs() <= tol).all(), float((a - b).abs().max())


def test_compiled_cpu_path_matches_reference():
    x = sample(300, torch.float32)
    dispatch.enable_compile(True)
    try:
        for cfg in (Q(), Q.paper()):
            ref = L.encode(x, cfg, "key")
            fused = L.encode(x, cfg, "key", impl=dispatch.fused_encode_op(x.device))
            assert torch.equal(ref.anchor, fused.anchor) and torch.equal(ref.residual, fused.residual)
            a = L.decode(ref, "full")
            b = L.decode(ref, "full", impl=dispatch.fused_decode_op(x.device))
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    finally:
        dispatch.enable_compile(None)
