"""`PrefixCache`: the prefill server's full-precision KV of prompts it has prefilled, shared by every connection, so
that a conversation's next turn (or another agent's copy of one system prompt) computes only the tokens past its
longest cached prefix. And `token_digest`, what a decode node's REQUEST says it holds.

Keys (after LMCache's chunked token database): a prompt is cut into `CHUNK`-token chunks; chunk j's key is
sha256(key of chunk j-1 ‖ chunk j's token ids), the chain rooted in the model's fingerprint and dtype, so a key
names the whole token prefix. An entry also keeps its chunk's ids and a hit compares them, so not even a hash
collision yields KV of other tokens. Only whole chunks are kept. Bounded by bytes, least recently used evicted
first; an evicted chunk costs time (its tokens are recomputed), never correctness. Thread-safe.

Threat model (docs/wire-format.md): one server secret is one tenant. A hit returns KV of exactly the tokens the
client sent, which it already knows; what a client can learn is *timing* — whether some prefix was prefilled before
(by anyone sharing the secret)."""
from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict

import torch

CHUNK = 256  # tokens per cached chunk


def token_digest(fingerprint: str, quant_config: dict, ids) -> str:
    """What a decode node holds, as its REQUEST states it: sha256 over the model fingerprint, the codec config and the
    held token ids (int64 little-endian)."""
    h = hashlib.sha256(f"lynx-held|{fingerprint}|{json.dumps(quant_config, sort_keys=True)}|".encode())
    h.update(torch.as_tensor(list(ids), dtype=torch.int64).numpy().astype("<i8").tobytes())
    return h.hexdigest()


def _chunk_ids(ids: list[int], j: int) -> bytes:
    return torch.as_tensor(ids[j * CHUNK:(j + 1) * CHUNK], dtype=torch.int64).numpy().astype("<i8").tobytes()


class PrefixCache:
    """Full-precision KV by chained chunk hash, at most `budget_bytes` (0: off)."""

    def __init__(self, budget_bytes: int, root: str):
        if budget_bytes < 0:
            raise ValueError(f"prefix cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget, self.root = int(budget_bytes), hashlib.sha256(f"lynx-prefix|{root}".encode()).digest()
        self._entries: OrderedDict[bytes, tuple[bytes, list]] = OrderedDict()  # key -> (ids, [(k, v)] per layer)
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = self.misses = self.evictions = self.hit_tokens = 0

    def _keys(self, ids: list[int], n: int) -> list[tuple[bytes, bytes]]:
        """(key, ids bytes) of the first n whole chunks."""
        out, parent = [], self.root
        for j in range(n):
            raw = _chunk_ids(ids, j)
            parent = hashlib.sha256(parent + raw).digest()
            out.append((parent, raw))
        return out

    def lookup(self, ids: list[int], limit: int) -> tuple[int, list | None]:
        """The longest cached prefix of `ids` within `limit` tokens (whole chunks): (tokens, [(K, V)] per layer, each
        [1, H_kv, tokens, D]) or (0, None)."""
        if not self.budget:
            return 0, None
        parts = []
        with self._lock:
            for key, raw in self._keys(ids, min(limit, len(ids)) // CHUNK):
                e = self._entries.get(key)
                if e is None or e[0] != raw:
                    break
                self._entries.move_to_end(key)
                parts.append(e[1])
            n = len(parts) * CHUNK
            self.hits, self.misses = self.hits + bool(parts), self.misses + (not parts)
            self.hit_tokens += n
        if not parts:
            return 0, None
        layers = len(parts[0])
        kv = [(torch.cat([p[i][0] for p in parts], 2), torch.cat([p[i][1] for p in parts], 2)) for i in range(layers)]
        return n, kv

    def insert(self, ids: list[int], start: int, kv: list) -> None:
        """Keep the whole chunks of `ids` from position `start` (a chunk boundary) on, whose KV `kv` holds: per layer
        (K, V), each [1, H_kv, n, D] for positions [start, start + n)."""
        if not self.budget or start % CHUNK:
            return
        n = min(k.shape[2] for k, _ in kv)
        keys = self._keys(ids, (start + n) // CHUNK)
        for j in range(start // CHUNK, len(keys)):
            a = j * CHUNK - start
            part = [(k[:, :, a:a + CHUNK].clone(), v[:, :, a:a + CHUNK].clone()) for k, v in kv]
            size = sum(k.nbytes + v.nbytes for k, v in part)
            if size > self.budget:
                return
            key, raw = keys[j]
            with self._lock:
                if key in self._entries:
                    self._entries.move_to_end(key)
                    continue
                self._entries[key] = (raw, part)
                self.bytes += size
                while self.bytes > self.budget:
                    _, (_, gone) = self._entries.popitem(last=False)
                    self.bytes -= sum(k.nbytes + v.nbytes for k, v in gone)
                    self.evictions += 1

    def stats(self) -> dict:
        with self._lock:
            return {"entries": len(self._entries), "bytes": self.bytes, "budget": self.budget, "hits": self.hits,
                    "misses": self.misses, "hit_tokens": self.hit_tokens, "evictions": self.evictions}
