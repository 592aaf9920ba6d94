"""Tasks, tokenizers and the embedded default model (everything offline)."""
