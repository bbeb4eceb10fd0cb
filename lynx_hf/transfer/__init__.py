"""Disaggregated KV transfer: wire format, transports (tcp + link emulator, torch.distributed, in-process), the
prefill-side sender and the decode-side receiver (a LynxCache loader)."""
from .wire import Frame, FrameType, Stream, WireError

__all__ = ["Frame", "FrameType", "Stream", "WireError"]
