"""V-trace off-policy correction (IMPALA, Espeholt et al. 2018, section 4).

All tensors are time-major: index [t, b] is step t of batch entry b. For an
unroll of T steps, x_t is the observation that the agent acted on at step t,
a_t ~ mu(.|x_t) the action the behaviour policy (the actor) took there, r_t the
reward of that step and discounts[t] = gamma * (1 - done_{t+1}) the discount
applied to everything after it (0 where the step ended an episode).

The V-trace target for V(x_s) is

    v_s = V(x_s) + sum_{t>=s} (prod_{i=s}^{t-1} discounts[i] * c_i) * delta_t V
    delta_t V = rho_t * (r_t + discounts[t] * V(x_{t+1}) - V(x_t))
    rho_t = min(rho_bar, pi(a_t|x_t) / mu(a_t|x_t)),  c_i = min(1, pi/mu),

with V(x_T) = bootstrap_value. It obeys the recursion

    v_s - V(x_s) = delta_s V + discounts[s] * c_s * (v_{s+1} - V(x_{s+1})),

which is what we compute, backwards from s = T-1. The policy gradient uses
the advantage rho_pg_s * (r_s + discounts[s] * v_{s+1} - V(x_s)), with
rho_pg_s = min(rho_pg_bar, pi/mu) and v_T = bootstrap_value.

Both outputs are targets: they are computed without gradient, so the loss
treats them as constants (as the paper does).
"""

import collections

import torch
import torch.nn.functional as F

VTraceReturns = collections.namedtuple("VTraceReturns", ["vs", "pg_advantages"])

VTraceFromLogitsReturns = collections.namedtuple(
    "VTraceFromLogitsReturns",
    [
        "vs",
        "pg_advantages",
        "log_rhos",
        "behavior_action_log_probs",
        "target_action_log_probs",
    ],
)


def _check_shapes(steps_name, steps, discounts, rewards, values, bootstrap_value):
    """ValueError unless `steps` (log_rhos, or from_logits' actions) is [T, B], discounts,
    rewards and values are [T, B] too and bootstrap_value is [B]. Ranks and sizes are checked
    once, where a public function is entered: a few comparisons of shapes, no device work."""
    if steps.dim() != 2:
        raise ValueError(f"vtrace: {steps_name} must have rank 2 ([T, B]), got shape "
                         f"{tuple(steps.shape)}")
    T, B = steps.shape
    for name, tensor, shape in (("discounts", discounts, (T, B)), ("rewards", rewards, (T, B)),
                                ("values", values, (T, B)),
                                ("bootstrap_value", bootstrap_value, (B,))):
        if tuple(tensor.shape) != shape:
            raise ValueError(f"vtrace: {name} must have shape {shape} ({steps_name} is "
                             f"[T, B] = [{T}, {B}]), got shape {tuple(tensor.shape)}")


def action_log_probs(policy_logits, actions):
    """Log-probability of each taken action under a softmax policy.

    Args:
      policy_logits: float32 [T, B, A], unnormalised log-probabilities.
      actions: int64 [T, B], indices into the last dimension of policy_logits.

    Returns:
      float32 [T, B], log softmax(policy_logits)[t, b, actions[t, b]]. Keeps the
      gradient with respect to policy_logits.
    """
    log_probs = F.log_softmax(policy_logits, dim=-1)
    return log_probs.gather(-1, actions.unsqueeze(-1)).squeeze(-1)


def from_logits(
    behavior_policy_logits,
    target_policy_logits,
    actions,
    discounts,
    rewards,
    values,
    bootstrap_value,
    clip_rho_threshold=1.0,
    clip_pg_rho_threshold=1.0,
):
    """V-trace for softmax policies given by their logits.

    Args:
      behavior_policy_logits: float32 [T, B, A], logits of the policy mu that
        chose the actions (recorded by the actors).
      target_policy_logits: float32 [T, B, A], logits of the policy pi being
        learned (the learner's forward pass).
      actions: int64 [T, B], the actions taken, sampled from mu.
      discounts: float32 [T, B], discount after each step (0 at episode ends).
      rewards: float32 [T, B], reward of each step.
      values: float32 [T, B], the learner's V(x_t).
      bootstrap_value: float32 [B], V(x_T), the value after the last step.
      clip_rho_threshold: float or None, rho_bar for the value targets; None
        means no clipping.
      clip_pg_rho_threshold: float or None, the clip of rho in the policy
        gradient advantage; None means no clipping.

    Returns:
      VTraceFromLogitsReturns with
        vs: float32 [T, B], V-trace value targets (no gradient).
        pg_advantages: float32 [T, B], policy gradient advantages (no gradient).
        log_rhos: float32 [T, B], log(pi(a_t|x_t) / mu(a_t|x_t)).
        behavior_action_log_probs: float32 [T, B], log mu(a_t|x_t).
        target_action_log_probs: float32 [T, B], log pi(a_t|x_t); keeps its
          gradient with respect to target_policy_logits, since the policy
          gradient loss is built from it.
    """
    _check_shapes("actions", actions, discounts, rewards, values, bootstrap_value)
    for name, logits in (("behavior_policy_logits", behavior_policy_logits),
                         ("target_policy_logits", target_policy_logits)):
        if logits.dim() != 3 or logits.shape[:2] != actions.shape:
            raise ValueError(f"vtrace: {name} must have shape [T, B, A] with [T, B] = "
                             f"{list(actions.shape)} (actions), got shape {tuple(logits.shape)}")

    target_action_log_probs = action_log_probs(target_policy_logits, actions)
    behavior_action_log_probs = action_log_probs(behavior_policy_logits, actions)
    log_rhos = target_action_log_probs - behavior_action_log_probs
    vtrace_returns = _from_importance_weights(
        log_rhos=log_rhos,
        discounts=discounts,
        rewards=rewards,
        values=values,
        bootstrap_value=bootstrap_value,
        clip_rho_threshold=clip_rho_threshold,
        clip_pg_rho_threshold=clip_pg_rho_threshold,
    )
    return VTraceFromLogitsReturns(
        vs=vtrace_returns.vs,
        pg_advantages=vtrace_returns.pg_advantages,
        log_rhos=log_rhos,
        behavior_action_log_probs=behavior_action_log_probs,
        target_action_log_probs=target_action_log_probs,
    )


def from_importance_weights(
    log_rhos,
    discounts,
    rewards,
    values,
    bootstrap_value,
    clip_rho_threshold=1.0,
    clip_pg_rho_threshold=1.0,
):
    """V-trace value targets and policy gradient advantages.

    Args:
      log_rhos: float32 [T, B], log(pi(a_t|x_t) / mu(a_t|x_t)), the log
        importance weights of the taken actions.
      discounts: float32 [T, B], discount after each step (0 at episode ends).
      rewards: float32 [T, B], reward of each step.
      values: float32 [T, B], V(x_t) under the current value function.
      bootstrap_value: float32 [B], V(x_T), the value after the last step.
      clip_rho_threshold: float or None, rho_bar for the value targets; None
        means no clipping.
      clip_pg_rho_threshold: float or None, the clip of rho in the policy
        gradient advantage; None means no clipping.

    Returns:
      VTraceReturns with vs (float32 [T, B], the value targets) and
      pg_advantages (float32 [T, B]). Neither carries gradient.
    """
    _check_shapes("log_rhos", log_rhos, discounts, rewards, values, bootstrap_value)
    return _from_importance_weights(log_rhos, discounts, rewards, values, bootstrap_value,
                                    clip_rho_threshold, clip_pg_rho_threshold)


@torch.no_grad()
def _from_importance_weights(log_rhos, discounts, rewards, values, bootstrap_value,
                             clip_rho_threshold, clip_pg_rho_threshold):
    """from_importance_weights on inputs whose shapes were checked."""
    rhos = torch.exp(log_rhos)
    if clip_rho_threshold is not None:
        clipped_rhos = torch.clamp(rhos, max=clip_rho_threshold)
    else:
        clipped_rhos = rhos
    # The trace cutting c_i uses c_bar = 1, as in the paper's experiments.
    cs = torch.clamp(rhos, max=1.0)

    # V(x_{t+1}) for every t, with the bootstrap value after the last step.
    values_t_plus_1 = torch.cat([values[1:], bootstrap_value.unsqueeze(0)], dim=0)
    deltas = clipped_rhos * (rewards + discounts * values_t_plus_1 - values)

    # Backward recursion: vs_minus_values[s] = deltas[s] + discounts[s] * cs[s]
    # * vs_minus_values[s + 1], with vs_minus_values[T] = 0. Everything
    # elementwise is precomputed above; the loop does one in-place fused
    # multiply-add per step on views of a single buffer, which costs about half
    # of building a list and stacking it (T = 80 runs on every learner step).
    vs_minus_values = deltas.clone()
    decay = discounts * cs
    acc_rows = vs_minus_values.unbind(0)
    decay_rows = decay.unbind(0)
    for t in range(len(acc_rows) - 2, -1, -1):
        acc_rows[t].addcmul_(decay_rows[t], acc_rows[t + 1])
    vs = vs_minus_values + values

    vs_t_plus_1 = torch.cat([vs[1:], bootstrap_value.unsqueeze(0)], dim=0)
    if clip_pg_rho_threshold is not None:
        clipped_pg_rhos = torch.clamp(rhos, max=clip_pg_rho_threshold)
    else:
        clipped_pg_rhos = rhos
    pg_advantages = clipped_pg_rhos * (rewards + discounts * vs_t_plus_1 - values)

    return VTraceReturns(vs=vs, pg_advantages=pg_advantages)
