"""Model bundles: a directory with config.json, tokenizer.model and one safetensors file per role.

    config.json     format version, vocab size, special ids, per-role architecture, fingerprints
    tokenizer.model SentencePiece model shared by every role
    <role>.safetensors  weights of the verifier, nar_drafter and ar_drafter (any subset), in float32
                    or float16 (smaller on disk, the repository's size budget); loaded as float32

The bundle fingerprint hashes the tokenizer and every weights file, so services can check at
start-up that they were given the same bundle (or at least the same tokenizer).

Loading checks the config, the tokenizer and every weights file's sha256 at once, but builds a role's
torch model only when it is first asked for (`ModelBundle.models` is a `LazyModels`): a service on
ONNX Runtime whose graphs are already exported needs only `configs` and the fingerprint, and so
runs on an install without torch (the runtime image). This module imports torch only inside the
functions that make or load weights.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from seq2seq_models.config import ModelConfig
from seq2seq_models.hf_tokenizer import HFTokenizer, IdsOnlyTokenizer
from seq2seq_models.tokenizer import BOS_ID, EOS_ID, MASK_ID, PAD_ID, UNK_ID, Tokenizer, train_tokenizer

if TYPE_CHECKING:
    import torch

    from seq2seq_models.transformer import Seq2SeqTransformer

FORMAT_VERSION = 1
ROLES = ("verifier", "nar_drafter", "ar_drafter")
TOKENIZER_FILE = "tokenizer.model"
CONFIG_FILE = "config.json"


@dataclass
class ModelBundle:
    path: Path
    name: str
    tokenizer: Tokenizer
    fingerprint: str
    models: Mapping[str, Seq2SeqTransformer] = field(default_factory=dict)
    metadata: dict = field(default_factory=dict)
    # Every loaded role's architecture, known without building its model (torch-free callers read these).
    configs: dict[str, ModelConfig] = field(default_factory=dict)

    def config(self, role: str) -> ModelConfig:
        """`role`'s architecture, without loading its weights."""
        if role in self.configs:
            return self.configs[role]
        return self._role(role).config

    @property
    def verifier(self) -> Seq2SeqTransformer:
        return self._role("verifier")

    @property
    def nar_drafter(self) -> Seq2SeqTransformer:
        return self._role("nar_drafter")

    @property
    def ar_drafter(self) -> Seq2SeqTransformer:
        return self._role("ar_drafter")

    def has(self, role: str) -> bool:
        return role in self.models

    def _role(self, role: str) -> Seq2SeqTransformer:
        if role not in self.models:
            raise KeyError(f"bundle {self.path} has no {role} loaded")
        return self.models[role]


WEIGHT_DTYPES = ("float32", "float16")


def save_bundle(
    out: str | Path,
    tokenizer_bytes: bytes,
    models: dict[str, Seq2SeqTransformer],
    name: str,
    metadata: dict | None = None,
    weights_dtype: str = "float32",
) -> Path:
    if weights_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weights_dtype must be one of {sorted(WEIGHT_DTYPES)}, not {weights_dtype!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / TOKENIZER_FILE).write_bytes(tokenizer_bytes)
    tokenizer = Tokenizer(tokenizer_bytes)
    for role, model in models.items():
        if model.config.vocab_size != tokenizer.vocab_size:
            raise ValueError(f"{role} vocab {model.config.vocab_size} != tokenizer vocab {tokenizer.vocab_size}")
    tokenizer_entry = {"file": TOKENIZER_FILE, "fingerprint": tokenizer.fingerprint}
    special_ids = {"pad": PAD_ID, "unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID, "mask": MASK_ID}
    return _write_bundle(out, tokenizer_entry, special_ids, models, name, metadata, weights_dtype)


def save_imported_bundle(
    out: str | Path,
    models: dict[str, Seq2SeqTransformer],
    name: str,
    tokenizer_spec: dict[str, Any] | None,
    metadata: dict | None = None,
) -> Path:
    """A bundle of imported models (`seq2seq_models.hf_import`): the special ids are the verifier's,
    and the tokenizer is the checkpoint's own (`tokenizer_spec`, its files already in `out`) or
    none (the bundle serves ids only)."""
    out = Path(out)
    cfg = models["verifier"].config
    forced = (metadata or {}).get("generation", {}).get("forced_bos_token_id")
    if tokenizer_spec is None:
        tokenizer: Any = IdsOnlyTokenizer(cfg.vocab_size, forced)
        entry: dict[str, Any] = {"kind": "none", "forced_bos_token_id": forced}
    else:
        tokenizer = HFTokenizer(out, tokenizer_spec)
        entry = dict(tokenizer_spec)
    entry["fingerprint"] = tokenizer.fingerprint
    special_ids = {"pad": cfg.pad_id, "unk": cfg.unk_id, "bos": cfg.bos_id, "eos": cfg.eos_id, "mask": cfg.mask_id}
    return _write_bundle(out, entry, special_ids, models, name, metadata, "float32")


def _write_bundle(
    out: Path,
    tokenizer_entry: dict[str, Any],
    special_ids: dict[str, int],
    models: dict[str, Seq2SeqTransformer],
    name: str,
    metadata: dict | None,
    weights_dtype: str,
) -> Path:
    import torch
    from safetensors.torch import save_file

    dtype = getattr(torch, weights_dtype)
    entries = {}
    for role, model in models.items():
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
        weights = out / f"{role}.safetensors"
        state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(weights), metadata={"role": role})
        # safetensors creates the file 0600; the images run as a non-root user that must read it.
        weights.chmod(0o644)
        entries[role] = {
            "file": weights.name,
            "sha256": _sha256(weights.read_bytes()),
            "architecture": model.config.to_dict(),
            "dtype": weights_dtype,
        }
    fingerprint = tokenizer_entry["fingerprint"]
    config = {
        "format_version": FORMAT_VERSION,
        "name": name,
        "vocab_size": next(iter(models.values())).config.vocab_size,
        "special_ids": special_ids,
        "tokenizer": tokenizer_entry,
        "models": entries,
        "fingerprint": _bundle_fingerprint(fingerprint, entries),
        "metadata": metadata or {},
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def bundle_roles(path: str | Path) -> list[str]:
    """The roles a bundle has models for, read from its config without loading any weights."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{path} is not a model bundle (no {CONFIG_FILE})")
    return list(json.loads(config_path.read_text())["models"])


def load_bundle(
    path: str | Path,
    roles: Iterable[str] | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> ModelBundle:
    """Load a bundle; `roles` limits which models are loaded (default: all it has). Every file is
    checked now; each role's torch model is built (in `dtype`, default float32, on `device`) when
    first used."""
    path = Path(path)
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{path} is not a model bundle (no {CONFIG_FILE})")
    config = json.loads(config_path.read_text())
    if config.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: unsupported bundle format {config.get('format_version')}")
    tokenizer = _load_tokenizer(path, config)
    if tokenizer.fingerprint != config["tokenizer"]["fingerprint"]:
        raise ValueError(f"{path}: the tokenizer does not match the fingerprint in {CONFIG_FILE}")
    wanted = list(config["models"]) if roles is None else list(roles)
    entries = {}
    for role in wanted:
        entry = config["models"].get(role)
        if entry is None:
            raise KeyError(f"bundle {path} has no {role}")
        weights_path = path / entry["file"]
        if _sha256(weights_path.read_bytes()) != entry["sha256"]:
            raise ValueError(f"{weights_path} does not match its sha256 in {CONFIG_FILE}")
        entries[role] = (weights_path, ModelConfig.from_dict(entry["architecture"]))
    models = LazyModels(entries, dtype, device)
    return ModelBundle(
        path=path,
        name=config["name"],
        tokenizer=tokenizer,
        fingerprint=config["fingerprint"],
        models=models,
        metadata=config.get("metadata", {}),
        configs={role: cfg for role, (_, cfg) in entries.items()},
    )


def load_bundle_tokenizer(path: str | Path) -> Any:
    """A bundle's tokenizer alone (the gateway needs no weights), checked against its fingerprint."""
    path = Path(path)
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{path} is not a model bundle (no {CONFIG_FILE})")
    config = json.loads(config_path.read_text())
    tokenizer = _load_tokenizer(path, config)
    if tokenizer.fingerprint != config["tokenizer"]["fingerprint"]:
        raise ValueError(f"{path}: the tokenizer does not match the fingerprint in {CONFIG_FILE}")
    return tokenizer


def bundle_decoding_defaults(path: str | Path) -> dict[str, Any]:
    """The decoding defaults a bundle carries (an imported checkpoint's generation settings,
    `seq2seq_models.hf_import.generation`), by `decoding.config.DecodingConfig` field name; {} for none."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{path} is not a model bundle (no {CONFIG_FILE})")
    return dict(json.loads(config_path.read_text()).get("metadata", {}).get("decoding_defaults", {}))


def _load_tokenizer(path: Path, config: dict) -> Any:
    """The bundle's tokenizer: specdec's SentencePiece model, an imported checkpoint's own, or none."""
    entry = config["tokenizer"]
    kind = entry.get("kind", "sentencepiece")
    if kind == "sentencepiece":
        return Tokenizer.load(path / entry["file"])
    if kind == "none":
        return IdsOnlyTokenizer(config["vocab_size"], entry.get("forced_bos_token_id"))
    spec = {k: v for k, v in entry.items() if k != "fingerprint"}
    return HFTokenizer(path, spec)


TORCH_MISSING = "torch is not installed (a runtime install without it serves ONNX Runtime exports only)"


class LazyModels(Mapping[str, "Seq2SeqTransformer"]):
    """role -> torch model, each built from its (already checked) weights file on first access.
    Membership and iteration read the role names only; a lookup loads."""

    def __init__(self, entries: dict[str, tuple[Path, ModelConfig]], dtype: Any, device: Any) -> None:
        self._entries = entries
        self._dtype = dtype
        self._device = device
        self._loaded: dict[str, Seq2SeqTransformer] = {}

    def __getitem__(self, role: str) -> Seq2SeqTransformer:
        if role not in self._loaded:
            weights_path, cfg = self._entries[role]  # KeyError for a role not loaded, as a dict
            self._loaded[role] = _load_model(weights_path, cfg, self._dtype, self._device)
        return self._loaded[role]

    def __contains__(self, role: object) -> bool:
        return role in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def _load_model(weights_path: Path, cfg: ModelConfig, dtype: Any, device: Any) -> Seq2SeqTransformer:
    try:
        import torch
        from safetensors.torch import load_file
    except ImportError:
        raise RuntimeError(f"cannot load {weights_path.name}: {TORCH_MISSING}") from None
    from seq2seq_models.transformer import Seq2SeqTransformer

    model = Seq2SeqTransformer(cfg)
    model.load_state_dict(load_file(str(weights_path)))
    return model.to(device=device, dtype=dtype or torch.float32).eval()


def make_tiny_bundle(out: str | Path, seed: int) -> Path:
    """A deterministic random bundle (tiny verifier + both drafters) for tests and demos."""
    import torch

    from seq2seq_models.transformer import Seq2SeqTransformer

    corpus = (Path(__file__).parent / "data" / "tiny_corpus.txt").read_text().splitlines()
    tokenizer_bytes = train_tokenizer(corpus, vocab_size=160)
    vocab = Tokenizer(tokenizer_bytes).vocab_size
    shapes = {
        "verifier": {"d_model": 64, "n_heads": 4, "encoder_layers": 2, "decoder_layers": 2, "ffn_dim": 128},
        "nar_drafter": {"d_model": 32, "n_heads": 2, "encoder_layers": 1, "decoder_layers": 1, "ffn_dim": 64},
        "ar_drafter": {"d_model": 32, "n_heads": 2, "encoder_layers": 1, "decoder_layers": 1, "ffn_dim": 64},
    }
    generator = torch.Generator().manual_seed(seed)
    models = {}
    for role, shape in shapes.items():
        model = Seq2SeqTransformer(ModelConfig(vocab_size=vocab, max_len=256, **shape))
        models[role] = scramble_weights(model, generator)
    metadata = {"kind": "random", "seed": seed}
    return save_bundle(out, tokenizer_bytes, models, name=f"tiny-random-seed{seed}", metadata=metadata)


def scramble_weights(
    model: Seq2SeqTransformer, generator: torch.Generator, dtype: torch.dtype | None = None
) -> Seq2SeqTransformer:
    """Random weights that do not just echo the input token: with tied embeddings and a residual
    stream, a standard init makes every position predict its own input token. Random-sign layer
    norm gains break that alignment, so a random model (tiny bundles, tests) produces varied text.
    The noise is drawn in `dtype` (default float32)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=dtype or torch.float32)
            if param.dim() == 2:
                param.copy_(noise / param.shape[1] ** 0.5)
            elif name.endswith("norm.weight"):
                param.copy_(noise)
            else:
                param.copy_(noise * 0.1)
    return model


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _bundle_fingerprint(tokenizer_fp: str, entries: dict) -> str:
    parts = [tokenizer_fp] + [f"{role}:{entries[role]['sha256']}" for role in sorted(entries)]
    return _sha256("\n".join(parts).encode())
