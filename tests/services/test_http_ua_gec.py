"""The HTTP endpoints on the shipped UA-GEC bundle, where drafts are accepted: the README's curl
examples run as written (each answer compared with gRPC's `Generate` of the same request), the
streamed tokens' provenance adds up to the accepted drafts, and the playground page works in a real
headless browser (Debian's chromium and chromedriver; skipped, saying why, where none can run)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import grpc
import pytest

from core.backends import DEFAULT_BACKEND
from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from decoding.policies.loop import drafted_count
from drafter_service.session import LocalDrafter
from gateway.wire import overrides_to_wire
from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc
from seq2seq_models.bundle import load_bundle
from specdec.api import DEFAULT_BUNDLE_DIR
from specdec.serve import ServiceStack
from tests.services.conftest import REPO
from verifier_service.session import make_verifier

README_ADDRESS = "http://127.0.0.1:8000"
# A sentence the model corrects (a comma before "яку"), most of it copied in accepted drafts.
SENTENCE = "Я хочу подякувати вам за допомогу яку ви надали мені минулого тижня."
ARTIFACTS = REPO / "tests" / "artifacts"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def ua_gec():
    sections = {
        "verifier": {"address": "127.0.0.1:0"},
        "drafter": {"address": "127.0.0.1:0"},
        "gateway": {"address": "127.0.0.1:0", "language_pair": "uk:uk"},
    }
    with ServiceStack("all", DEFAULT_BUNDLE_DIR, sections) as running:
        yield running


@pytest.fixture(scope="module")
def generate(ua_gec):
    """gRPC's Generate on the same stack: (text, decoding overrides) -> GenerateResponse."""
    with grpc.insecure_channel(ua_gec.running.addresses["gateway"]) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)

        def run(text: str, overrides: dict[str, Any]) -> gateway_pb2.GenerateResponse:
            request = gateway_pb2.GenerateRequest(text=text, config=overrides_to_wire(overrides))
            return stub.Generate(request, timeout=120)

        yield run


def readme_curls() -> list[str]:
    """The curl commands of the README's HTTP example (continuation lines joined)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    start = readme.index("Over HTTP, with nothing but `curl`")
    block = readme[start:].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = block.replace("\\\n", " ").splitlines()
    return [c for c in commands if c.startswith("curl ")]


def _body(args: list[str]) -> dict[str, Any]:
    return json.loads(args[args.index("-d") + 1]) if "-d" in args else {}


def _events(output: str) -> list[dict[str, Any]]:
    data = [line[len("data: "):] for line in output.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_readme_curl_examples_answer_as_grpc_does(ua_gec, generate):
    address = "http://" + ua_gec.running.http_address
    commands = readme_curls()
    paths = {re.search(r"http://\S+?(/\S*)", c).group(1) for c in commands}
    assert paths == {"/v1/completions", "/v1/models", "/v2/models/specdec/infer", "/v2/health/ready", "/translate",
                     "/languages"}
    for command in commands:
        args = [a.replace(README_ADDRESS, address) for a in shlex.split(command)]
        done = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (command, done.stderr)
        path = re.search(r"http://\S+?(/\S*)", command).group(1)
        body = _body(args)
        if path == "/v1/completions":
            overrides = {**body["specdec"], "max_new_tokens": body.get("max_tokens")}
            expected = generate(body["prompt"], overrides)
            if body.get("stream"):
                events = _events(done.stdout)
                text = "".join(e["choices"][0]["text"] for e in events)
            else:
                text = json.loads(done.stdout)["choices"][0]["text"]
            assert text == expected.text, command
        elif path == "/v2/models/specdec/infer":
            answer = json.loads(done.stdout)
            expected = generate(body["inputs"][0]["data"][0], body["parameters"])
            assert answer["outputs"][0] == {"name": "TEXT", "datatype": "BYTES", "shape": [1], "data": [expected.text]}
            assert answer["outputs"][1]["data"] == list(expected.output_ids)
        elif path == "/translate":
            assert json.loads(done.stdout) == {"translatedText": generate(body["q"], {}).text}
        else:
            expected_json = {
                "/v1/models": lambda a: [m["id"] for m in a["data"]] == ["specdec"],
                "/v2/health/ready": lambda a: a == {"ready": True},
                "/languages": lambda a: a == [{"code": "uk", "name": "Ukrainian", "targets": ["uk"]}],
            }[path]
            assert expected_json(json.loads(done.stdout)), (command, done.stdout)


def test_streamed_provenance_is_the_decode_loops(ua_gec, generate):
    """In GAD and IAD each streamed piece marked "draft" holds the accepted draft tokens of one of the
    decode loop's committed blocks and each "verifier" piece the rest, as the in-process decode of the
    same request commits them; together they are gRPC's output."""
    bundle = load_bundle(DEFAULT_BUNDLE_DIR)
    verifier = make_verifier(bundle, DEFAULT_BACKEND)
    drafter = LocalDrafter({"nar_drafter": bundle.nar_drafter, "ar_drafter": bundle.ar_drafter})
    address = "http://" + ua_gec.running.http_address
    for mode in ("gad", "iad"):
        parts = _committed_parts(bundle.tokenizer.encode(SENTENCE), DecodingConfig(mode=Mode(mode), k=10),
                                 verifier, drafter)
        body = {"model": "specdec", "prompt": SENTENCE, "stream": True, "specdec": {"mode": mode, "k": 10}}
        done = subprocess.run(["curl", "-sN", f"{address}/v1/completions", "-d", json.dumps(body)],
                              capture_output=True, text=True, timeout=120, check=True)
        pieces = [e["choices"][0] for e in _events(done.stdout)]
        marked = [(p["specdec"]["token_ids"], p["specdec"]["source"]) for p in pieces if "source" in p["specdec"]]
        assert marked == parts
        expected = generate(SENTENCE, {"mode": mode, "k": 10})
        assert [i for ids, _ in marked for i in ids] == list(expected.output_ids)
        drafted = sum(len(ids) for ids, source in marked if source == "draft")
        # The last block's accepted drafts may run past the EOS that ends the output.
        assert 0 < drafted <= expected.stats.accepted_tokens


def _committed_parts(source: list[int], config: DecodingConfig, verifier, drafter) -> list[tuple[list[int], str]]:
    """The in-process decode's committed blocks, each split into its drafted and its verifier part."""
    parts: list[tuple[list[int], str]] = []

    def on_tokens(block: list[int]) -> None:
        n = drafted_count(block)
        parts.extend((ids, source) for ids, source in ((block[:n], "draft"), (block[n:], "verifier")) if ids)

    decode(source, config, verifier, drafter, on_tokens=on_tokens)
    return parts


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the dev extra)")
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.chrome.service import Service

    for binary in (CHROMIUM, CHROMEDRIVER):
        if not shutil.which(binary):
            pytest.skip(f"no headless browser: {binary} is missing (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1360,860"):
        options.add_argument(arg)
    try:
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    except WebDriverException as exc:
        pytest.skip(f"the headless browser cannot start here: {exc.msg}")
    yield driver
    driver.quit()


def test_the_playground_renders_a_correction_with_marked_blocks_and_stats(ua_gec, generate, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    browser.get("http://" + ua_gec.running.http_address + "/")
    assert browser.title == "specdec playground"
    browser.find_element(By.ID, "text").send_keys(SENTENCE)
    Select(browser.find_element(By.ID, "mode")).select_by_value("gad")
    k = browser.find_element(By.ID, "param-k")
    k.clear()
    k.send_keys("10")
    browser.find_element(By.ID, "run").click()
    WebDriverWait(browser, 60).until(lambda d: d.find_elements(By.ID, "time-split") or d.find_element(
        By.ID, "error").text)
    assert browser.find_element(By.ID, "error").text == ""
    expected = generate(SENTENCE, {"mode": "gad", "k": 10})
    assert browser.find_element(By.ID, "output").text == expected.text
    drafts = browser.find_elements(By.CSS_SELECTOR, "#output span.draft")
    verifier = browser.find_elements(By.CSS_SELECTOR, "#output span.verifier")
    assert drafts and verifier  # accepted drafted blocks, and the verifier's corrections and own tokens
    assert "," in "".join(span.text for span in verifier)  # the comma the model inserts is the verifier's
    stats = {row.find_elements(By.TAG_NAME, "td")[0].text: row.find_elements(By.TAG_NAME, "td")[1].text
             for row in browser.find_elements(By.CSS_SELECTOR, "#stats tr")}
    assert stats["iterations (verifier steps)"] == str(expected.stats.iterations)
    assert stats["mode"] == "gad" and "verifier" in stats["time split"]
    ARTIFACTS.mkdir(exist_ok=True)
    shot = Path(ARTIFACTS / "playground.png")
    assert browser.save_screenshot(str(shot))
    print(f"\nplayground screenshot: {shot}")
