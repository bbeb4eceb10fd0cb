"""`PromptStore`: one layer's encoded prompt as it arrives — anchor-stream segments (codes + metadata), their
residuals (and, in exact mode, their corrections), which prompt positions they cover and whether a tier is complete.
Codes move to the cache's device when they are stored (through pinned host memory, without blocking the receiver),
so a tier is dequantized where the model runs and only codes cross PCIe. Not thread-safe by itself: `LynxCache`
calls it under its lock."""
from __future__ import annotations

import bisect

import torch

from ..quant import SplitKV, codec, correction, dequantize
from ..quant.exact import check_correction

KINDS = ("key", "value")


def stage(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`: host → accelerator copies go through pinned memory and do not block (the one place where
    the decode side moves prompt data between devices)."""
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type != "cpu" and torch.cuda.is_available():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


class PromptStore:
    """Segments of prompt positions [offset, prompt_len) for keys and for values, each [start, start + S_seg)."""

    def __init__(self, prompt_len: int, offset: int, device: torch.device):
        self.prompt_len, self.offset, self.device = prompt_len, offset, device
        self.window = prompt_len - offset
        self.segments = {k: {} for k in KINDS}  # kind -> {start: SplitKV}
        self._starts = {k: [] for k in KINDS}   # kind -> sorted segment starts
        self._tokens = {k: 0 for k in KINDS}    # kind -> prompt positions covered by anchors
        self.missing = 0                        # residual / correction parts of segments still to arrive
        self.staged_bytes = 0                   # bytes moved here from another device (codes and metadata)

    def _stage(self, t: torch.Tensor) -> torch.Tensor:
        if t.device != self.device:
            self.staged_bytes += t.numel() * t.element_size()
        return stage(t, self.device)

    def put_anchor(self, kind: str, start: int, split: SplitKV) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        end = start + split.shape[2]
        if start < self.offset or end > self.prompt_len:
            raise ValueError(f"segment [{start}, {end}) lies outside the layer's prompt KV [{self.offset}, "
                             f"{self.prompt_len})")
        starts, segs = self._starts[kind], self.segments[kind]  # coverage is a set of disjoint intervals
        i = bisect.bisect_left(starts, start)
        for s0 in starts[max(i - 1, 0): i + 1]:  # only the neighbours can overlap
            if start < s0 + segs[s0].shape[2] and s0 < end:
                raise ValueError(f"{kind} segment [{start}, {end}) overlaps [{s0}, {s0 + segs[s0].shape[2]}) "
                                 "(duplicate?)")
        split = SplitKV(split.config, split.kind, split.shape, split.dtype, self._stage(split.anchor),
                        None if split.residual is None else self._stage(split.residual),
                        {n: self._stage(t) for n, t in split.meta.items()}, split.axis,
                        split.correction)  # (a correction is unpacked on the CPU: it stays there)
        starts.insert(i, start)
        segs[start] = split
        self._tokens[kind] += split.shape[2]
        split_codec = codec(split.config).split
        self.missing += split_codec and split.residual is None
        self.missing += split_codec and split.config.exact and split.correction is None

    def put_residual(self, kind: str, start: int, data: torch.Tensor, stream: str = "residual") -> None:
        """A segment's residual codes, or (stream "correction") its exact-mode correction bytes."""
        seg = self.segments[kind].get(start) if kind in KINDS else None
        if seg is None:
            raise ValueError(f"{stream} for {kind} at token {start} arrived before its anchor")
        if not codec(seg.config).split or stream == "correction" and not seg.config.exact:
            raise ValueError(f"method {seg.config.method!r} has no {stream} stream"
                             + (" (not an exact config)" if stream == "correction" else ""))
        if getattr(seg, stream) is not None:
            raise ValueError(f"duplicate {stream} segment for {kind} at token {start}")
        if stream == "residual":
            want = (*seg.shape[:3], seg.shape[3] * (8 - seg.config.anchor_bits) // 8)
            if tuple(data.shape) != want or data.dtype != torch.uint8:
                raise ValueError(f"residual shape {tuple(data.shape)} {data.dtype}, expected {want} uint8")
        elif stream == "correction":
            check_correction(data, seg.shape, seg.dtype)
        else:
            raise ValueError(f"stream must be 'residual' or 'correction', got {stream!r}")
        setattr(seg, stream, data if stream == "correction" else self._stage(data))
        self.missing -= 1

    def covered(self, kind: str) -> int:
        """Prompt positions of `kind` that anchors cover."""
        return self._tokens[kind]

    def anchors_complete(self) -> bool:
        return all(self._tokens[k] == self.window for k in KINDS)

    def residual_complete(self) -> bool:
        return self.anchors_complete() and self.missing == 0

    def snapshot(self, kind: str) -> list[tuple[int, SplitKV]]:
        """(start, segment) in prompt order: a list that later puts do not change (taken under the cache's lock)."""
        return [(s0, self.segments[kind][s0]) for s0 in self._starts[kind]]

    def nbytes(self, tier: str = "full") -> int:
        """Bytes held (what crossed the wire): both streams ("full") or the anchor stream alone ("anchor")."""
        return sum(s.nbytes(tier) for kind in KINDS for s in self.segments[kind].values())

    def select(self, fn) -> None:
        """Apply a batch-dimension map (reorder, select, repeat) to every segment's codes and metadata."""
        for kind in KINDS:
            for seg in self.segments[kind].values():
                rows = codec(seg.config).select
                if rows is not None:  # an entropy-coded stream: its codec maps the rows
                    new = rows(seg, fn)
                    seg.anchor, seg.meta, seg.shape = new.anchor, new.meta, new.shape
                    continue
                exact = None if seg.correction is None else dequantize(seg, "full")  # the values, bit for bit
                seg.anchor, seg.meta = fn(seg.anchor), {n: fn(t) for n, t in seg.meta.items()}
                if seg.residual is not None:
                    seg.residual = fn(seg.residual)
                seg.shape = (seg.anchor.shape[0], *seg.shape[1:])
                if exact is not None:  # a correction spans the rows: the mapped rows' one, made again
                    seg.correction = correction(fn(exact), seg)


def complete(layers, stream: str) -> bool:
    """Every given layer's (LynxLayer's) anchor — or residual — stream is in; the caller holds the cache's lock."""
    done = (lambda s: s.anchors_complete()) if stream == "anchor" else (lambda s: s.residual_complete())
    return all(done(l.store) for l in layers)
