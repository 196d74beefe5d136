"""The gateway's peers: the verifier and drafter pools (replica sets, a Triton-hosted verifier),
their sessions over gRPC, and failover between replicas."""
