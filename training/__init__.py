"""Making the bundled models: UA-GEC data, the shared tokenizer, the verifier, sequence-level
distillation, the NAR block drafter and the small AR drafter (`python -m training.pipeline`)."""
