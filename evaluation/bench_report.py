"""What every benchmark shares: the machine's name, the services started as a user starts them,
and BENCHMARKS.md, where each benchmark owns one `## ` section and replaces only that."""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
from pathlib import Path


def bench_parser(doc: str | None, root: Path, data_dir: bool = True) -> argparse.ArgumentParser:
    """The flags a benchmark script under `root`/bench shares: `--bundle` (default the repository's
    ua-gec), `--data-dir` (whose test texts; unless `data_dir` is false), and `--write` to replace its
    section of `--output` (default BENCHMARKS.md); the script adds its own."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default=str(root / "bundles" / "ua-gec"), help="model bundle directory "
                   "(default: the repository's bundles/ua-gec)")
    if data_dir:
        p.add_argument("--data-dir", help="prepared data dir whose test.text.jsonl to use (default: ua-gec)")
    p.add_argument("--write", action="store_true", help="also replace this benchmark's section of --output")
    p.add_argument("--output", type=Path, default=root / "BENCHMARKS.md", help="the file --write updates "
                   "(default: the repository's BENCHMARKS.md)")
    return p


def cpu_name() -> str:
    """The CPU's model name and its widest vector units: hosts that report the same name ("AMD EPYC")
    differ widely in int8 and bfloat16 speed depending on AVX-512 VNNI / BF16."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []

    def field(key: str) -> str:
        return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(key)), "")

    name = field("model name") or platform.processor() or "unknown CPU"
    flags = set(field("flags").split())
    return f"{name} ({vector_units(flags)})" if flags else name


def accelerator_note(devices: dict[str, str] | None = None) -> str:
    """What a stamp adds after the CPU's name when a model ran on a GPU, e.g. "; models on NVIDIA H200
    (verifier cuda, drafter cuda)"; else "". `devices`: section -> device; by default what the
    SPECDEC__<SECTION>__DEVICE variables the benchmarks pass on to the services say."""
    if devices is None:
        devices = {section: os.environ.get(f"SPECDEC__{section.upper()}__DEVICE", "")
                   for section in ("verifier", "drafter")}
    if not any(d.startswith("cuda") for d in devices.values()):
        return ""
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU seen"
    except Exception as exc:  # the note is informational: never fail a benchmark for it
        gpu = f"GPU unknown ({type(exc).__name__})"
    placed = ", ".join(f"{section} {device or 'cpu'}" for section, device in devices.items())
    return f"; models on {gpu} ({placed})"


def vector_units(flags: set[str]) -> str:
    """AVX-512 with VNNI / BF16 where present, else AVX2, as /proc/cpuinfo's flags name them."""
    if "avx512f" in flags:
        extras = [name for flag, name in (("avx512_vnni", "VNNI"), ("avx512_bf16", "BF16")) if flag in flags]
        return " ".join(["AVX-512", *extras])
    return "AVX2, no AVX-512" if "avx2" in flags else "no AVX2"


def machine_stamp(*facts: str) -> str:
    """The line every BENCHMARKS.md section opens with: machine, cores, `facts`, date, the command run."""
    import datetime as dt
    import shlex

    parts = [f"Machine: {cpu_name()}, {os.cpu_count()} cores{accelerator_note()}", *facts,
             f"date {dt.date.today().isoformat()}", f"command `{shlex.join(['python', *sys.argv])}`"]
    return "; ".join(parts)


def median_seconds(fn, repeats: int, warmup: int = 1) -> float:
    """Median wall time of `repeats` calls of `fn`, after `warmup` untimed calls (ONNX Runtime allocates
    its buffers for the shapes on the first)."""
    import statistics
    import time

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def publish(args: argparse.Namespace, heading: str, stamp: str, intro: str, lines: list[str]) -> int:
    """A benchmark's section (its machine stamp, a paragraph saying what was run, its table lines)
    printed under `heading` and, with `--write`, put in place of that section of `args.output`;
    returns 0, the script's exit status."""
    body = "\n".join([stamp, "", intro, "", *lines])
    print(f"{heading}\n\n{body}")
    if args.write:
        write_section(args.output, heading, body)
    return 0


def write_section(path: Path, heading: str, body: str) -> None:
    """Replace the section under `heading` (up to the next `## ` heading) or append it."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    section = f"{heading}\n\n{body.strip()}\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + section
    path.write_text(text)


def start_services(
    bundle_dir: Path, backend: str, threads: int | None = None, env: dict[str, str] | None = None,
    extra_args: tuple[str, ...] = (), log: Path | None = None, role: str = "all", cpus: set[int] | None = None,
) -> tuple[subprocess.Popen, str]:
    """`specdec serve all` (or `serve <role>`) in its own process on ephemeral ports; returns it and
    the gateway's (the role's) address. `env` adds to the environment (e.g. SPECDEC__GATEWAY__...
    keys), `extra_args` to the command (later flags win, e.g. other addresses); `log` keeps the
    servers' stderr, whose tail a failed start shows; `cpus` pins the process to those CPUs."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    roles = ("gateway", "verifier", "drafter") if role == "all" else (role,)
    addresses = [flag for r in roles for flag in (f"--{r}-addr", "127.0.0.1:0")]
    cmd = [sys.executable, "-m", "specdec", "serve", role, "--bundle", str(bundle_dir), "--backend", backend,
           *addresses, *extra_args]
    pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
    with open(log, "w") if log is not None else open(os.devnull, "w") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True, preexec_fn=pin)
    assert proc.stdout is not None
    address = proc.stdout.readline().strip()  # printed once all it serves is SERVING
    if not address:
        tail = "\n".join(log.read_text().splitlines()[-5:]) if log is not None else ""
        raise RuntimeError(f"specdec serve {role} exited with {proc.wait()}" + (f":\n{tail}" if tail else ""))
    return proc, address
