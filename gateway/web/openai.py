"""OpenAI-style completions: `POST /v1/completions` (server-sent events with `"stream": true`) and
`GET /v1/models`, so the OpenAI SDKs and the tools built on them can call the gateway.

A request maps onto the gateway's: `prompt` (a string, a list of strings, or token ids) is the text
or `input_ids`; `max_tokens` is `max_new_tokens` (unset: the gateway's default, not OpenAI's 16);
`seed` is the seed; `temperature` above 0 or `top_p` below 1 is speculative sampling (mode `spec`)
unless the request names another mode, whose refusal of them is then the answer; `temperature` 0
is greedy. The decoding mode and its settings go in the extra field `specdec`, named as KServe's
request parameters (the CLI flags): `{"mode": "gad", "k": 10}`. `n` choices per prompt are
decoded as separate requests (a sampling mode's choice i uses seed + i when a seed is given).

Each choice carries the extra field `specdec`: the output ids and the stats of `Generate`; in a
stream, every chunk's `specdec` says which tokens it holds and where they came from (`"draft"`:
accepted from the drafter's or, under IAD, the input's draft; `"verifier"`: the verifier's own),
and each choice's last chunk has the stats. `logprobs: 0` (a whole response) returns each output
token's log-probability (`output_logprobs`: the verifier's, processed as the mode decoded with), its
text and offset. What the gateway cannot do is refused by name (`logprobs` above 0 or with `stream`:
the top alternatives at each position; `stop`, `echo`, `suffix`, penalties, `logit_bias`, `best_of`
above `n`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from typing import Any

from aiohttp import web

from core.errors import SpecdecError
from decoding.policies.loop import drafted_count
from decoding.report import TextStream
from gateway.context import Answer
from gateway.kserve import RequestPath, json_parameters, settings
from gateway.web.app import HttpContext, HttpError, error_body, handler, json_response, read_json, run_all
from gateway.wire import stats_record
from protos.specdec.v1 import gateway_pb2

# What OpenAI's completions request may hold; the fields it sets beyond these are refused by name.
FIELDS = {
    "model", "prompt", "max_tokens", "temperature", "top_p", "seed", "n", "stream", "stream_options", "logprobs",
    "echo", "stop", "suffix", "presence_penalty", "frequency_penalty", "logit_bias", "best_of", "user", "specdec",
}
# Fields the gateway has no use for, accepted only at the value that asks for nothing.
_NOTHING = {"echo": (None, False), "stop": (None, [], ""), "suffix": (None, ""),
            "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {})}
FINISH = {"eos": "stop", "length": "length"}
SPEC_MODE = "spec"
# The OpenAI names of sampling settings and the request parameters they become.
SAMPLING = {"temperature": "temperature", "top_p": "top_p"}


def routes(gateway: RequestPath, model_name: str, max_choices: int) -> list[web.RouteDef]:
    endpoint = Completions(gateway, model_name, max_choices)
    return [web.get("/v1/models", endpoint.models), web.post("/v1/completions", handler(endpoint.complete))]


class Completions:
    def __init__(self, gateway: RequestPath, model_name: str, max_choices: int) -> None:
        self.gateway = gateway
        self.model_name = model_name
        # Choices one request may ask for (prompts x n): each is a request of its own to admission,
        # so more than a client's share (max_per_client) would be refused there anyway.
        self.max_choices = max_choices
        self.created = int(time.time())

    async def models(self, request: web.Request) -> web.Response:
        model = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "specdec"}
        return json_response({"object": "list", "data": [model]})

    async def complete(self, request: web.Request, context: HttpContext) -> web.StreamResponse:
        body = await read_json(request)
        jobs, stream, include_usage = self.jobs(body)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name}
        if stream:
            return await self._stream(request, context, jobs, head, include_usage)
        answers = await run_all([self._run(job, context) for _, job in jobs])
        choices = []
        for index, answer in enumerate(answers):
            ids = answer.result.output_ids
            logprobs = _logprobs(self.gateway.tokenizer.decode, ids, answer.result.token_logprobs) \
                if body.get("logprobs") == 0 else None
            choices.append({
                "index": index, "text": self.gateway.tokenizer.decode(ids), "logprobs": logprobs,
                "finish_reason": FINISH.get(answer.result.stats.finish_reason, "stop"),
                "specdec": {"output_ids": ids, "stats": stats_record(answer.result.stats, answer.mode, answer.total_s)},
            })
        return json_response({**head, "choices": choices, "usage": _usage(jobs, answers)})

    async def _run(self, job: gateway_pb2.GenerateRequest, context: HttpContext) -> Answer:
        answer = await self.gateway.answer(job, context)
        self.gateway.metrics.latency.observe(answer.total_s, mode=answer.mode.value, rpc="Completions")
        return answer

    # ---- the request -----------------------------------------------------------------------------

    def jobs(self, body: dict[str, Any]) -> tuple[list[tuple[int, gateway_pb2.GenerateRequest]], bool, bool]:
        """(prompt index, request) per choice in OpenAI's order, whether to stream, and whether the
        stream ends with a usage chunk. 400 for what the gateway cannot do; 404 for another model."""
        unknown = sorted(set(body) - FIELDS)
        if unknown:
            raise HttpError(400, f"unknown parameter {unknown[0]!r}", param=unknown[0], code="unknown_parameter")
        model = body.get("model")
        if model != self.model_name:
            raise HttpError(404, f"the model {model!r} does not exist; this server has {self.model_name!r}",
                            param="model", code="model_not_found")
        for name, allowed in _NOTHING.items():
            value = body.get(name)
            # 0 and 0.0 alike (clients send penalties as floats), but never False for 0.
            if not any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed):
                raise HttpError(400, f"{name} is not supported by this server", param=name, code="unsupported")
        n = _integer(body, "n", 1, least=1)
        best_of = body.get("best_of")
        if best_of is not None and _integer(body, "best_of", 1, least=1) != n:
            raise HttpError(400, "best_of other than n is not supported by this server", param="best_of")
        stream = _typed(body, "stream", bool, False)
        options = _typed(body, "stream_options", dict, None)
        if options is not None and not stream:
            raise HttpError(400, "stream_options needs stream: true", param="stream_options")
        include_usage = bool((options or {}).get("include_usage", False))
        logprobs = body.get("logprobs")
        if logprobs is not None:
            if _integer(body, "logprobs", 0) > 0:
                raise HttpError(400, "logprobs above 0 (the top alternatives at each position) is not supported by "
                                     "this server; logprobs: 0 returns each output token's log-probability",
                                param="logprobs", code="unsupported")
            if stream:
                raise HttpError(400, "logprobs with stream is not supported by this server", param="logprobs",
                                code="unsupported")
        prompts = _prompts(body.get("prompt"))
        if len(prompts) * n > self.max_choices:
            raise HttpError(400, f"{len(prompts)} prompts x n={n} is more than the {self.max_choices} choices one "
                                 "request may ask for ([gateway] max_per_client)", param="n")
        parameters = _parameters(body)
        if logprobs is not None:
            parameters["output_logprobs"] = True
        seed = parameters.get("seed")
        jobs = []
        for index, prompt in enumerate(prompts):
            for i in range(n):
                params = dict(parameters)
                if seed is not None and n > 1:
                    params["seed"] = seed + i
                jobs.append((index, _generate_request(prompt, params)))
        return jobs, stream, include_usage

    # ---- streaming -------------------------------------------------------------------------------

    async def _stream(self, request: web.Request, context: HttpContext, jobs: list, head: dict,
                      include_usage: bool) -> web.StreamResponse:
        """The choices' chunks as server-sent events, interleaved as they come. The response starts
        with the first event, so a request refused before any output gets its status and error body;
        a failure after that is an `error` event. Leaving (the client gone) cancels every decode."""
        events: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        tasks = [asyncio.ensure_future(self._produce(i, job, context, events)) for i, (_, job) in enumerate(jobs)]
        texts = [ChoiceText(self.gateway.tokenizer.decode) for _ in jobs]
        answers: list[Answer | None] = [None] * len(jobs)
        response: web.StreamResponse | None = None
        try:
            left = len(jobs)
            while left:
                index, event = await events.get()
                if isinstance(event, Exception):
                    if response is None:
                        raise event
                    failure = event if isinstance(event, HttpError) else HttpError(500, "internal error")
                    await _send(response, error_body(request.path, failure))
                    break
                if response is None:
                    response = await _open_events(request, context)
                if isinstance(event, Answer):
                    answers[index] = event
                    left -= 1
                    chunks = texts[index].finish(event)
                    self.gateway.metrics.latency.observe(event.total_s, mode=event.mode.value, rpc="Completions")
                else:
                    chunks = texts[index].add(event)
                for chunk in chunks:
                    await _send(response, {**head, "choices": [{"index": index, **chunk}]})
            else:
                if include_usage:
                    await _send(response, {**head, "choices": [], "usage": _usage(jobs, answers)})
            assert response is not None
            await response.write(b"data: [DONE]\n\n")
            return response
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _produce(self, index: int, job: gateway_pb2.GenerateRequest, context: HttpContext,
                       events: asyncio.Queue) -> None:
        try:
            async with contextlib.aclosing(self.gateway.stream(job, context)) as blocks:
                async for event in blocks:
                    events.put_nowait((index, event))
        except Exception as exc:  # the consumer answers it (HttpError), or reports a bug as a 500
            events.put_nowait((index, exc))


class ChoiceText:
    """One choice's stream as chunks: each committed block split into its drafted and its verifier
    part, each part's text as `TextStream` lets it out (text that later tokens cannot change)."""

    def __init__(self, decode: Any) -> None:
        self.text = TextStream(decode)

    def add(self, block: list[int]) -> list[dict[str, Any]]:
        drafted = drafted_count(block)
        parts = ((list(block[:drafted]), "draft"), (list(block[drafted:]), "verifier"))
        return [self._chunk(self.text.add(ids), ids, source) for ids, source in parts if ids]

    def finish(self, answer: Answer) -> list[dict[str, Any]]:
        tail, rest = self.text.finish(answer.result.output_ids)
        chunks = [self._chunk(tail, rest, "verifier")] if tail or rest else []
        stats = stats_record(answer.result.stats, answer.mode, answer.total_s)
        reason = FINISH.get(answer.result.stats.finish_reason, "stop")
        return [*chunks, {"text": "", "logprobs": None, "finish_reason": reason, "specdec": {"stats": stats}}]

    @staticmethod
    def _chunk(text: str, ids: list[int], source: str) -> dict[str, Any]:
        return {"text": text, "logprobs": None, "finish_reason": None, "specdec": {"source": source, "token_ids": ids}}


async def _open_events(request: web.Request, context: HttpContext) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Request-Id": context.request_id()})
    await response.prepare(request)
    return response


async def _send(response: web.StreamResponse, event: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(event, ensure_ascii=False).encode() + b"\n\n")


# ---- fields --------------------------------------------------------------------------------------


def _prompts(prompt: Any) -> list[str | list[int]]:
    """The prompts: a string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_ids(p) for p in prompt):
            return [list(p) for p in prompt]
        if _ids(prompt):
            return [list(prompt)]
    raise HttpError(400, "prompt must be a string, a list of strings, a list of token ids or a list of such lists",
                    param="prompt")


def _ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(i, int) and not isinstance(i, bool)
                                                           for i in value)


def _parameters(body: dict[str, Any]) -> dict[str, Any]:
    """The request parameters (KServe's names) the body asks for: its `specdec` settings, then
    max_tokens, seed and the sampling settings mapped onto them."""
    params = dict(_typed(body, "specdec", dict, {}))
    for name, param in (("max_tokens", "max_new_tokens"), ("seed", "seed")):
        value = body.get(name)
        if value is None:
            continue
        if param in params:
            raise HttpError(400, f"set {name} or specdec.{param}, not both", param=name)
        params[param] = _integer(body, name, 0)
    given = {name: body[name] for name in SAMPLING if body.get(name) is not None}
    for name, value in given.items():
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise HttpError(400, f"{name} must be a number, got {json.dumps(value)[:40]}", param=name)
    samples = given.get("temperature", 1.0) > 0 and ("temperature" in given or given.get("top_p", 1.0) < 1)
    if params.get("mode") == SPEC_MODE or samples:
        params.setdefault("mode", SPEC_MODE)
        for name, value in given.items():
            params[SAMPLING[name]] = float(value)
    return params


def _generate_request(prompt: str | list[int], params: dict[str, Any]) -> gateway_pb2.GenerateRequest:
    try:
        config, target = settings(json_parameters(params))
    except SpecdecError as exc:
        raise HttpError(400, exc.message, param="specdec", code=exc.code.value.lower()) from None
    if isinstance(prompt, str):
        return gateway_pb2.GenerateRequest(text=prompt, config=config, **target)
    return gateway_pb2.GenerateRequest(input_ids=prompt, config=config, **target)


def _logprobs(decode: Any, ids: list[int], token_logprobs: list[float]) -> dict[str, Any]:
    """OpenAI's `logprobs` object of one choice: each output token (its text), its log-probability
    and where its text starts in the choice's text; no alternatives (`top_logprobs`)."""
    tokens, offsets = [], []
    before = ""
    for i in range(len(ids)):
        text = decode(ids[: i + 1])
        offsets.append(len(before))
        tokens.append(text[len(before):] if text.startswith(before) else decode([ids[i]]))
        before = text
    return {"tokens": tokens, "token_logprobs": [float(x) for x in token_logprobs[: len(ids)]],
            "top_logprobs": None, "text_offset": offsets}


def _usage(jobs: list, answers: list[Answer | None]) -> dict[str, int]:
    """Token counts: each prompt's tokens once (however many choices it has), every choice's output."""
    prompt: dict[int, int] = {}
    completion = 0
    for (index, _), answer in zip(jobs, answers, strict=True):
        if answer is not None:
            prompt[index] = answer.input_tokens
            completion += len(answer.result.output_ids)
    total_prompt = sum(prompt.values())
    return {"prompt_tokens": total_prompt, "completion_tokens": completion, "total_tokens": total_prompt + completion}


def _integer(body: dict[str, Any], name: str, default: int, least: int = 0) -> int:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise HttpError(400, f"{name} must be an integer of at least {least}, got {json.dumps(value)[:40]}",
                        param=name)
    return value


def _typed(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise HttpError(400, f"{name} must be a {kind.__name__}, got {json.dumps(value)[:40]}", param=name)
    return value
