"""What the prefill server and the decode client are set to, as frozen dataclasses with one validator each
(`__post_init__`): a bad value is one `ConfigError` naming the setting, raised where the settings are built — for
the commands, from their flags, before any model loads. The secret and open sockets or transports are not settings
(a credential and live resources): `PrefillServer` and `DecodeClient` take them beside these.

`PrefillServer(model, ServerSettings(...), secret=...)` and `DecodeClient(model, host, port, ClientSettings(...))`;
either also takes the settings' fields as keywords (applied over the settings given, or the defaults), so
`PrefillServer(model, secret=s, bandwidth_bps=15e6)` reads as before."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..errors import ConfigError
from ..session import PLACES
from ..flags import MAX_CONCURRENT_PREFILLS, MAX_INFLIGHT_MB, MAX_TIMEOUT_S, PREFIX_CACHE_MB, machine_mb
from .nixl import PLANES

PREFILL_STEP = 1024  # tokens of one forward pass of a long prompt (a short request waits for at most one)
RENAMED = {"prefill_chunk": "prefill_step"}  # PrefillServer keywords renamed in 0.1.0 (one word, one meaning)


def _number(name: str, x, *, none: bool = False, zero: bool = False, hi: float = math.inf) -> None:
    if x is None and none:
        return
    real = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    if not (real and (x > 0 or zero and x == 0)):
        raise ConfigError(f"{name} must be a finite number {'>= 0' if zero else '> 0'}, got {x!r}")
    if x > hi:
        raise ConfigError(f"{name} must be at most {hi:g}, got {x!r}")


def _count(name: str, x) -> None:
    if not (isinstance(x, int) and not isinstance(x, bool) and x >= 1):
        raise ConfigError(f"{name} must be an int >= 1, got {x!r}")


def _choice(name: str, x, allowed: tuple, listed: str | None = None) -> None:
    if x not in allowed:
        raise ConfigError(f"{name} must be one of {listed or allowed}, got {x!r}")


def with_fields(cls, settings, fields: dict, owner: str):
    """`settings` (or cls's defaults) with `fields` applied: a keyword the settings do not have is a TypeError
    naming it (and its new name, if it was renamed)."""
    names = {f.name for f in dataclasses.fields(cls)}
    for name in fields:
        if name not in names:
            new = RENAMED.get(name)
            raise TypeError(f"{owner}: {name!r} is now {new!r}" if new else
                            f"{owner} got an unexpected keyword argument {name!r}")
    if settings is not None and not isinstance(settings, cls):
        raise TypeError(f"{owner}: settings must be a {cls.__name__}, got {type(settings).__name__}")
    return dataclasses.replace(settings, **fields) if settings is not None else cls(**fields)


@dataclass(frozen=True)
class ServerSettings:
    """A prefill server's settings.

    host, port: where it listens (port 0: any free one). bandwidth_bps, latency_s: the emulated NIC every connection
    shares (None: unpaced). handshake_timeout: seconds a connection has to prove the secret. max_connections:
    authenticated connections served at once; max_preauth (max_preauth_per_host): connections still proving it (from
    one host). insecure: no secret (loopback only). tls_cert, tls_key: TLS on top of the frame MACs (the key may be
    inside the certificate's file). idle_timeout_s: an authenticated connection's silence before it is closed;
    send_timeout_s: a peer that reads nothing for this long fails its request. prefill_step: tokens of one forward
    pass of a long prompt. prefix_cache_mb: full-precision KV kept for later turns (0: none). data_plane: "tcp" or
    "nixl". max_inflight_mb: a connection's frames queued and not yet read. max_concurrent_prefills: requests holding
    a prompt's working set at once."""
    host: str = "127.0.0.1"
    port: int = 0
    bandwidth_bps: float | None = None
    latency_s: float = 0.0
    handshake_timeout: float = 5.0
    max_connections: int = 32
    insecure: bool = False
    tls_cert: str | None = None
    tls_key: str | None = None
    max_preauth: int = 128
    max_preauth_per_host: int = 96
    idle_timeout_s: float = 300.0
    send_timeout_s: float = 30.0
    prefill_step: int = PREFILL_STEP
    prefix_cache_mb: float = PREFIX_CACHE_MB
    data_plane: str = "tcp"
    max_inflight_mb: float = MAX_INFLIGHT_MB
    max_concurrent_prefills: int = MAX_CONCURRENT_PREFILLS

    def __post_init__(self):
        _number("bandwidth_bps", self.bandwidth_bps, none=True)
        _number("latency_s", self.latency_s, zero=True)
        for name in ("prefix_cache_mb", "max_inflight_mb"):
            x = getattr(self, name)
            _number(name, x, zero=name == "prefix_cache_mb")
            if x > machine_mb():
                raise ConfigError(f"{name} must be at most this machine's memory ({machine_mb():,.0f} MB), got {x!r}")
        for name in ("handshake_timeout", "idle_timeout_s", "send_timeout_s"):
            _number(name, getattr(self, name), hi=MAX_TIMEOUT_S)
        for name in ("max_connections", "max_preauth", "max_preauth_per_host", "prefill_step",
                     "max_concurrent_prefills"):
            _count(name, getattr(self, name))
        if not isinstance(self.port, int) or isinstance(self.port, bool) or not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be an int in [0, 65535], got {self.port!r}")
        _choice("data_plane", self.data_plane, PLANES)
        if self.tls_key and not self.tls_cert:
            raise ConfigError("a TLS key without a certificate (--tls-key without --tls-cert): pass both, or "
                              "neither for plain TCP")


@dataclass(frozen=True)
class ClientSettings:
    """A decode client's settings.

    timeout_s: how long a request may wait for the server (and the connection for its handshake). insecure: no
    secret (loopback only). tls, tls_ca: speak TLS, trusting the system's CAs or the PEM file `tls_ca` (a private CA
    or a self-signed server certificate); the server's certificate must name the host. data_plane: "tcp" (the
    channel carries the segments) or "nixl" (NIXL writes them into this process's memory). prefill_on: where a
    continued turn's new positions are computed — "prefill", "decode" (here, in full precision) or "auto" (the
    faster by rates measured on this connection). link_bps: the link's rate (bits/s) if known, for
    `anchor_bits="auto"` (None: measured)."""
    timeout_s: float = 30.0
    insecure: bool = False
    tls: bool = False
    tls_ca: str | None = None
    data_plane: str = "tcp"
    prefill_on: str = "prefill"
    link_bps: float | None = None

    def __post_init__(self):
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) \
                or not (math.isfinite(self.timeout_s) and 0 < self.timeout_s <= MAX_TIMEOUT_S):
            raise ConfigError(f"timeout_s must be a finite number of seconds in (0, {MAX_TIMEOUT_S:g}], "
                              f"got {self.timeout_s!r}")
        _choice("data_plane", self.data_plane, PLANES)
        _choice("prefill_on", self.prefill_on, PLACES, ", ".join(PLACES))
        _number("link_bps", self.link_bps, none=True)
