"""`specdec serve verifier|drafter|gateway|all`: run the services until SIGTERM / Ctrl-C (its flags:
`specdec.commands.serve`).

`ServiceStack` runs the same servers on a background event loop, for tests and benchmarks.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import structlog

from core.config import (
    SERVICE_ADDRESSES,
    ServiceSection,
    check_security_keys,
    check_service_precision,
    parse_section,
    with_origin,
)
from serving.logs import configure_logging

ROLES = ("verifier", "drafter", "gateway", "all")


@dataclass
class Running:
    """The servers one `serve()` call started (None for roles it did not start)."""

    verifier: Any = None
    drafter: Any = None
    gateway: Any = None
    addresses: dict[str, str] = field(default_factory=dict)  # each gRPC server's, by role
    http_address: str | None = None  # the gateway's HTTP endpoints, when it serves them

    def servers(self) -> list[Any]:
        # Stop order: the gateway first, so its in-flight requests still reach the models.
        return [s for s in (self.gateway, self.drafter, self.verifier) if s is not None]


@dataclass(frozen=True)
class ServeConfig:
    """Every section of the merged configuration, checked and typed."""

    gateway: Any  # gateway.config.GatewayConfig
    verifier: ServiceSection
    verifier_limits: Any  # verifier_service.server.VerifierLimits
    drafter: ServiceSection
    drafter_limits: Any  # drafter_service.server.DrafterLimits


def serve_config(sections: Mapping[str, Mapping[str, Any]]) -> ServeConfig:
    """Check every section the same way (`core.config.parse_section`): an unknown key or a value of
    the wrong type is a one-line ValueError naming section and key, before any server starts."""
    from drafter_service.server import DrafterLimits
    from gateway.config import gateway_config
    from verifier_service.server import VerifierLimits

    try:
        verifier, verifier_limits = _model_service("verifier", sections.get("verifier", {}), VerifierLimits)
        drafter, drafter_limits = _model_service("drafter", sections.get("drafter", {}), DrafterLimits)
        return ServeConfig(gateway_config(sections), verifier, verifier_limits, drafter, drafter_limits)
    except ValueError as exc:  # one set by an environment variable says so
        raise with_origin(exc, sections) from None


def config_keys() -> dict[str, set[str]]:
    """Every key each section of the configuration accepts (the schema `serve_config` checks against)."""
    from dataclasses import fields

    from decoding.config import DecodingConfig, DecodingLimits
    from drafter_service.server import DrafterLimits
    from gateway.config import FROM_OTHER_SECTIONS, GatewayConfig
    from verifier_service.server import VerifierLimits

    def names(*schemas: type) -> set[str]:
        return {f.name for schema in schemas for f in fields(schema)}

    return {
        "gateway": names(GatewayConfig) - FROM_OTHER_SECTIONS,
        "defaults": names(DecodingConfig),
        "limits": names(DecodingLimits),
        "verifier": names(ServiceSection, VerifierLimits),
        "drafter": names(ServiceSection, DrafterLimits),
    }


async def start_services(
    role: str,
    bundle: Path | None,
    sections: Mapping[str, Mapping[str, Any]],
) -> Running:
    """Start `role`'s server(s) from merged config sections (see core.config). When one cannot start
    (e.g. its address is taken), those already started are stopped and the error is raised."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; choose one of {ROLES}")
    config = serve_config(sections)
    _check_devices(role, config)
    check_listen_addresses(role, config)
    if role == "all":
        config = share_host_threads(config)
    running = Running()
    try:
        await _start_roles(role, bundle, config, running)
    except BaseException:
        await stop_services(running, 0)  # nothing stays up when one of the servers cannot start
        raise
    return running


def check_listen_addresses(role: str, config: ServeConfig) -> None:
    """Every address `role` would listen on (gRPC and metrics), checked free before any model loads:
    a taken one is a BindError naming it (serving.host)."""
    from serving.host import check_can_listen

    listens = {
        "verifier": (config.verifier.address, config.verifier.metrics_address),
        "drafter": (config.drafter.address, config.drafter.metrics_address),
        "gateway": (config.gateway.address, config.gateway.metrics_address),
    }
    for name, (address, metrics) in listens.items():
        if role in (name, "all"):
            check_can_listen(f"[{name}] address", address)
            if metrics:
                check_can_listen(f"[{name}] metrics_address", metrics)
    if role in ("gateway", "all") and config.gateway.http_address:
        check_can_listen("[gateway] http_address", config.gateway.http_address)


async def _start_roles(role: str, bundle: Path | None, config: ServeConfig, running: Running) -> None:
    from drafter_service.server import DrafterServer
    from gateway.server import start_gateway
    from seq2seq_models.bundle import load_bundle
    from verifier_service.server import VerifierServer

    loaded = load_bundle(bundle) if bundle is not None and role == "all" else None
    if role in ("verifier", "all"):
        v = config.verifier
        running.verifier = await VerifierServer.start(loaded or _need(bundle), v, config.verifier_limits)
        running.addresses["verifier"] = _with_port(v.address, running.verifier.host.port)
    # An imported bundle may have no drafter yet: `serve all` then runs the modes that need none.
    if role == "drafter" or (role == "all" and has_drafter(loaded)):
        d = config.drafter
        running.drafter = await DrafterServer.start(loaded or _need(bundle), d, config.drafter_limits)
        running.addresses["drafter"] = _with_port(d.address, running.drafter.host.port)
    if role in ("gateway", "all"):
        from gateway.config import with_bundle_defaults
        from seq2seq_models.bundle import bundle_decoding_defaults, load_bundle_tokenizer

        gateway = with_bundle_defaults(config.gateway, bundle_decoding_defaults(_need(bundle)))
        if role == "all":  # talk to the servers just started, on the ports they actually bound
            gateway = replace(
                gateway,
                verifier_address=running.addresses["verifier"],
                drafter_address=running.addresses.get("drafter"),
            )
        tokenizer = loaded.tokenizer if loaded is not None else load_bundle_tokenizer(_need(bundle))
        running.gateway = await start_gateway(gateway, tokenizer)
        running.addresses["gateway"] = _with_port(gateway.address, running.gateway.host.port)
        if running.gateway.http is not None:
            running.http_address = _with_port(gateway.http_address, running.gateway.http.port)


def has_drafter(bundle: Any) -> bool:
    """Whether a bundle (loaded, or its directory) has a drafter model for the drafter service."""
    from seq2seq_models.bundle import bundle_roles

    roles = list(bundle.models) if hasattr(bundle, "models") else bundle_roles(bundle)
    return any(role in roles for role in ("nar_drafter", "ar_drafter"))


# How long the drafter and verifier let their in-flight sessions finish when they stop.
MODEL_GRACE_S = 10.0


async def stop_services(running: Running, grace: float | None = None) -> None:
    """Stop every server; `grace` None: the gateway's `drain_grace_s`, MODEL_GRACE_S for the models.
    After the gateway's drain its requests have ended, so the models' own drains are short."""
    for server in running.servers():
        if grace is None and server is not running.gateway:
            await server.stop(MODEL_GRACE_S)
        else:
            await server.stop(grace)


def serve_forever(
    role: str,
    bundle: Path | None,
    sections: Mapping[str, Mapping[str, Any]],
    on_ready: Callable[[Running], None],
    grace: float | None = None,
) -> None:
    """Start, call `on_ready` once everything is SERVING, then drain on SIGTERM / SIGINT."""
    import signal

    configure_logging()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        # Start-up may wait long for a peer (the gateway's startup_timeout_s): a signal ends it there.
        starting = asyncio.ensure_future(start_services(role, bundle, sections))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            structlog.get_logger(service=role).info("stopped_before_serving")
            return
        stopping.cancel()
        running = starting.result()
        on_ready(running)
        await stop.wait()
        await stop_services(running, grace)

    asyncio.run(main())


def serve_processes(
    bundle: Path,
    sections: Mapping[str, Mapping[str, Any]],
    child_args: list[str],
    on_ready: Callable[[Running], None],
    grace: float | None = None,
) -> None:
    """`serve all` as three processes: the verifier and the drafter as `specdec serve verifier|drafter`
    children (with `child_args`: the same bundle, config and flags), the gateway in this process.

    Why: in one process the three services' Python work (the gateway's accept loops and peer calls,
    the model servers' message handling and scheduling) shares one GIL, which caps a loaded stack
    at one core of Python however many cores ONNX Runtime could use. Each child prints its bound
    address when it is SERVING; the gateway starts on those. On SIGTERM / SIGINT the gateway drains
    first (its in-flight requests still reach the models), then the children are stopped."""
    import signal
    import subprocess
    import sys

    check_listen_addresses("all", serve_config(sections))  # a taken address starts no child
    children: dict[str, subprocess.Popen] = {}
    try:
        roles = ("verifier", "drafter") if has_drafter(bundle) else ("verifier",)
        for role in roles:
            cmd = [sys.executable, "-m", "specdec", "serve", role, *child_args]
            children[role] = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        addresses = {}
        for role, proc in children.items():
            line = proc.stdout.readline().strip() if proc.stdout else ""
            if not line:
                raise SystemExit(f"specdec serve {role} exited with {proc.wait()} before it was serving")
            addresses[role] = line
        gateway = {**sections.get("gateway", {}), "verifier_address": addresses["verifier"],
                   "drafter_address": addresses.get("drafter", "")}

        def ready(running: Running) -> None:
            running.addresses.update(addresses)
            on_ready(running)

        serve_forever("gateway", bundle, {**sections, "gateway": gateway}, ready, grace)
    finally:
        for proc in children.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in children.values():
            try:
                proc.wait(MODEL_GRACE_S + 5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class ServiceStack:
    """Servers on a background event loop thread (tests, benchmarks): `with ServiceStack(...) as s:`.
    Its gateway's HTTP endpoints take an ephemeral loopback port unless `sections` name an address
    (`running.http_address`), so stacks side by side never compete for the default one."""

    def __init__(self, role: str, bundle: Path | None, sections: Mapping[str, Mapping[str, Any]] | None = None):
        self.role = role
        self.bundle = bundle
        sections = dict(sections or {})
        gateway = dict(sections.get("gateway", {}))
        gateway.setdefault("http_address", "127.0.0.1:0")
        self.sections = {**sections, "gateway": gateway}
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"stack-{role}", daemon=True)
        self.running = Running()

    def start(self) -> ServiceStack:
        configure_logging()
        self._thread.start()
        self.running = self.call(start_services(self.role, self.bundle, self.sections))
        return self

    def call(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, grace: float = 2.0) -> None:
        try:
            self.call(stop_services(self.running, grace))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> ServiceStack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _model_service(section: str, table: Mapping[str, Any], limits_cls: type) -> tuple[ServiceSection, Any]:
    """[verifier] or [drafter]: the keys both share, then the service's own limits."""
    service, limits = parse_section(section, table, ServiceSection, limits_cls)
    check_security_keys(section, service)
    check_service_precision(section, service)
    service.setdefault("address", SERVICE_ADDRESSES[section])
    return ServiceSection(**service), limits_cls(**limits)


def share_host_threads(config: ServeConfig) -> ServeConfig:
    """Verifier and drafter on one host (`serve all`, in one process or three): when both run on the
    CPU, their intra-op threads split the usable CPUs (`core.threads.split_threads`; a value set in
    the config or by a flag stands), so their forwards do not fight for the same cores."""
    from core.threads import split_threads
    from seq2seq_models.ort_runner import resolve_device

    v, d = config.verifier, config.drafter
    on_cpu = all(resolve_device(s.device, onnx=s.backend == "onnxruntime") == "cpu" for s in (v, d))
    if not on_cpu:
        return config
    vt, dt = split_threads(v.intra_op_threads, d.intra_op_threads)
    return replace(config, verifier=replace(v, intra_op_threads=vt), drafter=replace(d, intra_op_threads=dt))


def _check_devices(role: str, config: ServeConfig) -> None:
    """A GPU that is not there fails here, in one line naming the section, before any bundle loads."""
    from seq2seq_models.ort_runner import require_device

    for name, section in (("verifier", config.verifier), ("drafter", config.drafter)):
        if role in (name, "all"):
            try:
                # The CUDA driver must see the GPU (the torch backend: torch); ONNX Runtime needs its CUDA provider too.
                require_device(section.device, onnx=section.backend == "onnxruntime")
            except ValueError as exc:
                raise ValueError(f"[{name}] device: {exc}") from None


def _need(bundle: Path | None) -> Path:
    if bundle is None:
        raise FileNotFoundError("this service needs a model bundle: pass --bundle DIR")
    return Path(bundle)


def _with_port(address: str, port: int) -> str:
    if address.startswith("unix:"):  # a Unix-domain socket has no port: its path is the address
        return address
    host = address.rpartition(":")[0] or "127.0.0.1"
    return f"{host}:{port}"
