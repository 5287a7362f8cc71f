"""LLM-as-a-judge scores S(o) in [1, 10] against a reference demonstration (DaGRPO eq. (7)).

    S(o_i) = F_judge(q, o_i, o_demo),  i = 1..G                      # DaGRPO eq. (7)

The judge grades a response against a reference on three dimensions: correctness of the final
answer, validity of the reasoning, completeness of the logical steps (DaGRPO Sec. 5).

`Judge` is the protocol every judge implements (the OpenAI-compatible `OpenAIJudge` below, the
offline rule judge in `gjax/rewards/rule_judge.py`, user judges):

    async def score(questions, responses, references) -> list[float | None]

batched, one entry per response, each a float in [1, 10] or `None` when no score arrived
(request failed after retries, reply unparseable). A judge never raises for one bad item;
what `None` means for training is decided by `resolve_missing_scores` (the failure policy).

Policies of `OpenAIJudge` (all counted in `stats()`):
  * parsing (`parse_score`): a JSON object with a `score`/`rating`/`grade` key, else the last
    `Score: N` / `Rating: N` / `Grade: N` (markdown, `[[N]]`, `N/10` suffixes allowed), else
    the last `N/10` or `N out of 10`, else a reply that is nothing but a number. `N/D` with
    D != 10 is rescaled to N*10/D. Anything else is unparseable -> `None` (never guessed from
    stray numbers in prose: "the answer 32 is right" must not become a score).
  * out of range (finite values outside [1, 10]): `out_of_range="clamp"` (default; e.g. a
    judge writing `Score: 0` for a hopeless answer gets 1) counted as `clamped`, or
    `"reject"` -> `None` counted as `unparseable`. NaN/inf are always rejected.
  * unparseable replies are not retried (a deterministic judge would answer the same) and
    not cached; failed requests are not cached.
  * retries: 429, 408, 409 and 5xx replies, timeouts and connection errors are retried up to
    `max_retries` times with exponential backoff and jitter, sleeping at least the server's
    `Retry-After` / `retry-after-ms` when given (capped at `max_retry_after_s`). Other 4xx
    (bad request, auth) fail at once. The openai client's own retries are disabled
    (`max_retries=0`) so every HTTP request is counted here.
  * concurrency: at most `max_concurrency` requests in flight per event loop (a semaphore;
    backoff sleeps happen outside it). Each request has a hard deadline of `timeout_s`.
  * cache: keyed by sha256 of (model, messages, sampling parameters); identical requests in
    flight at the same time share one HTTP request (`dedup_hits`).
  * the API key comes from `api_key` or the environment variable `api_key_env`; it is held
    in a wrapper whose repr is `***` and which refuses to be pickled, and it is never logged.
    An `api_key_env` that looks like a key rather than a variable name is refused unshown.
  * authentication: a 401/403 reply means every later request fails the same way, so
    `score` raises `JudgeAuthError` (a user error: fix the key) instead of returning
    scores that never arrived; the pipeline stops the run on it.
  * httpx (under the openai client) logs one INFO line per request; it is set to WARNING.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import email.utils
import hashlib
import inspect
import json
import logging
import math
import os
import random
import re
import string
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from gjax.errors import ConfigError, UserError
from gjax.registry import Registry

log = logging.getLogger(__name__)


class JudgeAuthError(UserError, RuntimeError):
    """The judge endpoint rejected the credentials (HTTP 401/403): no score can arrive."""


# What an API key (not an environment variable NAME) looks like: a vendor prefix, or a long
# token mixing lower case and digits (variable names are conventionally upper case).
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_KEY_PREFIX_RE = re.compile(r"^(sk|pk|rk|gsk|hf|ghp|gho|xai|xoxb|xoxp)[-_]|^AIza")  # case-sensitive


def looks_like_api_key(value: Any) -> bool:
    """True when `value`, meant to NAME an environment variable, looks like a secret itself."""
    if not isinstance(value, str) or not value:
        return False
    if not _ENV_NAME_RE.match(value) or _KEY_PREFIX_RE.match(value):
        return True
    lower = sum(c.islower() for c in value)
    digits = sum(c.isdigit() for c in value)
    return len(value) >= 24 and lower >= 4 and digits >= 4


def _refuse_key_as_env_name(field: str) -> str:
    return (
        f"{field} must be the NAME of an environment variable that holds the judge's API key "
        "(e.g. OPENAI_API_KEY), but its value looks like a key itself (not shown, and not "
        f"written anywhere). Export the key, e.g. `export OPENAI_API_KEY=...`, and set {field} "
        "to the variable's name."
    )


def _quiet_httpx(*extra: str) -> None:
    """httpx logs every request at INFO (~1,000 lines a step at the papers' batch)."""
    for name in ("httpx", "httpcore", *extra):
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:  # a level the user set stays
            logger.setLevel(logging.WARNING)


SCORE_MIN = 1.0
SCORE_MAX = 10.0


@runtime_checkable
class Judge(Protocol):
    """Scores responses in [SCORE_MIN, SCORE_MAX]; `None` = no score arrived for that item.

    Implementations must return a list of the same length as `responses`, never raise for a
    single item, and be safe to call concurrently from one event loop. Optional extras the
    pipeline uses when present: `stats() -> dict[str, float]` (cumulative counters) and
    `async aclose()`.
    """

    async def score(
        self,
        questions: Sequence[str],
        responses: Sequence[str],
        references: Sequence[str],
    ) -> list[float | None]: ...


JUDGES: Registry[Any] = Registry("judge")

# ---------------------------------------------------------------------------------------------
# Prompt (DaGRPO Sec. 5: correctness of the final answer, validity of the reasoning process,
# completeness of the logical steps; the paper does not print its prompt, this is our wording).

DAGRPO_SYSTEM_PROMPT = (
    "You are a careful, strict grader of mathematical solutions. You compare a student's "
    "solution with a verified reference solution and reply with a single overall score."
)

DAGRPO_PROMPT_TEMPLATE = """\
Grade the student's solution to the problem below, using the reference solution as ground truth.

[Problem]
{question}

[Reference solution]
{reference}

[Student solution]
{response}

Judge the student's solution on three criteria:
1. Correctness of the final answer: does it agree with the reference's final answer?
2. Validity of the reasoning: is every step mathematically sound?
3. Completeness of the logical steps: are the necessary steps all present, without unjustified leaps?

Give one overall integer score from 1 to 10: 10 = correct final answer with valid, complete
reasoning; 1 = no meaningful progress. A wrong final answer should not score above 5.
Briefly justify the score, then end your reply with a line of the form "Score: N"."""

_TEMPLATE_FIELDS = ("question", "response", "reference")


def check_template(template: str) -> None:
    """Raises ValueError unless `template` uses exactly {question}, {response}, {reference}."""
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ValueError(f"judge prompt template is not a valid format string: {e}") from None
    unknown = fields - set(_TEMPLATE_FIELDS)
    missing = set(_TEMPLATE_FIELDS) - fields
    if unknown or missing:
        raise ValueError(
            f"judge prompt template must use the fields {{question}}, {{response}}, {{reference}} "
            f"(literal braces doubled as '{{{{'); unknown fields {sorted(unknown)}, "
            f"missing fields {sorted(missing)}"
        )


def clip_text(text: Any, max_chars: int) -> str:
    """UTF-8-safe text of at most ~max_chars: keeps the head and the tail (the final answer)."""
    text = text if isinstance(text, str) else str(text)
    # Lone surrogates / undecodable bytes would make the JSON request body fail to encode.
    text = text.encode("utf-8", "replace").decode("utf-8")
    if max_chars > 0 and len(text) > max_chars:
        half = max_chars // 2
        dropped = len(text) - 2 * half
        text = f"{text[:half]}\n[... {dropped} characters omitted ...]\n{text[len(text) - half :]}"
    return text


# ---------------------------------------------------------------------------------------------
# Score parsing.

_NUM = r"([-+]?\d+(?:\.\d+)?)"
_JSON_OBJ_RE = re.compile(r"\{[^{}]*\}")
_KEYED_RE = re.compile(
    r"\b(?:score|rating|grade)\b[ \t*_]*[:=][ \t*_\[\]\"'`]*"
    + _NUM
    + r"(?:\s*(?:/|out\s+of)\s*(\d+))?",
    re.IGNORECASE,
)
_FRACTION_RE = re.compile(_NUM + r"\s*(?:/|\bout\s+of\b)\s*(\d+)\b", re.IGNORECASE)
_BARE_RE = re.compile(r"^[\s*_\[\]\"'`]*" + _NUM + r"[\s*_\[\]\"'`.]*$")
_JSON_KEYS = ("score", "rating", "grade")


def _scaled(num: str, den: str | None) -> float:
    value = float(num)
    if den and den != "10":
        d = float(den)
        value = value * 10.0 / d if d > 0 else math.nan
    return value


def _raw_score(text: str) -> float | None:
    for match in reversed(_JSON_OBJ_RE.findall(text)):
        try:
            obj = json.loads(match)
        except ValueError:
            continue
        if isinstance(obj, dict):
            for key, value in obj.items():
                if str(key).lower() in _JSON_KEYS:
                    try:
                        return float(value)
                    except (TypeError, ValueError):
                        return None
    keyed = _KEYED_RE.findall(text)
    if keyed:
        return _scaled(*keyed[-1])
    fractions = [(n, d) for n, d in _FRACTION_RE.findall(text) if d == "10"]
    if fractions:
        return _scaled(*fractions[-1])
    bare = _BARE_RE.match(text)
    if bare:
        return float(bare.group(1))
    return None


OUT_OF_RANGE = ("clamp", "reject")


def parse_score(text: str | None, *, out_of_range: str = "clamp") -> tuple[float | None, str]:
    """Score in [1, 10] from a judge reply, and a status: 'ok', 'clamped' or 'unparseable'.

    >>> parse_score("Reasoning is sound.\\nScore: 7")
    (7.0, 'ok')
    >>> parse_score('{"score": 12}')
    (10.0, 'clamped')
    >>> parse_score("The final answer 32 is correct.")
    (None, 'unparseable')
    """
    if out_of_range not in OUT_OF_RANGE:
        raise ValueError(f"out_of_range must be 'clamp' or 'reject', got {out_of_range!r}")
    if not text:
        return None, "unparseable"
    value = _raw_score(text)
    if value is None or not math.isfinite(value):
        return None, "unparseable"
    if SCORE_MIN <= value <= SCORE_MAX:
        return value, "ok"
    if out_of_range == "reject":
        return None, "unparseable"
    return min(max(value, SCORE_MIN), SCORE_MAX), "clamped"


# ---------------------------------------------------------------------------------------------
# Failure policy for scores that never arrived.

ON_MISSING = ("keep", "drop", "fill")


def resolve_missing_scores(
    scores: Sequence[float | None] | np.ndarray,
    *,
    on_missing: str = "keep",
    fill_value: float = 5.5,
    rewards: np.ndarray | None = None,
    valid: np.ndarray | None = None,
    positive_threshold: float = 0.5,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, float]]:
    """Judge scores (None/NaN = missing) -> (scores [B] f32, valid [B] bool, scored [B] bool, metrics).

    The returned scores are finite everywhere (the objective's DaGRPO masks, eqs. (8)-(10),
    must not see NaN); `scored` says which ones came from the judge. Policies:
      * 'keep' (default): the sample stays in training as unscored. Its score is set to the
        extreme consistent with its reward (positive, reward >= positive_threshold -> 10;
        negative -> 1), so it never tightens anyone else's mask: S_min+ (eq. (8)) cannot drop
        because of a 10, S_max- cannot rise because of a 1. A batch with no scores at all
        therefore reduces to the plain binary-reward advantage (no masking for delta <= 9).
        Needs `rewards`.
      * 'drop': the sample is made invalid (valid=False); its score is set to `fill_value`
        only to stay finite.
      * 'fill': the score is `fill_value`; validity unchanged.
    """
    if on_missing not in ON_MISSING:
        raise ValueError(f"on_missing must be one of {ON_MISSING}, got {on_missing!r}")
    raw = np.asarray([np.nan if s is None else s for s in scores], dtype=np.float64).reshape(-1)
    n = raw.shape[0]
    scored = np.isfinite(raw)
    valid = np.ones(n, bool) if valid is None else np.asarray(valid, bool).reshape(-1).copy()
    if valid.shape[0] != n:
        raise ValueError(f"valid has {valid.shape[0]} entries for {n} scores")
    out = np.where(scored, np.clip(raw, SCORE_MIN, SCORE_MAX), fill_value)
    missing = ~scored
    if on_missing == "keep":
        if rewards is None:
            raise ValueError("on_missing='keep' needs the rewards to tell positives from negatives")
        rewards = np.asarray(rewards, np.float64).reshape(-1)
        if rewards.shape[0] != n:
            raise ValueError(f"rewards has {rewards.shape[0]} entries for {n} scores")
        extreme = np.where(rewards >= positive_threshold, SCORE_MAX, SCORE_MIN)
        out = np.where(missing, extreme, out)
    elif on_missing == "drop":
        valid &= scored
    metrics = {
        "judge/missing_fraction": float(missing.mean()) if n else 0.0,
        "judge/missing": float(missing.sum()),
        "judge/dropped": float(missing.sum()) if on_missing == "drop" else 0.0,
    }
    return out.astype(np.float32), valid, scored, metrics


# ---------------------------------------------------------------------------------------------
# Secrets and counters.


class _Secret:
    """An API key that does not show up in repr/str/logs and refuses to be pickled."""

    __slots__ = ("_value",)

    def __init__(self, value: str):
        self._value = value

    def get(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "'***'"

    __str__ = __repr__

    def __reduce__(self):
        raise TypeError("refusing to pickle an API key (it must never reach a checkpoint)")


_COUNTERS = (
    "items",  # responses passed to score()
    "scored",  # items that got a score
    "missing",  # items returned as None
    "cache_hits",  # items served from the cache
    "dedup_hits",  # items that joined an identical request already in flight
    "calls",  # HTTP requests sent (first attempts + retries)
    "retries",  # HTTP requests that were retries
    "failures",  # requests given up (retries exhausted or non-retryable error)
    "unparseable",  # replies that arrived without a valid score
    "clamped",  # out-of-range scores clamped to [1, 10]
    "timeouts",  # attempts that hit the deadline
    "rate_limited",  # attempts answered 429
    "server_errors",  # attempts answered 5xx
    "connection_errors",  # attempts that failed to connect / lost the connection
    "other_errors",  # other failed attempts (4xx, malformed replies)
)


class _Stats:
    def __init__(self, latency_window: int = 4096):
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._latency_sum = 0.0
        self._latency_n = 0
        self._latency_max = 0.0
        self._recent = collections.deque(maxlen=latency_window)

    def add(self, name: str, k: int = 1) -> None:
        with self._lock:
            self._counts[name] += k

    def latency(self, seconds: float) -> None:
        with self._lock:
            self._latency_sum += seconds
            self._latency_n += 1
            self._latency_max = max(self._latency_max, seconds)
            self._recent.append(seconds)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = {k: float(v) for k, v in self._counts.items()}
            recent = np.asarray(self._recent, np.float64)
            out["latency_n"] = float(self._latency_n)
            out["latency_mean_s"] = self._latency_sum / self._latency_n if self._latency_n else 0.0
            out["latency_max_s"] = self._latency_max
            out["latency_p50_s"] = float(np.percentile(recent, 50)) if recent.size else 0.0
            out["latency_p95_s"] = float(np.percentile(recent, 95)) if recent.size else 0.0
        return out


def _retry_after_s(headers: Mapping[str, str] | None) -> float | None:
    """Seconds from `retry-after-ms` or `Retry-After` (seconds or an HTTP date), else None."""
    if not headers:
        return None
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return max(float(ms) / 1000.0, 0.0)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - time.time(), 0.0)


_RETRY_STATUS = frozenset({408, 409, 429})


@dataclasses.dataclass
class _LoopState:
    client: Any
    semaphore: asyncio.Semaphore
    inflight: dict[str, asyncio.Future]


# ---------------------------------------------------------------------------------------------
# The OpenAI-compatible judge.


@JUDGES.register("openai")
class OpenAIJudge:
    """DaGRPO judge (eq. (7)) over any OpenAI-compatible `/v1/chat/completions` endpoint.

    Args:
      model: the judge model name sent to the endpoint.
      base_url: endpoint root, e.g. "http://127.0.0.1:8000/v1" (None = OpenAI's).
      api_key: the key; if None it is read from the environment variable `api_key_env`. With
        neither, a custom `base_url` gets the placeholder "EMPTY" (local servers ignore it);
        OpenAI's own endpoint raises.
      prompt_template / system_prompt: the grading prompt ({question}, {response}, {reference}).
      temperature, max_tokens, extra_body: sampling parameters sent with every request.
      max_concurrency: requests in flight per event loop.
      timeout_s: hard deadline of one HTTP request.
      max_retries: retries after the first attempt (so at most max_retries + 1 requests).
      backoff_base_s, backoff_max_s: delay before retry k (0-based) is
        d = min(backoff_max_s, backoff_base_s * 2**k), drawn uniformly from [d/2, d].
      max_retry_after_s: cap on a server's Retry-After.
      out_of_range: 'clamp' or 'reject' (see `parse_score`).
      max_chars: question/response/reference longer than this are clipped (head + tail).
      cache_size: entries of the content-keyed score cache (0 disables it).
      seed: seed of the jitter RNG.
    """

    def __init__(
        self,
        *,
        model: str,
        base_url: str | None = None,
        api_key: str | None = None,
        api_key_env: str | None = "OPENAI_API_KEY",
        prompt_template: str = DAGRPO_PROMPT_TEMPLATE,
        system_prompt: str | None = DAGRPO_SYSTEM_PROMPT,
        temperature: float = 0.0,
        max_tokens: int = 512,
        extra_body: Mapping[str, Any] | None = None,
        max_concurrency: int = 16,
        timeout_s: float = 60.0,
        max_retries: int = 4,
        backoff_base_s: float = 1.0,
        backoff_max_s: float = 30.0,
        max_retry_after_s: float = 120.0,
        out_of_range: str = "clamp",
        max_chars: int = 24_000,
        cache_size: int = 100_000,
        seed: int | None = None,
    ):
        if not model:
            raise ValueError("OpenAIJudge needs a model name (config key 'model')")
        check_template(prompt_template)
        if out_of_range not in OUT_OF_RANGE:
            raise ValueError(f"out_of_range must be 'clamp' or 'reject', got {out_of_range!r}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if backoff_base_s < 0 or backoff_max_s < 0 or max_retry_after_s < 0:
            raise ValueError("backoff_base_s, backoff_max_s and max_retry_after_s must be >= 0")
        if looks_like_api_key(api_key_env):
            raise ValueError(_refuse_key_as_env_name("api_key_env"))
        _quiet_httpx()
        key = api_key
        if key is None and api_key_env:
            key = os.environ.get(api_key_env) or None
        if key is None:
            if base_url is None or "api.openai.com" in base_url:
                raise ValueError(
                    "OpenAIJudge has no API key: set config 'api_key' or the environment "
                    f"variable named by 'api_key_env' ({api_key_env!r}), or point 'base_url' "
                    "at a server that needs none"
                )
            log.warning(
                "judge at %s: no API key (api_key_env=%r unset); sending a placeholder",
                base_url,
                api_key_env,
            )
            key = "EMPTY"
        self._api_key = _Secret(key)
        self.model = model
        self.base_url = base_url
        self.api_key_env = api_key_env
        self.prompt_template = prompt_template
        self.system_prompt = system_prompt
        self.temperature = float(temperature)
        self.max_tokens = int(max_tokens)
        self.extra_body = dict(extra_body or {})
        self.max_concurrency = int(max_concurrency)
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_base_s = float(backoff_base_s)
        self.backoff_max_s = float(backoff_max_s)
        self.max_retry_after_s = float(max_retry_after_s)
        self.out_of_range = out_of_range
        self.max_chars = int(max_chars)
        self.cache_size = int(cache_size)
        self._rng = random.Random(seed)
        self._stats = _Stats()
        self._auth_error: str | None = None  # set by a 401/403 reply; every later call raises
        self._cache: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._cache_lock = threading.Lock()
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState] = (
            weakref.WeakKeyDictionary()
        )
        self._loops_lock = threading.Lock()

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> OpenAIJudge:
        """From a dict / ConfigDict with the constructor's keyword names; unknown keys raise."""
        config = dict(config.to_dict() if hasattr(config, "to_dict") else config)
        valid = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
        unknown = sorted(set(config) - set(valid))
        if unknown:
            raise ValueError(f"unknown OpenAIJudge config keys {unknown}; valid keys: {valid}")
        return cls(**config)

    def __repr__(self) -> str:
        return (
            f"OpenAIJudge(model={self.model!r}, base_url={self.base_url!r}, "
            f"api_key_env={self.api_key_env!r}, max_concurrency={self.max_concurrency}, "
            f"timeout_s={self.timeout_s}, max_retries={self.max_retries})"
        )

    def __reduce__(self):
        raise TypeError("OpenAIJudge holds an API key and is not picklable; rebuild it from config")

    # -- public API ----------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Cumulative counters (see `_COUNTERS`) and request latency (successful replies)."""
        return self._stats.snapshot()

    def messages(self, question: str, response: str, reference: str) -> list[dict[str, str]]:
        """The chat messages sent for one item."""
        user = self.prompt_template.format_map(
            {
                "question": clip_text(question, self.max_chars),
                "response": clip_text(response, self.max_chars),
                "reference": clip_text(reference, self.max_chars),
            }
        )
        msgs = [{"role": "user", "content": user}]
        if self.system_prompt:
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs

    async def score(
        self,
        questions: Sequence[str],
        responses: Sequence[str],
        references: Sequence[str],
    ) -> list[float | None]:
        """Scores in [1, 10] (None = no score arrived), one per response, in order."""
        n = len(responses)
        if len(questions) != n or len(references) != n:
            raise ValueError(
                f"judge.score needs one question and one reference per response: got "
                f"{len(questions)} questions, {n} responses, {len(references)} references"
            )
        self._stats.add("items", n)
        if self._auth_error is None:
            results = await asyncio.gather(
                *(self._score_one(q, r, ref) for q, r, ref in zip(questions, responses, references))
            )
        if self._auth_error is not None:
            self._stats.add("missing", n)
            raise JudgeAuthError(self._auth_error)
        n_scored = sum(s is not None for s in results)
        self._stats.add("scored", n_scored)
        self._stats.add("missing", n - n_scored)
        return list(results)

    async def aclose(self) -> None:
        """Closes the HTTP client of the running event loop (others are dropped)."""
        loop = asyncio.get_running_loop()
        with self._loops_lock:
            state = self._loops.pop(loop, None)
        if state is not None:
            await state.client.close()

    # -- internals -----------------------------------------------------------------------------

    def _state(self) -> _LoopState:
        # httpx connection pools and asyncio primitives belong to one event loop: one client and
        # one semaphore per loop (the pipeline uses a single loop; tests may use several).
        loop = asyncio.get_running_loop()
        with self._loops_lock:
            state = self._loops.get(loop)
            if state is None:
                import openai  # imported on use: slow to import, only an OpenAI judge needs it

                client = openai.AsyncOpenAI(
                    api_key=self._api_key.get(),
                    base_url=self.base_url,
                    max_retries=0,
                    timeout=self.timeout_s,
                )
                # The client's HTTP library under whatever top-level name it is installed.
                _quiet_httpx(
                    *{k.__module__.partition(".")[0] for k in type(client._client).__mro__}
                    - {"openai", "builtins"}
                )
                state = _LoopState(client, asyncio.Semaphore(self.max_concurrency), {})
                self._loops[loop] = state
        return state

    def _cache_key(self, messages: list[dict[str, str]]) -> str:
        payload = {
            "model": self.model,
            "messages": messages,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "extra_body": self.extra_body,
        }
        blob = json.dumps(payload, sort_keys=True, ensure_ascii=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()

    def _cache_get(self, key: str) -> float | None:
        with self._cache_lock:
            value = self._cache.get(key)
            if value is not None:
                self._cache.move_to_end(key)
            return value

    def _cache_put(self, key: str, value: float) -> None:
        if self.cache_size <= 0:
            return
        with self._cache_lock:
            self._cache[key] = value
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    async def _score_one(self, question: str, response: str, reference: str) -> float | None:
        messages = self.messages(question, response, reference)
        key = self._cache_key(messages)
        cached = self._cache_get(key)
        if cached is not None:
            self._stats.add("cache_hits")
            return cached
        state = self._state()
        leader = state.inflight.get(key)
        if leader is not None:
            self._stats.add("dedup_hits")
            return await asyncio.shield(leader)
        future = asyncio.get_running_loop().create_future()
        state.inflight[key] = future
        try:
            value = await self._request(state, messages)
        except BaseException:
            future.cancel()
            raise
        finally:
            state.inflight.pop(key, None)
        if value is not None:
            self._cache_put(key, value)
        future.set_result(value)
        return value

    def _backoff_s(self, attempt: int, retry_after: float | None) -> float:
        d = min(self.backoff_max_s, self.backoff_base_s * (2.0**attempt))
        delay = d / 2.0 + self._rng.uniform(0.0, d / 2.0)
        if retry_after is not None:
            # Honour the server: never earlier than Retry-After (plus a little jitter).
            floor = min(retry_after, self.max_retry_after_s)
            delay = max(delay, floor + self._rng.uniform(0.0, 0.05 * floor))
        return delay

    async def _request(self, state: _LoopState, messages: list[dict[str, str]]) -> float | None:
        """One item: HTTP attempts with retries. Never raises (except cancellation)."""
        import openai  # imported on use (see above)

        for attempt in range(self.max_retries + 1):
            retry_after = None
            async with state.semaphore:
                self._stats.add("calls")
                if attempt:
                    self._stats.add("retries")
                t0 = time.perf_counter()
                try:
                    async with asyncio.timeout(self.timeout_s):
                        completion = await state.client.chat.completions.create(
                            model=self.model,
                            messages=messages,
                            temperature=self.temperature,
                            max_tokens=self.max_tokens,
                            timeout=self.timeout_s,
                            extra_body=self.extra_body or None,
                        )
                except (TimeoutError, openai.APITimeoutError):
                    kind, retryable, detail = "timeouts", True, f"no reply within {self.timeout_s}s"
                except openai.APIStatusError as e:
                    status = e.status_code
                    retryable = status in _RETRY_STATUS or status >= 500
                    kind = (
                        "rate_limited"
                        if status == 429
                        else "server_errors"
                        if status >= 500
                        else "other_errors"
                    )
                    detail = f"HTTP {status}"
                    retry_after = _retry_after_s(getattr(e.response, "headers", None))
                except openai.APIConnectionError as e:
                    kind, retryable, detail = "connection_errors", True, type(e).__name__
                except Exception as e:  # malformed reply body, validation errors, ...
                    kind, retryable, detail = "other_errors", False, f"{type(e).__name__}: {e}"
                else:
                    self._stats.latency(time.perf_counter() - t0)
                    return self._parse(completion)
            self._stats.add(kind)
            if not retryable or attempt == self.max_retries:
                self._stats.add("failures")
                if detail in ("HTTP 401", "HTTP 403"):
                    log.error(
                        "judge at %s rejected the credentials (%s): check the key in $%s",
                        self.base_url,
                        detail,
                        self.api_key_env,
                    )
                    self._auth_error = (
                        f"the judge at {self.base_url} rejected the credentials ({detail}): "
                        f"check the key in ${self.api_key_env} (config.reward.judge.api_key_env) "
                        "and the endpoint (config.reward.judge.base_url); no judge score can "
                        "arrive, so the run stops here."
                    )
                log.warning(
                    "judge %s at %s: giving up after %d attempt(s): %s",
                    self.model,
                    self.base_url,
                    attempt + 1,
                    detail,
                )
                return None
            delay = self._backoff_s(attempt, retry_after)
            log.debug("judge attempt %d failed (%s); retrying in %.3fs", attempt + 1, detail, delay)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    def _parse(self, completion: Any) -> float | None:
        try:
            text = completion.choices[0].message.content
        except (AttributeError, IndexError, TypeError):
            text = None
        value, status = parse_score(text, out_of_range=self.out_of_range)
        if status == "clamped":
            self._stats.add("clamped")
        elif value is None:
            self._stats.add("unparseable")
            log.debug("judge reply without a score: %r", (text or "")[:200])
        return value


JUDGE_NAMES = ("none", "openai", "rule")  # config.reward.judge.name


def check_config(judge: Any) -> None:
    """Validates `config.reward.judge` (gjax.config.validate asks it, through the rewards'
    hook, before anything is written): raises `ConfigError` naming the field, never echoing a
    key."""
    if judge.name not in JUDGE_NAMES:
        raise ConfigError(
            f"config.reward.judge.name: must be one of {'|'.join(JUDGE_NAMES)}, got {judge.name!r}"
        )
    if judge.on_missing not in ON_MISSING:
        raise ConfigError(
            f"config.reward.judge.on_missing: must be {'|'.join(ON_MISSING)}, got "
            f"{judge.on_missing!r}"
        )
    if looks_like_api_key(judge.api_key_env):
        raise ConfigError(_refuse_key_as_env_name("config.reward.judge.api_key_env"))
    if judge.out_of_range not in OUT_OF_RANGE:
        raise ConfigError(
            f"config.reward.judge.out_of_range: must be clamp|reject, got {judge.out_of_range!r}"
        )
    if judge.noise_std > 0 and judge.name != "rule":
        raise ConfigError(
            f"config.reward.judge.noise_std={judge.noise_std}: the noise model is the rule "
            f"judge's (a study's stand-in for an imperfect judge), and the judge here is "
            f"{judge.name!r}; set reward.judge.name='rule' or noise_std=0"
        )
    if not 0.0 <= judge.max_missing_fraction <= 1.0:
        raise ConfigError(
            "config.reward.judge.max_missing_fraction: must be in [0, 1], got "
            f"{judge.max_missing_fraction}"
        )
    if judge.max_missing_steps < 0:
        raise ConfigError(
            "config.reward.judge.max_missing_steps: must be >= 0 (0: never stop), got "
            f"{judge.max_missing_steps}"
        )


def make_judge(name: str, config: Mapping[str, Any] | None = None) -> Judge:
    """Builds a registered judge: `JUDGES.get(name).from_config(config)` or `(**config)`."""
    factory = JUDGES.get(name)
    config = dict(config or {})
    if hasattr(factory, "from_config"):
        return factory.from_config(config)
    return factory(**config)
