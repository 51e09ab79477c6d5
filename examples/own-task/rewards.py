"""Rewards for the word problems in data/: TRL's reward signature, fn(prompts, completions, **columns) -> scores.

Every column of the data file reaches every reward function as a keyword: here `target` (and `problem`).
A score of None means "does not apply" to that completion.
"""

import re

FINAL = re.compile(r"####\s*(-?\d+)")


def exact(prompts, completions, target, **kwargs):
    """1.0 when the number after the last '####' equals the row's target, else 0.0."""
    scores = []
    for completion, gold in zip(completions, target, strict=True):
        found = FINAL.findall(completion)
        scores.append(1.0 if found and int(found[-1]) == int(gold) else 0.0)
    return scores


def stated(prompts, completions, **kwargs):
    """A small bonus for stating a final answer at all ('#### <number>')."""
    return [1.0 if FINAL.search(completion) else 0.0 for completion in completions]
