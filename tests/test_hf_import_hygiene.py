"""`specdec import-hf` refuses what it should, in one line: every bad checkpoint (weights cut short or
not weights at all, malformed JSON, tokenizer files that tokenizer_config.json names but are
missing, weights that do not fit the config, a pickle that would run code) is exit status 2 and one
stderr line naming the file, never a traceback, with nothing executed and nothing written; `--out`
must be new or empty (`--force` replaces it whole); a tokenizer's saved truncation never cuts a
source, and a source longer than the model takes is refused with its length and the limit."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers", reason="import-hf needs transformers (the hf extra)")

import torch  # noqa: E402

from bench.hf_checkpoints import Shape, build  # noqa: E402
from seq2seq_models.bundle import load_bundle  # noqa: E402
from seq2seq_models.hf_tokenizer import HFTokenizer  # noqa: E402
from specdec.cli import main as cli_main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CORPUS = (ROOT / "seq2seq_models" / "data" / "tiny_corpus.txt").read_text().splitlines()
SHAPE = Shape(layers=1, max_len=64)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Good BART (tokenizer.json) and Marian (SentencePiece) checkpoints, built once."""
    root = tmp_path_factory.mktemp("good")
    return {family: build(family, root / family, SHAPE, seed=3) for family in ("bart", "marian")}


class Payload:
    """Unpickled, this would create the file `path`: what a hostile pytorch_model.bin does."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _cut_in_half(d: Path) -> None:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])


def _edit_config(d: Path, **changes) -> None:
    path = d / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _hostile_pickle(d: Path) -> None:
    """A pytorch_model.bin as torch.save writes one, whose unpickling creates `ran`: a plain
    `torch.load` of a copy does (so the payload is real), the import must not."""
    (d / "model.safetensors").unlink()
    torch.save({"model.shared.weight": Payload(d / "ran")}, d / "pytorch_model.bin")
    torch.save({"model.shared.weight": Payload(d.parent / "control")}, d.parent / "control.bin")
    torch.load(d.parent / "control.bin", weights_only=False)
    assert (d.parent / "control").exists()


BAD = {
    # case: (family, how the good checkpoint is spoilt, what the line names, what it says)
    "safetensors cut in half": ("bart", _cut_in_half, "model.safetensors", "truncated"),
    "safetensors that are not": ("bart", lambda d: (d / "model.safetensors").write_bytes(b"\x10" * 64),
                                 "model.safetensors", "not a safetensors file"),
    "malformed config.json": ("bart", lambda d: (d / "config.json").write_text('{"model_type": "bart", "d_model"'),
                              "config.json", "not valid JSON"),
    "malformed generation_config.json": ("bart", lambda d: (d / "generation_config.json").write_text("{,}"),
                                         "generation_config.json", "not valid JSON"),
    "tokenizer file missing": ("marian", lambda d: (d / "source.spm").unlink(), "tokenizer_config.json",
                               "missing: source.spm"),
    "weights of another shape": ("bart", lambda d: _edit_config(d, encoder_ffn_dim=48), "model.safetensors",
                                 "do not fit config.json"),
    "weights missing": ("bart", lambda d: _edit_config(d, decoder_layers=2), "model.safetensors",
                        "weights missing (model.decoder.layers.1."),
    "weights without a place": ("bart", lambda d: _edit_config(d, decoder_layers=0), "model.safetensors",
                                "without a place in the model"),
    "no weights": ("bart", lambda d: (d / "model.safetensors").unlink(), str, "no weights"),
    "a pickle that would run code": ("marian", _hostile_pickle, "pytorch_model.bin",
                                     "(GLOBAL posix.system); pickles are read with weights_only=True"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_checkpoint_is_one_line_and_exit_status_2(checkpoints, case, tmp_path, capsys):
    model_dir, out = _spoiled(checkpoints, case, tmp_path)
    capsys.readouterr()
    code = cli_main(["import-hf", "--model", str(model_dir), "--out", str(out)])
    _check_refusal(case, code, capsys.readouterr().err.strip(), model_dir, out, tmp_path)


@pytest.mark.parametrize("case", ["a pickle that would run code", "tokenizer file missing"])
def test_the_command_itself_prints_one_line(checkpoints, case, tmp_path):
    """As a user runs it: the process's whole stderr is the one line (no warnings, no traceback)."""
    model_dir, out = _spoiled(checkpoints, case, tmp_path)
    run = subprocess.run([sys.executable, "-m", "specdec", "import-hf", "--model", str(model_dir), "--out", str(out)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    _check_refusal(case, run.returncode, run.stderr.strip(), model_dir, out, tmp_path)


def _spoiled(checkpoints, case: str, tmp_path: Path) -> tuple[Path, Path]:
    family, spoil, _, _ = BAD[case]
    model_dir = tmp_path / "checkpoint"
    shutil.copytree(checkpoints[family], model_dir)
    spoil(model_dir)
    return model_dir, tmp_path / "bundle"


def _check_refusal(case: str, code: int, err: str, model_dir: Path, out: Path, tmp_path: Path) -> None:
    _, _, file, says = BAD[case]
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert (str(model_dir) if file is str else str(model_dir / file)) in err and says in err, err
    assert not out.exists() and not (tmp_path / "bundle.tmp").exists()  # nothing written
    assert not (model_dir / "ran").exists()  # nothing in a pickle ran


def test_a_pickle_of_plain_weights_imports_as_its_safetensors_do(checkpoints, tmp_path):
    from safetensors.torch import load_file

    model_dir = tmp_path / "bin"
    shutil.copytree(checkpoints["bart"], model_dir)
    torch.save(load_file(str(model_dir / "model.safetensors")), model_dir / "pytorch_model.bin")
    (model_dir / "model.safetensors").unlink()
    assert cli_main(["import-hf", "--model", str(model_dir), "--out", str(tmp_path / "from-bin")]) == 0
    assert cli_main(["import-hf", "--model", str(checkpoints["bart"]), "--out", str(tmp_path / "from-st")]) == 0
    weights = [load_file(str(tmp_path / name / "verifier.safetensors")) for name in ("from-bin", "from-st")]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_out_must_be_new_or_empty_and_force_replaces_it_whole(checkpoints, tmp_path, capsys):
    out = tmp_path / "bundle"
    out.mkdir()
    assert cli_main(["import-hf", "--model", str(checkpoints["bart"]), "--out", str(out)]) == 0  # empty: fine
    (out / "nar_drafter.safetensors").write_bytes(b"an earlier bundle's drafter")
    capsys.readouterr()
    assert cli_main(["import-hf", "--model", str(checkpoints["bart"]), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not empty" in err and "--force" in err, err
    assert (out / "nar_drafter.safetensors").exists()  # refused: untouched
    assert cli_main(["import-hf", "--model", str(checkpoints["bart"]), "--out", str(out), "--force"]) == 0
    assert not (out / "nar_drafter.safetensors").exists()  # replaced whole
    assert sorted(load_bundle(out).models) == ["verifier"]


def test_a_saved_truncation_never_cuts_a_source_and_a_long_one_is_refused(checkpoints, tmp_path, capsys,
                                                                           monkeypatch):
    """A fine-tuning script left truncation (and padding) in tokenizer.json: transformers' generate
    path ignores both, so the import drops them, and a bundle that still has them ignores them too."""
    model_dir = tmp_path / "truncating"
    shutil.copytree(checkpoints["bart"], model_dir)
    saved = json.loads((model_dir / "tokenizer.json").read_text())
    saved["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    saved["padding"] = {"strategy": {"Fixed": 12}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 1,
                        "pad_type_id": 0, "pad_token": "<pad>"}
    (model_dir / "tokenizer.json").write_text(json.dumps(saved))
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    text = " ".join(CORPUS[:3])
    full = tok(text)["input_ids"]
    assert len(full) > 12  # longer than the saved truncation and padding
    out = tmp_path / "bundle"
    assert cli_main(["import-hf", "--model", str(model_dir), "--out", str(out)]) == 0
    bundle = load_bundle(out)
    assert bundle.tokenizer.encode(text) == full[:-1]
    assert json.loads((out / "tokenizer.json").read_text())["truncation"] is None
    # A bundle written before: its tokenizer.json still truncates; encoding ignores that.
    spec = {k: v for k, v in json.loads((out / "config.json").read_text())["tokenizer"].items() if k != "fingerprint"}
    (out / "tokenizer.json").write_text(json.dumps(saved))
    assert HFTokenizer(out, spec).encode(text) == full[:-1]
    # Longer than the model takes (max_len 64: 63 source tokens with EOS): refused, with both numbers.
    shutil.rmtree(out)
    assert cli_main(["import-hf", "--model", str(model_dir), "--out", str(out)]) == 0
    long_text = " ".join(CORPUS[:12])
    n = len(tok(long_text)["input_ids"]) - 1
    assert n > 63
    monkeypatch.setattr("sys.stdin", io.StringIO(long_text + "\n"))
    capsys.readouterr()
    assert cli_main(["decode", "--bundle", str(out), "--backend", "torch", "--mode", "ar"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"input has {n} tokens; the limit is 63" in err, err
