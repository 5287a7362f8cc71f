"""Host-side group handling: selection (DAPO dynamic sampling, GPG beta_th), anchors, layout."""

import numpy as np
import pytest

from gjax.experience import Groups, append_anchors, select_groups, to_model_inputs


def make_groups(rewards_PxG, *, S=3, N=4, seed=0):
    rewards_PxG = np.asarray(rewards_PxG, np.float32)
    P, G = rewards_PxG.shape
    rng = np.random.default_rng(seed)
    prompt_mask = np.ones((P, S), bool)
    prompt_mask[:, 0] = False  # one left pad
    comp_mask = np.ones((P, G, N), bool)
    comp_mask[..., -1] = False  # EOS at N-2, then one pad
    return Groups(
        prompt_ids_PxS=rng.integers(2, 50, (P, S)).astype(np.int32),
        prompt_mask_PxS=prompt_mask,
        completion_ids_PxGxN=rng.integers(2, 50, (P, G, N)).astype(np.int32),
        completion_mask_PxGxN=comp_mask,
        truncated_PxG=np.zeros((P, G), bool),
        is_anchor_PxG=np.zeros((P, G), bool),
        rewards_PxG=rewards_PxG,
        scores_PxG=np.full((P, G), np.nan, np.float32),
        valid_PxG=np.ones((P, G), bool),
    )


def test_select_dynamic_sampling_keeps_informative_groups_first():
    # groups 0 and 2 are zero-variance; 1 and 3 informative.
    g = make_groups([[1, 1], [0, 1], [0, 0], [1, 0]])
    batch, carried = select_groups(
        g, 2, min_valid_fraction=1.0, drop_zero_variance=True, final_round=False
    )
    np.testing.assert_array_equal(batch.rewards_PxG, [[0, 1], [1, 0]])
    assert batch.valid_PxG.all() and carried.num_prompts == 0


def test_select_carries_over_until_threshold_then_fills():
    g = make_groups([[1, 1], [0, 1], [0, 0], [1, 1]])  # 1 informative of 4
    batch, carried = select_groups(
        g, 4, min_valid_fraction=0.5, drop_zero_variance=False, final_round=False
    )
    assert batch is None and carried.num_prompts == 1
    more = Groups.concat([carried, make_groups([[0, 1], [1, 1], [0, 0], [0, 0]], seed=1)])
    batch, carried = select_groups(
        more, 4, min_valid_fraction=0.5, drop_zero_variance=False, final_round=False
    )
    # 2 informative of 4 = 0.5 >= beta_th: informative first, then zero-variance filler kept
    # valid (GPG counts them in B for alpha = B/(B-M)).
    assert batch is not None and carried.num_prompts == 0
    np.testing.assert_array_equal(batch.rewards_PxG[:2], [[0, 1], [0, 1]])
    assert batch.valid_PxG.all()


def test_select_final_round_fills_and_dapo_invalidates_filler():
    g = make_groups([[1, 1], [0, 1], [0, 0]])
    batch, _ = select_groups(
        g, 3, min_valid_fraction=1.0, drop_zero_variance=True, final_round=True
    )
    assert batch.valid_PxG[0].all() and not batch.valid_PxG[1:].any()


def test_zero_variance_ignores_invalid_samples():
    g = make_groups([[1, 0], [1, 1]])
    g.valid_PxG[0, 1] = False  # only one valid sample left: zero variance
    batch, carried = select_groups(
        g, 1, min_valid_fraction=1.0, drop_zero_variance=True, final_round=False
    )
    assert batch is None and carried.num_prompts == 0


def test_append_anchors_marks_and_extends_groups():
    g = make_groups([[0, 0], [1, 0]])
    ids = np.full((2, 1, 4), 7, np.int32)
    mask = np.ones((2, 1, 4), bool)
    mixed = append_anchors(g, ids, mask)
    assert mixed.completion_ids_PxGxN.shape == (2, 3, 4)
    np.testing.assert_array_equal(mixed.is_anchor_PxG, [[0, 0, 1], [0, 0, 1]])
    assert np.isnan(mixed.scores_PxG[:, 2]).all() and mixed.valid_PxG.all()


def test_to_model_inputs_alignment():
    g = make_groups([[0, 1]], S=3, N=4)
    x = to_model_inputs(g)
    B, S_total = x["input_ids_BxS"].shape
    assert (B, S_total) == (2, 7)
    # Row b = p*G + g; completion tokens follow the prompt, and the targets_BxT are exactly
    # the tokens at positions S .. S+N-1 (predicted by hidden states at S-1 .. S+N-2).
    np.testing.assert_array_equal(x["input_ids_BxS"][:, 3:], x["targets_BxT"])
    np.testing.assert_array_equal(x["input_ids_BxS"][1, :3], g.prompt_ids_PxS[0])
    np.testing.assert_array_equal(x["segment_ids_BxS"][0], [0, 1, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(x["positions_BxS"][0], [0, 0, 1, 2, 3, 4, 4])
    np.testing.assert_array_equal(x["loss_mask_BxT"][0], [1, 1, 1, 0])


def test_to_model_inputs_overlong_filter_and_invalid():
    g = make_groups([[0, 1, 1]])
    g.truncated_PxG[0, 1] = True
    g.valid_PxG[0, 2] = False
    kept = to_model_inputs(g)["loss_mask_BxT"].sum(1)
    dropped = to_model_inputs(g, drop_truncated=True)["loss_mask_BxT"].sum(1)
    np.testing.assert_array_equal(kept, [3, 3, 0])
    np.testing.assert_array_equal(dropped, [3, 0, 0])


@pytest.mark.parametrize("P", [1, 3])
def test_take_and_concat_roundtrip(P):
    g = make_groups(np.zeros((P, 2)))
    both = Groups.concat([g, g])
    assert both.num_prompts == 2 * P
    np.testing.assert_array_equal(both.take(np.arange(P)).prompt_ids_PxS, g.prompt_ids_PxS)
