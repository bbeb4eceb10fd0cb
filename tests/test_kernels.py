"""Every kernel against its pure-torch twin (lynx.Kernels): the Triton kernels (TRITON_INTERPRET=1 on CPU, set in
conftest), the C kernels (AVX-512 build and the portable build), the torch.compile path. Tolerances: codes,
statistics and packed bytes 0 everywhere; the C kernels' decoded values 0 too; Triton decoded fp32 1e-6 rel +
1e-7 abs, bf16/fp16 one ulp of the output dtype (the interpreter's casts round differently from torch's)."""
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lynx_hf import LynxQuantConfig as Q
from lynx_hf.quant import dispatch
from lynx_hf.quant import lynx as L

from lynx_hf.kernels import cpu  # noqa: E402
from lynx_hf.quant.tables import tables  # noqa: E402

CFGS = [Q(), Q(key_axis="token"), Q.paper(), Q.paper(key_axis="token", page_size=64, chunk_size=16)]
NARROW = [Q(anchor_bits=3), Q(anchor_bits=2, key_axis="token"), Q.paper(anchor_bits=3, key_axis="token"),
          Q.paper(anchor_bits=2)]  # anchors of 3 and 2 bits: the group-packing kernels
ULP = {torch.float32: 0.0, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


DEVICE = os.environ.get("LYNX_TEST_DEVICE", "cpu")  # eval/gpu_check.sh runs these on "cuda" (real Triton)


def sample(S, dtype, seed=0, D=64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, S, D, generator=g) * torch.linspace(0.3, 3, D)
    x[:, :, 0] *= 20
    return x.to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("cfg", CFGS + NARROW, ids=["lynx-ch", "lynx-tok", "paper-ch", "paper-tok", "lynx3-ch",
                                                 "lynx2-tok", "paper3-tok", "paper2-ch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("S", [1, 77])
def test_triton_matches_reference(cfg, dtype, S):
    _triton_vs_reference(cfg, sample(S, dtype), dtype)


@pytest.mark.parametrize("bits,D", [(2, 20), (3, 40), (2, 128), (3, 96)])
def test_triton_narrow_anchor_odd_widths(bits, D):
    """Group packing over head dims that leave a partial (2 bits: D = 20) or a non-power-of-two count of groups."""
    for cfg in (Q(anchor_bits=bits), Q.paper(anchor_bits=bits)):
        _triton_vs_reference(cfg, sample(33, torch.float32, D=D), torch.float32)


def _triton_vs_reference(cfg, x, dtype):
    pytest.importorskip("triton")
    from lynx_hf.kernels import dequantize_codes_triton, encode_codes_triton

    k = dataclasses.replace(L.REFERENCE, encode_codes=encode_codes_triton, dequantize_codes=dequantize_codes_triton)
    ref = L.encode(x, cfg, "key")
    tri = L.encode(x, cfg, "key", k)
    assert torch.equal(ref.anchor, tri.anchor) and torch.equal(ref.residual, tri.residual)
    for tier in ("anchor", "full"):
        a = L.dequantize(ref, tier).float()
        b = L.dequantize(ref, tier, k).float()
        tol = 1e-6 * a.abs() + 1e-7 + ULP[dtype] * a.abs()
        assert ((a - b).abs() <= tol).all(), float((a - b).abs().max())


@pytest.mark.slow  # torch.compile builds
def test_compiled_cpu_path_matches_reference():
    x = sample(300, torch.float32).cpu()
    k = dispatch.kernels(x.device, path="compiled")
    for cfg in (Q(), Q.paper()):
        ref = L.encode(x, cfg, "key")
        fused = L.encode(x, cfg, "key", k)
        assert torch.equal(ref.anchor, fused.anchor) and torch.equal(ref.residual, fused.residual)
        assert torch.allclose(L.dequantize(ref, "full"), L.dequantize(ref, "full", k), rtol=1e-6, atol=1e-7)


# ---- C kernels (CPU): bit-identical to the torch twins, in both builds ----

@pytest.fixture(scope="module", params=["native", "portable"])
def c_kernels(request):
    """The C kernels as built for this machine (AVX-512 where it has it), then rebuilt without AVX-512."""
    ok, why = cpu.available()
    if not ok:
        pytest.skip(f"C kernels unavailable: {why}")
    saved = cpu._state.pop("lib")
    if request.param == "portable":
        cpu._state["lib"] = cpu._build(["-mno-avx512f"])
    else:
        cpu._state["lib"] = saved
    yield L.Kernels(cpu.minmax_cpu, cpu.range_stats_cpu, cpu.encode_codes_cpu, cpu.dequantize_codes_cpu)
    cpu._state["lib"] = saved


CPU_CFGS = CFGS + [Q(alpha=0.0), Q(alpha=3.0, value_axis="token"), Q(alpha=40.0)]


@pytest.mark.parametrize("cfg", CPU_CFGS, ids=["lynx-ch", "lynx-tok", "paper-ch", "paper-tok", "lin", "a3", "a40"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 3, 1, 64), (2, 3, 77, 64), (1, 2, 300, 128), (1, 2, 65, 48), (1, 2, 33, 20)])
def test_c_kernels_match_reference_exactly(c_kernels, cfg, dtype, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * torch.linspace(0.3, 3, shape[-1])
    x[:, :, 0] *= 20
    x = x.to(dtype)
    for kind in ("key", "value"):
        for fast in (True, False):
            ref = L.encode(x, cfg, kind, fast=fast)
            got = L.encode(x, cfg, kind, c_kernels, fast=fast)
            assert got.axis == ref.axis
            assert torch.equal(ref.anchor, got.anchor) and torch.equal(ref.residual, got.residual)
            assert ref.meta.keys() == got.meta.keys()
            for name in ref.meta:
                assert ref.meta[name].dtype == got.meta[name].dtype and torch.equal(ref.meta[name], got.meta[name])
        for tier in ("anchor", "full"):
            a, b = L.dequantize(ref, tier), L.dequantize(ref, tier, c_kernels)
            assert a.dtype == b.dtype and torch.equal(a, b), tier


@pytest.mark.parametrize("cfg", NARROW, ids=["lynx3-ch", "lynx2-tok", "paper3-tok", "paper2-ch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 3, 77, 64), (1, 2, 300, 128), (1, 2, 65, 48), (1, 2, 33, 40)])
def test_c_kernels_narrow_anchor_match_reference_exactly(c_kernels, cfg, dtype, shape):
    """Anchors of 3 and 2 bits (the portable group-packing loops in both builds): codes, packed bytes and both
    tiers' values equal the torch twin's exactly."""
    test_c_kernels_match_reference_exactly(c_kernels, cfg, dtype, shape)


def test_c_kernels_two_bit_anchor_over_a_partial_group(c_kernels):
    test_c_kernels_match_reference_exactly(c_kernels, Q(anchor_bits=2), torch.float32, (1, 2, 33, 20))


def test_c_minmax_and_range_stats_match_reference(c_kernels):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 130, 64, generator=g) * 5
    x[0, 1, 7, 3] = float("nan")
    x[1, 2, 129, 60] = float("inf")
    (lc, hc), (lt, ht) = L.minmax(x, 64)
    (lc2, hc2), (lt2, ht2) = c_kernels.minmax(x, 64)
    for a, b in ((lc, lc2), (hc, hc2), (lt, lt2), (ht, ht2)):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    lo, hi = torch.randn(1000, generator=g) * 100, None
    hi = lo + torch.rand(1000, generator=g) * torch.logspace(-9, 3, 1000)
    for a, b in zip(L.range_stats(lo, hi), c_kernels.range_stats(lo, hi)):
        assert a.dtype == b.dtype == torch.float16 and torch.equal(a, b)


@pytest.mark.parametrize("bits", [4, 3, 2])
@pytest.mark.parametrize("method,alpha", [("lynx", 0.5), ("lynx", 0.0), ("lynx", 3.0), ("lynx", 40.0),
                                          ("paper", 255.0), ("paper", 0.0)])
def test_c_codes_exact_at_every_threshold(c_kernels, method, alpha, bits):
    """u on, just above and just below each threshold (and its mirror), plus dense random u: the arithmetic code
    path must agree with the threshold count everywhere, edges included, at every anchor width."""
    thr, _, _ = tables(method, alpha, "center" if method == "lynx" else "paper", bits)
    up, down = torch.tensor(float("inf")), torch.tensor(-float("inf"))
    u = torch.cat([thr, thr.nextafter(up), thr.nextafter(down), -thr, (-thr).nextafter(torch.tensor(0.0)),
                   torch.rand(100_000, generator=torch.Generator().manual_seed(2)) * 2.2 - 1.1,
                   torch.tensor([0.0, -0.0, 1.0, -1.0, 5.0, -5.0, 1e-30, -1e-30])])
    u = torch.cat([u, torch.zeros((-u.numel()) % 64)]).view(1, 1, -1, 64)
    S = u.shape[2]
    mu, rho = torch.zeros(1, 1, S, dtype=torch.float16), torch.ones(1, 1, S, dtype=torch.float16)
    args = dict(axis="token", page=256, chunk=64, sign_magnitude=method == "paper", anchor_bits=bits)
    ref = L.encode_codes(u, None, None, mu, rho, thr, **args, alpha=None)
    assert torch.equal(ref[0], L.encode_codes(u, None, None, mu, rho, thr, **args, alpha=alpha)[0])  # torch fast
    got = c_kernels.encode_codes(u, None, None, mu, rho, thr, **args, alpha=alpha)
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])


def test_c_encode_refuses_nan_like_reference(c_kernels):
    x = torch.randn(1, 2, 70, 64)
    x[0, 1, 69, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        L.encode(x, Q(), "key", c_kernels)


def test_dispatch_picks_c_on_cpu_and_keeps_paths_selectable():
    assert dispatch.kernels(torch.device("cpu"), 10).encode_codes is cpu.encode_codes_cpu
    assert dispatch.kernels(torch.device("cpu"), 10, path="eager") is L.REFERENCE
    with pytest.raises(ValueError, match="path"):
        dispatch.use("fast")


def test_compiled_path_survives_bad_input_and_falls_back_on_a_broken_compiler(monkeypatch):
    """An error that eager torch raises too is the input's: it propagates and compiling stays on. One the eager op
    does not raise is the compiler's: that op goes eager for good, with one warning."""
    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError("inductor fell over")

    monkeypatch.setattr(dispatch, "_compile_broken", set())
    monkeypatch.setitem(dispatch._compiled, "dequantize_codes", broken)
    monkeypatch.setattr(L, "dequantize_codes", lambda *a, **k: (_ for _ in ()).throw(ValueError("bad codes")))
    with pytest.raises(ValueError, match="bad codes"):
        dispatch.COMPILED.dequantize_codes(1)
    assert "dequantize_codes" not in dispatch._compile_broken
    monkeypatch.setattr(L, "dequantize_codes", lambda *a, **k: "eager result")
    with pytest.warns(UserWarning, match="dequantize_codes failed"):
        assert dispatch.COMPILED.dequantize_codes(1) == "eager result"
    assert dispatch._compile_broken == {"dequantize_codes"} and dispatch.COMPILED.dequantize_codes(1) == "eager result"
    assert len(calls) == 2  # the broken compiled op is not tried again


def test_c_build_checks_its_abi_and_bounds_the_compiler(monkeypatch, tmp_path):
    """The library must report the ABI and argument-struct sizes the Python side expects; $CC is split like a
    shell would; a compiler that hangs is stopped after BUILD_TIMEOUT_S."""
    import sys

    monkeypatch.setenv("LYNX_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu, "ABI", 999)
    with pytest.raises(RuntimeError, match="ABI 3 .* expected ABI 999"):
        cpu._build()
    monkeypatch.setattr(cpu, "BUILD_TIMEOUT_S", 0.5)
    monkeypatch.setenv("CC", f"{sys.executable} -c 'import time; time.sleep(30)'")
    with pytest.raises(RuntimeError, match="took over 0.5 s"):
        cpu._build()


ROOT = Path(__file__).resolve().parent.parent


def _from_the_root(code: str) -> str:
    """Run `code` in a fresh Python whose working directory (so sys.path[0]) is the repository's root."""
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def test_the_bare_name_kernels_is_left_to_the_installed_distribution_from_a_checkout():
    """Python run from the repository's root puts it on sys.path, where kernels/ would shadow Hugging Face's
    `kernels` (imported by Transformers >= 5.25, issue 53): Transformers' model classes import, and `kernels` is the
    installed one."""
    from importlib.metadata import PackageNotFoundError, distribution

    out = _from_the_root("import transformers, transformers.activations, kernels, lynx_hf.kernels as k; "
                         "transformers.LlamaForCausalLM; print(kernels.__file__, k.__name__)")
    try:
        installed = bool(distribution("kernels"))
    except PackageNotFoundError:  # (Transformers < 5.25: this folder answers the bare name, harmlessly)
        installed = False
    where, name = out.split()
    assert (Path(where).resolve().parent != ROOT / "kernels") == installed and name == "lynx_hf.kernels"


def test_no_other_top_level_folder_shadows_an_installed_distribution():
    """Every folder at the root that Python could import by its bare name from a checkout (a package: it has an
    __init__.py) names no installed distribution's top-level module, kernels/ apart (it steps aside, above)."""
    from importlib.metadata import packages_distributions

    ours = {d.name for d in ROOT.iterdir() if (d / "__init__.py").is_file()}
    assert {"kernels", "lynx_hf", "eval"} <= ours
    taken = packages_distributions()
    clash = {name: taken[name] for name in ours - {"kernels", "lynx_hf"} if name in taken}
    assert not clash, f"these folders shadow installed distributions from a checkout: {clash}"


@pytest.mark.slow
def test_the_default_model_loads_from_the_repository_root():
    out = _from_the_root("import lynx_hf; m, tok = lynx_hf.load_default_model(); print(type(m).__name__)")
    assert out.split()[-1] == "LlamaForCausalLM"
