"""Evaluation reports: the per-benchmark markdown table."""

from __future__ import annotations

from collections.abc import Mapping


def markdown_table(results: Mapping[str, Mapping[str, float]]) -> str:
    """One row per benchmark: problems, n, greedy, avg@n, pass@k..., maj@n; and `dropped`
    (samples a serving backend dropped, scored as wrong) where any benchmark has some."""

    def order(col: str) -> tuple:
        name, _, k = col.partition("@")
        rank = {"problems": 0, "n": 1, "greedy": 2, "avg": 3, "pass": 4, "maj": 5, "dropped": 6}
        return (rank.get(name, 9), int(k) if k.isdigit() else 0)

    cols: list[str] = []
    for m in results.values():
        n = int(m["n"])
        for c in m:
            shown = not c.startswith("maj@") or c == f"maj@{n}"
            if shown and c not in ("no_answer", "truncated", "length_mean") and c not in cols:
                cols.append(c)
    cols = sorted(cols, key=order) + ["no_answer", "truncated", "length_mean"]

    def fmt(c, v):
        if v is None:
            return ""
        if c in ("problems", "n", "dropped"):
            return str(int(v))
        return f"{v:.1f}" if c == "length_mean" else f"{100 * v:.1f}"

    lines = [
        "| benchmark | " + " | ".join(cols) + " |",
        "| --- | " + " | ".join("---" for _ in cols) + " |",
    ]
    for name, m in results.items():
        row = {"dropped": 0, **m}  # a benchmark without drops, in a table with some
        lines.append(f"| {name} | " + " | ".join(fmt(c, row.get(c)) for c in cols) + " |")
    return "\n".join(lines) + "\n\n(accuracies in %; length_mean in new tokens)\n"
