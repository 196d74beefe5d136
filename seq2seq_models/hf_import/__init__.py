"""Hugging Face seq2seq checkpoints as specdec models: `specdec import-hf`.

A `save_pretrained` directory of one of the supported families is read with `transformers` (the
only place that library is needed), its architecture is described by `ModelConfig`'s fields and its
weights are renamed onto `Seq2SeqTransformer`'s. Nothing is re-implemented per family at run time:
the differences are data (norm placement and kind, positions, activation, embedding scale and
norm, head tying), and the layers in `seq2seq_models.layers` read them.

One module per family, found by `model_type` in `registry`: `marian`, `bart` (BART, mBART),
`m2m100` (M2M100, NLLB) and `t5` (T5, mT5, flan-T5); the first three share the layout of
`bart_layout`, and every family the helpers of `common`. Positions are imported as tables for the
model's `max_len`, so a sinusoid, an offset and a learnt table all run as the same lookup.
`checkpoint` reads a checkpoint through its family, `tokenizer` writes its tokenizer into the
bundle, and `write_bundle` is the command's whole job. Import the modules themselves: this package
imports nothing eagerly.
"""
