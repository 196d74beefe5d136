"""The small AR drafter on ONNX Runtime: beam drafts (MJSD) and sampled drafts (speculative sampling)
with the same results as the torch drafter (`seq2seq_models.drafting.beam_draft` / `sample_draft`).

Graphs come from `seq2seq_models.onnx_export` (role "ar_drafter", exported on demand and cached by
bundle fingerprint, or exported at image build time): the one-row `decoder.onnx` returns the logits
of a block's last position (a session catching up on its prefix, each sampled token), and
`decoder_batch.onnx` the logits of every beam in one call (a beam step). The search itself runs
here on the host in numpy, float64 log-softmax as the torch drafter does, with the same tie rule
(ties to the lower flat index, parent-major, then token id), so drafts are equal token for token
and their log-probabilities to float32 rounding.

A session's state (`ArRow`) is its cross-attention K/V, the K/V of BOS + its prefix and the logits
that predict the next token. A rollback re-feeds the last kept token (one position), since the
logits of earlier positions are not kept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from core.checks import check_session_step
from core.sampling import SamplingParams, sample_index, warp
from seq2seq_models.onnx_model import OnnxModel
from seq2seq_models.ort_runner import host

if TYPE_CHECKING:
    from seq2seq_models.transformer import Seq2SeqTransformer


class OnnxArDrafter(OnnxModel):
    """The exported small AR drafter: `open` a row per session, then `beam` / `sample` drafts from it."""

    role = "ar_drafter"

    def __init__(self, model: Seq2SeqTransformer | None = None, **options: Any) -> None:
        """`options`: those of `OnnxModel` (fingerprint, cache_root, device, intra_op_threads; or
        config and load instead of `model`). The AR drafter runs fp32 only."""
        OnnxModel.__init__(self, model, **options)

    def open(self, source_ids: list[int]) -> ArRow:
        return ArRow(self, source_ids)

    def beam(self, row: ArRow, gamma: int, num_beams: int) -> tuple[list[int], list[float]]:
        """`beam_draft` on the exported graphs: the best beam of up to `gamma` tokens and log q(d_1..d_i)."""
        cfg = self.config
        width = min(num_beams, cfg.vocab_size)
        scores, tokens = _top(log_softmax(row.logits[0]), width)
        seqs, cums = tokens[:, None], scores[:, None]
        finished = tokens == cfg.eos_id
        if gamma > 1 and not finished.all():
            past_k = np.repeat(host(row.k), width, axis=1)  # every beam starts from the row's prefix
            past_v = np.repeat(host(row.v), width, axis=1)
            # Every beam reads the row's source (the batched decoder takes a source per row).
            cross_k = np.repeat(host(row.cross[0]), width, axis=1)
            cross_v = np.repeat(host(row.cross[1]), width, axis=1)
            for _ in range(gamma - 1):
                if finished.all():
                    break
                block_k, block_v, logits = self.runner.decode_batch({
                    "tokens": seqs[:, -1:].astype(np.int64),
                    "block_lens": np.ones(width, np.int64),
                    "past_lens": np.full(width, past_v.shape[3], np.int64),
                    "past_k": past_k, "past_v": past_v, "cross_k": cross_k, "cross_v": cross_v,
                    "src_lens": np.full(width, cross_v.shape[3], np.int64),
                    "head_rows": np.arange(width, dtype=np.int64),
                })
                cand_scores, parent, token = expand_beams(scores, log_softmax(logits), finished, width, cfg.pad_id)
                past_k = np.concatenate([past_k, block_k], axis=4)[:, parent]  # keys transposed
                past_v = np.concatenate([past_v, block_v], axis=3)[:, parent]
                seqs = np.concatenate([seqs[parent], token[:, None]], axis=1)
                cums = np.concatenate([cums[parent], cand_scores[:, None]], axis=1)
                finished = finished[parent] | (token == cfg.eos_id)
                scores = cand_scores
        best = int(np.argmax(scores))  # the first of equal scores, as torch.argmax
        ids = [int(t) for t in seqs[best]]
        if cfg.eos_id in ids:
            ids = ids[: ids.index(cfg.eos_id) + 1]
        return ids, [float(c) for c in cums[best, : len(ids)]]

    def sample(
        self, row: ArRow, gamma: int, params: SamplingParams, rng: np.random.Generator
    ) -> tuple[list[int], list[np.ndarray]]:
        """`sample_draft` on the exported graphs: up to `gamma` tokens from the warped q, and each q.
        The row is left as it was (the sampled tokens' K/V are dropped)."""
        past, logits, past_len = (row.k, row.v), row.logits, row.positions
        ids: list[int] = []
        rows: list[np.ndarray] = []
        for i in range(gamma):
            q = warp(log_softmax(host(logits)[0]), params)
            token = sample_index(q, rng)
            ids.append(token)
            rows.append(q)
            if token == self.config.eos_id or i == gamma - 1:
                break
            k, v, logits = self.runner.decode(past, row.cross, tokens=[[token]], past_len=past_len)
            past, past_len = (k, v), past_len + 1
        return ids, rows


class ArRow:
    """One session's AR drafter state (the `PrefixState` protocol: `tokens`, `max_tokens`, `sync`)."""

    def __init__(self, drafter: OnnxArDrafter, source_ids: list[int]) -> None:
        cfg = drafter.config
        self.config = cfg
        self._runner = drafter.runner
        self.cross = self._runner.encode(source_ids, cfg.eos_id)
        self.k, self.v = self._runner.empty_past(cfg)
        self.tokens: list[int] = []  # output tokens after BOS that the K/V hold
        self.logits: Any = None  # [1, V]: the next token's logits after BOS + tokens
        self._feed(0, [cfg.bos_id])

    @property
    def positions(self) -> int:
        """Positions the K/V hold: BOS + tokens."""
        return 1 + len(self.tokens)

    @property
    def max_tokens(self) -> int:
        return self.config.max_len - 1

    @property
    def cache_bytes(self) -> int:
        return self._runner.nbytes(self.k) + self._runner.nbytes(self.v) + sum(map(self._runner.nbytes, self.cross))

    def sync(self, committed_len: int, append_ids: list[int], lookahead: int = 0) -> None:
        """Keep `committed_len` tokens, append `append_ids` (one decoder call)."""
        check_session_step(committed_len, len(self.tokens), len(append_ids), lookahead, self.config)
        if committed_len == len(self.tokens):
            if append_ids:
                self._feed(self.positions, append_ids)
                self.tokens.extend(append_ids)
            return
        # A rollback: the logits after the kept prefix are gone, so its last token is fed again.
        last = self.tokens[committed_len - 1] if committed_len else self.config.bos_id
        del self.tokens[committed_len:]
        self._feed(committed_len, [last, *append_ids])
        self.tokens.extend(append_ids)

    def _feed(self, past_len: int, block: list[int]) -> None:
        past = (self.k, self.v)
        self.k, self.v, self.logits = self._runner.decode(past, self.cross, tokens=[block], past_len=past_len)


def log_softmax(logits: Any) -> np.ndarray:
    """Log-softmax over the last axis in float64 (the torch drafter's `.double()` log-softmax)."""
    x = np.asarray(logits, np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def expand_beams(
    scores: np.ndarray, logp: np.ndarray, finished: np.ndarray, width: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`seq2seq_models.beam_step.expand_beams` for one source, in numpy: scores [W], logp [W, V]
    (modified in place), finished [W] -> the best `width` (scores, parent beam, token)."""
    vocab = logp.shape[-1]
    logp[finished] = -np.inf
    logp[:, pad_id] = np.where(finished, 0.0, logp[:, pad_id])  # a finished beam continues with PAD, free
    top, flat = _top((scores[:, None] + logp).reshape(-1), width)
    return top, flat // vocab, flat % vocab


def _top(values: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k descending, ties to the lower index (`kernels.cpu.topk_lowest_id_first`)."""
    order = np.argsort(-values, kind="stable")[: min(k, values.shape[0])]
    return values[order], order
