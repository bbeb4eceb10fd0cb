"""Every Triton kernel launch the codec's dispatch can make compiles for NVIDIA sm_80 and sm_90 — ahead of time, on
this CPU machine (no GPU, no driver) — without register spills. The Triton interpreter the other kernel tests use
accepts code the GPU compiler rejects; this is the test that a change keeps the GPU build. The launches come from
driving the dispatch (eval/benches/bench_kernels.py), not from a list kept here."""
import re

import pytest

from lynx_hf.eval.benches import bench_kernels as bk

pytestmark = pytest.mark.skipif(bk.backend_missing() is not None, reason=str(bk.backend_missing()))


@pytest.fixture(scope="module")
def launches():
    return bk.launches()


def test_the_launches_cover_every_option_the_dispatch_has(launches):
    """What the dispatch can launch, seen from the launches: both kernels, page on/off, both axes, sign-magnitude
    on/off, anchor-only and full, every input and output dtype, every head dimension's block, and the group-packing
    kernels of 3- and 2-bit anchors."""
    enc = [dict(l.signature) | dict(l.constexprs) for l in launches if l.kernel == "_encode_kernel"]
    dec = [dict(l.signature) | dict(l.constexprs) for l in launches if l.kernel == "_dequantize_kernel"]
    assert enc and dec
    assert {(e["HAS_PAGE"], e["SIGN_MAG"], e["TOKEN_AXIS"]) for e in enc} == \
        {(p, p, t) for p in (False, True) for t in (False, True)}  # the page stage and sign-magnitude: "paper"
    assert {e["x_ptr"] for e in enc} == {"*fp32", "*fp16", "*bf16"}
    assert {d["out_ptr"] for d in dec} == {"*fp32", "*fp16", "*bf16"}
    assert {d["HAS_RES"] for d in dec} == {False, True} and {d["HAS_PAGE"] for d in dec} == {False, True}
    assert {e["HALF_D"] for e in enc} == {D // 2 for D in bk.HEAD_DIMS}
    assert {e["STAT_UNIT"] for e in enc} == {1.0, 1.0 / 255}  # fp16 chunk stats ("lynx"), uint8 ("paper")
    for kernel in ("_encode_groups_kernel", "_dequantize_groups_kernel"):  # anchors of 3 and 2 bits
        narrow = [dict(l.signature) | dict(l.constexprs) for l in launches if l.kernel == kernel]
        assert {n["ABITS"] for n in narrow} == {2, 3}, kernel
        assert {(n.get("HAS_PAGE"), n.get("TOKEN_AXIS")) for n in narrow} == \
            {(p, t) for p in (False, True) for t in (False, True)}


def test_every_launch_compiles_for_ampere_and_hopper_without_spills(launches):
    rows = bk.compile_all()
    assert len(rows) == len(launches) * len(bk.TARGETS)
    failed = [r for r in rows if "error" in r]
    assert not failed, failed[:3]
    spilled = [r for r in rows if r["spill_bytes"]]
    assert not spilled, spilled[:3]
    assert all(0 < r["registers"] <= 255 for r in rows)
    assert {r["arch"] for r in rows} == {"sm_80", "sm_90"}


def test_a_kernel_that_stops_compiling_fails_the_check(launches, tmp_path):
    """The test of the test: a copy of the dequantize kernel with one edit the GPU compiler refuses (a block of
    HALF_D + 1 lanes: not a power of two) fails for both targets, where the real one compiles."""
    import dataclasses

    from lynx_hf.kernels import dequantize

    src = open(dequantize.__file__).read()
    assert src.count("tl.arange(0, HALF_D)") == 1
    broken = tmp_path / "broken_dequantize.py"
    broken.write_text(src.replace("tl.arange(0, HALF_D)", "tl.arange(0, HALF_D + 1)"))
    launch = next(l for l in launches if l.kernel == "_dequantize_kernel")
    good = bk.compile_all([launch], workers=1)
    bad = bk.compile_all([dataclasses.replace(launch, module=str(broken))], workers=1)
    assert all("error" not in r and r["spill_bytes"] == 0 for r in good)
    assert len(bad) == 2 and all(re.search("arange|power of 2|power-of-two", r.get("error", "")) for r in bad), bad
