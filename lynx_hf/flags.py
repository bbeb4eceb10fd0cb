"""The command line's shared parts: `number`, the one validator of every numeric flag (argparse `type=`: finite,
inside a stated range, checked when the arguments are parsed — before any model loads — and refused in one line
naming the flag); the help texts several commands share; `subcommand` and its `HelpFormatter`. Every command's module
takes them from here (none imports lynx_hf.cli, which only registers the commands)."""
from __future__ import annotations

import argparse
import math
import os

MAX_TIMEOUT_S = 86400.0  # one day: a longer timeout is a typo (and 1e308 overflows the system's clocks)
MAX_MBPS = 1e7           # 10 Tbit/s
MAX_TOKENS = 1 << 20

# the prefill server's defaults (PrefillServer and serve-prefill --help state them; here so --help needs no torch)
PREFIX_CACHE_MB = 512.0      # full-precision KV kept for later turns (SmolLM2-135M in fp32: 46 KB a token)
MAX_INFLIGHT_MB = 128.0      # a connection's frames queued and not yet read
MAX_CONCURRENT_PREFILLS = 4  # requests holding a prompt's working set at once


MODEL_HELP = "Hub id or local path (default: embedded SmolLM2-135M-Instruct)"
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_HELP = "the model's dtype, so its KV's (both processes must run the same one)"
ANCHOR_BITS_HELP = ("the Lynx anchor's width in bits (2, 3, 4 or auto; default 4): the first stream carries the 8-bit "
                    "code's top bits, the residual the rest, so a narrower anchor lands sooner and drafts on coarser "
                    "KV; auto: chosen per request from the link's rate, the prompt and the drafts each width keeps")
JSON_HELP = "print only the final JSON line"
NIXL_EXTRA = "pip install 'lynx-hf[nixl]'"
PORT_HELP = "the prefill process's loopback port (default: a free one)"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default, unless its help states one or there is none to state."""

    def _get_help_string(self, action):
        h = action.help or ""
        if "default" in h or action.default in (None, False, argparse.SUPPRESS):
            return h
        return super()._get_help_string(action)


def subcommand(sub, name: str, text: str) -> argparse.ArgumentParser:
    """A subcommand whose --help shows `text` and every option's default."""
    return sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".",
                          formatter_class=HelpFormatter)


def machine_mb() -> float:
    """This machine's memory in MB (1 PiB where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 20)
    except (ValueError, OSError, AttributeError):
        return float(1 << 30)


class number:
    """argparse type: an int (`integer`) or a float in [lo, hi] (`lo_open`: (lo, hi]); `zero` also admits 0 where
    it has a meaning of its own (e.g. "off"); `words` are taken as they are (e.g. "auto")."""

    def __init__(self, lo: float, hi: float, *, integer: bool = False, lo_open: bool = False, zero: bool = False,
                 meaning: str = "", words: tuple = ()):
        self.lo, self.hi, self.integer, self.lo_open, self.zero, self.words = lo, hi, integer, lo_open, zero, words
        self.__name__ = "int" if integer else "number"  # argparse's word for a value it cannot parse
        self.range = (f"{'(' if lo_open else '['}{lo:g}, {hi:g}]" + (" or 0" if zero else "")
                      + "".join(f" or {w}" for w in words) + (f" ({meaning})" if meaning else ""))

    def ok(self, x: float) -> bool:
        if self.zero and x == 0:
            return True
        return math.isfinite(x) and (x > self.lo if self.lo_open else x >= self.lo) and x <= self.hi

    def __call__(self, text: str):
        if text in self.words:
            return text
        try:
            x = int(text) if self.integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if self.integer else 'a number'} in "
                                             f"{self.range}, got {text!r}") from None
        if not self.ok(x):
            raise argparse.ArgumentTypeError(f"must be {'an integer' if self.integer else 'a finite number'} in "
                                             f"{self.range}, got {text!r}")
        return x


def tokens(lo: int = 1, hi: int = MAX_TOKENS, **kw) -> number:
    return number(lo, hi, integer=True, **kw)


def count(hi: int, lo: int = 1, **kw) -> number:
    return number(lo, hi, integer=True, **kw)


def anchor_width() -> number:
    """--anchor-bits: 2, 3, 4 or auto (chosen per request: lynx_hf.width)."""
    return count(4, lo=2, words=("auto",))


def seconds(hi: float = MAX_TIMEOUT_S) -> number:
    return number(0, hi, lo_open=True)


def mbps(zero: str = "") -> number:
    return number(0, MAX_MBPS, lo_open=True, zero=bool(zero), meaning=zero and f"0: {zero}")


def megabytes(zero: str = "") -> number:
    return number(0, machine_mb(), lo_open=True, zero=bool(zero), meaning=zero and f"0: {zero}")
