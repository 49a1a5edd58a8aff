"""Rewards divided by the running standard deviation of every reward the learner has seen,
as the NLE paper's IMPALA baseline learns NetHack (--normalize_rewards).

A task's payoff then has the same size to the loss whatever its units: Staircase's success
of 1 among still-step penalties of -0.00001, or NetHackScore's jumps of 4 for a kill and 50
for a new level. The entropy cost, the value loss and the gradient clip are sized for
rewards of about that spread. The statistic covers all the rewards of the run so far, not a
window, so it settles as the run goes on; it is saved in the checkpoint and a resume goes on
from it.

    Learner.update: batch["reward"] [T+1, B] --RewardNormalizer.normalized--> reward / std,
    which loss.py then scales by --reward_scale and clips by --reward_clipping.
"""

import math

import torch

# Added to the variance, as Gymnasium's NormalizeReward does, so that a run whose rewards
# so far are all equal (no success yet among constant penalties) divides by at most
# 1 / sqrt(VARIANCE_FLOOR) and never by zero.
VARIANCE_FLOOR = 1e-8


class RewardNormalizer:
    """The running mean and variance of the rewards of every transition given to it."""

    def __init__(self):
        self.count = 0
        self.mean = 0.0
        self.variance = 0.0

    def std(self):
        return math.sqrt(self.variance + VARIANCE_FLOOR)

    def update(self, rewards):
        """Adds float rewards (any shape) to the statistics; Chan et al.'s merge of two sets'
        moments, so that the result is the variance of every finite reward seen, in float64."""
        rewards = rewards.detach().double()
        # A non-finite reward is left out, so that it costs only its own update (which the
        # learner skips) and not every later one's statistics.
        rewards = rewards[torch.isfinite(rewards)]
        count = rewards.numel()
        if count == 0:
            return
        mean = rewards.mean().item()
        variance = rewards.var(unbiased=False).item()
        total = self.count + count
        delta = mean - self.mean
        self.variance = (self.variance * self.count + variance * count +
                         delta * delta * self.count * count / total) / total
        self.mean += delta * count / total
        self.count = total

    def normalized(self, batch):
        """The batch with its T transitions' rewards (reward[1:]) added to the statistics and
        every reward divided by the standard deviation that results; the other fields are
        the batch's own tensors."""
        rewards = batch["reward"]
        self.update(rewards[1:])
        return dict(batch, reward=rewards / self.std())

    def state_dict(self):
        return dict(count=self.count, mean=self.mean, variance=self.variance)

    def load_state_dict(self, state):
        self.count = int(state["count"])
        self.mean = float(state["mean"])
        self.variance = float(state["variance"])
