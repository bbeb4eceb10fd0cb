"""Streaming. Verified tokens reach any standard Transformers streamer through `put`; a streamer that also has
`put_provisional(tokens)` and `resolve_provisional(n_kept)` sees drafts as they are made and learns, after
verification, how many of them stood (the rest are retracted; the kept ones are also `put` as verified)."""
from __future__ import annotations

import sys

from transformers.generation.streamers import BaseStreamer


class SpeculativeStreamer(BaseStreamer):
    """Records the stream as events and, with a tokenizer, prints verified text plainly and provisional text dimmed
    (erased on retraction) — for UIs and agent loops that want to start early."""

    def __init__(self, tokenizer=None, skip_prompt: bool = True, file=None):
        self.tok, self.skip_prompt, self.file = tokenizer, skip_prompt, file or sys.stdout
        self.events: list[tuple[str, list[int]]] = []
        self.final: list[int] = []
        self.pending: list[int] = []
        self._prompt_seen = False
        self._shown = ""

    def put(self, value) -> None:
        ids = value.reshape(-1).tolist()
        if not self._prompt_seen:
            self._prompt_seen = True
            if self.skip_prompt:
                return
        self.final += ids
        self.events.append(("final", ids))
        self._render()

    def put_provisional(self, value) -> None:
        ids = value.reshape(-1).tolist()
        self.pending += ids
        self.events.append(("provisional", ids))
        self._render()

    def resolve_provisional(self, n_kept: int) -> None:
        self.events.append(("retract", self.pending[n_kept:]))
        self.pending = []
        self._render()

    def end(self) -> None:
        self.events.append(("end", []))
        if self.tok is not None:
            print(file=self.file, flush=True)

    def _render(self) -> None:
        if self.tok is None:
            return
        text = self.tok.decode(self.final, skip_special_tokens=True)
        prov = self.tok.decode(self.pending, skip_special_tokens=True) if self.pending else ""
        self.file.write("\r\033[K" + text + (f"\033[2m{prov}\033[0m" if prov else ""))
        self.file.flush()
