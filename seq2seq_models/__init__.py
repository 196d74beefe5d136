"""Encoder-decoder Transformers (AR verifier, NAR block drafter, small AR drafter), their rollback
KV cache, model bundles, ONNX export and the SentencePiece tokenizer wrapper.

Import the modules themselves (`seq2seq_models.bundle`, `seq2seq_models.tokenizer`, ...): this
package imports nothing eagerly, so the tokenizer can be used without loading torch.
"""
