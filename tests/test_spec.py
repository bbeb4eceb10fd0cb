"""Invariants of the verification rules: greedy match, and speculative sampling's output distribution = p."""
import pytest
import torch

from lynx_hf.spec import greedy_verify, rejection_verify


def test_greedy_verify():
    scores = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 1.0]])
    ok, tok = greedy_verify(torch.tensor([1, 2]), scores)
    assert ok.tolist() == [True, False] and tok.tolist() == [1, 0]


@pytest.mark.parametrize("seed", [0, 1])
def test_rejection_sampling_reproduces_p(seed):
    g = torch.Generator().manual_seed(seed)
    V, N = 6, 40000
    p = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    draft = torch.multinomial(q.expand(N, V), 1, replacement=True, generator=g).squeeze(-1)
    ok, tok = rejection_verify(draft, p.expand(N, V).contiguous(), q.expand(N, V).contiguous(), generator=g)
    freq = torch.bincount(tok, minlength=V).float() / N
    # 5 standard errors per bin: fails with probability < 1e-5 when the rule is right
    se = (p * (1 - p) / N).sqrt()
    assert ((freq - p).abs() <= 5 * se + 1e-4).all(), (freq, p)
    # acceptance rate is sum(min(p, q))
    assert abs(ok.float().mean() - torch.minimum(p, q).sum()) < 0.01


def test_identical_distributions_accept_everything():
    p = torch.softmax(torch.randn(4, 10), -1)
    draft = torch.multinomial(p, 1).squeeze(-1)
    ok, tok = rejection_verify(draft, p, p)
    assert ok.all() and torch.equal(tok, draft)


def test_zero_draft_probability_is_rejected_and_nan_raises():
    p = torch.tensor([[0.5, 0.5, 0.0]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    ok, tok = rejection_verify(torch.tensor([1]), p, q)  # q(x) = 0: the drafter could not have sampled it
    assert not ok.any() and tok.item() in (0, 1)
    with pytest.raises(ValueError, match="NaN"):
        rejection_verify(torch.tensor([0]), torch.tensor([[float("nan"), 1.0, 0.0]]), q)
