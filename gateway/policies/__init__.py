"""The accept-loop policies, written once against `core.interfaces` (DESIGN sections 1, 3)."""

from gateway.policies.decode import decode
from gateway.policies.loop import DecodeResult, DecodeStats

__all__ = ["DecodeResult", "DecodeStats", "decode"]
