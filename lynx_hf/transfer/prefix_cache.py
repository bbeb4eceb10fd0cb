"""`PrefixCache`: the prefill server's full-precision KV of prompts it has prefilled, shared by every connection, so
that a conversation's next turn (or another agent's copy of one system prompt) computes only the tokens past its
longest cached prefix. And `token_digest`, what a decode node's REQUEST says it holds.

Keys (after LMCache's token database): a prompt is cut into `BLOCK`-token blocks; block j's key is sha256(key of
block j-1 ‖ block j's token ids), the chain rooted in the model's fingerprint and dtype, so a key names the whole
token prefix. An entry also keeps its block's ids and a hit compares them, so not even a hash collision yields KV
of other tokens. Only whole blocks are kept.

Memory: at most `budget_bytes` of KV (each entry's own tensors, cloned once at insert; a hit hands out those very
tensors, never a copy). Eviction keeps what can be hit: an entry is reachable only through its chain, so the victim
is always the least recently used *leaf* (an entry no other entry continues) — a chain loses its tail first, a
budget always holds whole prefixes, and a prompt larger than the budget keeps its head. `stats()["unreachable"]`
counts entries whose parent is gone (0 by construction). An evicted block costs time (its tokens are recomputed),
never correctness. Thread-safe.

Threat model (docs/wire-format.md): one server secret is one tenant. A hit returns KV of exactly the tokens the
client sent, which it already knows; what a client can learn is *timing* — whether some prefix was prefilled before
(by anyone sharing the secret)."""
from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

BLOCK = 256  # tokens per cached block (the codec's chunk C is another thing)


def token_digest(fingerprint: str, quant_config: dict, ids) -> str:
    """What a decode node holds, as its REQUEST states it: sha256 over the model fingerprint, the codec config and the
    held token ids (int64 little-endian)."""
    h = hashlib.sha256(f"lynx-held|{fingerprint}|{json.dumps(quant_config, sort_keys=True)}|".encode())
    h.update(torch.as_tensor(list(ids), dtype=torch.int64).numpy().astype("<i8").tobytes())
    return h.hexdigest()


def _block_ids(ids: list[int], j: int) -> bytes:
    return torch.as_tensor(ids[j * BLOCK:(j + 1) * BLOCK], dtype=torch.int64).numpy().astype("<i8").tobytes()


@dataclass(eq=False)
class _Entry:
    ids: bytes                # the block's token ids (int64 little-endian), compared on every hit
    parent: bytes | None      # the previous block's key (None: a chain's first block)
    kv: list                  # [(K, V)] per layer, each [1, H_kv, BLOCK, D]: this entry's own tensors
    nbytes: int
    children: int = 0         # entries that continue this one (0: a leaf, evictable)


def layer_kv(blocks: list, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's KV of a hit's blocks (`lookup`'s second value), joined: (K, V) [1, H_kv, n, D] — a transient copy
    of that layer only."""
    return torch.cat([b[layer][0] for b in blocks], 2), torch.cat([b[layer][1] for b in blocks], 2)


class PrefixCache:
    """Full-precision KV by chained block hash, at most `budget_bytes` (0: off)."""

    def __init__(self, budget_bytes: int, root: str):
        if not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"prefix cache budget must be an int >= 0 bytes, got {budget_bytes!r}")
        self.budget, self.root = budget_bytes, hashlib.sha256(f"lynx-prefix|{root}".encode()).digest()
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = self.misses = self.evictions = self.hit_tokens = 0

    def _keys(self, ids: list[int], n: int) -> list[tuple[bytes, bytes]]:
        """(key, ids bytes) of the first n whole blocks."""
        out, parent = [], self.root
        for j in range(n):
            raw = _block_ids(ids, j)
            parent = hashlib.sha256(parent + raw).digest()
            out.append((parent, raw))
        return out

    def lookup(self, ids: list[int], limit: int) -> tuple[int, list]:
        """The longest cached prefix of `ids` within `limit` tokens (whole blocks): (tokens, blocks), blocks being
        the entries' own [(K, V)] per layer (each [1, H_kv, BLOCK, D]; `layer_kv` joins one layer), or (0, [])."""
        if not self.budget:
            return 0, []
        blocks = []
        with self._lock:
            for key, raw in self._keys(ids, min(limit, len(ids)) // BLOCK):
                e = self._entries.get(key)
                if e is None or e.ids != raw:
                    break
                self._entries.move_to_end(key)
                blocks.append(e.kv)
            n = len(blocks) * BLOCK
            self.hits, self.misses = self.hits + bool(blocks), self.misses + (not blocks)
            self.hit_tokens += n
        return n, blocks

    def insert(self, ids: list[int], start: int, kv: list) -> int:
        """Keep the whole blocks of `ids` from position `start` (a block boundary, whose previous blocks are cached)
        on, whose KV `kv` holds: per layer (K, V), each [1, H_kv, n, D] for positions [start, start + n) (views are
        fine: each block is cloned once, into the cache). Stops where the budget cannot make room without evicting
        this chain itself. Returns the blocks added."""
        if not self.budget or start % BLOCK:
            return 0
        n = min(k.shape[2] for k, _ in kv)
        keys = self._keys(ids, (start + n) // BLOCK)
        chain = {k for k, _ in keys}  # never evicted to make room for their own continuation
        added = 0
        for j in range(start // BLOCK, len(keys)):
            key, raw = keys[j]
            parent = keys[j - 1][0] if j else None
            a = j * BLOCK - start
            size = sum(k[:, :, a:a + BLOCK].nbytes + v[:, :, a:a + BLOCK].nbytes for k, v in kv)
            with self._lock:
                e = self._entries.get(key)
                if e is not None:
                    if e.ids != raw:
                        return added  # a hash collision: never attach other tokens' continuation
                    self._entries.move_to_end(key)
                    continue
                if parent is not None and parent not in self._entries:
                    return added  # its prefix is gone: the entry could never be hit
                if not self._make_room(size, chain):
                    return added  # the chain keeps its head
            part = [(k[:, :, a:a + BLOCK].clone(), v[:, :, a:a + BLOCK].clone()) for k, v in kv]
            with self._lock:
                if key in self._entries or (parent is not None and parent not in self._entries) \
                        or not self._make_room(size, chain):
                    return added  # another connection raced us here: nothing is lost but this block
                self._entries[key] = _Entry(raw, parent, part, size)
                if parent is not None:
                    self._entries[parent].children += 1
                self.bytes += size
                added += 1
        return added

    def _make_room(self, size: int, keep: set) -> bool:
        """Evict least recently used leaves outside `keep` until `size` more bytes fit (the lock is held)."""
        while self.bytes + size > self.budget:
            victim = next((k for k, e in self._entries.items() if e.children == 0 and k not in keep), None)
            if victim is None:
                return False
            gone = self._entries.pop(victim)
            if gone.parent is not None and gone.parent in self._entries:
                self._entries[gone.parent].children -= 1
            self.bytes -= gone.nbytes
            self.evictions += 1
        return True

    def stats(self) -> dict:
        with self._lock:
            unreachable = sum(e.parent is not None and e.parent not in self._entries for e in self._entries.values())
            return {"entries": len(self._entries), "bytes": self.bytes, "budget": self.budget, "hits": self.hits,
                    "misses": self.misses, "hit_tokens": self.hit_tokens, "evictions": self.evictions,
                    "unreachable": unreachable}
