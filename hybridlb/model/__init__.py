"""Model package: checkpoint spec and loading, the torch decoder, tokenizer, make-model."""
