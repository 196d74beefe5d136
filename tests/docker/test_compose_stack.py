"""The CPU compose stack, end to end: build the base image (when missing) and the image, `up` with
docker-compose.cpu.yml, wait for healthy, decode in every lossless mode through the gateway and
compare with in-process `specdec decode` on the same bundle, kill the drafter and see the degraded
fallback give the same outputs, start it again and see it used, then `down` with nothing left.

The measured times (build, up to healthy, the whole test) are printed; README "Deploy" quotes them.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("SPECDEC_IMAGE", "specdec:latest")
COMPOSE_FILE = ROOT / "docker-compose.cpu.yml"
TEXTS = ["Я хочу подякувати вам за вашу допомогу.", "Він сказав що прийде завтра."]
LOSSLESS = ["ar", "iad", "gad"]


def _run(*cmd: str, timeout: float = 120, env: dict[str, str] | None = None, check: bool = True):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def _docker_unavailable() -> str | None:
    """Why Docker cannot run here, or None."""
    for tool in ("docker", "docker-compose"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    proc = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        return f"no docker daemon answers: {(proc.stderr.strip().splitlines() or ['?'])[-1]}"
    return None


def _free_ports(n: int) -> list[int]:
    """n distinct ports below the ephemeral range, free now (the stack binds them on loopback)."""
    ports: list[int] = []
    # Start at a place that depends on the process, so two runs rarely pick the same ports, and wrap
    # round the whole window (46100-47999) so every start finds them.
    start = (os.getpid() % 190) * 10
    for port in (46100 + (start + i) % 1900 for i in range(1900)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError("no free ports")


@pytest.fixture(scope="module")
def timings() -> dict[str, float]:
    out: dict[str, float] = {}
    yield out
    print("\nDOCKER TIMINGS " + json.dumps({k: round(v, 1) for k, v in out.items()}), file=sys.__stderr__)


@pytest.fixture(scope="module")
def image(timings) -> str:
    reason = _docker_unavailable()
    if reason:
        print(f"tests/docker skipped: {reason}", file=sys.__stderr__)
        pytest.skip(reason)
    started = time.monotonic()
    # Builds the base image from Debian packages first when it is missing (deploy/build-base-image.sh).
    _run(str(ROOT / "deploy" / "build-image.sh"), "--tag", IMAGE, timeout=3600)
    timings["build_s"] = time.monotonic() - started
    size = _run("docker", "image", "inspect", "-f", "{{.Size}}", IMAGE).stdout.strip()
    timings["image_mb"] = int(size) / 1e6
    return IMAGE


class Stack:
    def __init__(self, image: str, compose_file: Path = COMPOSE_FILE, name: str = "test") -> None:
        self.project = f"specdec-{name}-{os.getpid()}"
        self.compose_file = compose_file
        gateway, verifier, drafter, verifier2 = _free_ports(4)
        self.gateway = f"127.0.0.1:{gateway}"
        self.env = {**os.environ, "SPECDEC_IMAGE": image, "GATEWAY_PORT": str(gateway),
                    "VERIFIER_PORT": str(verifier), "DRAFTER_PORT": str(drafter), "VERIFIER2_PORT": str(verifier2)}

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        return _run("docker-compose", "-p", self.project, "-f", str(self.compose_file), *args,
                    timeout=timeout, env=self.env, check=check)

    def health(self, service: str) -> str:
        cid = self.compose("ps", "-q", service).stdout.strip()
        if not cid:
            return "absent"
        return _run("docker", "inspect", "-f", "{{.State.Health.Status}}", cid).stdout.strip()

    def wait_healthy(self, service: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while (status := self.health(service)) != "healthy":
            if status == "unhealthy" or time.monotonic() > deadline:
                logs = self.compose("logs", "--tail", "40", check=False).stdout
                raise AssertionError(f"{service} is {status}:\n{logs[-6000:]}")
            time.sleep(1)

    def containers(self) -> list[str]:
        proc = _run("docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={self.project}")
        return proc.stdout.split()


@pytest.fixture(scope="module")
def stack(image, timings):
    s = Stack(image)
    started = time.monotonic()
    try:
        # `up -d` starts the gateway only once verifier and drafter are healthy (depends_on).
        s.compose("up", "-d", timeout=600)
        s.wait_healthy("gateway")
        timings["up_to_healthy_s"] = time.monotonic() - started
        yield s
    finally:
        stopped = time.monotonic()
        s.compose("down", "--timeout", "20", check=False)
        timings["down_s"] = time.monotonic() - stopped
        left = s.containers()
        assert not left, f"containers left after down: {left}"


def _generate(stack: Stack, text: str, mode: str) -> dict:
    proc = _run(sys.executable, "-m", "specdec", "generate", text, "--addr", stack.gateway, "--mode", mode, "--json",
                "--timeout", "60")
    return json.loads(proc.stdout)


def test_a_rebuild_removes_the_images_it_replaces(image, tmp_path, timings):
    # Docker's classic builder keeps every stage's image; before build-image.sh tagged its stages and
    # removed what a rebuild replaced, each CI run left ~5 GB of untagged images until a disk filled.
    # A copy of the build context under a tag of its own, built, then changed and built again.
    tag = "specdec-rebuild-test:latest"
    tags = (tag, "specdec-rebuild-test-stage:build", "specdec-rebuild-test-stage:serve-env-cpu")
    context = _context_copy(tmp_path / "repo")
    script = str(context / "deploy" / "build-image.sh")
    try:
        _run(script, "--tag", tag, timeout=1800)  # the same content as `image`: every layer from the cache
        before = {t: _image_id(t) for t in tags}
        untagged_before = _untagged_images()
        init = context / "specdec" / "__init__.py"
        init.write_text(init.read_text() + "# changed by test_a_rebuild_removes_the_images_it_replaces\n")
        started = time.monotonic()
        _run(script, "--tag", tag, timeout=1800)
        timings["rebuild_s"] = time.monotonic() - started
        after = {t: _image_id(t) for t in tags}
        assert all(after[t] and after[t] != before[t] for t in tags), (before, after)
        left = _untagged_images() - untagged_before
        assert not left, f"the rebuild left untagged images: {left}"
    finally:
        _run("docker", "image", "rm", *tags, check=False)


def _context_copy(dest: Path) -> Path:
    """deploy/ and what .dockerignore lets into the build context, copied: a tree the test may change."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "onnx", ".build")
    # deploy/ whole (the script and Dockerfile); its .build/ is staged by the script itself.
    allowed = [line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!") and not line.startswith("!deploy/")]
    dest.mkdir(parents=True)
    for name in [".dockerignore", "deploy", *allowed]:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=ignore, dirs_exist_ok=True)
        elif source.exists():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def _image_id(tag: str) -> str:
    proc = _run("docker", "image", "inspect", "-f", "{{.Id}}", tag, check=False)
    return proc.stdout.strip() if proc.returncode == 0 else ""


def _untagged_images() -> set[str]:
    return set(_run("docker", "images", "-q", "--no-trunc", "--filter", "dangling=true").stdout.split())

def test_the_stack_serves_every_lossless_mode_and_survives_the_drafter(stack, timings):
    started = time.monotonic()
    bundle = str(ROOT / "bundles" / "ua-gec")
    stdin = "\n".join(TEXTS) + "\n"
    for mode in LOSSLESS:
        proc = subprocess.run([sys.executable, "-m", "specdec", "decode", "--mode", mode, "--bundle", bundle],
                              input=stdin, capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        local = [json.loads(line) for line in proc.stdout.splitlines()]
        for text, want in zip(TEXTS, local, strict=True):
            got = _generate(stack, text, mode)
            assert got["output_ids"] == want["output_ids"], (mode, text)
            assert got["text"] == want["text"]
            assert not got["stats"].get("degraded"), (mode, got["stats"])

    # The drafter dies (SIGKILL, no drain): GAD falls back to AR through the verifier, same output.
    gad = _generate(stack, TEXTS[0], "gad")
    stack.compose("kill", "drafter")
    fallback = _generate(stack, TEXTS[0], "gad")
    assert fallback["stats"].get("degraded") is True
    assert fallback["output_ids"] == gad["output_ids"]

    # Back: once healthy, the gateway uses it again (it retries a lost drafter after drafter_retry_s).
    stack.compose("start", "drafter")
    stack.wait_healthy("drafter")
    deadline = time.monotonic() + 60
    while (again := _generate(stack, TEXTS[0], "gad"))["stats"].get("degraded"):
        assert time.monotonic() < deadline, "the gateway never used the restarted drafter"
        time.sleep(1)
    assert again["output_ids"] == gad["output_ids"]
    assert again["stats"]["drafted_tokens"] > 0
    timings["requests_and_fault_s"] = time.monotonic() - started

