"""Evaluation metrics of scored samples: pass@k, avg@n, maj@k (pure, numpy).

Reported per benchmark (`summarize`):

* ``pass@k``: the unbiased estimator of A-GRAE eq. (37), 1 - C(n-c, k) / C(n, k) averaged
  over problems (c correct of n samples); ``pass@1`` = mean c / n;
* ``avg@n``: mean accuracy over all n samples (the same number as pass@1; the name the
  papers use for small sets, e.g. DaGRPO's avg@32);
* ``maj@k``: accuracy of the majority answer among k samples (``maj_at_k``);
* ``no_answer`` (share of samples without an extractable answer), ``truncated`` (share that
  hit the token limit) and ``length_mean`` (new tokens);
* ``dropped``: only where a serving backend dropped requests, how many samples it dropped
  (each scored as a wrong answer in the figures above).

(The CLI, `python -m gjax.eval`, adds ``greedy``: the accuracy of one greedy completion.)
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from collections.abc import Sequence

import numpy as np

from gjax.answers import extract_answer
from gjax.errors import UserError


class EvalError(UserError, ValueError):
    """A bad evaluation request (flags, k values, paths); the message says what to change."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem: 1 - C(n-c, k) / C(n, k) (A-GRAE eq. (37)).

    The probability that at least one of k samples drawn without replacement from the n
    generated (c of them correct) is correct. Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i),
    which equals the binomial ratio and never forms large binomials.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    if k == 1:
        return c / n  # exact (the product below rounds)
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


_KEY_DROP = re.compile(r"\\left|\\right|\\!|\\,|\\;|\\:|\\ |\$|\s|\\text\{\s*\}")


def answer_key(text: str, extractors: Sequence[str] = ("boxed", "answer_tag")) -> str | None:
    """The vote of one completion for maj@k: its extracted final answer, normalized by
    string (spacing, ``\\left``/``\\right``, ``$``, ``\\dfrac``/``\\tfrac`` -> ``\\frac``, a
    trailing period dropped), or None when it has none. Answers equal in value but written
    differently (``0.5`` and ``\\frac12``) vote apart."""
    answer, _ = extract_answer(text, extractors)
    if answer is None:
        return None
    key = _KEY_DROP.sub("", answer).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return key.rstrip(".") or None


def maj_at_k(keys: Sequence[str | None], correct: Sequence[float], k: int) -> float:
    """Majority-vote accuracy of one problem over its n samples, in chunks of k.

    The n samples are split into floor(n/k) consecutive chunks of k; in each, the answer
    given most often (by `answer_key`; samples without an answer do not vote) wins, and the
    chunk scores that answer's correctness. A tie between answers scores the mean
    correctness of the tied answers (the expected score of a uniform tie-break), so the
    result does not depend on the order of the samples. A chunk where nobody answered scores
    0. Returns the mean over chunks.
    """
    n = len(keys)
    if len(correct) != n or not 1 <= k <= n:
        raise ValueError(f"maj@k needs 1 <= k <= n = len(keys) = len(correct); got k={k}, n={n}")
    scores = []
    for start in range(0, n - k + 1, k):
        chunk = [(keys[i], float(correct[i])) for i in range(start, start + k)]
        votes = Counter(key for key, _ in chunk if key is not None)
        if not votes:
            scores.append(0.0)
            continue
        top = max(votes.values())
        winners = [key for key, v in votes.items() if v == top]
        # All samples with one key share its correctness; their mean guards odd verifier cases.
        scores.append(
            float(np.mean([np.mean([c for key, c in chunk if key == w]) for w in winners]))
        )
    return float(np.mean(scores))


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks = [2**i for i in range(int(math.log2(n)) + 1)] if n >= 1 else []
    return sorted(set(ks) | {n})


def parse_ks(text: str | Sequence[int] | None, n: int, *, where: str = "--k") -> list[int]:
    if text is None or text == "":
        return default_ks(n)
    try:
        ks = sorted({int(x) for x in (text.split(",") if isinstance(text, str) else text)})
    except ValueError as e:
        raise EvalError(f"{where}={text!r}: expected a comma-separated list of integers") from e
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise EvalError(
            f"{where}: k={bad} outside 1..n={n} (pass@k and maj@k need k <= the samples per "
            "problem); lower k or raise the number of samples"
        )
    return ks


@dataclasses.dataclass
class Samples:
    """The scored completions of P problems x N samples (prompt-major)."""

    texts: list[list[str]]  # [P][N]
    correct_PxN: np.ndarray  # float32 in {0, 1}
    lengths_PxN: np.ndarray  # int32 new tokens (stop token included)
    truncated_PxN: np.ndarray  # bool: no stop token within max_new_tokens
    keys: list[list[str | None]]  # answer_key per sample
    dropped_PxN: np.ndarray | None = None  # bool: a serving backend dropped the request


def summarize(samples: Samples, ks: Sequence[int]) -> dict[str, float]:
    """Benchmark metrics from scored samples (see the module docstring)."""
    p, n = samples.correct_PxN.shape
    correct_P = samples.correct_PxN.sum(-1).astype(int)
    out: dict[str, float] = {"problems": p, "n": n}
    out[f"avg@{n}"] = float(samples.correct_PxN.mean())
    for k in ks:
        out[f"pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in correct_P]))
    for k in ks:
        if k > 1:
            out[f"maj@{k}"] = float(
                np.mean([maj_at_k(samples.keys[i], samples.correct_PxN[i], k) for i in range(p)])
            )
    out["no_answer"] = float(np.mean([[key is None for key in row] for row in samples.keys]))
    out["truncated"] = float(samples.truncated_PxN.mean())
    out["length_mean"] = float(samples.lengths_PxN.mean())
    if samples.dropped_PxN is not None and samples.dropped_PxN.any():
        out["dropped"] = int(samples.dropped_PxN.sum())  # scored as wrong answers above
    return out
