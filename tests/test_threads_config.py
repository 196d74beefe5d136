"""Per-service intra-op threads: [verifier] / [drafter] intra_op_threads from file, environment and
flags, the split `serve all` makes when both models share a host's CPUs, and the value reaching ONNX
Runtime's sessions and torch."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from core.config import load_sections
from core.threads import AUTO, MAX_THREADS, alone_threads, split_threads, usable_cpus
from drafter_service.session import make_drafter
from seq2seq_models.bundle import load_bundle, make_tiny_bundle
from seq2seq_models.ort_runner import default_intra_op_threads
from specdec.serve import serve_config, share_host_threads
from verifier_service.session import make_verifier


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return load_bundle(make_tiny_bundle(tmp_path_factory.mktemp("threads-bundle"), seed=3))


def test_split_keeps_the_verifiers_threads_and_halves_the_drafters() -> None:
    assert split_threads(AUTO, AUTO, cpus=2) == (2, 1)
    assert split_threads(AUTO, AUTO, cpus=1) == (1, 1)
    assert split_threads(AUTO, AUTO, cpus=5) == (5, 2)
    assert split_threads(AUTO, AUTO, cpus=64) == (MAX_THREADS, MAX_THREADS)
    assert split_threads(3, AUTO, cpus=8) == (3, 4)
    assert split_threads(AUTO, 6, cpus=8) == (8, 6)
    assert split_threads(4, 4, cpus=2) == (4, 4)  # explicit values stand, even oversubscribed
    assert alone_threads(cpus=3) == 3 and alone_threads(cpus=100) == MAX_THREADS
    assert default_intra_op_threads() == alone_threads(usable_cpus())


def test_the_key_comes_from_file_env_and_flags(tmp_path) -> None:
    path = tmp_path / "specdec.toml"
    path.write_text("[verifier]\nintra_op_threads = 3\n[drafter]\nintra_op_threads = 2\n")
    config = serve_config(load_sections(path, environ={}))
    assert (config.verifier.intra_op_threads, config.drafter.intra_op_threads) == (3, 2)
    env = {"SPECDEC__DRAFTER__INTRA_OP_THREADS": "5"}
    config = serve_config(load_sections(path, environ=env, overrides={"verifier": {"intra_op_threads": 1}}))
    assert (config.verifier.intra_op_threads, config.drafter.intra_op_threads) == (1, 5)
    assert serve_config(load_sections(None, environ={})).verifier.intra_op_threads == AUTO


@pytest.mark.parametrize("value", ["-1", "two"])
def test_a_bad_value_names_section_and_key(value) -> None:
    with pytest.raises(ValueError, match=r"\[verifier\] intra_op_threads"):
        serve_config(load_sections(None, environ={"SPECDEC__VERIFIER__INTRA_OP_THREADS": value}))


def test_serve_all_splits_the_cpus_only_where_nothing_is_set() -> None:
    cpu = {"device": "cpu", "backend": "onnxruntime"}
    shared = share_host_threads(serve_config(load_sections(None, environ={}, overrides={"verifier": cpu,
                                                                                         "drafter": cpu})))
    expected = split_threads(AUTO, AUTO)
    assert (shared.verifier.intra_op_threads, shared.drafter.intra_op_threads) == expected
    assert expected[0] == alone_threads() and 1 <= expected[1] <= expected[0]
    set_both = {"verifier": {**cpu, "intra_op_threads": 4}, "drafter": {**cpu, "intra_op_threads": 3}}
    shared = share_host_threads(serve_config(load_sections(None, environ={}, overrides=set_both)))
    assert (shared.verifier.intra_op_threads, shared.drafter.intra_op_threads) == (4, 3)


def test_serve_all_processes_passes_the_split_to_its_children() -> None:
    from specdec.commands.serve import serve_child_args

    args = argparse.Namespace(config=None, backend="onnxruntime", device="cpu", precision=None, verifier_addr=None,
                              drafter_addr=None, verifier_metrics_addr=None, drafter_metrics_addr=None,
                              max_batch_rows=None, max_batch_tokens=None, batch_wait_ms=None,
                              verifier_model_workers=2)
    cpu = {"device": "cpu", "backend": "onnxruntime"}
    sections = load_sections(None, environ={}, overrides={"verifier": {**cpu, "intra_op_threads": 3}, "drafter": cpu})
    child = serve_child_args(args, Path("b"), sections)
    flags = dict(zip(child[::2], child[1::2], strict=True))
    assert flags["--verifier-threads"] == "3"
    assert flags["--verifier-model-workers"] == "2"
    assert flags["--drafter-threads"] == str(split_threads(3, AUTO)[1])


def test_onnx_sessions_get_the_threads(bundle) -> None:
    verifier = make_verifier(bundle, "onnxruntime", device="cpu", intra_op_threads=1)
    drafter = make_drafter(bundle, "onnxruntime", device="cpu", intra_op_threads=2)
    runners = {"verifier": verifier.runner, "drafter": drafter.onnx_nar.runner}
    for name, want in (("verifier", 1), ("drafter", 2)):
        runner = runners[name]
        for session in (runner.encoder, runner.decoder, runner.batch_decoder):
            assert session.get_session_options().intra_op_num_threads == want, name
    default = make_verifier(bundle, "onnxruntime", device="cpu")
    assert default.runner.decoder.get_session_options().intra_op_num_threads == default_intra_op_threads()


def test_torch_backend_sets_torch_threads(bundle) -> None:
    before = torch.get_num_threads()
    try:
        make_verifier(bundle, "torch", intra_op_threads=2)
        assert torch.get_num_threads() == 2
        make_drafter(bundle, "torch", intra_op_threads=1)
        assert torch.get_num_threads() == 1
        make_verifier(bundle, "torch")  # no value: torch's own setting stands
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
