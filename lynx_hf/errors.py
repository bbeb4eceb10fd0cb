"""The errors lynx-hf raises on purpose — a bad setting, a misbehaving peer, a transfer that cannot complete — as
one family, so a command line can report them in one line and let every other exception (a bug) show its
traceback. Each keeps the built-in base it always had (ValueError, RuntimeError), so existing handlers still match."""
from __future__ import annotations


class LynxError(Exception):
    """Base of every error lynx-hf raises deliberately."""


class ConfigError(LynxError, ValueError):
    """A setting or an argument is invalid."""
