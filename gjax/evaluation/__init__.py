"""Evaluation: n samples per problem, scored, and pass@k / avg@n / maj@k of them.

* `metrics`: pass@k, maj@k, `summarize` (pure, over scored samples);
* `sampling`: `sample_and_score`, n completions per problem in fixed-shape batches;
* `heldout`: training's held-out evaluation (`HeldoutEval`, `heldout_metrics`);
* `episodes`: a multi-turn run's held-out samples as episodes of its environment;
* `report`: the per-benchmark markdown table.

The command `python -m gjax.eval` evaluates a checkpoint or a model on the papers' benchmarks.
"""
