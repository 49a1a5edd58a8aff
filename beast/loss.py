"""The IMPALA loss shared by MonoBeast and PolyBeast: V-trace actor-critic.

Rollout indexing (both variants write rollouts this way):
  index t holds the environment's output x_t (frame_t, and reward_t / done_t of
  the step that *led* to x_t) and the behaviour agent's output computed *on*
  x_t (action a_t, the policy mu(.|x_t), baseline).  obs[t] -> action[t].
So the transition t -> t+1 pairs agent keys at t with environment keys at t+1:
agent-side tensors are cut to [:-1] and environment-side tensors to [1:].

The policies (softmax, diagonal Gaussian) are objects of beast/policies.py, built from the
rollout fields that carry their parameters; the loss asks them for log-probabilities and
the entropy, whatever the kind of action.

The loss is the sum of LOSS_TERMS; to add a term, write one function and add it there.
"""

import dataclasses

import torch

from beast import policies
from beast import vtrace


def clip_rewards(rewards, mode):
    """rewards: float32 [T, B]; mode: "abs_one" clips to [-1, 1], "none" keeps them."""
    if mode == "abs_one":
        return rewards.clamp(-1.0, 1.0)
    return rewards


@dataclasses.dataclass(frozen=True)
class LossInputs:
    """What a loss term reads. Built once per step by compute_loss.

    Fields:
      batch: the rollout dict, tensors [T+1, B, ...] (see module docstring),
        including any extra keys the actors recorded.
      learner_outputs: the learner's forward pass over the whole rollout,
        tensors [T+1, B, ...] (floating ones float32), including any extra
        model outputs.
      vtrace_returns: vtrace.VTraceFromLogitsReturns, all float32 [T, B]: vs and
        pg_advantages (targets, no gradient), log_rhos,
        behavior_action_log_probs, target_action_log_probs (with gradient).
      policy: the learner's policy pi over steps 0..T-1 (beast/policies.py: log_prob,
        entropy, ... over [T, B]), with gradient.
      behaviour_policy: the policy mu that acted, over the same steps, from the batch.
      values: float32 [T, B], learner_outputs["baseline"][:-1], with gradient.
    """

    batch: dict
    learner_outputs: dict
    vtrace_returns: vtrace.VTraceFromLogitsReturns
    policy: policies.Policy
    behaviour_policy: policies.Policy
    values: torch.Tensor


# Every term sums over time and batch, as TorchBeast does, so that its
# learning rates carry over.


def pg_loss(flags, inputs):
    """Policy gradient: -sum_t log pi(a_t|x_t) * V-trace advantage_t.

    The advantages are normalized over the batch first as flags.normalize_advantages says.
    With flags.pg_clip = eps > 0, a trust region around the policy that acted, as PPO's
    clipped objective draws it: a sample stops pushing once pi(a_t|x_t) / mu(a_t|x_t) has
    left [1 - eps, 1 + eps] on the side its advantage pushes towards, so a run of batches
    cannot carry an action's probability far from what the actors saw.
    """
    returns = inputs.vtrace_returns
    advantages = policy_advantages(flags, returns)
    eps = flags.pg_clip
    if eps > 0:
        advantages = trust_region(advantages, returns.log_rhos, eps)
    return -(returns.target_action_log_probs * advantages).sum()


def policy_advantages(flags, returns):
    """V-trace's pg_advantages [T, B], normalized over the batch as flags.normalize_advantages
    says: "none", "mean" (less their mean) or "mean_std" (less their mean, over their
    standard deviation).

    The batch's mean advantage is mostly the value's error of the moment, common to every
    action taken; it pushes every sampled action up (or down) together, which moves the
    policy without telling actions apart. Dividing by the standard deviation makes the step's
    size the same whatever the rewards' scale, but in a batch that holds few rewards it also
    blows the value's noise up to the size of a real advantage.
    """
    advantages = returns.pg_advantages
    mode = flags.normalize_advantages
    if mode == "none":
        return advantages
    centred = advantages - advantages.mean()
    if mode == "mean_std":
        return centred / (centred.std() + 1e-8)
    return centred


def outside_trust_region(advantages, log_rhos, eps):
    """True where the ratio pi/mu = exp(log_rhos) is already past 1 + eps (advantage > 0)
    or below 1 - eps (advantage < 0). Args: float32 [T, B] each. Returns bool [T, B]."""
    ratio = log_rhos.detach().exp()
    return ((advantages > 0) & (ratio > 1 + eps)) | ((advantages < 0) & (ratio < 1 - eps))


def trust_region(advantages, log_rhos, eps):
    """The advantages with 0 where outside_trust_region. Args: float32 [T, B] each."""
    outside = outside_trust_region(advantages, log_rhos, eps)
    return torch.where(outside, torch.zeros_like(advantages), advantages)


def baseline_loss(flags, inputs):
    """Value regression towards the V-trace targets; needs flags.baseline_cost."""
    return flags.baseline_cost * 0.5 * ((inputs.vtrace_returns.vs - inputs.values) ** 2).sum()


def entropy_loss(flags, inputs):
    """Negative entropy of pi, so minimising it keeps the policy exploring;
    needs flags.entropy_cost."""
    return -flags.entropy_cost * inputs.policy.entropy_sum()


# The loss is the sum of these terms, each fn(flags, LossInputs) -> scalar
# tensor and logged under fn.__name__. To add a term, write one function and
# add it here.
LOSS_TERMS = (pg_loss, baseline_loss, entropy_loss)


def check_loss_terms(terms):
    """ValueError unless each term's name is a logs.csv column of its own: unique, and not
    total_loss. Checked when this module is imported and when a run starts (Learner)."""
    seen = {"total_loss"}
    for term in terms:
        name = term.__name__
        if name in seen:
            raise ValueError(f"LOSS_TERMS: {name!r} is already a stats entry")
        seen.add(name)


check_loss_terms(LOSS_TERMS)


def loss_inputs(flags, learner_outputs, batch):
    """Cuts the rollout to transitions and runs V-trace: the LossInputs of one batch.

    log_rhos = log pi(a_t|x_t) - log mu(a_t|x_t), the importance weight of the action
    taken. A continuous action in the batch is the unclipped sample, so both log-densities
    are exact (the clipped action the environment saw is a function of the sample).

    Args: as compute_loss.
    """
    transitions = slice(None, -1)
    policy = policies.from_fields(learner_outputs, transitions)
    behaviour_policy = policies.from_fields(batch, transitions)
    values = learner_outputs["baseline"][:-1].float()
    rewards, discounts = _transitions(flags, batch, values)
    actions = batch["action"][:-1]
    target_log_probs = policy.log_prob(actions)
    behaviour_log_probs = behaviour_policy.log_prob(actions)
    log_rhos = target_log_probs - behaviour_log_probs
    returns = vtrace.from_importance_weights(
        log_rhos=log_rhos, discounts=discounts, rewards=rewards, values=values,
        # The value of the last observation bootstraps the returns beyond T.
        bootstrap_value=learner_outputs["baseline"][-1].float())
    returns = vtrace.VTraceFromLogitsReturns(
        vs=returns.vs, pg_advantages=returns.pg_advantages, log_rhos=log_rhos,
        behavior_action_log_probs=behaviour_log_probs, target_action_log_probs=target_log_probs)
    return LossInputs(batch=batch, learner_outputs=learner_outputs, vtrace_returns=returns,
                      policy=policy, behaviour_policy=behaviour_policy, values=values)


def _transitions(flags, batch, values):
    """(rewards, discounts), float32 [T, B] each, of the T transitions of a batch;
    values: float32 [T, B], V(x_t)."""
    rewards = batch["reward"][1:].float()
    scale = flags.reward_scale
    if scale != 1.0:  # skipped at 1, so that unscaled runs pay nothing for it
        rewards = rewards * scale
    rewards = clip_rewards(rewards, flags.reward_clipping)
    # A done at t+1 means x_{t+1} starts a new episode: nothing flows back.
    discounts = (~batch["done"][1:]).float() * flags.discounting
    if "truncated" in batch:
        # x_t is a time limit's final observation: the episode did not end, it was cut.
        # The step t -> t+1 into the next episode is no transition; with the reward V(x_t)
        # and the discount 0 (done at t+1) its V-trace target is V(x_t) exactly, its
        # advantage 0, and the step into x_t bootstraps from V(x_t) as if the episode went on.
        rewards = torch.where(batch["truncated"][:-1], values.detach(), rewards)
    return rewards, discounts


def compute_loss(flags, learner_outputs, batch):
    """The V-trace actor-critic loss for one batch: the sum of LOSS_TERMS.

    The shapes are checked where they enter: the rollout's fields by its schema
    (beast/rollout.py), the model's outputs when the run starts (rollout.Schema.of), the
    [T, B] inputs of V-trace by vtrace.from_importance_weights.

    Args:
      flags: needs discounting, reward_clipping, reward_scale, pg_clip,
        normalize_advantages and whatever the
        terms read (baseline_cost, entropy_cost for the default ones).
      learner_outputs: dict of the learner's forward pass over the whole
        rollout: the policy's fields (policy_logits float32 [T+1, B, A]), baseline
        float32 [T+1, B]; other keys are passed on to the terms.
      batch: the rollout dict (see module docstring): the behaviour policy's fields
        (policy_logits float32 [T+1, B, A]), action int64 [T+1, B], reward float32
        [T+1, B], done bool [T+1, B]; other keys are passed on to the terms.
      With a Gaussian policy (continuous actions), policy_mean and policy_logstd,
      float32 [T+1, B, A] each, take the place of policy_logits in both, and the
      batch's action is float32 [T+1, B, A].

    Returns:
      (total_loss scalar tensor, dict of detached scalar tensors for logging:
      total_loss and one entry per term, keyed by the term's __name__; with
      flags.pg_clip > 0 also pg_clipped, the share of the T x B samples whose advantage
      the trust region set to 0).
    """
    inputs = loss_inputs(flags, learner_outputs, batch)
    losses = [term(flags, inputs) for term in LOSS_TERMS]
    total_loss = sum(losses)
    if total_loss.dim() != 0:  # one look at the sum instead of one per term
        shapes = ", ".join(f"{term.__name__} {tuple(loss.shape)}"
                           for term, loss in zip(LOSS_TERMS, losses) if loss.dim() != 0)
        raise ValueError(f"every loss term must return a scalar; these returned shapes: "
                         f"{shapes}")
    stats = {"total_loss": total_loss.detach()}
    stats.update((term.__name__, loss.detach()) for term, loss in zip(LOSS_TERMS, losses))
    eps = flags.pg_clip
    if eps > 0:
        # How often the trust region binds: the share of the batch's samples it stopped
        # (pg_loss found the same mask; recomputing it costs a few elementwise ops on T x B).
        returns = inputs.vtrace_returns
        stats["pg_clipped"] = outside_trust_region(
            policy_advantages(flags, returns), returns.log_rhos, eps).float().mean()
    return total_loss, stats
