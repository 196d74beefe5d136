"""specdec: lossless and near-lossless accelerated decoding, in-process or served over gRPC.

The Python API (`specdec.api`): `specdec.Engine.load(bundle)` decodes in this process,
`specdec.Engine.connect(address)` through a gateway; both `generate(...)` and `generate_stream(...)`.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_API = ("Chunk", "Engine", "Output", "SpecdecError", "Stats", "StatusCode")
__all__ = [*_API, "__version__"]


def __getattr__(name: str) -> Any:
    """The API's names, imported on first use: `specdec --version` and the CLI's parsing stay light."""
    if name in _API:
        from specdec import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
