"""`specdec export-onnx` and `specdec export-triton`: a bundle's models written for other runtimes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from core.backends import BACKENDS
from specdec.api import resolve_bundle
from specdec.commands.flags import BUNDLE_HELP


def register(sub) -> None:
    p = sub.add_parser("export-onnx", help="export the bundle's models to ONNX (cached by bundle fingerprint)")
    p.add_argument("--bundle", help=BUNDLE_HELP)
    p.add_argument("--out", help="cache root (default: $SPECDEC_ONNX_CACHE or BUNDLE/onnx)")
    p.add_argument("--force", action="store_true", help="re-export even when the cache has this fingerprint")
    p.set_defaults(run=run_export_onnx)

    p = sub.add_parser("export-triton", help="write a Triton Inference Server model repository for the verifier")
    p.add_argument("--bundle", help=BUNDLE_HELP)
    p.add_argument("--out", required=True, help="model repository directory (tritonserver --model-repository)")
    p.add_argument("--model", default="specdec_verifier", help="model name (verifier_url triton://HOST:PORT/MODEL)")
    p.add_argument("--backend", choices=BACKENDS, default=None, help="the verifier backend inside the model "
                   "(default: torch)")
    p.add_argument("--device", default="cpu", help="where the model runs inside Triton: cpu, cuda or cuda:N")
    p.add_argument("--max-sessions", type=int, default=64, help="sessions (sequences) the model holds at once")
    p.add_argument("--session-idle-s", type=float, default=300.0, help="the model frees sessions idle this long")
    p.add_argument("--threads", type=int, default=1, help="torch threads in the model instance")
    p.add_argument("--onnx", action="store_true", help="also the ONNX encoder/decoder on the onnxruntime backend")
    p.set_defaults(run=run_export_triton)


def run_export_onnx(args: argparse.Namespace) -> int:
    from seq2seq_models.bundle import bundle_roles, load_bundle
    from seq2seq_models.onnx_export import ROLES, default_cache_root, ensure_export

    path = resolve_bundle(args.bundle)
    bundle = load_bundle(path, roles=[r for r in ROLES if r in bundle_roles(path)])
    out = Path(args.out) if args.out else default_cache_root(bundle.path)
    exports = {}
    for role in bundle.models:
        export = ensure_export(bundle.models[role], bundle.fingerprint, out, force=args.force, role=role)
        exports[role] = {"directory": str(export.directory), "reused": export.reused}
    print(json.dumps({"fingerprint": bundle.fingerprint, "exports": exports}))
    return 0


def run_export_triton(args: argparse.Namespace) -> int:
    from verifier_service.triton_export import TritonExportOptions, export_triton

    options = TritonExportOptions(
        model=args.model, backend=args.backend or "torch", device=args.device,
        instance_kind="KIND_GPU" if args.device.startswith("cuda") else "KIND_CPU",
        max_sessions=args.max_sessions, session_idle_s=args.session_idle_s, threads=args.threads, onnx=args.onnx,
    )
    model_dir = export_triton(resolve_bundle(args.bundle), args.out, options)
    repository = str(Path(args.out).resolve())
    print(json.dumps({"repository": repository, "model": options.model, "directory": str(model_dir)}))
    return 0
