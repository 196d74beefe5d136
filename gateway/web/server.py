"""The HTTP listener's assembly: every protocol's routes on one application (gateway.web.app), with
the gateway's body size limit, bearer token and TLS settings, started and stopped by the gateway."""

from __future__ import annotations

from gateway.config import GatewayConfig
from gateway.kserve import RequestPath
from gateway.web import kserve_rest, openai, playground, translate
from gateway.web.app import HttpListener, make_app
from gateway.web.languages import Languages
from serving.tls import ServerTLS


class HttpServer:
    def __init__(self, gateway: RequestPath, config: GatewayConfig, token: str | None, shutdown_s: float) -> None:
        model = config.kserve_model
        tokenizer = gateway.tokenizer
        languages = Languages.of(getattr(tokenizer, "languages", {}), list(getattr(tokenizer, "prefix", [])),
                                 config.language_pair)
        routes = [
            *kserve_rest.routes(gateway, model),
            *openai.routes(gateway, model, config.max_per_client),
            *translate.routes(gateway, languages, config.max_per_client),
            *playground.routes(model, config.defaults),
        ]
        app = make_app(config.max_request_bytes, token, routes, api_keys=(translate.PATHS, translate.api_key))
        self.listener = HttpListener(app, shutdown_s)

    @property
    def port(self) -> int:
        return self.listener.port

    async def start(self, address: str, tls: ServerTLS | None) -> int:
        return await self.listener.start(address, tls)

    async def stop(self) -> None:
        await self.listener.stop()
