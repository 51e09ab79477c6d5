"""Child process for :mod:`pods.rewards.symbolic`: reads ``{"gold": str, "candidates": [str]}`` JSON
lines, answers ``{"match": bool}`` lines. It runs math-verify on its own main thread, so math-verify's
``signal.alarm`` timeouts work here; the parent's deadline (which kills this process) is the backstop."""

from __future__ import annotations

import json
import logging
import os
import sys


def main() -> None:
    """Serve requests until stdin closes."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr  # keep library prints off the protocol channel
    logging.disable(logging.CRITICAL)
    try:
        from math_verify import parse, verify
    except Exception as error:  # report, then exit
        out.write(json.dumps({"error": f"{type(error).__name__}: {error}"}) + "\n")
        out.flush()
        return
    timeout = int(os.environ.get("PODS_MATH_VERIFY_INNER_TIMEOUT", "1"))
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        match = False
        try:
            request = json.loads(line)
            gold = parse("$" + request["gold"] + "$", parsing_timeout=timeout)
            if gold:
                for candidate in request["candidates"]:
                    predicted = parse(candidate, parsing_timeout=timeout)
                    if predicted and verify(gold, predicted, timeout_seconds=timeout):
                        match = True
                        break
        except BaseException:  # a timeout or any parser error means "no match"
            match = False
        out.write(json.dumps({"match": match}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
