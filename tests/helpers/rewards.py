"""Reward functions for tests, loaded as ``reward.rule=tests.helpers.rewards:NAME``."""


def half_constant(response: str, answer: str) -> float:
    """Constant 1 for prompts with an even answer (their groups carry no signal); otherwise the
    parity of the response's character codes (any different digit flips it about half the
    time, so these groups mostly carry signal)."""
    if int(answer) % 2 == 0:
        return 1.0
    return float(sum(map(ord, response)) % 2)
