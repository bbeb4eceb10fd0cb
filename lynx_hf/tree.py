"""Token trees for drafting, with no model and no cache: growth by cumulative draft probability, the node subset a
verification pass runs, the paths a tree attention mask is built from, and the greedy acceptance walk.

A tree is drafted per prompt row after the root (the last verified token, not a node). Every row's tree has the
same shape of bookkeeping — n nodes, each with a token, a parent (node index, or ROOT), a depth ≥ 1 and a score
(cumulative log-probability of its path under the draft) — so rows stack into [B, n] tensors:

    tokens [B, n] long, parent [B, n] long, depth [B, n] long, score [B, n] float32.

Growth is layer by layer (EAGLE-2 style, by confidence): a draft step runs the current frontier (m nodes of one
depth) in one forward pass, gives each the children its distribution needs (its tokens within `cutoff` nats of
its best, at most `branch`), and keeps the best of those children by score, within `cutoff` of the best, as the
next frontier: one node where the draft is sure, several only while near-ties are open. A child's score never
exceeds its parent's, so the n best nodes of a tree (ties broken by depth) always form a subtree: `best_subtree`
picks what a verification pass runs."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .spec import UNUSED

ROOT = -1  # parent of the nodes at depth 1: the root (the last verified token)
NO_NODE = -2  # padding of Tree.path_nodes past the root


@dataclass
class Tree:
    """Growing token tree(s) for B rows; `frontier` [B, m]: node indices of the deepest expandable layer."""

    tokens: torch.Tensor
    parent: torch.Tensor
    depth: torch.Tensor
    score: torch.Tensor
    frontier: torch.Tensor = field(default=None)

    @classmethod
    def empty(cls, batch: int, device) -> "Tree":
        z = torch.zeros(batch, 0, dtype=torch.long, device=device)
        return cls(z, z.clone(), z.clone(), torch.zeros(batch, 0, device=device), z.clone())

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def add_children(self, logp: torch.Tensor, branch: int, width: int, stop: torch.Tensor | None = None,
                     cutoff: float = float("inf"), floor: float = float("-inf")) -> None:
        """logp [B, m, V]: the draft's log-probabilities after each frontier node (after the root when the tree is
        empty, m = 1). Gives each node as many children as its own distribution needs — its tokens within `cutoff`
        of its most probable one, at most `branch` (one where the draft is sure, several at near-ties) — and makes
        the best of them by cumulative score the next frontier: at most `width`, never a child whose token is in
        `stop` [S] (e.g. EOS), none scoring more than `cutoff` below the best new child, and none scoring below
        `floor` (a node the verify pass would not run) but each row's best (the main line goes on). Every node of
        a step gets the same number of child slots (the most any node needs); the slots a node does not need score
        −inf and are never expanded or verified. The frontier has as many columns as the row that keeps most; it
        is empty when no row has a child worth expanding (e.g. EOS is all but certain)."""
        B, m, V = logp.shape
        if self.size == 0:
            if m != 1:
                raise ValueError(f"an empty tree grows from the root alone (m = 1), got m = {m}")
            par, base, d = torch.full((B, 1), ROOT, device=logp.device), logp.new_zeros(B, 1), 0
        else:
            if self.frontier.shape[1] != m:
                raise ValueError(f"logp has {m} rows per batch row, the frontier {self.frontier.shape[1]}")
            par, base = self.frontier, self.score.gather(1, self.frontier)
            d = int(self.depth.gather(1, self.frontier[:, :1]).max())
        k = min(branch, V)
        top, tok = logp.float().topk(k, dim=-1)                          # [B, m, k], best first
        need = top >= top[..., :1] - cutoff                              # the children each node needs
        k = max(1, int(need.sum(-1).max()))
        top, tok = top[..., :k].masked_fill(~need[..., :k], float("-inf")), tok[..., :k]
        score = (base[:, :, None] + top).reshape(B, m * k)
        tok = tok.reshape(B, m * k)
        par = par[:, :, None].expand(B, m, k).reshape(B, m * k)
        first = self.size
        self.tokens = torch.cat([self.tokens, tok], 1)
        self.parent = torch.cat([self.parent, par], 1)
        self.depth = torch.cat([self.depth, torch.full_like(tok, d + 1)], 1)
        self.score = torch.cat([self.score, score], 1)
        rank = score if stop is None or stop.numel() == 0 else score.masked_fill(torch.isin(tok, stop), float("-inf"))
        best = rank.max(1, keepdim=True).values
        ok = (rank > float("-inf")) & (rank >= score.max(1, keepdim=True).values - cutoff) & \
            ((rank >= floor) | (rank == best))
        keep = int(ok.sum(1).max().clamp(max=min(width, m * k)))
        self.frontier = first + rank.topk(keep, dim=-1).indices  # [B, keep], best first

    def path_nodes(self, nodes: torch.Tensor) -> torch.Tensor:
        """Node ids on each node's path, the node itself first: nodes [B, m] → [B, m, max depth], padded with
        NO_NODE past the root (what each node attends to among the tree's nodes)."""
        out, cur = [], nodes
        for _ in range(int(self.depth.gather(1, nodes).max()) if nodes.numel() else 0):
            out.append(torch.where(cur == ROOT, torch.full_like(cur, NO_NODE), cur))
            cur = torch.where(cur == ROOT, cur, self.parent.gather(1, cur.clamp_min(0)))
        return torch.stack(out, -1) if out else nodes.new_zeros(*nodes.shape, 0)

    def paths(self, nodes: torch.Tensor) -> torch.Tensor:
        """Tokens from depth 1 down to each node: nodes [B, m] of one depth d → [B, m, d]."""
        ids = self.path_nodes(nodes).flip(-1)                                     # [B, m, d], depth 1 first
        return self.tokens.gather(1, ids.flatten(1)).view(ids.shape)


def best_subtree(tree: Tree, n: int, cutoff: float = float("inf"), floor: float = float("-inf")) -> torch.Tensor:
    """Node indices [B, n'] of the best nodes per row by score (ties: shallower first), sorted by depth then index,
    so that every node's parent comes before it: at most n, none scoring below `floor` (a calibrated score: the
    log-probability that the full tier takes the node's path) nor more than `cutoff` below the row's best deepest
    node — whose whole path is in whatever its score, budget permitting — as many per row as the row that keeps
    most. Always a subtree (ancestor-closed). The pass is as large as the tree's likely paths: fewer nodes where
    the draft is sure, up to n at near-ties."""
    if tree.size == 0:  # no draft step ran (the residual landed first): verify the root alone
        return tree.tokens.new_zeros(tree.tokens.shape[0], 0)
    deepest = tree.depth == tree.depth.max(1, keepdim=True).values
    ref = tree.score.masked_fill(~deepest, float("-inf")).max(1, keepdim=True).values   # [B, 1]
    lo = torch.maximum(ref - cutoff, ref.clamp(max=floor))
    n = int((tree.score >= lo).sum(1).max().clamp(1, min(n, tree.size)))
    order = torch.sort(tree.depth, dim=1, stable=True).indices                 # shallower first among ties
    by_score = torch.sort(tree.score.gather(1, order), dim=1, descending=True, stable=True).indices
    pick = order.gather(1, by_score[:, :n])                                     # [B, n]
    key = tree.depth.gather(1, pick) * (tree.size + 1) + pick
    return pick.gather(1, key.argsort(dim=1))


def restrict(tree: Tree, nodes: torch.Tensor):
    """The subtree on `nodes` [B, n] (ancestor-closed, parents first), re-indexed 0..n-1:
    (tokens [B, n], parent [B, n] in that numbering or ROOT, depth [B, n])."""
    B, n = nodes.shape
    remap = torch.full((B, tree.size), ROOT, dtype=torch.long, device=nodes.device)
    remap.scatter_(1, nodes, torch.arange(n, device=nodes.device).expand(B, n))
    par = tree.parent.gather(1, nodes)
    new_par = torch.where(par == ROOT, par, remap.gather(1, par.clamp_min(0)))
    if bool(((par != ROOT) & (new_par == ROOT)).any()):
        raise ValueError("nodes do not form a subtree: a parent is missing")
    return tree.tokens.gather(1, nodes), new_par, tree.depth.gather(1, nodes)


def child_with_token(parent: torch.Tensor, tokens: torch.Tensor, node: torch.Tensor, token: torch.Tensor):
    """For each row, the child of `node` [B] (ROOT for the root) that carries `token` [B]: index [B], −1 if none."""
    if parent.shape[1] == 0:
        return torch.full_like(node, -1)
    hit = (parent == node[:, None]) & (tokens == token[:, None])                 # [B, n]
    idx = hit.long().argmax(1)
    return torch.where(hit.any(1), idx, torch.full_like(idx, -1))


def walk_tree(parent: torch.Tensor, tokens: torch.Tensor, choice: torch.Tensor):
    """The greedy acceptance walk, per row: from the root, emit the target's choice and follow the child carrying it,
    until a node has no such child. parent / tokens [B, n]: a subtree (parents first, `restrict` numbering);
    choice [B, n+1]: the target's token after the root (column 0) and after each node (column j + 1).
    Returns (accepted [B] long: nodes on the accepted path, path [B, n] long: those nodes, −1 after them,
    tokens [B, n+1] long: the accepted path's tokens then the correction or bonus, UNUSED after them) — the tree
    counterpart of `spec.verify_chain` (every row emits accepted + 1 tokens)."""
    B, n = parent.shape
    cur = torch.full((B,), ROOT, dtype=torch.long, device=parent.device)
    path = torch.full((B, n), -1, dtype=torch.long, device=parent.device)
    out = torch.full((B, n + 1), UNUSED, dtype=torch.long, device=parent.device)
    accepted = torch.zeros(B, dtype=torch.long, device=parent.device)
    walking = torch.ones(B, dtype=torch.bool, device=parent.device)
    for d in range(n + 1):
        tok = choice.gather(1, (cur + 1)[:, None])[:, 0]                           # [B]
        out[:, d] = torch.where(walking, tok, out[:, d])
        child = child_with_token(parent, tokens, cur, tok)
        walking = walking & (child >= 0)
        if not bool(walking.any()):
            break
        path[:, d] = torch.where(walking, child, path[:, d])
        accepted += walking.long()
        cur = torch.where(walking, child, cur)
    return accepted, path, out
