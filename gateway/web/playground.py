"""The playground page at `/`: a text box, the mode and its settings, the output with its accepted
drafted tokens marked, and the request's stats.

One HTML file with its script and styles inline (no build step, no external assets: the gateway may
be offline). It streams from `/v1/completions` like any client; each streamed piece says whether
its tokens were accepted from the draft or written by the verifier (gateway.web.openai). The modes
and their settings come from the mode registry and the gateway's [defaults], filled into the page
when it is served, so the form always matches what the gateway accepts.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from aiohttp import web

from decoding.config import CHOICES, DecodingConfig, Mode
from decoding.modes import MODES, DrafterMethod
from decoding.modes.mode_spec import COMMON_PARAMS

PAGE = Path(__file__).with_name("playground.html")
PLACEHOLDER = "/*CONFIG*/null"
# The page's script and styles are inline; it talks to this gateway only.
POLICY = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
          "img-src 'self' data:; base-uri 'none'; form-action 'none'")
# Where a mode's accepted draft tokens come from, as the page's legend says it.
DRAFT_SOURCES = {DrafterMethod.BLOCK: "the drafter", DrafterMethod.BEAM: "the small AR drafter's beam",
                 DrafterMethod.SAMPLE: "the small AR drafter's samples"}


def routes(model_name: str, defaults: DecodingConfig) -> list[web.RouteDef]:
    page = render(model_name, defaults)

    async def index(request: web.Request) -> web.Response:
        return web.Response(text=page, content_type="text/html", headers={"Content-Security-Policy": POLICY})

    return [web.get("/", index)]


def render(model_name: str, defaults: DecodingConfig) -> str:
    """The page with its settings filled in."""
    settings = json.dumps(page_config(model_name, defaults)).replace("</", "<\\/")
    return PAGE.read_text(encoding="utf-8").replace(PLACEHOLDER, settings)


def page_config(model_name: str, defaults: DecodingConfig) -> dict[str, Any]:
    """The model's name, every mode with the settings it takes (their kind, default and help), the defaults."""
    by_name = {f.name: f for f in fields(DecodingConfig)}
    modes = []
    for mode, spec in MODES.items():
        params = []
        for name in sorted(spec.applicable - COMMON_PARAMS):
            f = by_name[name]
            default = getattr(defaults, name)
            param = {"name": name, "kind": _kind(f), "default": getattr(default, "value", default),
                     "help": f.metadata["help"]}
            if name in CHOICES:
                param["choices"] = [m.value for m in CHOICES[name]]
            params.append(param)
        source = "the input (copied)" if mode == Mode.IAD else DRAFT_SOURCES.get(spec.drafter)
        modes.append({"name": mode.value, "lossless": spec.lossless, "draft_source": source, "params": params,
                      "about": _about(mode, spec.lossless)})
    return {"model": model_name, "modes": modes,
            "defaults": {"mode": defaults.mode.value, "max_new_tokens": defaults.max_new_tokens}}


def _kind(f: Any) -> str:
    """How the page shows a setting: a checkbox, a list of choices, or a number (int or float)."""
    if f.name in CHOICES:
        return "choice"
    return "bool" if "bool" in str(f.type) else "int" if "int" in str(f.type) else "float"


def _about(mode: Mode, lossless: bool) -> str:
    if mode in (Mode.AR, Mode.BEAM):
        return "no drafting: every token is the verifier's"
    if lossless:
        return "lossless: the output is exactly greedy's, in fewer verifier steps"
    if mode == Mode.SPECULATIVE:
        return "samples with the verifier's distribution"
    return "near-lossless: accepts drafted tokens the verifier rates nearly as likely as its own"
