"""Reward functions for tests, loaded as ``reward.rule=tests.helpers.rewards:NAME``."""


def half_constant(response: str, answer: str, row: dict) -> float:
    """Constant 1 for prompts with an even answer (their groups carry no signal); otherwise the
    parity of the response's character codes (any different digit flips it about half the
    time, so these groups mostly carry signal)."""
    if int(answer) % 2 == 0:
        return 1.0
    return float(sum(map(ord, response)) % 2)


def last_number(response: str, answer: str, row: dict) -> dict:
    """1.0 when the last number in the response is the answer ("3 + 4 makes 7" scores 1 for 7,
    where exact_match with reward.extract: strict, which reads the whole response as one number,
    scores 0). Rows whose data_source is "strict" must answer with the number alone. Whether a
    response holds a number at all is logged as reward/has_number."""
    import re

    numbers = re.findall(r"-?\d+(?:\.\d+)?", response.replace(",", ""))
    if row["data_source"] == "strict" and numbers and response.strip() != numbers[-1]:
        numbers = []
    right = bool(numbers) and float(numbers[-1]) == float(answer)
    return {"score": float(right), "has_number": float(bool(numbers))}


def digit_share(response: str, answer: str, row: dict) -> float:
    """The share of the response's characters that are digits: graded, so even a random model's
    samples differ in reward and GRPO's update is not zero (tests.arch_models)."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)
