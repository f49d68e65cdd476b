"""The SPMD stage loop, its metrics and checkpoints."""
