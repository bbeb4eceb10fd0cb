"""The seam between a LynxCache and whatever fills it (vLLM-connector style), and nothing else.

`attach(cache)` starts delivering and returns at once; a loader delivers through `cache.put_anchor / put_residual /
put_logits`, or `cache.fail(exc)` when it cannot finish. The cache calls the optional hooks `on_draft(n)` and
`on_wait()` (documented no-ops); the cache's `close()` calls `close()`. Implementations: `lynx_hf.local.
InProcessLoader` (a local prefill, on a token-count or simulated-link schedule) and `lynx_hf.transfer.receiver.
NetworkLoader` (frames from a prefill server)."""
from __future__ import annotations

from abc import ABC, abstractmethod

from .errors import LynxError


class LoaderError(LynxError, RuntimeError):
    """The loader failed (peer gone, corrupted stream, timeout): the prompt KV will not be completed."""


class Loader(ABC):
    """Fills one LynxCache. Subclasses implement `attach`; the hooks below are optional no-ops."""

    cache = None

    @abstractmethod
    def attach(self, cache) -> "Loader":
        """Set `cache.loader = self` and start delivering into `cache`; return at once."""

    def on_draft(self, n: int) -> None:
        """The decoder has made n draft steps (a step-count schedule may release the residual here)."""

    def on_wait(self) -> None:
        """The decoder now needs the residual (a step-count schedule releases it; a real link just goes on)."""

    def close(self) -> None:
        """The request is over on the decode side (finished, stopped early or failed): stop delivering and free
        resources. Called once, by the cache's `close`."""
