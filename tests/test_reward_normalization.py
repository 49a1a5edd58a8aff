"""--normalize_rewards: the rewards the loss sees are divided by the spread of every reward the
learner has seen, against NumPy's standard deviation of all of them, and a resume goes on
from the saved statistics."""

import numpy as np
import pytest
import torch

from beast import learner, reward_normalization, rollout
from test_learner import B, T, TinyModel, make_batch, make_flags, reference_loss_np


def batch_with_rewards(rewards):
    batch = make_batch()
    batch["reward"] = torch.tensor(rewards, dtype=torch.float32)
    batch[rollout.POLICY_STEP.name] = torch.zeros(T + 1, B, dtype=torch.int64)
    return batch


def test_the_statistics_are_those_of_every_reward_seen():
    """Batches of different sizes and scales, merged one at a time, give NumPy's variance of
    their concatenation; the first row of each (no transition's reward) is left out."""
    rng = np.random.default_rng(0)
    normalizer = reward_normalization.RewardNormalizer()
    seen = []
    for rows, scale, shift in [(4, 1.0, 0.0), (81, 50.0, 3.0), (2, 1e-3, -1.0), (21, 7.0, 0.0)]:
        rewards = rng.normal(shift, scale, size=(rows, 5)).astype(np.float32)
        normalizer.normalized(dict(reward=torch.from_numpy(rewards)))
        seen.append(rewards[1:].astype(np.float64))
    seen = np.concatenate(seen)
    assert normalizer.count == seen.size
    np.testing.assert_allclose(normalizer.mean, seen.mean(), rtol=1e-9)
    np.testing.assert_allclose(normalizer.variance, seen.var(), rtol=1e-9)


def test_rewards_are_divided_by_the_standard_deviation_and_nothing_else_changes():
    rewards = [[9.0, 9.0], [0.0, -0.5], [0.0, 2.0], [0.0, 0.0]]
    batch = batch_with_rewards(rewards)
    normalized = reward_normalization.RewardNormalizer().normalized(batch)
    std = np.sqrt(np.var(np.array(rewards)[1:]) + reward_normalization.VARIANCE_FLOOR)
    np.testing.assert_allclose(normalized["reward"].numpy(), np.array(rewards) / std, rtol=1e-6)
    assert torch.equal(batch["reward"], torch.tensor(rewards))  # the batch's own is untouched
    for key in batch.keys() - {"reward"}:
        assert normalized[key] is batch[key]


def test_equal_rewards_are_divided_by_the_floor_not_by_zero():
    """Only still-step penalties so far (no success yet): their spread is 0, and the floor
    bounds what they are multiplied by."""
    normalizer = reward_normalization.RewardNormalizer()
    normalized = normalizer.normalized(batch_with_rewards(np.full((T + 1, B), -1e-5)))
    expected = -1e-5 / np.sqrt(reward_normalization.VARIANCE_FLOOR)
    np.testing.assert_allclose(normalized["reward"].numpy(), expected, rtol=1e-6)


@pytest.mark.parametrize("normalize", [True, False])
def test_the_learner_trains_on_normalized_rewards(normalize):
    """The loss of a Learner update is the reference loss on rewards divided by the spread of
    its batches' rewards so far (the second batch: of both); off, on the rewards as they are."""
    flags = make_flags(unroll_length=T, batch_size=B, total_steps=1000, reward_clipping="none",
                       normalize_rewards=normalize, learning_rate=0.0)
    model = TinyModel()
    learn = learner.Learner(flags, model, TinyModel())
    first = [[0.0, 0.0], [0.5, -0.3], [0.7, -4.0], [-1.5, 1.0]]
    second = [[0.0, 0.0], [20.0, 0.0], [0.0, 0.0], [0.0, -3.0]]
    learn.update(batch_with_rewards(first), ())
    _, stats = learn.update(batch_with_rewards(second), ())
    seen = np.concatenate([np.array(first)[1:], np.array(second)[1:]])
    std = np.sqrt(seen.var() + reward_normalization.VARIANCE_FLOOR) if normalize else 1.0
    batch = batch_with_rewards(np.array(second) / std)
    with torch.no_grad():
        outputs, _ = model(batch, ())
    expected = reference_loss_np(flags, outputs, batch)
    np.testing.assert_allclose(stats["total_loss"], expected["total_loss"], rtol=1e-5)
    assert ("reward_std" in stats) == normalize
    if normalize:
        np.testing.assert_allclose(stats["reward_std"], std, rtol=1e-9)


def test_a_resume_goes_on_from_the_saved_statistics():
    flags = make_flags(unroll_length=T, batch_size=B, total_steps=1000, normalize_rewards=True)
    first = learner.Learner(flags, TinyModel(), TinyModel())
    first.update(batch_with_rewards([[0.0, 0.0], [5.0, 0.0], [0.0, 1.0], [0.0, 0.0]]), ())
    state = first.state_dict()
    assert state["reward_normalizer"]["count"] == T * B
    resumed = learner.Learner(flags, TinyModel(), TinyModel(), checkpoint=state)
    assert resumed.rewards.state_dict() == first.rewards.state_dict()
    off = learner.Learner(make_flags(unroll_length=T, batch_size=B, total_steps=1000,
                                     normalize_rewards=False), TinyModel(), TinyModel())
    assert "reward_normalizer" not in off.state_dict()


def test_a_non_finite_reward_is_left_out_of_the_statistics():
    """An infinite reward costs its own update (skipped by the learner), not the statistics
    that every later update divides by."""
    normalizer = reward_normalization.RewardNormalizer()
    normalizer.normalized(batch_with_rewards([[0.0, 0.0], [1.0, float("inf")], [3.0, float("nan")],
                                              [5.0, 7.0]]))
    np.testing.assert_allclose(normalizer.variance, np.var([1.0, 3.0, 5.0, 7.0]), rtol=1e-9)
    assert normalizer.count == 4
