"""Reward functions for tests, loaded as ``reward.rule=tests.helpers.rewards:NAME``."""


def half_constant(response: str, answer: str) -> float:
    """Constant 1 for prompts with an even answer (their groups carry no signal); otherwise the
    parity of the response's character codes (any different digit flips it about half the
    time, so these groups mostly carry signal)."""
    if int(answer) % 2 == 0:
        return 1.0
    return float(sum(map(ord, response)) % 2)


def last_number(response: str, answer: str) -> float:
    """1.0 when the last number in the response is the answer ("3 + 4 makes 7" scores 1 for 7,
    where exact_match, which reads the whole response as one number, scores 0)."""
    import re

    numbers = re.findall(r"-?\d+(?:\.\d+)?", response.replace(",", ""))
    return float(bool(numbers) and float(numbers[-1]) == float(answer))
