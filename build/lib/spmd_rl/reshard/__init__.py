"""Resharding between the training and generation engines: allgather-swap, host swap, ledger."""
