"""The decoding engine: request preparation, the decoding config, the accept loop, the modes and their policies."""
