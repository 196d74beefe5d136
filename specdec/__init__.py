"""specdec: lossless and near-lossless accelerated decoding served over gRPC."""

__version__ = "0.1.0"
