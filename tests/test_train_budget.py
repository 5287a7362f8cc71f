"""`train.max_sampled_tokens`: a run that ends at a matched sampling budget."""

import json
import os

import pytest

from gjax.train import SAMPLED, SampledBudget
from tests.test_train_e2e import EMBEDDED, rows, small_config


def test_the_budget_counts_on_from_the_checkpointed_history(capsys):
    history = [{"step": 1, SAMPLED: 120.0}, {"step": 2, SAMPLED: 80.0}]
    budget = SampledBudget(260, history)
    assert budget.sampled == 200.0 and not budget.spent(2)
    budget.add({SAMPLED: 59.0})
    assert not budget.spent(3)
    budget.add({SAMPLED: 1.0})
    assert budget.spent(4)
    assert capsys.readouterr().out == (
        "step 4: 260 sampled tokens >= train.max_sampled_tokens=260: training ends here.\n"
    )
    off = SampledBudget(0, history)  # no budget: never spent, whatever was sampled
    off.add({})
    assert not off.spent(3)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(EMBEDDED), reason="embedded policy not built")
def test_a_run_ends_at_its_budget_and_a_resume_trains_nothing_more(tmp_path, capsys):
    """A budget of one token ends the run after its first step, as its last: checkpointed,
    evaluated after training; its resume (the budget spent, train.steps not reached) trains
    nothing and keeps the summary; a larger budget on the same workdir trains on."""
    from gjax.train import train

    wd = tmp_path / "budget"
    c = small_config("grpo")
    c.train.steps, c.train.max_sampled_tokens, c.eval.num_samples = 4, 1, 0
    assert train(c, str(wd)) is None
    out = capsys.readouterr().out
    assert "step 1: " in out and "train.max_sampled_tokens=1: training ends here." in out
    assert "held-out accuracy after 1 steps: " in out
    first = rows(wd)
    assert [r["step"] for r in first] == [1] and first[0][SAMPLED] > 0
    assert json.loads((wd / "summary.json").read_text())["steps"] == 1
    assert sorted(os.listdir(wd / "checkpoints")) == ["1"]

    assert train(c, str(wd)) is None  # the resume: nothing left to sample
    tokens = int(first[0][SAMPLED])
    assert (
        f"step 1: {tokens} sampled tokens >= train.max_sampled_tokens=1: nothing to train "
        "(raise --config.train.max_sampled_tokens to train further)."
    ) in capsys.readouterr().out
    assert [r["step"] for r in rows(wd)] == [1]

    c.train.max_sampled_tokens = int(first[0][SAMPLED]) + 1  # one step more
    assert train(c, str(wd)) is None
    assert "step 2: " in capsys.readouterr().out
    assert [r["step"] for r in rows(wd)] == [1, 2]
    assert json.loads((wd / "summary.json").read_text())["steps"] == 2
