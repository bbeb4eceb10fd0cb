"""Drafts for vLLM's own verification: a `custom_class` proposer whose drafts are the shadow request's tokens.

Terms. A *live transfer* is one the decode instance's connector drafts for (`LynxConnector.drafting()`: xfer →
(P, key, members, first token)): its prompt length P, the *key* (digest of its members' first P + 1 tokens: the
prompt and its first token) and how many requests it has. A row *belongs* to a live transfer when its first P + 1
tokens have that key (the longest P wins); the shadows S and the real request R all do. The *source* of a transfer
is the longest sequence seen among its rows; a row whose tokens t[0:n] are a proper prefix of the source q gets
q[n:n+K] as drafts. vLLM's rejection sampler verifies them against the row's own KV (R: the full tier) — greedy:
the target's argmax; sampling: a draft without probabilities is a point mass, which keeps the target distribution —
so R's output is what full-tier decoding gives, whatever the drafts are.

Ownership. vLLM hands the proposer rows, not request ids (`propose(sampled_token_ids, num_tokens_no_spec,
token_ids_cpu)`), so rows are matched by content, and content is made unambiguous before any draft is given: the
connector's scheduler side sees every request's prompt and leaves out of `drafting()` any transfer that another
live request could be mistaken for (duplicate prompts, a prompt extending it, a plain request starting with its
P prompt tokens: scheduler.py's *rivals*), and a step in which more rows match a transfer than it has requests gives
that
transfer none. So only a transfer's own rows get its drafts, and a plain request decodes as it would without the
proposer (apart from vLLM's engine-wide padding of a resumed request's first step). A source outlives its row (S
may finish before R runs) until its transfer ends."""
from __future__ import annotations

import collections

import numpy as np

from .stream import token_digest


class DraftBook:
    """Sources per live transfer (at most `per_transfer`: each shadow's sequence, and R's). `record(xfer,
    tokens)`, `propose(xfer, tokens, k)`, `keep(xfers)`."""

    def __init__(self, per_transfer: int = 16):
        self.per_transfer = per_transfer
        self._src: dict[str, list[np.ndarray]] = {}

    def record(self, xfer: str, tokens) -> None:
        tokens = np.asarray(tokens, dtype=np.int64)
        n, srcs = len(tokens), self._src.setdefault(xfer, [])
        if any(len(q) >= n and np.array_equal(q[:n], tokens) for q in srcs):
            return  # known already (a row's earlier record, or a longer source it agrees with)
        srcs[:] = [q for q in srcs if not (len(q) < n and np.array_equal(q, tokens[:len(q)]))] + [tokens.copy()]
        del srcs[:-self.per_transfer]

    def propose(self, xfer: str, tokens, k: int) -> list[int]:
        """Up to k drafts: the continuation of the longest source that extends `tokens`, else []."""
        tokens = np.asarray(tokens, dtype=np.int64)
        n, best = len(tokens), None
        if k <= 0:
            return []
        for q in self._src.get(xfer, ()):
            if len(q) > n and (best is None or len(q) > len(best)) and np.array_equal(q[:n], tokens):
                best = q
        return [] if best is None else best[n:n + k].tolist()

    def keep(self, xfers) -> None:
        """Forget the sources of transfers no longer live."""
        for x in set(self._src) - set(xfers):
            del self._src[x]

    def __len__(self) -> int:
        return sum(map(len, self._src.values()))


def belongs(live: dict, tokens, cache: dict | None = None) -> str | None:
    """The live transfer (xfer → (P, key, members, first token)) whose first P + 1 tokens `tokens` starts with (the
    longest P), or None. Only rows with the transfer's first token at P are hashed; `cache` memoizes the digest of
    tokens[:P + 1] by (id(tokens), P) within one step."""
    best = None
    for xfer, (P, key, _, first) in live.items():
        if len(tokens) <= P or tokens[P] != first or (best is not None and P <= live[best][0]):
            continue
        d = cache.get((id(tokens), P)) if cache is not None else None
        if d is None:
            d = token_digest(tokens[:P + 1])
            if cache is not None:
                cache[(id(tokens), P)] = d
        if d == key:
            best = xfer
    return best


def live_transfers() -> dict:
    """The decode instance's live transfers with a shadow, from its worker-side connector (same process)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return {}
    c = get_kv_transfer_group()
    return c.drafting() if hasattr(c, "drafting") else {}


class LynxProposer:
    """vLLM's `custom_class` proposer (speculative_config={"method": "custom_class", "model":
    "lynx_hf.vllm.proposer.LynxProposer", "num_speculative_tokens": K}); runs in the worker process beside the
    connector it asks for live transfers (`live`: injectable, for tests)."""

    def __init__(self, vllm_config, live=live_transfers):
        from .fixes import install_expand_fix

        install_expand_fix()  # vLLM #55005: its rejection sampler's CPU expand kernel (a no-op where vLLM is fixed)
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.book, self.live = DraftBook(), live
        self.proposed = 0  # draft tokens handed to vLLM (its metrics count the accepted ones)

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings=None, **_) -> list[list[int]]:
        live = self.live()
        self.book.keep(live)
        if not live:
            return [[] for _ in sampled_token_ids]
        # token_ids_cpu: [max_num_reqs, max_model_len]; row i's sequence is token_ids_cpu[i, :num_tokens_no_spec[i]]
        rows = [token_ids_cpu[i, :int(num_tokens_no_spec[i])] for i in range(len(sampled_token_ids))]
        cache: dict = {}
        owner = [belongs(live, seq, cache) if sampled_token_ids[i] else None for i, seq in enumerate(rows)]
        counts = collections.Counter(x for x in owner if x is not None)
        owner = [x if x is not None and counts[x] <= live[x][2] else None for x in owner]  # more rows: ambiguous
        for seq, xfer in zip(rows, owner):
            if xfer is not None:  # rows still prefilling sampled nothing: they are not sources yet
                self.book.record(xfer, seq)
        out = []
        for seq, xfer in zip(rows, owner):
            room = self.max_model_len - len(seq) - 1
            drafts = self.book.propose(xfer, seq, min(self.k, room)) if xfer is not None and room > 0 else []
            self.proposed += len(drafts)
            out.append(drafts)
        return out

    def load_model(self, *args, **kwargs) -> None:
        """No model: the drafts come from the shadow's row."""
