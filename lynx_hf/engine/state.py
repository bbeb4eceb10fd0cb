"""`DecodeState`: one generation's state, which both drafters and the decode loop share — each row's verified tokens
(rows may differ in length: they accept drafts independently), which cache positions each row may attend to,
the caller's logits processors and stopping criteria applied per row, the outputs, the stream, the telemetry.

Rows. Row b's verified tokens are `seq[b, :n[b]]` (prompt included). The cache holds the KV of every verified
token but each row's last. A row stops taking tokens when the caller's stopping criteria finish it (with an EOS
criterion, a finished row is *parked*: padded at the end, as plain `generate` pads it) or at the length limit. When
every row has finished, the output is cut at the length where the last one finished, exactly where plain
lock-step `generate` would have stopped; rows that are behind there keep decoding up to it.

Cache positions. `kv_valid` [B, S] says which of the S cache positions row b may see (left padding, tree slots and
the holes that ragged acceptance leaves are not visible) and `kv_pos` [B, S] their logical positions. Without
holes a pass goes through the model's own 2D-mask path; with holes, or for tree passes, the engine builds 4D masks
(masks.py), which needs an attention implementation that takes them — elsewhere rows accept in lock-step."""
from __future__ import annotations

import inspect
from collections import defaultdict
from contextlib import nullcontext

import torch
from torch import nn

from .masks import layer_masks, masked_gqa


class DecodeState:
    def __init__(self, model, input_ids, cache, attention_mask, logits_processor, stopping_criteria,
                 generation_config, streamer, spec):
        gc = generation_config
        B, T = input_ids.shape
        P, dev = cache.prompt_len, input_ids.device
        self.model, self.cache, self.trace, self.streamer = model, cache, cache.trace, streamer
        self.spec = spec  # SpecConfig: the drafting settings of this call
        self.lp, self.sc, self.do_sample = logits_processor, stopping_criteria, bool(gc.do_sample)
        self.P, self.B = P, B
        has_eos = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
        pad = gc._pad_token_tensor
        # as plain generate: finished rows get the pad token only when an EOS criterion is present
        self.pad = int(pad.reshape(-1)[0]) if has_eos and pad is not None else None
        self.max_length = getattr(stopping_criteria, "max_length", None)
        self.ragged = False  # rows accept drafts independently (else in lock-step); set by the loop (support.py)
        # positions always go in as position_ids, as generate passes them, where the model takes them
        self.pass_positions = "position_ids" in inspect.signature(getattr(model, "forward", model)).parameters
        ids = [c.eos_token_id for c in stopping_criteria if hasattr(c, "eos_token_id")]
        ids = [t.reshape(-1) for t in ids if isinstance(t, torch.Tensor)]
        self.eos_ids = torch.cat(ids).to(dev) if ids else input_ids.new_zeros(0)  # drafting stops at these
        cap = max(T, self.max_length or 0) + 1
        self.seq = input_ids.new_zeros(B, cap)                                   # seq: [B, cap], rows of n[b]
        self.seq[:, :T] = input_ids
        self.n = [T] * B
        self.finished, self.parked = [False] * B, [False] * B
        self.finish_len: list[int | None] = [None] * B
        mask = attention_mask[:, :P].bool() if attention_mask is not None else torch.ones(B, P, dtype=torch.bool,
                                                                                            device=dev)
        self.has_padding = not bool(mask.all())
        self.kv_valid = mask                                                     # [B, S] bool
        self.kv_pos = (mask.long().cumsum(-1) - 1).clamp_min(0)                  # [B, S] long
        self.prompt_pos = mask.long().sum(-1)                                    # [B]: position of token P
        keep = gc.return_dict_in_generate
        self.scores = [[] for _ in range(B)] if keep and gc.output_scores else None
        self.logits = [[] for _ in range(B)] if keep and gc.output_logits else None
        self.streamed = P  # columns of seq already put to the streamer
        self.provisional = getattr(streamer, "provisional", hasattr(streamer, "put_provisional"))
        self.pending_drafts = 0

    # -- rows -----------------------------------------------------------------------------------------------------
    def active(self, b: int) -> bool:
        """Row b still takes tokens."""
        return not self.parked[b] and self.n[b] < self.bound()

    def bound(self) -> float:
        """Length no row goes past: the length limit, and once every row has finished, where the last one did."""
        lim = self.max_length if self.max_length is not None else float("inf")
        return min(lim, max(self.finish_len)) if all(self.finished) else lim

    def active_rows(self) -> list[bool]:
        return [self.active(b) for b in range(self.B)]

    def lengths_equal(self) -> int:
        """The common length of all rows (the engine drafts only from such a state)."""
        if len(set(self.n)) != 1:
            raise RuntimeError(f"rows differ in length ({self.n}) where the engine expects them aligned")
        return self.n[0]

    def last_tokens(self) -> torch.Tensor:
        """Each row's last verified token [B, 1] (the one the cache does not hold yet)."""
        idx = torch.tensor(self.n, device=self.seq.device)[:, None] - 1
        return self.seq.gather(1, idx)

    def position(self, length: torch.Tensor | list[int]) -> torch.Tensor:
        """Logical position [B] of the token at index `length[b]` of each row (index ≥ P)."""
        return self.prompt_pos + torch.as_tensor(length, device=self.seq.device) - self.P

    # -- processors and sampling ----------------------------------------------------------------------------------
    def process(self, logits: torch.Tensor, ctx) -> torch.Tensor:
        """Processed scores [B, V] for the token after each row's context, from raw logits [B, V] (left untouched).
        ctx: [B, L], or a callable giving it or a list of per-row 1-D contexts (built only when processors exist)."""
        scores = logits.to(copy=True, dtype=torch.float32)
        if not len(self.lp):
            return scores
        ctx = ctx() if callable(ctx) else ctx
        if isinstance(ctx, torch.Tensor):
            return self.lp(ctx, scores)
        groups = defaultdict(list)
        for b, c in enumerate(ctx):
            groups[len(c)].append(b)
        for rows in groups.values():
            idx = torch.tensor(rows, device=scores.device)
            scores[idx] = self.lp(torch.stack([ctx[b] for b in rows]), scores[idx])
        return scores

    def row_contexts(self) -> list[torch.Tensor]:
        return [self.seq[b, :self.n[b]] for b in range(self.B)]

    def pick(self, scores: torch.Tensor):
        """(token [B], probs [B, V] or None) from processed scores."""
        if self.do_sample:
            probs = nn.functional.softmax(scores, dim=-1)
            return torch.multinomial(probs, 1).squeeze(1), probs
        return scores.argmax(-1), None

    # -- verified tokens --------------------------------------------------------------------------------------------
    def emit(self, tok: torch.Tensor, scores: torch.Tensor, logits: torch.Tensor, rows=None) -> list[bool]:
        """Append tok[b] to each active row b (of `rows`, default all), record its scores and logits, apply the
        stopping criteria per row. Returns which rows took a token."""
        took = [self.active(b) and (rows is None or bool(rows[b])) for b in range(self.B)]
        if not any(took):
            return took
        groups = defaultdict(list)
        for b in range(self.B):
            if took[b]:
                if self.n[b] == self.seq.shape[1]:
                    self.seq = torch.cat([self.seq, torch.zeros_like(self.seq)], 1)
                self.seq[b, self.n[b]] = tok[b]
                self.n[b] += 1
                groups[self.n[b]].append(b)
                if self.scores is not None:
                    self.scores[b].append(scores[b])
                if self.logits is not None:
                    self.logits[b].append(logits[b].float())
        for L, rows_ in groups.items():
            idx = torch.tensor(rows_, device=self.seq.device)
            done = self.sc(self.seq[idx, :L], scores[idx])
            for b, d in zip(rows_, done.tolist()):
                if d and not self.finished[b]:
                    self.finished[b], self.finish_len[b] = True, L
                    self.parked[b] = self.pad is not None
        return took

    def all_done(self) -> bool:
        return not any(self.active_rows())

    def sequences(self) -> torch.Tensor:
        """[B, T_out]: each row's verified tokens, parked rows padded, cut where lock-step generate would stop."""
        return self._padded(int(self.bound()) if all(self.finished) else max(self.n))

    def stacked(self, per_row: list, T_in: int, T_out: int) -> tuple:
        """Per-row lists of [V] tensors → a tuple of [B, V] per generated step (a step a parked row did not run:
        −inf, but 0 at the pad token)."""
        like = next(r[0] for r in per_row if r)
        filler = torch.full_like(like, float("-inf"))
        filler[self.pad if self.pad is not None else 0] = 0.0
        return tuple(torch.stack([r[j] if j < len(r) else filler for r in per_row]) for j in range(T_out - T_in))

    # -- streaming --------------------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Put every column that all rows have reached (parked rows count as padded) and mark it verified."""
        live = [self.n[b] for b in range(self.B) if not self.parked[b]]
        T = int(min(min(live) if live else max(self.n), self.bound()))
        if T <= self.streamed:
            return
        cols = self._padded(T)[:, self.streamed:T]
        for j in range(cols.shape[1]):
            self.trace.mark("verified")
            if self.streamer is not None:
                self.streamer.put(cols[:, j].cpu())
        self.streamed = T

    def _padded(self, T: int) -> torch.Tensor:
        """Columns [0, T) of the rows, parked rows padded past their end."""
        out = self.seq.new_full((self.B, T), self.pad if self.pad is not None else 0)
        for b in range(self.B):
            m = min(self.n[b], T)
            out[b, :m] = self.seq[b, :m]
        return out

    def put_provisional(self, tok: torch.Tensor) -> None:
        if self.provisional:
            self.streamer.put_provisional(tok.cpu())
            self.pending_drafts += 1

    def resolve(self, n_kept: int) -> None:
        """Tell a provisional streamer how many of its pending drafts stood (the rest are retracted)."""
        if self.provisional and self.pending_drafts:
            self.streamer.resolve_provisional(n_kept)
        self.pending_drafts = 0

    # -- the model and the cache ------------------------------------------------------------------------------------
    def holes(self) -> bool:
        return not bool(self.kv_valid[:, self.P:].all())

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, n_logits: int, vis: torch.Tensor | None = None,
                valid: torch.Tensor | bool = True) -> torch.Tensor:
        """Run ids [B, n] at logical positions pos [B, n] after the cache's content; float32 logits [B, n_logits, V]
        of the last n_logits positions. vis [B, n, S + n]: who sees whom (default: every visible cache position,
        causal among the new tokens); valid: whether later passes see the new positions ([B, n] or one bool)."""
        B, n = ids.shape
        S = self.cache.get_seq_length()
        if S != self.kv_valid.shape[1]:
            raise RuntimeError(f"cache holds {S} positions, the engine tracks {self.kv_valid.shape[1]}")
        k_pos = torch.cat([self.kv_pos, pos], 1)
        if vis is None and not self.holes():
            kw = {"position_ids": pos} if self.pass_positions else {}
            if self.has_padding:
                kw["attention_mask"] = torch.cat([self.kv_valid, self.kv_valid.new_ones(B, n)], 1)
        else:
            if vis is None:
                causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
                vis = torch.cat([self.kv_valid[:, None, :].expand(B, n, S), causal.expand(B, n, n)], -1)
            masks = layer_masks(self.model, self.cache.layers, self.cache.dtype, vis, pos, k_pos)
            kw = {"attention_mask": masks, "position_ids": pos}
        with masked_gqa(self.model, ids.device) if kw.get("attention_mask") is not None else nullcontext():
            out = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=n_logits, **kw)
        if isinstance(valid, bool):
            valid = self.kv_valid.new_full((B, n), valid)
        self.kv_valid, self.kv_pos = torch.cat([self.kv_valid, valid], 1), k_pos
        return out.logits[:, -n_logits:].float()

    def drop_tail(self, length: int) -> None:
        """Forget cache positions from `length` on."""
        self.cache.crop(length - self.cache.get_seq_length())
        self.kv_valid, self.kv_pos = self.kv_valid[:, :length], self.kv_pos[:, :length]

    def keep_tail(self, start: int, index: torch.Tensor, valid: torch.Tensor) -> None:
        """Keep positions before `start`, then per row start + index[b] ([B, k]); valid [B, k]: which of those the
        row sees (the rest are holes). Trailing columns no row sees are dropped."""
        k = index.shape[1]
        while k and not bool(valid[:, k - 1].any()):
            k -= 1
        index, valid = index[:, :k], valid[:, :k]
        for l in self.cache.layers:  # each keeps positions < start and, per row, start + index[b] ([B, k])
            l.keep_tail(start, index)
        pos = self.kv_pos[:, start:].gather(1, index)
        self.kv_valid = torch.cat([self.kv_valid[:, :start], valid], 1)
        self.kv_pos = torch.cat([self.kv_pos[:, :start], pos], 1)
