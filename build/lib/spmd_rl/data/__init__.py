"""Prompt datasets and the resumable sampler."""
