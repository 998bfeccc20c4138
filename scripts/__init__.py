"""Checkpoint and tokenizer makers, and machine set-up scripts."""
