"""The two drafters behind one small interface. A drafter runs draft *steps* on the anchor tier (one forward pass
each) from an aligned `DecodeState`, then `verify()`: one full-tier pass over [the tokens verified since the prompt,
the drafts] after the loop has dropped the anchor-phase tail and armed the per-layer full tier (each layer runs as
soon as its residual has landed), the acceptance math from `spec` / `tree`, and the accepted tokens emitted per row
(`emit_verified`). Rows accept independently; where the model's attention cannot take the engine's masks, every
row keeps the drafts that all live rows accepted (lock-step).

  * `ChainDrafter`: one token per row and step; exact greedy match or the speculative-sampling rule.
  * `TreeDrafter` (greedy): the frontier of a token tree per step, with per-node positions and tree masks; the
    verify pass runs the tree's likely nodes (`verify_min_prob`, at most `verify_nodes`) and keeps only the
    accepted path's KV (gathered in place). A node is verified only where it can pay (`verify_floor`): the chance
    the full tier takes its path times the plain step an accepted token saves must exceed what the node adds to the
    verify pass, both from this request's own draft steps."""
from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod

import torch

from ..floors import line
from ..spec import verify_chain
from ..tree import Tree, best_subtree, restrict, walk_tree
from .state import DecodeState


class Drafter(ABC):
    def __init__(self, state: DecodeState):
        self.s = state
        self.n0 = state.lengths_equal()  # rows are aligned when drafting starts (the first token only)
        self.steps = 0

    @abstractmethod
    def can_step(self) -> bool:
        """Another step could draft something (some row is still going, the tree has a frontier)."""

    @abstractmethod
    def step(self) -> None:
        """One forward pass on the anchor tier."""

    @abstractmethod
    def next_nodes(self) -> int:
        """Positions per row the next step would run (what its cost scales with)."""

    @abstractmethod
    def verify(self) -> tuple[list[int], int]:
        """One full-tier pass; emit what each row accepted. Returns (accepted drafts per row, provisional drafts
        that stood)."""

    def _sequence_part(self):
        """The tokens verified since the prompt [B, n_seq] and their positions: the verify pass re-runs them, since
        the anchor-phase tail was computed against the anchor tier."""
        s, P = self.s, self.s.P
        ids = s.seq[:, P:self.n0]
        pos = s.position(P)[:, None] + torch.arange(self.n0 - P, device=ids.device)
        return ids, pos


def emit_verified(s: DecodeState, tokens: torch.Tensor, accepted: torch.Tensor, scores_at, logits: torch.Tensor):
    """Emit tokens[b, :accepted[b] + 1] per row, in order, until the row stops taking tokens; scores_at(j) gives
    the processed scores [B, V] of column j, logits [B, k+1, V] the raw ones. Without per-row acceptance every live
    row keeps only what all of them accepted. Returns (emitted per row, accepted drafts per row)."""
    rows = s.active_rows()
    acc = [int(a) if r else 0 for a, r in zip(accepted.tolist(), rows)]
    if not s.ragged and any(rows):
        acc = [min(a for a, r in zip(acc, rows) if r)] * s.B
    emitted = [0] * s.B
    for j in range(max(acc) + 1 if any(rows) else 0):
        want = [rows[b] and j <= acc[b] for b in range(s.B)]
        if not any(want):
            break
        took = s.emit(tokens[:, j], scores_at(j), logits[:, j], want)
        for b in range(s.B):
            emitted[b] += took[b]
            rows[b] = rows[b] and took[b]
    return emitted, [min(e, a) for e, a in zip(emitted, acc)]


class ChainDrafter(Drafter):
    def __init__(self, state: DecodeState):
        super().__init__(state)
        self.ctx = state.seq[:, :self.n0]                  # [B, n0 + steps]: verified tokens, then the drafts
        self.probs: list[torch.Tensor] = []                # [B, V] per step, sampling only
        self.going = torch.tensor(state.active_rows(), device=self.ctx.device)

    def can_step(self) -> bool:
        return bool(self.going.any())

    def next_nodes(self) -> int:
        return 1

    def step(self) -> None:
        s = self.s
        pos = s.position([self.ctx.shape[1] - 1] * s.B)[:, None]
        logits = s.forward(self.ctx[:, -1:], pos, 1)[:, -1]
        tok, q = s.pick(s.process(logits, self.ctx))
        if s.pad is not None:  # parked rows draft the pad token, as plain generate feeds them
            tok = torch.where(torch.tensor(s.parked, device=tok.device), torch.full_like(tok, s.pad), tok)
        self.ctx = torch.cat([self.ctx, tok[:, None]], -1)
        self.probs.append(q)
        s.put_provisional(tok)
        self.going &= ~torch.isin(tok, s.eos_ids)  # the stopping criteria see verified tokens only

    def verify(self):
        s, k = self.s, self.ctx.shape[1] - self.n0
        drafts = self.ctx[:, self.n0:]                                             # [B, k]
        ids, pos = self._sequence_part()
        pos = torch.cat([pos, pos[:, -1:] + 1 + torch.arange(k, device=pos.device)], 1)
        logits = s.forward(torch.cat([ids, drafts], 1), pos, k + 1, valid=True)    # [B, k+1, V]
        scores = torch.stack([s.process(logits[:, j], self.ctx[:, :self.n0 + j]) for j in range(k + 1)], 1)
        probs = torch.stack(self.probs, 1) if s.do_sample and k else None
        accepted, tokens = verify_chain(drafts, scores, probs)
        emitted, kept = emit_verified(s, tokens, accepted, lambda j: scores[:, j], logits)
        # the KV of every verified token but each row's last: the sequence part, then the emitted drafts but one
        n_seq = ids.shape[1]
        cols = torch.arange(n_seq + k, device=ids.device)
        longest = max([n_seq + e - 1 for e in emitted if e] or [n_seq])
        need = torch.tensor([n_seq + e - 1 if e else longest for e in emitted], device=ids.device)  # done rows: any
        s.keep_tail(s.P, cols.expand(s.B, -1), cols[None] < need[:, None])
        stood = [kept[b] for b in range(s.B) if emitted[b]]
        return kept, min(stood) if stood else 0


class TreeDrafter(Drafter):
    def __init__(self, state: DecodeState):
        super().__init__(state)
        spec = state.spec
        self.spec = spec
        dev = state.seq.device
        self.tree = Tree.empty(state.B, dev)
        self.slots = state.seq.new_zeros(state.B, 0)   # tree nodes whose KV the cache's tail holds, in order
        self.main: list = []                           # per depth: the node [B] streamed provisionally, or None
        self.root_pos = state.position([self.n0 - 1] * state.B)               # [B]: the last verified token's
        self.stop = state.eos_ids  # never expanded
        self.floor = math.log(spec.verify_min_prob)  # nodes less likely than this are neither expanded nor verified
        self.costs: list = []  # (positions per row, seconds) of each draft step

    def can_step(self) -> bool:
        return self.tree.size == 0 or self.tree.frontier.shape[1] > 0

    def next_nodes(self) -> int:
        return 1 if self.tree.size == 0 else self.tree.frontier.shape[1]

    @staticmethod
    def _visibility(tree: Tree, nodes: torch.Tensor, slots: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
        """vis [B, n, K]: nodes [B, n] see `before` [B, K - Ns - n] (visible cache positions), then among the tree's
        slots [B, Ns] (already in the cache) and the nodes themselves exactly their ancestors and themselves."""
        anc = tree.path_nodes(nodes)                                                # [B, n, d]
        sees = (torch.cat([slots, nodes], 1)[:, None, :, None] == anc[:, :, None, :]).any(-1)  # [B, n, Ns + n]
        return torch.cat([before[:, None, :].expand(-1, nodes.shape[1], -1), sees], -1)

    def step(self) -> None:
        t, m = time.perf_counter(), self.next_nodes()
        self._step()
        self.costs.append((m, time.perf_counter() - t))

    def verify_floor(self) -> float:
        """log p*: the least calibrated path probability worth a place in the verify pass. The draft steps' times
        fit T(m) = a + c·m over their frontier sizes m (one forward pass, m positions a row, as the verify pass has
        n): a node adds c to the verify pass and, kept, saves a plain step of a + c, so it pays iff its path's
        probability p > c / (a + c). `verify_min_prob`'s floor without `price_verify` or until two frontier sizes
        were timed."""
        fit = line(self.costs) if self.spec.price_verify else None
        if fit is None:
            return self.floor
        c, mm, mt = fit
        a = mt - c * mm
        if c <= 0 or a + c <= 0:
            return self.floor
        return max(self.floor, math.log(min(1.0, c / (a + c))))

    def _step(self) -> None:
        s, tree, spec = self.s, self.tree, self.spec
        if tree.size == 0:                                                          # the root: [B, 1, V]
            nodes, logits = None, s.forward(s.seq[:, self.n0 - 1:self.n0], self.root_pos[:, None], 1)
            scores = s.process(logits[:, 0], s.seq[:, :self.n0])[:, None]
        else:
            nodes = tree.frontier                                                   # [B, m]
            before = s.kv_valid[:, :s.kv_valid.shape[1] - self.slots.shape[1]]      # prompt, verified, root
            vis = self._visibility(tree, nodes, self.slots, before)
            pos = self.root_pos[:, None] + tree.depth.gather(1, nodes)
            logits = s.forward(tree.tokens.gather(1, nodes), pos, nodes.shape[1], vis=vis, valid=False)  # [B, m, V]
            self.slots = torch.cat([self.slots, nodes], 1)
            paths = tree.paths(nodes)                                               # [B, m, d]
            scores = torch.stack([s.process(logits[:, j], lambda j=j: torch.cat([s.seq[:, :self.n0], paths[:, j]], 1))
                                  for j in range(nodes.shape[1])], 1)
        first = tree.size
        tree.add_children(torch.log_softmax(scores / spec.tree_temperature, -1), spec.tree_branch, spec.tree_width,
                          self.stop, spec.tree_cutoff, self.floor)
        self._extend_main(nodes, first)

    def _extend_main(self, nodes, first: int) -> None:
        """Append the top child of the last main-line node when that node was just expanded (always after the root)."""
        tree, main, B = self.tree, self.main, self.s.B
        if nodes is None:
            child = torch.full((B,), first, device=tree.tokens.device)  # topk is sorted: the root's best child
        else:
            hit = nodes == main[-1][:, None] if main and main[-1] is not None else None   # [B, m]
            if hit is None or not bool(hit.any(1).all()):
                main.append(None)
                return
            k = (tree.size - first) // nodes.shape[1]  # children per expanded node
            child = first + hit.long().argmax(1) * k
        main.append(child)
        tok = tree.tokens.gather(1, child[:, None])[:, 0]
        if self.s.pad is not None:
            tok = torch.where(torch.tensor(self.s.parked, device=tok.device), torch.full_like(tok, self.s.pad), tok)
        self.s.put_provisional(tok)

    def verify(self):
        s, spec, P = self.s, self.spec, self.s.P
        s.trace.stats.verify_bound = math.exp(floor := self.verify_floor())
        nodes = best_subtree(self.tree, spec.verify_nodes, spec.tree_cutoff, floor)  # [B, n], tree numbering
        tok, par, dep = restrict(self.tree, nodes)                                  # subtree numbering 0..n-1
        sub = Tree(tok, par, dep, self.tree.score.gather(1, nodes))
        B, n, dev = s.B, nodes.shape[1], tok.device
        ids, seq_pos = self._sequence_part()
        n_seq = ids.shape[1]
        idx = torch.arange(n, device=dev).expand(B, n)
        causal = torch.ones(n_seq, n_seq, dtype=torch.bool, device=dev).tril()
        vis_nodes = self._visibility(sub, idx, idx[:, :0], torch.cat([s.kv_valid, torch.ones(B, n_seq, dtype=torch.bool,
                                                                                          device=dev)], 1))
        vis_seq = torch.cat([s.kv_valid[:, None, :].expand(B, n_seq, -1), causal.expand(B, -1, -1),
                             torch.zeros(B, n_seq, n, dtype=torch.bool, device=dev)], -1)
        pos = torch.cat([seq_pos, self.root_pos[:, None] + dep], 1)
        logits = s.forward(torch.cat([ids, tok], 1), pos, n + 1, vis=torch.cat([vis_seq, vis_nodes], 1))
        s.trace.stats.tree_nodes += n                                               # logits: [B, n + 1, V]
        ctx = s.seq[:, :self.n0]
        paths = sub.path_nodes(idx).flip(-1)                                        # [B, n, d], depth 1 first

        def node_ctx(j):  # per row: the verified tokens, then the tokens down to node j - 1 (j = 0: the root)
            if j == 0:
                return ctx
            return [torch.cat([ctx[b], tok[b].gather(0, paths[b, j - 1][paths[b, j - 1] >= 0])]) for b in range(B)]

        if len(s.lp):
            choice = torch.stack([s.process(logits[:, j], lambda j=j: node_ctx(j)).argmax(-1) for j in range(n + 1)], 1)
        else:
            choice = logits.argmax(-1)                                              # [B, n + 1]
        accepted, path, tokens = walk_tree(par, tok, choice)
        cols = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), path + 1], 1).clamp_min(0)  # [B, n+1]
        along = logits.gather(1, cols[:, :, None].expand(-1, -1, logits.shape[-1]))  # [B, n+1, V]
        path_tok = tok.gather(1, path.clamp_min(0))
        emitted, kept = emit_verified(
            s, tokens.clamp_min(0), accepted,
            lambda j: s.process(along[:, j], lambda: torch.cat([ctx, path_tok[:, :j]], 1)), along)
        # only the accepted path's KV stays: the sequence part, then each row's emitted path nodes but the last
        k = max([e - 1 for e in emitted] + [0])
        index = path[:, :k].clamp_min(0)
        valid = torch.stack([torch.arange(k, device=dev) < (e - 1 if e else k) for e in emitted]) if k else \
            torch.zeros(B, 0, dtype=torch.bool, device=dev)
        s.keep_tail(P + n_seq, index, valid)
        rows = [b for b in range(B) if emitted[b]]
        stood = 0
        for d, m in enumerate(self.main):  # provisional drafts that stood: the main line along every row's path
            if m is None or not rows or not all(
                    d < emitted[b] and int(path[b, d]) >= 0 and int(nodes[b, path[b, d]]) == int(m[b]) for b in rows):
                break
            stood += 1
        return kept, stood
