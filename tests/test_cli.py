"""`specdec tiny-bundle` and `specdec decode`, run as a user runs them (a subprocess). The table of
bad inputs goes through the same `specdec.cli.main` in-process (a subprocess each would spend
seconds importing torch); the process exit path itself is covered by the subprocess tests."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.backends import DEFAULT_BACKEND
from decoding.config import DecodingConfig, Mode
from decoding.decode import decode
from drafter_service.session import LocalDrafter
from seq2seq_models.bundle import load_bundle
from specdec.cli import main as cli_main
from specdec.commands.flags import add_decoding_flags, decoding_overrides
from verifier_service.session import make_verifier

TEXTS = ["Я хочу подякувати вам за вашу допомогу.", "We have been living in this city."]


def _specdec(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "specdec", *args], input=stdin, capture_output=True, text=True, env=env, timeout=300
    )


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundle")
    proc = _specdec("tiny-bundle", "--out", str(out), "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    return out


def test_tiny_bundle_is_deterministic(bundle_dir, tmp_path):
    again = tmp_path / "again"
    assert _specdec("tiny-bundle", "--out", str(again), "--seed", "3").returncode == 0
    for name in ("config.json", "tokenizer.model", "verifier.safetensors", "nar_drafter.safetensors"):
        assert (again / name).read_bytes() == (bundle_dir / name).read_bytes()
    other = tmp_path / "other"
    assert _specdec("tiny-bundle", "--out", str(other), "--seed", "4").returncode == 0
    assert (other / "verifier.safetensors").read_bytes() != (bundle_dir / "verifier.safetensors").read_bytes()


MODE_FLAGS = {
    Mode.AR: [],
    Mode.BEAM: ["--beams", "3"],
    Mode.IAD: ["--k", "6"],
    Mode.GAD: ["--k", "4"],
    Mode.GAD_PLUS_PLUS: ["--k", "4", "--beta", "3", "--tau", "2.0"],
    Mode.MJSD: ["--gamma", "3", "--beams", "2", "--threshold", "0.2"],
    Mode.SPECULATIVE: ["--gamma", "3", "--temperature", "0.9", "--top-k", "20", "--top-p", "0.95", "--seed", "5"],
}


@pytest.mark.parametrize("mode", list(MODE_FLAGS), ids=lambda m: m.value)
def test_decode_round_trips_and_matches_the_library(bundle_dir, mode):
    flags = ["--mode", mode.value, *MODE_FLAGS[mode], "--max-new-tokens", "24"]
    proc = _specdec("decode", "--bundle", str(bundle_dir), *flags, stdin="\n".join(TEXTS) + "\n")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(records) == len(TEXTS)

    bundle = load_bundle(bundle_dir)
    verifier = make_verifier(bundle, DEFAULT_BACKEND)  # what `specdec decode` runs by default
    drafter = LocalDrafter({"nar_drafter": bundle.nar_drafter, "ar_drafter": bundle.ar_drafter})
    overrides = {
        "mode": mode, "max_new_tokens": 24, "k": 6 if mode == Mode.IAD else 4, "beta": 3, "tau": 2.0,
        "num_beams": 3 if mode == Mode.BEAM else 2, "gamma": 3, "threshold": 0.2,
        "temperature": 0.9 if mode == Mode.SPECULATIVE else 1.0, "top_k": 20 if mode == Mode.SPECULATIVE else 0,
        "top_p": 0.95 if mode == Mode.SPECULATIVE else 1.0, "seed": 5 if mode == Mode.SPECULATIVE else 0,
    }
    for text, record in zip(TEXTS, records, strict=True):
        expected = decode(bundle.tokenizer.encode(text), DecodingConfig(**overrides), verifier, drafter)
        assert record["output_ids"] == expected.output_ids
        assert record["text"] == bundle.tokenizer.decode(expected.output_ids)
        assert record["stats"]["iterations"] == expected.stats.iterations
        assert record["stats"]["finish_reason"] in {"eos", "length"}


def test_decode_with_ids(bundle_dir):
    proc = _specdec("decode", "--bundle", str(bundle_dir), "--ids", "--mode", "iad", stdin="5 6 7 8\n")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["stats"]["iterations"] >= 1


# Bad flags, each with the one line of error it must give (stdin is a valid sentence).
BAD_FLAGS = {
    "--k 0": "k must be >= 1",
    "--k 1000": "OUT_OF_RANGE: k must be <=",
    "--mode gad++ --beta 0": "beta must be >= 1",
    "--mode gad++ --tau -1": "tau must be",
    "--mode mjsd --threshold 0": "threshold must be in (0, 1]",
    "--mode mjsd --threshold 1.5": "threshold must be in (0, 1]",
    "--beta 3": "INVALID_ARGUMENT: --beta does not apply to mode gad (it takes --adaptive, --k, --overlap",
    "--mode ar --k 4 --top-p 0.5": "INVALID_ARGUMENT: --k, --top-p do not apply to mode ar (it takes only",
    "--max-new-tokens 0": "max_new_tokens must be >= 1",
    "--max-new-tokens 100000": "OUT_OF_RANGE: max_new_tokens",
    "--mode spec --top-p 0": "top_p must be in (0, 1]",
    "--mode spec --temperature -0.5": "temperature must be",
    "--mode fast": "invalid choice: 'fast'",
    "--k two": "invalid int value: 'two'",
    "--device gpu": "argument --device: must be auto",
}
# Bad input lines: (flags, stdin, message).
BAD_INPUT = [
    ([], "\n", "INVALID_ARGUMENT: line 1: input is empty"),
    (["--ids"], "5 6 nine\n", "expects space-separated integers"),
    (["--ids"], "5 6 100000\n", "outside the vocabulary"),
    (["--ids"], " ".join(["5"] * 400) + "\n", "OUT_OF_RANGE: line 1: input has 400 tokens"),
]
BAD = [(flags.split(), "x\n", message) for flags, message in BAD_FLAGS.items()] + BAD_INPUT


@pytest.mark.parametrize(("flags", "stdin", "message"), BAD, ids=[" ".join(b[0]) or b[1][:8] for b in BAD])
def test_bad_input_gives_one_clear_line_and_exit_2(bundle_dir, flags, stdin, message, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    try:
        code = cli_main(["decode", "--bundle", str(bundle_dir), *flags])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    stderr = capsys.readouterr().err
    assert code == 2
    assert message in stderr
    assert "Traceback" not in stderr
    assert len(stderr.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a host without a GPU")
def test_decode_on_a_missing_gpu_is_one_clear_line(bundle_dir, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("x\n"))
    code = cli_main(["decode", "--bundle", str(bundle_dir), "--device", "cuda", "--backend", "torch"])
    stderr = capsys.readouterr().err
    assert code == 2
    assert "device 'cuda' does not exist" in stderr and "Traceback" not in stderr
    assert len(stderr.strip().splitlines()) == 1


def test_missing_bundle_is_a_clear_error(tmp_path):
    proc = _specdec("decode", "--bundle", str(tmp_path / "nowhere"), stdin="x\n")
    assert proc.returncode == 2
    assert "is not a model bundle" in proc.stderr and "Traceback" not in proc.stderr


# The decoding flags as they have always been named; add_decoding_flags derives them from DecodingConfig.
FLAGS = {
    "--mode": ("mode", None), "--k": ("k", int), "--beta": ("beta", int), "--tau": ("tau", float),
    "--beams": ("num_beams", int), "--gamma": ("gamma", int), "--threshold": ("threshold", float),
    "--beam-delta": ("beam_delta", float), "--beam-max-candidates": ("beam_max_candidates", int),
    "--length-penalty": ("length_penalty", float), "--early-stopping": ("early_stopping", None),
    "--n-best": ("num_return_sequences", int), "--output-logprobs": ("output_logprobs", None),
    "--repetition-penalty": ("repetition_penalty", float), "--no-repeat-ngram-size": ("no_repeat_ngram_size", int),
    "--encoder-no-repeat-ngram-size": ("encoder_no_repeat_ngram_size", int), "--bad-words-ids": ("bad_words_ids", None),
    "--min-length": ("min_length", int), "--min-new-tokens": ("min_new_tokens", int),
    "--forced-eos-token-id": ("forced_eos_token_id", int), "--suppress-tokens": ("suppress_tokens", None),
    "--begin-suppress-tokens": ("begin_suppress_tokens", None),
    "--temperature": ("temperature", float), "--top-k": ("top_k", int), "--top-p": ("top_p", float),
    "--seed": ("seed", int), "--max-new-tokens": ("max_new_tokens", int), "--adaptive": ("adaptive", None),
    "--overlap": ("overlap", None),
    "--preverify": ("preverify", None),
}


def test_decoding_flags_keep_their_names_types_and_choices():
    parser = argparse.ArgumentParser()
    add_decoding_flags(parser)
    actions = {a.option_strings[0]: a for a in parser._actions if a.option_strings and a.dest != "help"}
    assert {flag: (a.dest, a.type) for flag, a in actions.items()} == FLAGS
    assert actions["--mode"].choices == ["ar", "beam", "iad", "gad", "gad++", "mjsd", "spec"]
    assert actions["--early-stopping"].choices == ["true", "false", "never"]
    assert all(a.help for a in actions.values())
    args = parser.parse_args(["--mode", "gad++", "--beams", "3", "--top-p", "0.5"])
    overrides = decoding_overrides(args)
    assert {k: v for k, v in overrides.items() if v is not None} == {"mode": "gad++", "num_beams": 3, "top_p": 0.5}
    assert DecodingConfig().with_overrides(overrides) == DecodingConfig(mode=Mode.GAD_PLUS_PLUS, num_beams=3, top_p=0.5)


def test_serve_gateway_without_bundle_uses_the_shipped_tokenizer():
    """`specdec serve gateway` with no --bundle reads bundles/ua-gec's tokenizer, so it starts against
    a verifier and drafter serving that bundle (their tokenizer fingerprints must match) and answers."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from gateway.wire import overrides_to_wire
    from protos.specdec.v1 import gateway_pb2, gateway_pb2_grpc
    from specdec.api import BUNDLE_ENV as DEFAULT_BUNDLE_ENV
    from specdec.api import DEFAULT_BUNDLE_DIR
    from specdec.serve import ServiceStack
    from tests.services.conftest import free_port, wait_ready_line

    models = {"verifier": {"address": "127.0.0.1:0"}, "drafter": {"address": "127.0.0.1:0"},
              "gateway": {"address": "127.0.0.1:0"}}
    with ServiceStack("all", DEFAULT_BUNDLE_DIR, models) as stack:
        addresses = stack.running.addresses
        env = {k: v for k, v in os.environ.items() if k != DEFAULT_BUNDLE_ENV}
        proc = subprocess.Popen(
            [sys.executable, "-m", "specdec", "serve", "gateway", "--gateway-addr", f"127.0.0.1:{free_port()}",
             "--verifier-addr", addresses["verifier"], "--drafter-addr", addresses["drafter"]],
            env={**env, "PYTHONWARNINGS": "ignore"}, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        try:
            address = wait_ready_line(proc, 60)
            with grpc.insecure_channel(address) as channel:
                health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert health.status == health_pb2.HealthCheckResponse.SERVING
                request = gateway_pb2.GenerateRequest(
                    text=TEXTS[1], config=overrides_to_wire({"mode": "gad", "k": 4, "max_new_tokens": 16, "seed": 1})
                )
                via_new = gateway_pb2_grpc.GatewayServiceStub(channel).Generate(request, timeout=60)
            with grpc.insecure_channel(addresses["gateway"]) as channel:
                via_stack = gateway_pb2_grpc.GatewayServiceStub(channel).Generate(request, timeout=60)
            assert via_new.output_ids and list(via_new.output_ids) == list(via_stack.output_ids)
            assert via_new.text == via_stack.text
        finally:
            proc.kill()
            proc.wait(30)


def test_decode_writes_a_record_per_line_and_goes_on_after_a_bad_one(bundle_dir):
    proc = _specdec("decode", "--bundle", str(bundle_dir), "--mode", "ar", "--max-new-tokens", "8",
                    stdin="a\nb\n\nc\n")
    assert proc.returncode == 2
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(records) == 4
    assert records[2] == {"line": 3, "error": "input is empty", "code": "INVALID_ARGUMENT"}
    assert all(r["output_ids"] for i, r in enumerate(records) if i != 2)
    assert proc.stderr.strip() == "specdec decode: error: INVALID_ARGUMENT: line 3: input is empty"
    # The stats are named as gRPC's DecodingStats, with the total wall time; AR commits a token a step.
    from protos.specdec.v1 import gateway_pb2

    stats = records[0]["stats"]
    assert list(stats) == list(gateway_pb2.DecodingStats.DESCRIPTOR.fields_by_name)
    assert stats["mean_accepted_length"] == 1.0 and stats["accepted_tokens"] == 0
    assert stats["total_time_ms"] >= stats["verifier_time_ms"] > 0


def test_version_and_every_default_in_the_help(capsys):
    from specdec import __version__
    from specdec.cli import build_parser

    with pytest.raises(SystemExit) as exc:
        cli_main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"specdec {__version__}"
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    missing = []
    for name, sub in commands.items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            takes_value = action.option_strings and action.nargs != 0 and not action.required
            if takes_value and "default" not in formatter._expand_help(action):
                missing.append(f"{name} {action.option_strings[0]}")
    assert missing == []
    help_text = commands["generate"].format_help()
    assert "(default: 120.0)" in help_text and "$SPECDEC_ADDR" in help_text


def test_every_command_module_is_in_the_one_table():
    """One way to register a subcommand: each module of specdec/commands (its shared flags aside) is in
    `specdec.cli.COMMANDS` once, and every subcommand of the parser comes from one of them."""
    from specdec import commands
    from specdec.cli import COMMANDS, build_parser

    modules = {p.stem for p in Path(commands.__file__).parent.glob("*.py")} - {"__init__", "flags"}
    assert sorted(m.__name__.removeprefix("specdec.commands.") for m in COMMANDS) == sorted(modules)
    parser = build_parser()
    choices = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    runners = {sub.get_default("run").__module__ for sub in choices.values()}
    assert runners == {m.__name__ for m in COMMANDS}


@pytest.mark.parametrize("address", ["127.0.0.1", "localhost:", ":50051", "127.0.0.1:port"])
def test_an_address_without_a_port_is_a_one_line_error(address, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["generate", "--addr", address, "x"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1
    assert f"argument --addr: {address!r} is not HOST:PORT" in err


def test_a_refused_connection_says_the_gateway_is_not_reachable(capsys, monkeypatch):
    from tests.services.conftest import free_port

    address = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("SPECDEC_ADDR", address)  # the address when --addr is not given
    assert cli_main(["generate", "--timeout", "10", "x"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"the gateway at {address} is not reachable" in err and "`specdec serve all`" in err


@pytest.fixture(scope="module")
def stack(bundle_dir):
    from specdec.serve import ServiceStack

    loopback = {"address": "127.0.0.1:0"}
    with ServiceStack("all", bundle_dir, {"verifier": loopback, "drafter": loopback, "gateway": loopback}) as s:
        yield s


def test_generate_reads_stdin_a_file_or_the_argument(stack, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPECDEC_ADDR", stack.running.addresses["gateway"])
    flags = ["--mode", "gad", "--k", "4", "--max-new-tokens", "12", "--json"]
    assert cli_main(["generate", *flags, TEXTS[1]]) == 0
    by_argument = json.loads(capsys.readouterr().out)
    assert by_argument["output_ids"]
    for stdin_args in ([], ["-"]):
        monkeypatch.setattr(sys, "stdin", io.StringIO(TEXTS[1] + "\n"))
        assert cli_main(["generate", *flags, *stdin_args]) == 0
        assert json.loads(capsys.readouterr().out)["output_ids"] == by_argument["output_ids"]
    text_file = tmp_path / "text.txt"
    text_file.write_text(TEXTS[1] + "\n", encoding="utf-8")
    assert cli_main(["generate", *flags, "--file", str(text_file)]) == 0
    assert json.loads(capsys.readouterr().out)["output_ids"] == by_argument["output_ids"]
    assert cli_main(["generate", *flags, "--file", str(text_file), "other"]) == 2
    assert "not both" in capsys.readouterr().err


@pytest.fixture(scope="module")
def drafterless_gateway(bundle_dir):
    """A gateway whose drafter is nowhere: drafter modes fall back to AR (degraded). Module-scoped, so
    its servers log to the session's stderr, not to one test's captured one."""
    from specdec.serve import ServiceStack
    from tests.services.conftest import free_port

    nowhere = f"127.0.0.1:{free_port()}"
    with ServiceStack("verifier", bundle_dir, {"verifier": {"address": "127.0.0.1:0"}}) as v:
        gateway = {"address": "127.0.0.1:0", "verifier_address": v.running.addresses["verifier"],
                   "drafter_address": nowhere, "startup_timeout_s": 1.0}
        with ServiceStack("gateway", bundle_dir, {"gateway": gateway}) as g:
            yield g.running.addresses["gateway"]


def test_plain_generate_output_says_when_it_was_degraded(drafterless_gateway, capsys):
    args = ["generate", "--addr", drafterless_gateway, "--mode", "gad", "--max-new-tokens", "6"]
    assert cli_main([*args, TEXTS[1]]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and ("specdec generate: degraded: the drafter was unavailable, so the gateway decoded "
                            "as plain AR through the verifier") in err.splitlines()
    assert cli_main([*args, "--mode", "ar", TEXTS[1]]) == 0
    assert "specdec generate: degraded" not in capsys.readouterr().err
