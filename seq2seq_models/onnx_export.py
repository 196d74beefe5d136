"""Export a bundle model to ONNX graphs, cached on disk by bundle fingerprint and role.

Every role gets the same encoder graph and a decoder-with-past; what the decoder returns depends
on the role: the verifier's ends in the fused output head, the NAR drafter's in an argmax over
its mask positions, the small AR drafter's in the logits of its last position (or, batched, of the
`head_rows`), which its beam search and sampling read on the host (`drafter_service.onnx_ar`).
Where exports live and how one is found is `seq2seq_models.onnx_cache`, which imports no torch.

* `encoder.onnx`: source ids [B, S] (right-padded) and src_mask [B, S] (bool, True = a real
  position) -> cross-attention K [L, B, H, hd, S] (transposed, as every graph here takes keys:
  `kernels.attention.KeysT`) and V [L, B, H, S, hd] of every decoder layer, stacked (the encoder runs
  once per session, the new sessions of one forward together; the decoder never sees memory). A
  row's positions past its own length are padding, cut off by the caller.
* `decoder.onnx` (one row with its past, with the fused output head): tokens [1, T], past_len []
  (the block's start position), past_k_i [1, H, hd, P] / past_v_i [1, H, P, hd] per layer with P >=
  past_len, cross_k_i [1, H, hd, S] / cross_v_i [1, H, S, hd] per layer with S >= src_len, src_len [],
  head_from [] (first block row whose head outputs are wanted), targets [R] (drafted token per head
  row, -1 = none), top_k [1] -> block_k [L, 1, H, hd, T] / block_v [L, 1, H, T, hd] (the block's own
  K/V), topk_logprobs [R, k],
  topk_ids [R, k], target_logprobs [R]. The K/V inputs are a row's slot of a `row_cache.KVPool`
  as it is: the graph masks the past to `past_len` and the source to `src_len`, so rolling back
  is only a smaller `past_len` and nothing is copied to make the inputs.
* `decoder_processing.onnx` of the verifier: `decoder.onnx` with the rows' logits processors as the
  batched decoder takes them (below), but for logprob_rows: a lone row's processors in logit space
  (a beam search row runs in the batched graph). A graph of its own, so that the plain one, every
  request's without processors, has not a node more.
* `decoder_batch.onnx` of the verifier: the ragged batched decoder of `batch_graph` (B rows, each
  with its own past length, block length and source's K/V) with the fused head over the wanted rows:
  `batch_graph.BATCH_INPUTS` + targets [R], top_k [1], and the rows' logits processors
  (`core.logits_processors.PROCESSING_INPUTS`: logprob_rows [R], the penalty's rows, ids and factors
  [P], the bans' rows and ids [Q], the forced rows and ids [F]; empty: none) -> block_k/block_v
  [L, B, H, T, hd] (the block's own K/V only; the host keeps each row's cache), topk_logprobs
  [R, k], topk_ids [R, k], target_logprobs [R]. B, T, P, S, R and the processors' sizes are all
  dynamic.
* `decoder_step.onnx` of the verifier: `decoder_batch.onnx` for a batch of one-token blocks (AR
  steps: tokens [B, 1]), traced with the STEP kernel, whose attention is fewer and cheaper ops there
  (`kernels.attention.StepAttention`); the same inputs and outputs.
* `decoder.onnx` of the NAR drafter: the verifier's one-row inputs up to src_len, then mask_from []
  -> block_k/block_v, draft_ids [T - mask_from]. Block rows before `mask_from`
  are committed tokens appended causally; rows from `mask_from` on are the k [MASK]s, which see the
  whole prefix and the whole block. So catching up on the committed tokens and drafting is one
  call.
* `decoder.onnx` of the small AR drafter: tokens [1, T], past_len [], past_k [L, 1, H, hd, P] /
  past_v [L, 1, H, P, hd] stacked, cross_k/cross_v likewise -> present_k/present_v (the past cut to
  `past_len`, then the block) and the logits of the block's last position (its sessions keep their
  own K/V, `drafter_service.onnx_ar`).
* `decoder_batch.onnx` of the NAR drafter: the ragged batched decoder with per-row `mask_from`
  (`batch_graph.NAR_BATCH_INPUTS`) -> block_k/block_v [L, B, H, T, hd], draft_ids [R] (the argmax
  of the `head_rows`, the rows' mask positions; ties to the lowest id).

The head runs inside the graph (`kernels.graph_head`: logits -> log-softmax -> TopK + gather) so a
step is one ORT call and only top-k rows cross back to Python. The layers are the model's own
(`seq2seq_models.layers`), traced with the GRAPH attention kernel (`kernels.attention`).

The legacy TorchScript exporter (`dynamo=False`) is used: the dynamo exporter needs onnxscript,
which this project does not depend on, and the traced graph here has no data-dependent control flow.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.attention import BATCHED, GRAPH, STEP, AttentionKernel, KeysT
from kernels.graph_head import output_head_graph
from seq2seq_models.batch_graph import BATCH_INPUTS, NAR_BATCH_INPUTS, BatchedDecoder, decode_after_past
from seq2seq_models.onnx_cache import (  # re-exported: the cache side imports no torch
    AR_BATCH_DECODER_OUTPUTS,
    AR_DECODER_INPUTS,
    AR_DECODER_OUTPUTS,
    BATCH_DECODER_FILE,
    BATCH_DECODER_INPUTS,
    BATCH_DECODER_OUTPUTS,
    CACHE_ENV,
    DECODER_FILE,
    DECODER_INPUTS,
    DECODER_OUTPUTS,
    ENCODER_FILE,
    ENCODER_INPUTS,
    ENCODER_OUTPUTS,
    EXPORT_FORMAT,
    MANIFEST_FILE,
    NAR_BATCH_DECODER_OUTPUTS,
    NAR_DECODER_INPUTS,
    NAR_DECODER_OUTPUTS,
    OPSET,
    PROCESSING_DECODER_FILE,
    PROCESSING_DECODER_INPUTS,
    ROLES,
    STEP_DECODER_FILE,
    USER_CACHE,
    OnnxExport,
    bundle_cache_root,
    cached_export,
    default_cache_root,
    export_dir,
    find_export,
    loose_cache_root,
)
from seq2seq_models.row_cache import layer_inputs
from seq2seq_models.transformer import Seq2SeqTransformer

__all__ = [
    "BATCH_DECODER_FILE", "CACHE_ENV", "DECODER_FILE", "ENCODER_FILE", "EXPORT_FORMAT", "MANIFEST_FILE",
    "PROCESSING_DECODER_FILE", "ROLES",
    "USER_CACHE", "OnnxExport", "bundle_cache_root", "cached_export", "default_cache_root", "ensure_export",
    "export_ar_drafter", "export_dir", "export_model", "export_nar_drafter", "export_verifier", "find_export",
    "loose_cache_root", "model_fingerprint",
]


def ensure_export(
    model: Seq2SeqTransformer, fingerprint: str, cache_root: Path, force: bool = False, role: str = "verifier"
) -> OnnxExport:
    """Export `model` as `role` under `cache_root` unless an export for `fingerprint` is already there."""
    if role not in ROLES:
        raise ValueError(f"no ONNX export for role {role!r}; expected one of {', '.join(ROLES)}")
    directory = export_dir(Path(cache_root), fingerprint, role)
    if not force and (cached := cached_export(Path(cache_root), fingerprint, role)) is not None:
        return cached
    tmp = directory.with_name(directory.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    _EXPORTERS[role](model, tmp)
    (tmp / MANIFEST_FILE).write_text(
        json.dumps({"fingerprint": fingerprint, "role": role, "format": EXPORT_FORMAT, "opset": OPSET,
                    "config": model.config.to_dict(), "torch": torch.__version__}, indent=2) + "\n"
    )
    # Written aside then renamed, so a concurrent reader never sees half an export.
    if directory.exists():
        for f in directory.iterdir():
            f.unlink()
        directory.rmdir()
    tmp.rename(directory)
    return OnnxExport(directory, fingerprint, reused=False)


def export_model(
    model: Seq2SeqTransformer, role: str, fingerprint: str | None = None, cache_root: str | Path | None = None
) -> OnnxExport:
    """`ensure_export` with the defaults both ONNX backends use: the model's own weights fingerprint
    when it came without a bundle, and `loose_cache_root()` when no cache root is given."""
    root = Path(cache_root) if cache_root is not None else loose_cache_root()
    return ensure_export(model, fingerprint or model_fingerprint(model), root, role=role)


def model_fingerprint(model: Seq2SeqTransformer) -> str:
    """A fingerprint for a model that did not come from a bundle (tests, benchmarks)."""
    import hashlib

    h = hashlib.sha256(json.dumps(model.config.to_dict(), sort_keys=True).encode())
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def export_verifier(model: Seq2SeqTransformer, out: Path) -> None:
    """Write encoder.onnx and the verifier's decoder.onnx for `model` (exported in float32) into `out`."""
    model32 = _export_encoder(model, out)
    cfg = model32.config
    example = (
        *_example_row(cfg, [7, 8, 9]),
        torch.tensor(1),  # head_from
        torch.tensor([8, -1]),  # targets
        torch.tensor([2]),  # top_k
    )
    axes = {
        "targets": {0: "rows"},
        "topk_logprobs": {0: "rows", 1: "k"},
        "topk_ids": {0: "rows", 1: "k"},
        "target_logprobs": {0: "rows"},
    }
    layers = cfg.decoder_layers
    _export_decoder(_DecoderStep(model32), example, out, layer_inputs(DECODER_INPUTS, layers), DECODER_OUTPUTS,
                    {**_row_axes(layers), **axes})
    processing = _example_processing(cfg.vocab_size, rows=2)[1:]  # logit-space rows: no logprob_rows
    _export_decoder(_DecoderStep(model32), (*example, *processing), out,
                    layer_inputs(PROCESSING_DECODER_INPUTS, layers), DECODER_OUTPUTS,
                    {**_row_axes(layers), **axes, **_PROCESSING_AXES}, PROCESSING_DECODER_FILE)
    _export_batch_decoder(model32, out)
    _export_batch_decoder(model32, out, step=True)


# The logits processors' inputs (PROCESSING_INPUTS): each sized by its own axis.
_PROCESSING_AXES = {
    "logprob_rows": {0: "rows"}, "penalty_rows": {0: "penalized"}, "penalty_ids": {0: "penalized"},
    "penalty_factors": {0: "penalized"}, "ban_rows": {0: "banned"}, "ban_ids": {0: "banned"},
    "forced_rows": {0: "forced"}, "forced_ids": {0: "forced"},
}


def _example_processing(vocab: int, rows: int) -> tuple[Tensor, ...]:
    """Example processors for `rows` head rows (rows >= 2), each size distinct from the others
    (P 3, Q 2, F 1) so that none is traced as another."""
    return (
        torch.arange(rows) % 2 == 0, torch.tensor([0, 1, 1]), torch.tensor([7, 8, 9]) % vocab,
        torch.tensor([1.5, 1.5, 2.0]), torch.tensor([1, 0]), torch.tensor([5, 6]) % vocab,
        torch.tensor([rows - 1]), torch.tensor([4]) % vocab,
    )


def _export_batch_decoder(model32: Seq2SeqTransformer, out: Path, role: str = "verifier", step: bool = False) -> None:
    """decoder_batch.onnx: `batch_graph.BatchedDecoder` with the BATCHED kernel, ending in the fused
    head (verifier), the mask positions' argmax (the NAR drafter, with `mask_from`) or the wanted
    rows' logits (the AR drafter). `step`: the verifier's decoder_step.onnx instead (blocks of one
    token, the STEP kernel)."""
    cfg = model32.config
    layers, heads, hd = cfg.decoder_layers, cfg.decoder_shape.heads, cfg.decoder_shape.head_dim
    # Every traced size distinct (B 2, T 3, P 5, S 4, R 4), so none is mistaken for another; a step
    # graph's blocks are one token (R is then B: every row is a head row).
    tokens = torch.tensor([[7], [8]]) if step else torch.tensor([[7, 8, 9], [7, 0, 0]])
    example: tuple = (
        tokens % cfg.vocab_size,  # tokens
        torch.tensor([1, 1]) if step else torch.tensor([3, 1]), torch.tensor([5, 2]),  # block_lens, past_lens
        *(torch.zeros(2, heads, hd, 5) for _ in range(layers)), *(torch.zeros(2, heads, 5, hd) for _ in range(layers)),
        *(torch.zeros(2, heads, hd, 4) for _ in range(layers)), *(torch.zeros(2, heads, 4, hd) for _ in range(layers)),
        torch.tensor([4, 3]),  # src_lens
        torch.tensor([0, 1]) if step else torch.tensor([0, 1, 2, 3]),  # head_rows
    )
    axes = {
        "tokens": {0: "batch", 1: "block"}, "block_lens": {0: "batch"}, "past_lens": {0: "batch"},
        **{name: {0: "batch", 3: "past"} for name in layer_inputs(["past_k"], layers)},
        **{name: {0: "batch", 2: "past"} for name in layer_inputs(["past_v"], layers)},
        **{name: {0: "batch", 3: "src_len"} for name in layer_inputs(["cross_k"], layers)},
        **{name: {0: "batch", 2: "src_len"} for name in layer_inputs(["cross_v"], layers)},
        "src_lens": {0: "batch"}, "head_rows": {0: "rows"},
        "block_k": {1: "batch", 4: "block"}, "block_v": {1: "batch", 3: "block"},
    }
    if role == "nar_drafter":
        module: nn.Module = _BatchedNarStep(model32)
        example = (*example, torch.tensor([1, 0]))  # mask_from
        inputs, outputs = NAR_BATCH_INPUTS, NAR_BATCH_DECODER_OUTPUTS
        axes |= {"mask_from": {0: "batch"}, "draft_ids": {0: "rows"}}
    elif role == "ar_drafter":
        module = _BatchedArStep(model32)
        inputs, outputs = BATCH_INPUTS, AR_BATCH_DECODER_OUTPUTS
        axes |= {"logits": {0: "rows"}}
    else:
        module = _BatchedVerifierStep(model32, STEP if step else BATCHED)
        rows = 2 if step else 4
        example = (*example, torch.tensor([8, -1, -1, -1][:rows]), torch.tensor([2]))  # targets, top_k
        example = (*example, *_example_processing(cfg.vocab_size, rows=rows))
        inputs, outputs = BATCH_DECODER_INPUTS, BATCH_DECODER_OUTPUTS
        axes |= {"targets": {0: "rows"}, "topk_logprobs": {0: "rows", 1: "k"}, "topk_ids": {0: "rows", 1: "k"},
                 "target_logprobs": {0: "rows"}, **_PROCESSING_AXES}
    if step:
        axes["tokens"] = {0: "batch"}  # one token a row
    inputs = layer_inputs(inputs, layers)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # tracer warnings about shape arithmetic are expected
        torch.onnx.export(
            module, example, str(out / (STEP_DECODER_FILE if step else BATCH_DECODER_FILE)), dynamo=False,
            opset_version=OPSET, input_names=inputs, output_names=outputs, dynamic_axes=axes,
        )


def export_nar_drafter(model: Seq2SeqTransformer, out: Path) -> None:
    """Write encoder.onnx and the NAR drafter's decoder.onnx for `model` (float32) into `out`."""
    model32 = _export_encoder(model, out)
    cfg = model32.config
    example = (*_example_row(cfg, [7, 8, cfg.mask_id, cfg.mask_id]), torch.tensor(2))  # ..., mask_from
    layers = cfg.decoder_layers
    _export_decoder(_NarDecoderStep(model32), example, out, layer_inputs(NAR_DECODER_INPUTS, layers),
                    NAR_DECODER_OUTPUTS, {**_row_axes(layers), "draft_ids": {0: "k"}})
    _export_batch_decoder(model32, out, role="nar_drafter")


def export_ar_drafter(model: Seq2SeqTransformer, out: Path) -> None:
    """Write encoder.onnx and the small AR drafter's decoders for `model` (float32) into `out`:
    decoder.onnx (one row, causal, the logits [1, V] of the block's last position: catching up on a
    prefix and each sampled token) and decoder_batch.onnx (logits of the `head_rows`: a step of all
    beams of a beam draft in one call)."""
    model32 = _export_encoder(model, out)
    cross_k, cross_v, past_k, past_v = _example_cache(model32.config)
    example = (
        torch.tensor([[7, 8, 9]]) % model32.config.vocab_size,  # tokens
        torch.tensor(3),  # past_len (< P on purpose: the slice must stay in the graph)
        past_k, past_v, cross_k, cross_v,
    )
    _export_decoder(_ArDecoderStep(model32), example, out, AR_DECODER_INPUTS, AR_DECODER_OUTPUTS, _AR_DECODER_AXES)
    _export_batch_decoder(model32, out, role="ar_drafter")


_EXPORTERS = {"verifier": export_verifier, "nar_drafter": export_nar_drafter, "ar_drafter": export_ar_drafter}


# The AR drafter's one-row decoder's dynamic axes: the block, the past's capacity, the source length.
_AR_DECODER_AXES = {
    "tokens": {1: "block"},
    "past_k": {4: "past_cap"},
    "past_v": {3: "past_cap"},
    "cross_k": {4: "src_len"},
    "cross_v": {3: "src_len"},
    "present_k": {4: "total"},
    "present_v": {3: "total"},
}


def _row_axes(layers: int) -> dict[str, dict[int, str]]:
    """The dynamic axes of a one-row decoder over a pool slot: the block, the capacities."""
    return {
        "tokens": {1: "block"},
        **{name: {3: "past_cap"} for name in layer_inputs(["past_k"], layers)},
        **{name: {2: "past_cap"} for name in layer_inputs(["past_v"], layers)},
        **{name: {3: "src_cap"} for name in layer_inputs(["cross_k"], layers)},
        **{name: {2: "src_cap"} for name in layer_inputs(["cross_v"], layers)},
        "block_k": {4: "block"}, "block_v": {3: "block"},
    }


def _example_row(cfg, tokens: list[int]) -> tuple:
    """Example one-row inputs up to src_len: `tokens` after a past of 3 in a capacity of 5 (the mask
    must stay in the graph), a source of 3 in a capacity of 4."""
    layers, heads, hd = cfg.decoder_layers, cfg.decoder_shape.heads, cfg.decoder_shape.head_dim
    return (
        torch.tensor([tokens]) % cfg.vocab_size, torch.tensor(3),  # tokens, past_len
        *(torch.zeros(1, heads, hd, 5) for _ in range(layers)), *(torch.zeros(1, heads, 5, hd) for _ in range(layers)),
        *(torch.zeros(1, heads, hd, 4) for _ in range(layers)), *(torch.zeros(1, heads, 4, hd) for _ in range(layers)),
        torch.tensor(3),  # src_len
    )


def _export_decoder(
    module: nn.Module, example: tuple, out: Path, inputs: list[str], outputs: list[str], axes: dict,
    file: str = DECODER_FILE,
) -> None:
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # tracer warnings about shape arithmetic are expected
        torch.onnx.export(
            module, example, str(out / file), dynamo=False, opset_version=OPSET,
            input_names=inputs, output_names=outputs, dynamic_axes=axes,
        )


def _export_encoder(model: Seq2SeqTransformer, out: Path) -> Seq2SeqTransformer:
    """Write encoder.onnx; returns the float32 copy of `model` the decoder is exported from."""
    out.mkdir(parents=True, exist_ok=True)
    model32 = _float32_copy(model)
    eos = model32.config.eos_id
    src = torch.tensor([[5, 6, 7, eos], [5, eos, 0, 0]]) % model32.config.vocab_size
    src_mask = torch.tensor([[True] * 4, [True, True, False, False]])
    sizes = {0: "batch", 1: "src_len"}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # tracer warnings about shape arithmetic are expected
        torch.onnx.export(
            _Encoder(model32), (src, src_mask), str(out / ENCODER_FILE), dynamo=False, opset_version=OPSET,
            input_names=ENCODER_INPUTS, output_names=ENCODER_OUTPUTS,
            dynamic_axes={"src": sizes, "src_mask": sizes, "cross_k": {1: "batch", 4: "src_len"},
                          "cross_v": {1: "batch", 3: "src_len"}},
        )
    return model32


def _example_cache(cfg) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Example cross-attention K and V (source of 4) and past K and V (capacity 5) for tracing the
    AR drafter's one-row decoder (keys transposed)."""
    layers, heads, hd = cfg.decoder_layers, cfg.decoder_shape.heads, cfg.decoder_shape.head_dim
    return (torch.zeros(layers, 1, heads, hd, 4), torch.zeros(layers, 1, heads, 4, hd),
            torch.zeros(layers, 1, heads, hd, 5), torch.zeros(layers, 1, heads, 5, hd))


# ----------------------------------------------------------------------------------------------
# Export modules: the model's own stacks (`encode`, `cross_kv`, `run_decoder`) run with the GRAPH
# attention kernel, and the past joined by concatenation instead of the KV cache's in-place
# writes, so that the traced graph is a pure function of its inputs.
# ----------------------------------------------------------------------------------------------


class _ModelGraph(nn.Module):
    """A module whose forward is one exported graph over `model`'s weights."""

    def __init__(self, model: Seq2SeqTransformer) -> None:
        super().__init__()
        self.model = model


class _Encoder(_ModelGraph):
    def forward(self, src: Tensor, src_mask: Tensor) -> tuple[Tensor, Tensor]:
        m = self.model
        memory = m.encode(src, src_mask, BATCHED)  # right-padded sources: the mask hides the padding
        ks, vs = m.cross_kv(memory, BATCHED)
        return torch.stack([k.transpose(-1, -2) for k in ks]), torch.stack(vs)


class _DecoderStep(_ModelGraph):
    def forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        """`ROW_INPUTS` (one K/V per layer), head_from, targets, top_k, then `processing`: none
        (decoder.onnx), or LOGIT_PROCESSING_INPUTS' (decoder_processing.onnx; a lone row with log-prob
        space processors, beam search's, runs in the batched graph)."""
        m = self.model
        (hidden, block_k, block_v), (head_from, targets, top_k, *processing) = _decode_row(m, inputs)
        rows = hidden.index_select(0, torch.arange(head_from, hidden.shape[0]))
        head = output_head_graph(rows, m.head_weight, m.out_bias, top_k, targets, processing or None,
                                 logit_space_only=True)
        return block_k, block_v, head.topk_logprobs, head.topk_ids, head.target_logprobs


class _BatchedStep(_ModelGraph):
    """A graph over `BatchedDecoder` (rows of several sessions' blocks): subclasses add the head.
    Its inputs are flat, the K/V one per layer (`row_cache.layer_inputs`); `decode` regroups them."""

    def __init__(self, model: Seq2SeqTransformer, kernel: AttentionKernel = BATCHED) -> None:
        super().__init__(model)
        self.decoder = BatchedDecoder(model, kernel)

    def decode(self, inputs: Sequence[Tensor]) -> tuple[tuple[Tensor, Tensor, Tensor], list[Tensor]]:
        """The decoder's outputs for the first inputs `BATCH_INPUTS` (and `mask_from`) name, and the
        inputs after them."""
        layers = self.model.config.decoder_layers
        tokens, block_lens, past_lens, *rest = inputs
        kv = [tuple(rest[i * layers : (i + 1) * layers]) for i in range(4)]  # past_k, past_v, cross_k, cross_v
        src_lens, head_rows, *after = rest[4 * layers :]
        mask_from = after.pop(0) if isinstance(self, _BatchedNarStep) else None
        out = self.decoder(tokens, block_lens, past_lens, *kv, src_lens, head_rows, mask_from)
        return out, after


class _BatchedVerifierStep(_BatchedStep):
    def forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        (rows, block_k, block_v), (targets, top_k, *processing) = self.decode(inputs)
        m = self.model
        head = output_head_graph(rows, m.head_weight, m.out_bias, top_k, targets, processing)
        return block_k, block_v, head.topk_logprobs, head.topk_ids, head.target_logprobs


class _BatchedNarStep(_BatchedStep):
    def forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        (rows, block_k, block_v), _ = self.decode(inputs)
        m = self.model
        draft_ids = F.linear(rows, m.head_weight, m.out_bias).argmax(-1)  # ties: lowest id, as torch
        return block_k, block_v, draft_ids


class _BatchedArStep(_BatchedStep):
    def forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        (rows, block_k, block_v), _ = self.decode(inputs)
        return block_k, block_v, self.model.logits(rows)


class _ArDecoderStep(_ModelGraph):
    def forward(
        self, tokens: Tensor, past_len: Tensor, past_k: Tensor, past_v: Tensor, cross_k: Tensor, cross_v: Tensor,
    ) -> tuple[Tensor, ...]:
        m = self.model
        hidden, present_k, present_v = _decode_block(m, tokens, past_len, past_k, past_v, cross_k, cross_v)
        t = tokens.shape[1]
        last = hidden.index_select(0, torch.arange(t - 1, t))  # the position that predicts the next token
        return present_k, present_v, m.logits(last)


class _NarDecoderStep(_ModelGraph):
    def forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        """`ROW_INPUTS` (one K/V per layer), then mask_from."""
        m = self.model
        layers = m.config.decoder_layers
        mask_from = inputs[3 + 4 * layers]
        (hidden, block_k, block_v), _ = _decode_row(m, inputs, mask_from)
        rows = hidden.index_select(0, torch.arange(mask_from, hidden.shape[0]))
        draft_ids = F.linear(rows, m.head_weight, m.out_bias).argmax(-1)  # ties: lowest id, as torch
        return block_k, block_v, draft_ids


def _decode_row(
    m: Seq2SeqTransformer, inputs: Sequence[Tensor], mask_from: Tensor | None = None
) -> tuple[tuple[Tensor, Tensor, Tensor], Sequence[Tensor]]:
    """Final-layer states [T, D] of one row's block and the block's own keys [L, 1, H, hd, T] and
    values [L, 1, H, T, hd], for the first inputs `ROW_INPUTS` name (one K/V per layer), and the
    inputs after them. The past is the first `past_len` positions of the given K/V and the source
    the first `src_len` of its; the block's tokens attend causally, and with `mask_from`, the
    block's positions from there on ([MASK]s) see every key (the prefix and the whole block)."""
    layers = m.config.decoder_layers
    tokens, past_len, *rest = inputs
    past_k, past_v, cross_k, cross_v = (list(rest[i * layers : (i + 1) * layers]) for i in range(4))
    src_len, *after = rest[4 * layers :]
    t = tokens.shape[1]
    offsets = torch.arange(t)
    positions = past_len + offsets  # [T]
    query = offsets[:, None]  # [T, 1]
    past_keys = torch.arange(past_k[0].shape[3])  # [P]
    # `query >= 0` only broadcasts the past mask over the block's queries ([T, P]).
    past_visible = (past_keys[None, :] < past_len) & (query >= 0)
    block_visible = offsets[None, :] <= query  # causal [T, T]
    if mask_from is not None:
        block_visible = block_visible | (query >= mask_from)
    self_mask = torch.cat([past_visible, block_visible], dim=1)[None, None]  # [1, 1, T, P + T]
    key_positions = torch.cat([past_keys, positions])[None]
    self_mask = m.self_attention_mask(self_mask, positions[None], key_positions, decoder=True)
    cross_mask = (torch.arange(cross_k[0].shape[3]) < src_len)[None, None, None, :]  # [1, 1, 1, S]
    x = m.embed_target(tokens, positions[None])
    hidden, block_k, block_v = decode_after_past(m, x, self_mask, past_k, past_v, cross_k, cross_v, cross_mask, GRAPH)
    return (hidden[0], block_k, block_v), after


def _decode_block(
    m: Seq2SeqTransformer, tokens: Tensor, past_len: Tensor, past_k: Tensor, past_v: Tensor,
    cross_k: Tensor, cross_v: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """Final-layer states [T, D] of a block after the first `past_len` cached positions, and
    the present K (transposed) and V (the kept past plus the block's own) of every layer, stacked
    (the small AR drafter's one-row decoder). The block's tokens attend causally."""
    t = tokens.shape[1]
    positions = past_len + torch.arange(t)  # [T]
    visible = torch.arange(past_len + t)[None, :] <= positions[:, None]  # [T, past_len + T]
    x = m.embed_target(tokens, positions[None])
    # Index tensors rather than Python slices: a slice bound would be traced as a constant.
    kept = torch.arange(past_len)
    present_k: list[Tensor] = []
    present_v: list[Tensor] = []

    def join_past(i: int, k: Tensor, v: Tensor) -> tuple[KeysT, Tensor]:
        kt = torch.cat([past_k[i].index_select(3, kept), k.transpose(-1, -2)], dim=3)
        v = torch.cat([past_v[i].index_select(2, kept), v], dim=2)
        present_k.append(kt)
        present_v.append(v)
        return KeysT(kt), v

    keys = torch.arange(visible.shape[1])[None]
    self_mask = m.self_attention_mask(visible[None, None], positions[None], keys, decoder=True)
    hidden = m.run_decoder(x, self_mask, [KeysT(k) for k in cross_k], cross_v, None, GRAPH, join_past)
    return hidden[0], torch.stack(present_k), torch.stack(present_v)


def _float32_copy(model: Seq2SeqTransformer) -> Seq2SeqTransformer:
    copy = Seq2SeqTransformer(model.config)
    copy.load_state_dict({k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()})
    return copy.eval()
