"""The papers' math test sets: where each lives on the Hub and which columns it uses.

The table is ``gjax.data.benchmarks``' (``python -m gjax.eval --benchmarks``); training's
``data.heldout_source`` names the same sets (``math500``, ``aime24``, ...).
"""

from __future__ import annotations

import dataclasses

from gjax.registry import Registry


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """Where a test set lives and how its rows map to (problem, answer)."""

    name: str
    hub_id: str
    split: str
    problem_field: str
    answer_field: str
    size: int  # rows of the published set (a loaded copy of another size is reported)
    num_samples: int  # the papers' n per problem
    subset: str | None = None


BENCHMARKS: Registry[Benchmark] = Registry("benchmark")
HELDOUT = "heldout"  # the embedded task's held-out split (needs no download)

for _b in (
    Benchmark("math500", "HuggingFaceH4/MATH-500", "test", "problem", "answer", 500, 4),
    Benchmark("aime24", "HuggingFaceH4/aime_2024", "train", "problem", "answer", 30, 32),
    Benchmark("aime25", "math-ai/aime25", "test", "problem", "answer", 30, 32),
    Benchmark("amc23", "knoveleng/AMC-23", "train", "problem", "answer", 40, 32),
    Benchmark("minerva", "knoveleng/Minerva-Math", "train", "problem", "solution", 272, 4),
    Benchmark("olympiadbench", "knoveleng/OlympiadBench", "train", "question", "answer", 675, 4),
):
    BENCHMARKS.add(_b.name, _b)
HELDOUT_NUM_SAMPLES = 8
