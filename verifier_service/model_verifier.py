"""The `core.interfaces.Verifier` attributes every verifier backend reads off its model config."""

from __future__ import annotations

from seq2seq_models.config import ModelConfig


class ModelVerifier:
    """The `core.interfaces.Verifier` attributes, read off the model's config (both backends)."""

    def __init__(self, config: ModelConfig) -> None:
        self.vocab_size = config.vocab_size
        self.source_vocab_size = config.source_vocab_size
        self.bos_id = config.bos_id
        self.eos_id = config.eos_id
        # The model's max_len counts the source's EOS and the target's BOS; the interface does not.
        self.max_source_len = config.max_len - 1
        self.max_target_len = config.max_len - 1
