"""Flags that several commands share: the per-request decoding flags, gateway addresses, the client's
TLS and token flags, and the help texts of the model-placement flags."""

from __future__ import annotations

import argparse
import typing
from dataclasses import Field, fields

from core.backends import DEFAULT_BACKEND
from core.config import GATEWAY_ADDRESS
from specdec.api import ADDR_ENV, BUNDLE_ENV, default_address

BUNDLE_HELP = f"model bundle directory (default: ${BUNDLE_ENV} or bundles/ua-gec)"
BACKEND_HELP = (
    f"backend of the verifier and the NAR drafter (default: {DEFAULT_BACKEND}, or the [verifier] and [drafter] "
    "backend keys of the config)"
)
PRECISION_HELP = (
    "fp32, or int8: the verifier's and the NAR drafter's ONNX graphs dynamically quantized (backend "
    "onnxruntime only; default: fp32, or the [verifier] and [drafter] precision keys of the config)"
)
TARGET_LANG_HELP = ("a many-to-many model's target language (NLLB fra_Latn, M2M100 fr, mBART-50 fr_XX); "
                    "empty: the model's default")
def add_target_flags(parser: argparse.ArgumentParser) -> None:
    """--target-lang and the target prefix flags of `decode` and `generate`."""
    parser.add_argument("--target-lang", default="", metavar="CODE", help=TARGET_LANG_HELP)
    prefix = parser.add_mutually_exclusive_group()
    prefix.add_argument("--target-prefix", default="", metavar="TEXT",
                        help="the output starts with this text (after the target language's code); every mode "
                             "continues from it")
    prefix.add_argument("--target-prefix-ids", default="", metavar="IDS",
                        help="the same as token ids, separated by spaces or commas")


def target_prefix(args: argparse.Namespace) -> str | list[int]:
    """The target prefix the flags give: text, ids, or "" (none)."""
    if args.target_prefix_ids:
        try:
            return [int(part) for part in args.target_prefix_ids.replace(",", " ").split()]
        except ValueError:
            raise ValueError(f"--target-prefix-ids takes token ids, got {args.target_prefix_ids!r}") from None
    return args.target_prefix


ADDR_HELP = f"gateway address HOST:PORT (default: ${ADDR_ENV}, else {GATEWAY_ADDRESS})"


def add_decoding_flags(parser: argparse.ArgumentParser) -> None:
    """The per-request decoding flags shared by `decode`, `generate` and `loadtest` (unset = default):
    one per DecodingConfig field, named and explained by the field's metadata."""
    from decoding.config import CHOICES, ID_LISTS, Mode, cli_flag
    from decoding.modes import mode_names

    g = parser.add_argument_group("decoding (unset: the default shown, or the gateway's [defaults])")
    for f, kind in _decoding_fields():
        help_text = f.metadata["help"]
        if "default" not in help_text:
            shown = "unset" if f.default is None else f.default
            help_text += f" (default: {shown})"
        if kind is Mode:
            g.add_argument(cli_flag(f), dest=f.name, choices=mode_names(), help=help_text)
        elif f.name in CHOICES:
            g.add_argument(cli_flag(f), dest=f.name, choices=[m.value for m in CHOICES[f.name]], help=help_text)
        elif f.name in ID_LISTS:  # "5 6 7", or sequences "5 6; 7" (DecodingConfig parses them)
            g.add_argument(cli_flag(f), dest=f.name, metavar="IDS", help=help_text)
        elif kind is bool:  # --adaptive / --no-adaptive; unset stays None (the default applies)
            g.add_argument(cli_flag(f), dest=f.name, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            g.add_argument(cli_flag(f), dest=f.name, type=kind, help=help_text)


def decoding_overrides(args: argparse.Namespace) -> dict:
    """The decoding flags as DecodingConfig overrides (None: not given)."""
    return {f.name: getattr(args, f.name) for f, _ in _decoding_fields()}


def address_arg(text: str) -> str:
    """HOST:PORT (or unix:PATH, or a gRPC target URI) as an argparse `type`: a port-less address
    would silently dial port 443, so it is argparse's one-line error instead."""
    if text.startswith("unix:") or "://" in text:
        return text
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (e.g. {GATEWAY_ADDRESS})")
    return text


def addresses_arg(text: str) -> str:
    """`address_arg`, or a comma-separated list of such addresses (the gateway's replicas)."""
    for part in text.split(","):
        address_arg(part)
    return text


def default_addr() -> str:
    """The gateway address a client command dials without --addr."""
    return default_address()


def add_client_security(p: argparse.ArgumentParser) -> None:
    """The TLS and token flags of the commands that call a gateway (`generate`, `loadtest`)."""
    s = p.add_argument_group("security (README: Security)")
    s.add_argument("--tls", action="store_true", help="connect over TLS, checking the gateway against the system's CAs")
    s.add_argument("--tls-ca", help="connect over TLS, checking the gateway's certificate against this PEM CA")
    s.add_argument("--tls-cert", help="PEM client certificate to present (the gateway's mTLS); needs --tls-key")
    s.add_argument("--tls-key", help="PEM private key of --tls-cert")
    token = s.add_mutually_exclusive_group()
    token.add_argument("--token", help="bearer token the gateway requires (visible in the process list)")
    token.add_argument("--token-file", help="read the bearer token from this file")


def client_security(args: argparse.Namespace):
    """(ClientTLS or None, bearer token or None) from the security flags of `add_client_security`."""
    from serving.auth import read_token
    from serving.tls import ClientTLS

    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    tls = ClientTLS(args.tls_ca, args.tls_cert, args.tls_key) if args.tls or args.tls_ca or args.tls_cert else None
    return tls, read_token(args.token, args.token_file)


def _decoding_fields() -> list[tuple[Field, type]]:
    """DecodingConfig's fields with the scalar type a flag parses (`float | None` -> float)."""
    from decoding.config import DecodingConfig

    hints = typing.get_type_hints(DecodingConfig)
    out = []
    for f in fields(DecodingConfig):
        kinds = [k for k in typing.get_args(hints[f.name]) or (hints[f.name],) if k is not type(None)]
        out.append((f, kinds[0]))
    return out
