"""The NIXL data plane: the segments' bytes move by NIXL (UCX underneath: RDMA, TCP, GPU memory), while the
authenticated channel keeps every control frame (docs/wire-format.md, "Data planes").

Contract:
- The decode side registers one receive arena per request (host memory, `stream_bound` bytes: the codec's bound for
  every segment it expects) with its NIXL agent and names it in its REQUEST: agent name, agent metadata, arena
  address and length — inside the MAC'd channel. The prefill side accepts no arena larger than the bound it computes
  itself, stages each segment's bytes in its own registered buffer, and when the connection's sender reaches the
  segment's frame (strict priority: anchor before residual, paced by the link emulator) WRITEs them into the arena
  with a notification, then sends a PLACED frame (offset, length, SHA-256) on the segment's stream.
- The decode side takes a PLACED frame only after NIXL's notification for it has arrived, and uses the bytes only
  if their SHA-256 matches the digest in the MAC'd frame: NIXL's bytes are not authenticated, the digest is. A
  mismatch fails the request in one line. A segment that does not fit in the arena goes as a SEGMENT frame.
- The arena is deregistered when the request's streams have ended; nothing NIXL sends is ever unpickled (its own
  descriptor serialisation pickles: descriptors travel here as integers in JSON).
- Optional: `pip install 'lynx-hf[nixl]'` (nixl-cu12, which needs only torch and numpy: the project's torch pin
  holds). Selecting the plane without it is one ConfigError naming the install command."""
from __future__ import annotations

import base64
import hashlib
import logging
import os
import secrets
import struct
import threading
import time

import torch

from ..errors import ConfigError
from .wire import WireError

PLACED = struct.Struct("<QQ32s")  # offset, length, SHA-256 of the bytes: a PLACED frame's payload
MAX_METADATA = 1 << 20            # bytes of a peer's NIXL agent metadata
INSTALL = "pip install 'lynx-hf[nixl]'"
PLANES = ("tcp", "nixl")


def _nixl():
    """nixl_agent and nixl_agent_config from the `nixl` meta package or the `nixl-cu12` wheel (its INFO lines, which
    it writes to stdout, kept out of our JSON output)."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        try:
            from nixl_cu12 import nixl_agent, nixl_agent_config
        except ImportError:
            raise ConfigError(f"the NIXL data plane needs NIXL: {INSTALL}") from None
    logging.getLogger("nixl").setLevel(logging.WARNING)
    return nixl_agent, nixl_agent_config


def available() -> bool:
    try:
        _nixl()
        return True
    except ConfigError:
        return False


def check_plane(name: str) -> None:
    """A data plane's name, checked (and NIXL's presence, if chosen) before anything connects."""
    if name not in PLANES:
        raise ConfigError(f"data_plane must be one of {PLANES}, got {name!r}")
    if name == "nixl":
        _nixl()


class Agent:
    """One NIXL agent (UCX backend) behind a lock, with a notification pump that any thread may wait on. No progress
    thread: UCX's busy-polls a core (measured: a forward pass of the default model 0.11 → 0.87 s on two cores); the
    initiator progresses while it waits for a write, the target in `progress` (the receiver calls it while it waits
    for frames)."""

    def __init__(self, role: str):
        nixl_agent, nixl_agent_config = _nixl()
        self.name = f"lynx-{role}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            self.agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        except Exception as e:  # noqa: BLE001 — NIXL raises plain exceptions
            raise ConfigError(f"cannot start a NIXL agent (UCX backend): {e}") from None
        if "UCX" not in self.agent.backends:
            raise ConfigError("NIXL has no UCX backend here: the data plane cannot start")
        self.lock = threading.Lock()
        self._remotes: dict[str, int] = {}  # peer agent -> connections using it
        self._cv = threading.Condition()
        self._seen: set[bytes] = set()

    def register(self, t: torch.Tensor):
        with self.lock:
            return self.agent.register_memory(t)

    def deregister(self, reg) -> None:
        with self.lock:
            self.agent.deregister_memory(reg)

    def metadata(self) -> bytes:
        with self.lock:
            return self.agent.get_agent_metadata()

    def add_remote(self, metadata: bytes, new_user: bool) -> str:
        """Load a peer's metadata (again: it names the memory registered since); `new_user`: a connection starts
        using this peer (counted, so that one connection's end does not forget a peer another one uses)."""
        with self.lock:
            name = self.agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else name
            self._remotes[name] = self._remotes.get(name, 0) + new_user
        return name

    def remove_remote(self, name: str) -> None:
        with self.lock:
            self._remotes[name] = self._remotes.get(name, 1) - 1
            if self._remotes[name] <= 0:
                del self._remotes[name]
                self.agent.remove_remote_agent(name)

    def write(self, src: torch.Tensor, addr: int, remote: str, notif: bytes, timeout_s: float) -> None:
        """WRITE `src` (registered, contiguous) to `addr` of `remote`'s registered memory, with notification `notif`;
        returns when NIXL says it is done."""
        a = self.agent
        with self.lock:
            h = a.initialize_xfer("WRITE", a.get_xfer_descs([src]), a.get_xfer_descs([(addr, src.numel(), 0)], "DRAM"),
                                  remote, notif)
            state = a.transfer(h)
        deadline = time.monotonic() + timeout_s
        try:
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise ConnectionError(f"a NIXL write to {remote} did not complete within {timeout_s:g} s")
                time.sleep(0.0002)
                with self.lock:
                    state = a.check_xfer_state(h)
            if state != "DONE":
                raise ConnectionError(f"a NIXL write to {remote} failed ({state})")
        finally:
            with self.lock:
                h.release()

    def progress(self) -> None:
        """Let UCX move what has arrived; notifications are kept for `wait_notif`."""
        with self.lock:
            new = self.agent.get_new_notifs()
        if new:
            with self._cv:
                for msgs in new.values():
                    self._seen.update(msgs)

    def wait_notif(self, tag: bytes, timeout_s: float) -> None:
        """Until NIXL's notification `tag` has arrived (from any peer); TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._cv:
                if tag in self._seen:
                    self._seen.discard(tag)
                    return
            self.progress()
            with self._cv:
                if tag in self._seen:
                    self._seen.discard(tag)
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"no NIXL notification {tag!r} within {timeout_s:g} s")
            time.sleep(0.0002)


_agents: dict[str, Agent] = {}
_agents_lock = threading.Lock()


def agent(role: str) -> Agent:
    """This process's agent for `role` ("prefill" or "decode"), started on first use."""
    with _agents_lock:
        if role not in _agents:
            _agents[role] = Agent(role)
        return _agents[role]


class Arena:
    """The decode side's receive memory for one request: registered, named in the REQUEST, read back by PLACED
    frames after NIXL's notification and the digest check."""

    def __init__(self, nbytes: int, rid: int):
        self.agent, self.rid = agent("decode"), rid
        self.buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)  # buf: [nbytes] bytes, host memory
        self.reg = self.agent.register(self.buf)

    def request(self) -> dict:
        """The REQUEST's "data_plane" field."""
        return {"kind": "nixl", "agent": self.agent.name, "metadata": base64.b64encode(self.agent.metadata()).decode(),
                "arena": [self.buf.data_ptr(), self.buf.numel()]}

    def take(self, payload: bytes, timeout_s: float) -> bytes:
        """A PLACED frame's segment bytes, once NIXL delivered them and their SHA-256 matches the frame's."""
        if len(payload) != PLACED.size:
            raise WireError(f"PLACED payload of {len(payload)} bytes, expected {PLACED.size}")
        off, n, digest = PLACED.unpack(payload)
        if off + n > self.buf.numel():
            raise WireError(f"PLACED bytes [{off}, {off + n}) outside the arena of {self.buf.numel()} bytes")
        try:
            self.agent.wait_notif(notif_tag(self.rid, off), timeout_s)
        except TimeoutError as e:
            raise WireError(f"a PLACED segment's bytes never arrived by NIXL: {e}") from None
        data = self.buf[off:off + n].numpy().tobytes()
        if hashlib.sha256(data).digest() != digest:
            raise WireError(f"the segment bytes NIXL delivered at [{off}, {off + n}) fail their SHA-256 digest "
                            f"(corrupted or forged on the fabric): request failed")
        return data

    def close(self) -> None:
        if self.reg is not None:
            self.agent.deregister(self.reg)
            self.reg = None


def notif_tag(rid: int, offset: int) -> bytes:
    return f"lynx {rid} {offset}".encode()


class _Bulk:
    """One segment's WRITE, posted by the connection's sender just before the PLACED frame that refers to it."""

    def __init__(self, plane: "PrefillPlane", src: torch.Tensor, addr: int, notif: bytes):
        self.plane, self.src, self.addr, self.notif, self.nbytes = plane, src, addr, notif, src.numel()

    def post(self) -> None:
        self.plane.agent.write(self.src, self.addr, self.plane.remote, self.notif, self.plane.timeout_s)


class PrefillPlane:
    """The prefill side of one connection's NIXL plane: the peer's agent, a registered staging buffer (grown as
    requests need, kept between them) and, per request, a bump allocator over the peer's arena."""

    def __init__(self, timeout_s: float = 30.0):
        self.agent, self.timeout_s = agent("prefill"), timeout_s
        self.remote: str | None = None
        self.stage: torch.Tensor | None = None
        self.reg = None
        self.addr = self.size = self.used = 0
        self.rid = 0
        self._lock = threading.Lock()

    def begin(self, dp, rid: int, bound: int) -> None:
        """A REQUEST's "data_plane" field, checked: the arena may not exceed `bound` (what this side computes for
        the request), so a peer cannot make it stage more than its segments."""
        if not isinstance(dp, dict) or dp.get("kind") != "nixl":
            raise WireError("data_plane must be {\"kind\": \"nixl\", ...}")
        arena, md = dp.get("arena"), dp.get("metadata")
        if not (isinstance(arena, list) and len(arena) == 2 and all(type(x) is int and x >= 0 for x in arena)):
            raise WireError("data_plane.arena must be [address, length] (non-negative ints)")
        if arena[1] > bound or arena[0] + arena[1] >= 1 << 64:
            raise WireError(f"data_plane.arena of {arena[1]} bytes exceeds this request's bound of {bound} bytes")
        if not isinstance(md, str) or len(md) > 2 * MAX_METADATA:
            raise WireError(f"data_plane.metadata must be base64 of at most {MAX_METADATA} bytes")
        try:
            meta = base64.b64decode(md, validate=True)
        except ValueError:
            raise WireError("data_plane.metadata is not base64") from None
        try:
            name = self.agent.add_remote(meta, self.remote is None)  # each request: it names the new arena
        except Exception as e:  # noqa: BLE001 — NIXL's parser rejects what it cannot load
            raise WireError(f"NIXL could not load the peer's agent metadata: {e}") from None
        if self.remote is not None and name != self.remote:
            self.agent.remove_remote(name)
            raise WireError(f"the peer's NIXL agent changed from {self.remote!r} to {name!r} on one connection")
        if name != dp.get("agent"):
            raise WireError(f"the NIXL metadata names agent {name!r}, the request {dp.get('agent')!r}")
        self.remote, self.addr, self.size, self.used, self.rid = name, arena[0], arena[1], 0, rid
        if self.stage is None or self.stage.numel() < self.size:
            self._release_stage()
            self.stage = torch.empty(max(self.size, 1 << 16), dtype=torch.uint8)  # stage: [bytes], host memory
            self.reg = self.agent.register(self.stage)

    def place(self, payload: bytes):
        """(PLACED payload, bulk) for a segment's bytes, or None if they no longer fit in the arena."""
        n = len(payload)
        with self._lock:
            off = self.used
            if off + n > self.size:
                return None
            self.used = off + n
        src = self.stage[off:off + n]
        src.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        desc = PLACED.pack(off, n, hashlib.sha256(payload).digest())
        return desc, _Bulk(self, src, self.addr + off, notif_tag(self.rid, off))

    def _release_stage(self) -> None:
        if self.reg is not None:
            self.agent.deregister(self.reg)
            self.reg, self.stage = None, None

    def close(self) -> None:
        self._release_stage()
        if self.remote is not None:
            try:
                self.agent.remove_remote(self.remote)
            except Exception:  # noqa: BLE001 — the peer's agent may be unknown already
                pass
            self.remote = None

