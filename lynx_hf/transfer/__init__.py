"""Disaggregated KV transfer: wire format, authenticated sessions, transports (tcp, tls, torch.distributed,
in-process), the prefill-side sender and server, the decode-side receiver (a LynxCache loader) and client."""
from .wire import Frame, FrameType, PeerClosed, Stream, WireError

__all__ = ["Frame", "FrameType", "PeerClosed", "Stream", "WireError"]
