"""Drafters for a verifier trained elsewhere (`specdec distill`): their shapes and starting weights.

A drafter is this project's own architecture (pre-LN, learnt positions, GELU, tied head) whatever
the verifier's family, with the verifier's vocabulary and special ids, so it drafts the verifier's
token ids. The NAR block drafter is shaped as in the GAD paper, a deep encoder and a shallow
decoder: its one forward per iteration costs little on the decoder side, while the encoder, run
once per source, carries the model's capacity. Its token embeddings start from the verifier's,
which gives the drafter the verifier's notion of which tokens are alike from the first step.

The default shapes are sized from the verifier: a share of its parameters (embeddings and output
head included, which dominate a small model's), so that a drafter costs a fraction of a verifier
forward on a small verifier as on a large one. A drafter of the verifier's width would cost nearly
what the verifier does on a small one, and drafting would not pay.
"""

from __future__ import annotations

import torch
from torch import Tensor

from seq2seq_models.config import ModelConfig
from seq2seq_models.transformer import Seq2SeqTransformer
from training.drafter_distillation.options import AR_SHARE, NAR_SHARE

WIDEST_DEFAULT = 512  # the default drafter width never exceeds this, whatever the verifier's
WIDTH_STEP = 32  # default widths are multiples of this, and at least this
# What a drafter takes from its verifier's config, so that it speaks the verifier's token ids.
VERIFIER_FIELDS = ("vocab_size", "src_vocab_size", "max_len", "pad_id", "unk_id", "bos_id", "eos_id", "mask_id")


def default_nar_shape(verifier: ModelConfig, verifier_params: int) -> tuple[int, int, int]:
    """(encoder layers, decoder layers, width): the verifier's encoder depth (at least 2) and one or
    two decoder layers, at the widest width up to the verifier's (and WIDEST_DEFAULT) that keeps the
    drafter within NAR_SHARE of the verifier's `verifier_params`."""
    decoder = min(2, max(1, verifier.decoder_layers // 3))
    widest = min(verifier.d_model, WIDEST_DEFAULT)
    return _within(verifier, NAR_SHARE * verifier_params, max(2, verifier.encoder_layers), decoder, widest, 2)


def default_ar_shape(verifier: ModelConfig, verifier_params: int) -> tuple[int, int, int]:
    """(encoder layers, decoder layers, width) of the small AR drafter: 3+1 layers (fewer for a
    shallower verifier), at most half the verifier's width and 256, within AR_SHARE of its parameters."""
    widest = max(WIDTH_STEP, min(verifier.d_model // 2, 256))
    return _within(verifier, AR_SHARE * verifier_params, min(3, max(1, verifier.encoder_layers)), 1, widest, 1)


def parameter_count(config: ModelConfig) -> int:
    """The parameters of a model of `config`, counted without making its weights."""
    with torch.device("meta"):
        return sum(p.numel() for p in Seq2SeqTransformer(config).parameters())


def drafter_config(verifier: ModelConfig, encoder_layers: int, decoder_layers: int, width: int) -> ModelConfig:
    """Our own architecture at this shape, speaking the verifier's ids (vocabularies, special ids,
    length limit); feed-forward 4x the width."""
    if min(encoder_layers, decoder_layers) < 1 or width < 8:
        raise ValueError(f"a drafter needs at least one layer per stack and width 8 or more, not "
                         f"{encoder_layers}+{decoder_layers} layers of width {width}")
    spoken = {name: getattr(verifier, name) for name in VERIFIER_FIELDS}
    return ModelConfig(
        d_model=width, n_heads=_heads(width, verifier), encoder_layers=encoder_layers,
        decoder_layers=decoder_layers, ffn_dim=4 * width, **spoken,
    )


def initial_weights(config: ModelConfig, verifier: Seq2SeqTransformer, seed: int) -> tuple[dict[str, Tensor], str]:
    """A fresh drafter's weights (seeded) whose token embeddings (and source embeddings, where the
    vocabularies are separate) are the verifier's: copied at the same width, else projected onto
    their leading principal directions (wider than the verifier: zero-padded). Then rescaled to
    the drafter's own initial scale, since the verifier may scale its embeddings differently (T5
    does not scale them at all). Returns the state dict and how the embeddings were made."""
    torch.manual_seed(seed)
    model = Seq2SeqTransformer(config)
    with torch.no_grad():
        how = _fit(model.embed.weight, verifier.embed.weight)
        if model.src_embed is not None and verifier.src_embed is not None:
            _fit(model.src_embed.weight, verifier.src_embed.weight)
    return model.state_dict(), how


def _fit(target: Tensor, source: Tensor) -> str:
    """Fill `target` [V, d] from `source` [V, D] (see `initial_weights`); returns how."""
    d, big_d = target.shape[1], source.shape[1]
    e = source.detach().to("cpu", torch.float64)
    if big_d == d:
        fitted, how = e, "copied from the verifier's (same width)"
    elif big_d > d:
        centred = e - e.mean(0, keepdim=True)
        _, vectors = torch.linalg.eigh(centred.T @ centred)  # ascending eigenvalues
        fitted = e @ vectors[:, -d:].flip(1)
        how = f"the verifier's projected onto their {d} leading principal directions (width {big_d} to {d})"
    else:
        fitted = torch.cat([e, e.new_zeros(e.shape[0], d - big_d)], 1)
        how = f"the verifier's, zero-padded from width {big_d} to {d}"
    fitted = fitted * (d**-0.5 / fitted.std().clamp(min=1e-12))
    target.copy_(fitted.to(target.dtype))
    return how


def _within(
    verifier: ModelConfig, budget: float, encoder: int, decoder: int, widest: int, fewest: int
) -> tuple[int, int, int]:
    """The widest shape of `encoder`+`decoder` layers within `budget` parameters (widths from
    `widest` down by WIDTH_STEP); where even WIDTH_STEP is over, fewer encoder layers, down to
    `fewest`+1 layers of WIDTH_STEP, which is the shape whatever the budget."""
    widths = [widest, *range((widest - 1) // WIDTH_STEP * WIDTH_STEP, WIDTH_STEP - 1, -WIDTH_STEP)]
    shapes = [(encoder, decoder, width) for width in widths if width >= WIDTH_STEP]
    shapes += [(layers, 1, WIDTH_STEP) for layers in range(encoder, fewest - 1, -1)]
    for shape in shapes:
        if parameter_count(drafter_config(verifier, *shape)) <= budget:
            return shape
    return fewest, 1, WIDTH_STEP


def _heads(width: int, verifier: ModelConfig) -> int:
    """The verifier's head count when it divides the width into heads of 16 or more, else heads of 64
    (or fewer heads, down to one)."""
    if width % verifier.n_heads == 0 and width // verifier.n_heads >= 16:
        return verifier.n_heads
    for heads in (width // 64, 8, 4, 2):
        if heads >= 1 and width % heads == 0:
            return heads
    return 1
