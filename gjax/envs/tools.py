"""Tools an environment lets the policy call: a protocol, a strict registry, the built-ins.

A tool is called with the `arguments` object of a well-formed call (gjax.envs.tool_calls) and
returns its output text, or raises `ToolError(kind, message)`; the environment turns either
into a `<tool_response>` the policy reads (an error as `error (<kind>): <message>`) and counts
errors by kind (`tools/errors/<kind>`). Any other exception a tool raises is counted as
`exception`; none leaves the environment.

Built-ins (`TOOLS`, each built from the `env.*` config section by `build_tool(name, env_cfg)`):
  calculator  {"expression": str}: arithmetic in the sandbox's AST walker (gjax.envs.sandbox);
  python      {"code": str}: a Python snippet with curated builtins in the sandbox;
  search      {"query": str}: BM25 over a local JSONL corpus of {"title", "text"} passages,
              the top `search_top_k` passages, each cut to `search_passage_chars`.
"""

from __future__ import annotations

import collections
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from gjax import paths
from gjax.envs.sandbox import Sandbox
from gjax.errors import ConfigError
from gjax.registry import Registry

# Error kinds, each counted as `tools/errors/<kind>`.
ERROR_KINDS = (
    "malformed",  # the call block is not {"name": str, "arguments": {...}}
    "unknown_tool",  # a name the environment does not offer
    "bad_arguments",  # arguments that do not fit the tool's parameters
    "exception",  # the tool (or the code it ran) raised
    "timeout",  # cut by the time bound
    "memory",  # cut by the memory bound
    "output",  # more output than allowed
    "crash",  # the tool's process died otherwise
)


class ToolError(Exception):
    """A tool call that failed in a way the policy should read; `kind` is in ERROR_KINDS."""

    def __init__(self, kind: str, message: str):
        if kind not in ERROR_KINDS:
            raise ValueError(f"unknown tool error kind {kind!r}; valid kinds: {ERROR_KINDS}")
        super().__init__(message)
        self.kind = kind


class Tool(Protocol):
    """What an environment asks of a tool."""

    name: str

    def schema(self) -> dict[str, Any]:
        """Its function signature for the system prompt's `<tools>` block (OpenAI style)."""
        ...

    def __call__(self, arguments: Mapping[str, Any]) -> str:
        """Runs one call (blocking; environments call it from worker threads); its output,
        or raises ToolError."""
        ...

    def close(self) -> None:
        """Frees what it holds (idempotent)."""
        ...


TOOLS: Registry[Callable[[Any], Tool]] = Registry("tool")


def _string_argument(arguments: Mapping[str, Any], key: str, max_chars: int) -> str:
    if set(arguments) != {key}:
        raise ToolError(
            "bad_arguments", f'takes exactly one argument "{key}", got {sorted(arguments)}'
        )
    value = arguments[key]
    if not isinstance(value, str) or not value.strip():
        raise ToolError("bad_arguments", f'"{key}" must be a non-empty string')
    if len(value) > max_chars:
        raise ToolError("bad_arguments", f'"{key}" is longer than {max_chars} characters')
    return value


def _function(name: str, description: str, param: str, param_doc: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {param: {"type": "string", "description": param_doc}},
                "required": [param],
            },
        },
    }


class SandboxTool:
    """A tool whose argument is code run in a `Sandbox` (modes `calc` and `python`)."""

    def __init__(self, name: str, mode: str, param: str, description: str, sandbox: Sandbox):
        self.name, self._mode, self._param = name, mode, param
        self._description = description
        self.sandbox = sandbox

    def schema(self) -> dict[str, Any]:
        doc = "an arithmetic expression" if self._mode == "calc" else "Python code"
        return _function(self.name, self._description, self._param, doc)

    def __call__(self, arguments: Mapping[str, Any]) -> str:
        source = _string_argument(arguments, self._param, max_chars=16_384)
        result = self.sandbox.run(self._mode, source)
        if result.kind is not None:
            raise ToolError(result.kind, result.error)
        return result.output.rstrip("\n")

    def close(self) -> None:
        self.sandbox.close()


def _sandbox(env_cfg) -> Sandbox:
    return Sandbox(
        timeout_s=env_cfg.tool_timeout_s,
        memory_mb=env_cfg.tool_memory_mb,
        max_output_bytes=env_cfg.tool_output_chars,
        workers=env_cfg.tool_workers,
    )


@TOOLS.register("calculator")
def calculator(env_cfg) -> Tool:
    return SandboxTool(
        "calculator",
        "calc",
        "expression",
        "Evaluates an arithmetic expression (+ - * / // % **, parentheses, sqrt, log, exp, "
        "sin, cos, floor, ceil, factorial, gcd, pi, e) and returns its value.",
        _sandbox(env_cfg),
    )


@TOOLS.register("python")
def python(env_cfg) -> Tool:
    return SandboxTool(
        "python",
        "python",
        "code",
        "Runs a short Python snippet (no imports; `math` is available) and returns what it "
        "prints and the value of its last expression.",
        _sandbox(env_cfg),
    )


# --------------------------------------------------------------------------- search

_TOKEN_RE = re.compile(r"\w+")


def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens (letters, digits, underscore)."""
    return _TOKEN_RE.findall(text.lower())


class BM25:
    """Okapi BM25 over passages: score(q, d) = sum_t idf(t) * f(t,d) (k1 + 1) /
    (f(t,d) + k1 (1 - b + b |d| / avgdl)), idf(t) = ln(1 + (N - n_t + 0.5) / (n_t + 0.5))
    (Robertson & Zaragoza 2009, eq. 3.3 with the non-negative idf of Lucene)."""

    def __init__(self, documents: Sequence[str], *, k1: float = 1.5, b: float = 0.75):
        self.k1, self.b = k1, b
        self._tf = [collections.Counter(tokenize(d)) for d in documents]
        self._len = [sum(tf.values()) for tf in self._tf]
        n = len(documents)
        self._avgdl = sum(self._len) / n if n else 0.0
        df = collections.Counter(t for tf in self._tf for t in tf)
        self._idf = {t: math.log(1 + (n - c + 0.5) / (c + 0.5)) for t, c in df.items()}

    def scores(self, query: str) -> list[float]:
        terms = set(tokenize(query))
        out = []
        for tf, dl in zip(self._tf, self._len):
            s = 0.0
            norm = self.k1 * (1 - self.b + self.b * dl / self._avgdl) if self._avgdl else 0.0
            for t in terms:
                f = tf.get(t, 0)
                if f:
                    s += self._idf[t] * f * (self.k1 + 1) / (f + norm)
            out.append(s)
        return out

    def top(self, query: str, k: int) -> list[tuple[int, float]]:
        """(passage index, score) of the k best passages with a positive score, best first
        (ties: corpus order)."""
        ranked = sorted(
            ((i, s) for i, s in enumerate(self.scores(query)) if s > 0),
            key=lambda x: (-x[1], x[0]),
        )
        return ranked[:k]


def load_corpus(path: str) -> list[dict[str, str]]:
    """A JSONL corpus: one {"title": str, "text": str} object a line (a ConfigError naming
    the line otherwise)."""
    where = f"config.env.search_corpus={path!r}"
    if not path:
        raise ConfigError(
            f"{where}: the search tool needs a corpus: set config.env.search_corpus to a JSONL "
            'file of {"title": ..., "text": ...} passages'
        )
    try:
        lines = paths.resolve(path).read_text().splitlines()
    except (OSError, FileNotFoundError) as e:
        raise ConfigError(f"{where}: cannot read the corpus ({e})") from None
    passages = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"{where}: line {n} is not valid JSON ({e})") from None
        if not (
            isinstance(obj, dict)
            and isinstance(obj.get("title"), str)
            and isinstance(obj.get("text"), str)
        ):
            raise ConfigError(
                f'{where}: line {n} must be an object with string "title" and "text" fields'
            )
        passages.append({"title": obj["title"], "text": obj["text"]})
    if not passages:
        raise ConfigError(f"{where}: the corpus has no passages")
    return passages


class SearchTool:
    """Top-k BM25 lookup over a local corpus; output bounded by k and the passage length."""

    name = "search"

    def __init__(self, passages: Sequence[Mapping[str, str]], *, top_k: int, passage_chars: int):
        if top_k < 1 or passage_chars < 1:
            raise ValueError(f"top_k and passage_chars must be >= 1, got {top_k}, {passage_chars}")
        self.passages = list(passages)
        self.top_k, self.passage_chars = top_k, passage_chars
        self._index = BM25([f"{p['title']} {p['text']}" for p in self.passages])

    def schema(self) -> dict[str, Any]:
        return _function(
            "search",
            f"Searches a local collection of passages and returns the {self.top_k} best matches.",
            "query",
            "the words to look for",
        )

    def __call__(self, arguments: Mapping[str, Any]) -> str:
        query = _string_argument(arguments, "query", max_chars=1_000)
        hits = self._index.top(query, self.top_k)
        if not hits:
            return "no passage matches the query"
        parts = []
        for rank, (i, _) in enumerate(hits, 1):
            p = self.passages[i]
            text = p["text"]
            if len(text) > self.passage_chars:
                text = text[: self.passage_chars] + " ..."
            parts.append(f"[{rank}] {p['title']}\n{text}")
        return "\n\n".join(parts)

    def close(self) -> None:
        pass


@TOOLS.register("search")
def search(env_cfg) -> Tool:
    return SearchTool(
        load_corpus(env_cfg.search_corpus),
        top_k=env_cfg.search_top_k,
        passage_chars=env_cfg.search_passage_chars,
    )


def tool_names(text: str) -> list[str]:
    """`env.tools` ("calculator,search") as names, each checked (a ConfigError listing them)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ConfigError(
            f"config.env.tools={text!r} names no tool; write a comma list of {TOOLS.names()}"
        )
    for n in names:
        if n not in TOOLS:
            raise ConfigError(
                f"config.env.tools: unknown tool {n!r} in {text!r}; valid names: {TOOLS.names()}"
            )
    if len(set(names)) != len(names):
        raise ConfigError(f"config.env.tools={text!r} names a tool twice")
    return names


def build_tool(name: str, env_cfg) -> Tool:
    """The tool `name` of the registry, built from the `env.*` config section."""
    return TOOLS.get(name)(env_cfg)
