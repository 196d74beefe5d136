"""gRPC server plumbing every specdec service shares: the host (health, reflection, size limits,
draining), status mapping and request ids, the session-stream protocol, metrics, logging."""
