"""Sampling from logits: processors (penalties, bias, masks), seeded sampling, log-probabilities."""
