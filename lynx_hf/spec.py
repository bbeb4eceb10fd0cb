"""Verification math, with no model and no cache: greedy match and the speculative-sampling rule
(Leviathan et al. 2023; Chen et al. 2023). Tokens: [B]; probabilities: [B, V] rows that sum to 1."""
from __future__ import annotations

import torch


def _check_probs(p: torch.Tensor, name: str) -> None:
    if not torch.isfinite(p).all():
        raise ValueError(f"{name} contains NaN or Inf")
    if (p < 0).any():
        raise ValueError(f"{name} has negative entries")


def greedy_verify(draft: torch.Tensor, target_scores: torch.Tensor):
    """(accepted [B] bool, token [B]): the target's argmax, which equals the draft where accepted."""
    target = target_scores.argmax(-1)
    return target == draft, target


def rejection_verify(draft: torch.Tensor, p: torch.Tensor, q: torch.Tensor, generator=None):
    """Accept draft x ~ q with probability min(1, p(x)/q(x)); on rejection sample from norm(max(0, p − q)).
    Returns (accepted [B] bool, token [B]); token is distributed exactly as p. A zero or non-finite q(x) (a draft
    the drafter could not have sampled) is rejected; if p − q has no positive mass, falls back to p."""
    _check_probs(p, "target probabilities p")
    _check_probs(q, "draft probabilities q")
    px = p.gather(-1, draft[:, None]).squeeze(-1)
    qx = q.gather(-1, draft[:, None]).squeeze(-1)
    u = torch.rand(px.shape, generator=generator, device=p.device, dtype=p.dtype)
    ratio = torch.where(qx > 0, px / qx.clamp_min(torch.finfo(p.dtype).tiny), torch.zeros_like(px))
    accepted = u < ratio.clamp(max=1.0)
    resid = (p - q).clamp_min(0)
    mass = resid.sum(-1, keepdim=True)
    resid = torch.where(mass > 0, resid / mass.clamp_min(torch.finfo(p.dtype).tiny), p)
    resample = torch.multinomial(resid, 1, generator=generator).squeeze(-1)
    return accepted, torch.where(accepted, draft, resample)
