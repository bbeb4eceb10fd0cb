"""Disaggregated KV transfer: wire format (wire, serde), the handshake and frame MACs (auth), transports (tcp, tls,
torch.distributed, in-process), the prefill side (prefill: one request; server: the accept loop; prefix_cache), the
decode side (decode: the receiver — a LynxCache loader — the client and a conversation's Session) and the NIXL data
plane (nixl)."""
from .wire import Frame, FrameType, PeerClosed, Stream, WireError

__all__ = ["Frame", "FrameType", "PeerClosed", "Stream", "WireError"]
