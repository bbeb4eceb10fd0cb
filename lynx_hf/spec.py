"""Verification math, with no model and no cache: greedy match and the speculative-sampling rule
(Leviathan et al. 2023; Chen et al. 2023), for one token ([B] / [B, V]) or a chain of k drafts (stacked tensors).

`verify_chain(drafts [B, k], target_scores [B, k+1, V], draft_probs [B, k, V] | None)` → `(accepted [B],
tokens [B, k+1])`: row b keeps its first accepted[b] drafts and then one more token, the target's correction at the
first rejection or the bonus token after k acceptances, so every row emits accepted + 1 tokens. Greedy
(draft_probs None) gives exactly the target's argmax chain; sampling gives tokens distributed exactly as sampling
from the target, position by position."""
from __future__ import annotations

import torch

UNUSED = -1  # tokens[b, j] for j > accepted[b]


def _check_probs(p: torch.Tensor, name: str) -> None:
    if not torch.isfinite(p).all():
        raise ValueError(f"{name} contains NaN or Inf")
    if (p < 0).any():
        raise ValueError(f"{name} has negative entries")


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


def verify_chain(drafts: torch.Tensor, target_scores: torch.Tensor, draft_probs: torch.Tensor | None = None,
                 generator=None):
    """drafts [B, k] (k ≥ 0); target_scores [B, k+1, V]: the target's processed scores at each draft position and
    after the last; draft_probs [B, k, V]: the distributions the drafts were sampled from, or None for greedy.
    Returns (accepted [B] long in [0, k], tokens [B, k+1] long): tokens[b, :accepted[b]] = drafts[b, :accepted[b]],
    tokens[b, accepted[b]] = the correction or bonus, UNUSED after it."""
    B, k = drafts.shape
    if target_scores.shape[:2] != (B, k + 1):
        raise ValueError(f"target_scores must be [B, k+1, V] = [{B}, {k + 1}, V], got {tuple(target_scores.shape)}")
    if draft_probs is None:
        fix = target_scores.argmax(-1)                              # [B, k+1]
        ok = fix[:, :k] == drafts
    else:
        V = target_scores.shape[-1]
        if draft_probs.shape != (B, k, V):
            raise ValueError(f"draft_probs must be [B, k, V] = [{B}, {k}, {V}], got {tuple(draft_probs.shape)}")
        p = torch.softmax(target_scores.float(), -1)                # [B, k+1, V]
        _check_probs(p, "target probabilities p")
        fix = torch.multinomial(p[:, k], 1, generator=generator)   # [B, 1]: the bonus
        ok = torch.zeros(B, 0, dtype=torch.bool, device=drafts.device)
        if k:
            ok, res = rejection_verify(drafts.reshape(-1), p[:, :k].reshape(-1, V),
                                       draft_probs.reshape(-1, V).float(), generator)
            fix, ok = torch.cat([res.view(B, k), fix], 1), ok.view(B, k)
    accepted = ok.long().cumprod(1).sum(1)                          # [B]
    j = torch.arange(k + 1, device=drafts.device)[None]             # [1, k+1]
    tokens = torch.where(j < accepted[:, None], torch.cat([drafts, fix[:, k:]], 1), fix)
    return accepted, tokens.masked_fill(j > accepted[:, None], UNUSED)
