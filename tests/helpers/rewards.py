"""Reward functions for tests, loaded as ``reward.rule=tests.helpers.rewards:NAME``."""


def half_constant(response: str, answer: str) -> float:
    """Constant 1 for prompts with an even answer (their groups carry no signal); otherwise the
    parity of the response's length (groups with signal, mostly)."""
    if int(answer) % 2 == 0:
        return 1.0
    return float(len(response) % 2)
