"""Invariants of the verification rules over stacked tensors: every row emits accepted + 1 tokens, greedy is the
target's argmax chain, and speculative sampling's output distribution is the target's (statistically, 5 standard
errors per bin: a correct rule fails with probability < 1e-5 per bin)."""
import pytest
import torch

from lynx_hf.spec import UNUSED, rejection_verify, verify_chain


def _invariants(drafts, accepted, tokens):
    B, k = drafts.shape
    assert tokens.shape == (B, k + 1) and ((0 <= accepted) & (accepted <= k)).all()
    assert torch.equal((tokens != UNUSED).sum(1), accepted + 1)  # emitted = accepted + 1 per row
    for b in range(B):
        a = int(accepted[b])
        assert torch.equal(tokens[b, :a], drafts[b, :a])


@pytest.mark.parametrize("k", [0, 1, 5])
def test_greedy_chain_is_the_argmax_chain(k):
    g = torch.Generator().manual_seed(k)
    B, V = 64, 7
    scores = torch.randn(B, k + 1, V, generator=g)
    target = scores.argmax(-1)
    drafts = torch.where(torch.rand(B, k, generator=g) < 0.7, target[:, :k], torch.randint(0, V, (B, k), generator=g))
    accepted, tokens = verify_chain(drafts, scores)
    _invariants(drafts, accepted, tokens)
    for b in range(B):  # the first mismatch decides; the emitted tokens are exactly the argmax chain's prefix
        a = int(accepted[b])
        assert a == k or drafts[b, a] != target[b, a]
        assert torch.equal(tokens[b, : a + 1], target[b, : a + 1])
    full = verify_chain(target[:, :k], scores)
    assert (full[0] == k).all() and torch.equal(full[1], target)  # all accepted: the bonus is the last argmax


def test_sampling_chain_reproduces_the_target_distribution():
    g = torch.Generator().manual_seed(0)
    N, V, k = 40000, 5, 2
    p = torch.softmax(torch.randn(k + 1, V, generator=g) * 1.5, -1)  # target at each position (context-free)
    q = torch.softmax(torch.randn(k, V, generator=g) * 1.5, -1)
    drafts = torch.stack([torch.multinomial(q[j].expand(N, V), 1, replacement=True, generator=g).squeeze(-1)
                          for j in range(k)], 1)
    accepted, tokens = verify_chain(drafts, p.log().expand(N, k + 1, V).contiguous(),
                                    q.expand(N, k, V).contiguous(), generator=g)
    _invariants(drafts, accepted, tokens)
    for j in range(k + 1):  # token j, over the rows that emitted it, is distributed as p_j
        rows = tokens[:, j] != UNUSED
        n = int(rows.sum())
        freq = torch.bincount(tokens[rows, j], minlength=V).float() / n
        assert ((freq - p[j]).abs() <= 5 * (p[j] * (1 - p[j]) / n).sqrt() + 1e-4).all(), (j, freq, p[j])
    # acceptance at position 0 is sum(min(p0, q0))
    assert abs(float((accepted > 0).float().mean()) - float(torch.minimum(p[0], q[0]).sum())) < 0.01


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="target_scores"):
        verify_chain(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match="draft_probs"):
        verify_chain(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, 5), torch.zeros(2, 3, 4))


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
