"""The IMPALA learner step shared by MonoBeast and PolyBeast: V-trace actor-critic loss.

Rollout indexing (both variants write rollouts this way):
  index t holds the environment's output x_t (frame_t, and reward_t / done_t of
  the step that *led* to x_t) and the behaviour agent's output computed *on*
  x_t (action a_t, policy_logits mu(.|x_t), baseline).  obs[t] -> action[t].
So the transition t -> t+1 pairs agent keys at t with environment keys at t+1:
agent-side tensors are cut to [:-1] and environment-side tensors to [1:].
"""

import contextlib

import torch
import torch.nn.functional as F

from beast import vtrace

AGENT_KEYS = ("policy_logits", "baseline", "action")


def clip_rewards(rewards, mode):
    """rewards: float32 [T, B]; mode: "abs_one" clips to [-1, 1], "none" keeps them."""
    if mode == "abs_one":
        return rewards.clamp(-1.0, 1.0)
    return rewards


def compute_loss(flags, learner_outputs, batch):
    """The V-trace actor-critic loss for one batch.

    Args:
      flags: needs discounting, reward_clipping, baseline_cost, entropy_cost.
      learner_outputs: dict of the learner's forward pass over the whole
        rollout: policy_logits float32 [T+1, B, A], baseline float32 [T+1, B].
      batch: the rollout dict, tensors [T+1, B, ...] (see module docstring).

    Returns:
      (total_loss scalar tensor, dict of scalar tensors for logging).
    """
    assert learner_outputs["baseline"].dim() == 2, "baseline must be [T+1, B]"
    # The value of the last observation bootstraps the returns beyond T.
    bootstrap_value = learner_outputs["baseline"][-1]
    target_logits = learner_outputs["policy_logits"][:-1].float()
    values = learner_outputs["baseline"][:-1].float()
    behaviour_logits = batch["policy_logits"][:-1]
    actions = batch["action"][:-1]
    rewards = clip_rewards(batch["reward"][1:].float(), flags.reward_clipping)
    # A done at t+1 means x_{t+1} starts a new episode: nothing flows back.
    discounts = (~batch["done"][1:]).float() * flags.discounting

    returns = vtrace.from_logits(
        behavior_policy_logits=behaviour_logits,
        target_policy_logits=target_logits,
        actions=actions,
        discounts=discounts,
        rewards=rewards,
        values=values,
        bootstrap_value=bootstrap_value.float(),
    )
    # Sums over time and batch, as TorchBeast does, so that its learning
    # rates carry over.
    pg_loss = -(returns.target_action_log_probs * returns.pg_advantages).sum()
    baseline_loss = flags.baseline_cost * 0.5 * ((returns.vs - values) ** 2).sum()
    log_policy = F.log_softmax(target_logits, dim=-1)
    entropy_loss = flags.entropy_cost * (log_policy.exp() * log_policy).sum()
    total_loss = pg_loss + baseline_loss + entropy_loss
    stats = dict(
        total_loss=total_loss.detach(),
        pg_loss=pg_loss.detach(),
        baseline_loss=baseline_loss.detach(),
        entropy_loss=entropy_loss.detach(),
    )
    return total_loss, stats


def autocast_context(device, precision):
    """bf16 autocast for the forward pass when asked; V-trace and the losses stay fp32."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def learn_step(flags, model, optimizer, scheduler, batch, initial_agent_state):
    """One optimisation step on one batch. Returns a dict of float stats.

    Args:
      model: the learner's model (on the learner device).
      batch: rollout dict of tensors [T+1, B, ...] on the learner device.
      initial_agent_state: tuple of the core state before step 0 of each rollout.
    """
    device = next(model.parameters()).device
    with autocast_context(device, getattr(flags, "precision", "fp32")):
        learner_outputs, _ = model(batch, initial_agent_state)
    learner_outputs = {k: v.float() if v.is_floating_point() else v
                       for k, v in learner_outputs.items()}
    total_loss, stats = compute_loss(flags, learner_outputs, batch)
    optimizer.zero_grad(set_to_none=True)
    total_loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), flags.grad_norm_clipping)
    optimizer.step()
    scheduler.step()
    stats["grad_norm"] = grad_norm
    # One sync point per learner step, for logging.
    return {k: float(v) for k, v in stats.items()}


def create_optimizer(flags, model):
    """RMSprop with TorchBeast's defaults and a learning rate that decays
    linearly to zero at total_steps."""
    optimizer = torch.optim.RMSprop(
        model.parameters(),
        lr=flags.learning_rate,
        momentum=flags.momentum,
        eps=flags.epsilon,
        alpha=flags.alpha,
    )
    steps_per_update = flags.unroll_length * flags.batch_size

    def lr_lambda(update):
        return max(0.0, 1.0 - min(update * steps_per_update, flags.total_steps) / flags.total_steps)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    return optimizer, scheduler


def episode_stats(batch):
    """Returns and lengths of the real games that ended inside the batch.

    Step 0 of a rollout repeats the last step of the previous one, so only
    steps 1..T are counted.
    """
    game_over = batch["game_over"][1:]
    returns = batch["episode_return"][1:][game_over]
    lengths = batch["episode_step"][1:][game_over]
    return returns.tolist(), lengths.tolist()
