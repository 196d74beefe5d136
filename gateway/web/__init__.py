"""The gateway's HTTP endpoints (KServe v2 REST, OpenAI-style completions, LibreTranslate, the
playground page), on their own address beside the gRPC port: `gateway.web.server.HttpServer`."""
