"""Streaming. Verified tokens reach any standard Transformers streamer through `put`; a streamer that also has
`put_provisional(tokens)` and `resolve_provisional(n_kept)` sees drafts as they are made and learns, after
verification, how many of them stood (the rest are retracted; the kept ones are also `put` as verified)."""
from __future__ import annotations

import shutil
import sys

from transformers.generation.streamers import BaseStreamer


class SpeculativeStreamer(BaseStreamer):
    """Records the stream as events and, with a tokenizer, prints it for a person: verified text plainly and once
    (append-only, never redrawn), and, on a terminal only, the pending drafts dimmed after it — as many as fit on the
    cursor's screen line, so erasing them (backspaces, clear to end of line) never has to cross a wrapped line. Not
    a terminal (a file, a pipe): the verified text only, no escape sequences."""

    def __init__(self, tokenizer=None, skip_prompt: bool = True, file=None):
        self.tok, self.skip_prompt, self.file = tokenizer, skip_prompt, file or sys.stdout
        self.events: list[tuple[str, list[int]]] = []
        self.final: list[int] = []
        self.pending: list[int] = []
        self._prompt_seen = False
        self._printed = ""    # verified text written so far
        self._col = 0         # the cursor's column on its screen line, after the verified text
        self._drafts_shown = 0  # cells of dimmed draft text on screen after it
        isatty = getattr(self.file, "isatty", None)
        self.tty = bool(isatty and isatty())

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
            self.pending = []
            self._render()
            print(file=self.file, flush=True)

    def _render(self) -> None:
        if self.tok is None:
            return
        out = []
        if self._drafts_shown:  # the drafts sit on the cursor's line: step back over them and clear
            out.append("\b" * self._drafts_shown + "\033[K")
            self._drafts_shown = 0
        text = self.tok.decode(self.final, skip_special_tokens=True)
        if text.startswith(self._printed):  # a decode that rewrites earlier text waits for the next token
            new, self._printed = text[len(self._printed):], text
            out.append(new)
            width = shutil.get_terminal_size((80, 24)).columns
            for ch in new:
                self._col = 0 if ch == "\n" else (self._col + 1) % width
            if self.tty and self.pending:
                drafts = self.tok.decode(self.pending, skip_special_tokens=True).replace("\n", " ")
                drafts = drafts[:max(0, width - self._col - 1)]
                if drafts:
                    out.append(f"\033[2m{drafts}\033[0m")
                    self._drafts_shown = len(drafts)
        if out:
            self.file.write("".join(out))
            self.file.flush()
