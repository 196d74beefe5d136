"""LibreTranslate's API: `POST /translate` and `GET /languages`, for the browser extensions, CMS plugins
and tools (Weblate) that speak it.

`q` (a text, or a list of texts answered as a list), `source` and `target` as LibreTranslate codes
(gateway.web.languages maps them to the model's), `format` "text" only; as JSON or as a form. Each
text is a request of the gateway's own (`GatewayServer.answer`) in its default decoding mode (the
[defaults] section), with the target language as its `target_lang`. Errors are LibreTranslate's:
`{"error": "..."}`, 400 for a bad request, 403 for a wrong API key, 429 when the client has too many
requests in the gateway. `alternatives` N asks for N other translations besides the best: the text
is decoded by beam search with N + 1 beams (its N + 1 best hypotheses: the first is
`translatedText`, the others `alternatives`, best first), as LibreTranslate asks its engine for
N + 1 hypotheses. An API key is the gateway's bearer token, sent as `Authorization: Bearer`
or as LibreTranslate sends it, the `api_key` field or query parameter.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway.kserve import RequestPath
from gateway.web.app import HttpContext, HttpError, handler, json_object, json_response, read_body, run_all
from gateway.web.languages import Languages
from protos.specdec.v1 import gateway_pb2

PATHS = ("/translate", "/languages")
FIELDS = {"q", "source", "target", "format", "api_key", "alternatives"}


def routes(gateway: RequestPath, languages: Languages, max_texts: int) -> list[web.RouteDef]:
    endpoint = Translate(gateway, languages, max_texts)
    return [web.get("/languages", endpoint.languages), web.post("/translate", handler(endpoint.translate))]


async def api_key(request: web.Request) -> str | None:
    """The API key a LibreTranslate client sent: the `api_key` query parameter or body field."""
    if "api_key" in request.query:
        return request.query["api_key"]
    if request.method != "POST":
        return None
    try:
        fields = await _fields(request)
    except HttpError:
        return None  # the handler reports the malformed body
    value = fields.get("api_key")
    return value if isinstance(value, str) else None


class Translate:
    def __init__(self, gateway: RequestPath, languages: Languages, max_texts: int) -> None:
        self.gateway = gateway
        self.model_languages = languages
        self.max_texts = max_texts  # texts per request: each is a request of its own to admission

    async def languages(self, request: web.Request) -> web.Response:
        return json_response(self.model_languages.listing())

    async def translate(self, request: web.Request, context: HttpContext) -> web.Response:
        fields = await _fields(request)
        unknown = sorted(set(fields) - FIELDS)
        if unknown:
            raise HttpError(400, f"unknown parameter {unknown[0]!r}")
        texts, many = _texts(fields.get("q"))
        if len(texts) > self.max_texts:
            raise HttpError(400, f"{len(texts)} texts is more than the {self.max_texts} one request may hold "
                                 "([gateway] max_per_client)")
        source, target = _required(fields, "source"), _required(fields, "target")
        if fields.get("format", "text") != "text":
            raise HttpError(400, f"format {fields['format']!r} is not supported: only \"text\"")
        alternatives = _alternatives(fields.get("alternatives"))
        try:
            self.model_languages.check_source(source)
            target_lang = self.model_languages.target(target)
        except ValueError as exc:
            raise HttpError(400, str(exc)) from None
        translated = await run_all([self._translate(text, target_lang, alternatives, context) for text in texts])
        body: dict[str, Any] = {"translatedText": [t[0] for t in translated] if many else translated[0][0]}
        if alternatives:
            body["alternatives"] = [t[1:] for t in translated] if many else translated[0][1:]
        return json_response(body)

    async def _translate(self, text: str, target_lang: str, alternatives: int, context: HttpContext) -> list[str]:
        """The translation, then its alternatives (best first)."""
        if not text:  # as LibreTranslate: nothing to translate is an empty translation, not an error
            return [""]
        request = gateway_pb2.GenerateRequest(text=text, target_lang=target_lang)
        if alternatives:
            n = alternatives + 1
            request.config.CopyFrom(gateway_pb2.DecodingConfig(mode=gateway_pb2.MODE_AR_BEAM, num_beams=n,
                                                               num_return_sequences=n))
        answer = await self.gateway.answer(request, context)
        self.gateway.metrics.latency.observe(answer.total_s, mode=answer.mode.value, rpc="Translate")
        decode = self.gateway.tokenizer.decode
        if not alternatives:
            return [decode(answer.result.output_ids)]
        return [decode(h.output_ids) for h in answer.result.hypotheses] or [decode(answer.result.output_ids)]


async def _fields(request: web.Request) -> dict[str, Any]:
    """The request's fields: a JSON object, or a form (url-encoded or multipart) as LibreTranslate takes."""
    if request.content_type in ("application/x-www-form-urlencoded", "multipart/form-data"):
        try:
            form = await request.post()
        except web.HTTPRequestEntityTooLarge as exc:
            raise HttpError(413, f"the request body is over the limit of {request.client_max_size} bytes") from exc
        return {key: value for key, value in form.items() if isinstance(value, str)}
    return json_object(await read_body(request))


def _texts(q: Any) -> tuple[list[str], bool]:
    if isinstance(q, str):
        return [q], False
    if isinstance(q, list) and all(isinstance(t, str) for t in q):
        return list(q), True
    raise HttpError(400, "Invalid request: missing q parameter" if q is None else "q must be a string or a list "
                    "of strings")


def _alternatives(value: Any) -> int:
    """`alternatives` as a count (absent: 0); LibreTranslate's forms send it as text."""
    if value is None:
        return 0
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise HttpError(400, f"alternatives must be a whole number of 0 or more, got {value!r}")
    return value


def _required(fields: dict[str, Any], name: str) -> str:
    value = fields.get(name)
    if not isinstance(value, str) or not value:
        raise HttpError(400, f"Invalid request: missing {name} parameter")
    return value
