"""The IMPALA learner step shared by MonoBeast and PolyBeast: V-trace actor-critic loss.

Rollout indexing (both variants write rollouts this way):
  index t holds the environment's output x_t (frame_t, and reward_t / done_t of
  the step that *led* to x_t) and the behaviour agent's output computed *on*
  x_t (action a_t, policy_logits mu(.|x_t), baseline).  obs[t] -> action[t].
So the transition t -> t+1 pairs agent keys at t with environment keys at t+1:
agent-side tensors are cut to [:-1] and environment-side tensors to [1:].
"""

import contextlib
import dataclasses
import math
import sys
import threading

import torch
import torch.nn.functional as F

from beast import distributed
from beast import rollout
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
      target_logits: float32 [T, B, A], learner_outputs["policy_logits"][:-1];
        None with a Gaussian policy (continuous actions).
      values: float32 [T, B], learner_outputs["baseline"][:-1], with gradient.
      target_mean, target_logstd: with a Gaussian policy, float32 [T, B, A],
        learner_outputs["policy_mean"][:-1] and ["policy_logstd"][:-1]; else None.
    """

    batch: dict
    learner_outputs: dict
    vtrace_returns: vtrace.VTraceFromLogitsReturns
    target_logits: torch.Tensor
    values: torch.Tensor
    target_mean: torch.Tensor = None
    target_logstd: torch.Tensor = None


# log(2 pi) / 2 and log(2 pi e) / 2, the constants of a Gaussian's log-density and entropy.
HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)
HALF_LOG_2PIE = 0.5 * math.log(2 * math.pi * math.e)


def gaussian_log_probs(mean, logstd, actions):
    """log N(actions; mean, exp(logstd)^2) of a diagonal Gaussian, summed over the action dims.

    Args: float32 [T, B, A] each. Returns float32 [T, B], with gradient to mean and logstd.
    """
    z = (actions - mean) * torch.exp(-logstd)
    return -(0.5 * z * z + logstd + HALF_LOG_2PI).sum(dim=-1)


def gaussian_entropy(logstd):
    """The entropy of a diagonal Gaussian, summed over the action dims.

    Args: logstd float32 [T, B, A]. Returns float32 [T, B].
    """
    return (logstd + HALF_LOG_2PIE).sum(dim=-1)


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
    if inputs.target_logits is None:  # a Gaussian policy
        return -flags.entropy_cost * gaussian_entropy(inputs.target_logstd).sum()
    log_policy = F.log_softmax(inputs.target_logits, dim=-1)
    return flags.entropy_cost * (log_policy.exp() * log_policy).sum()


# The loss is the sum of these terms, each fn(flags, LossInputs) -> scalar
# tensor and logged under fn.__name__. To add a term, write one function and
# add it here.
LOSS_TERMS = (pg_loss, baseline_loss, entropy_loss)


def loss_inputs(flags, learner_outputs, batch):
    """Cuts the rollout to transitions and runs V-trace: the LossInputs of one batch.

    Args: as compute_loss.
    """
    if "policy_mean" in learner_outputs:  # a Gaussian policy over continuous actions
        return _gaussian_loss_inputs(flags, learner_outputs, batch)
    # The value of the last observation bootstraps the returns beyond T.
    bootstrap_value = learner_outputs["baseline"][-1]
    target_logits = learner_outputs["policy_logits"][:-1].float()
    values = learner_outputs["baseline"][:-1].float()
    rewards, discounts = _transitions(flags, batch, values)
    returns = vtrace.from_logits(
        behavior_policy_logits=batch["policy_logits"][:-1],
        target_policy_logits=target_logits,
        actions=batch["action"][:-1],
        discounts=discounts,
        rewards=rewards,
        values=values,
        bootstrap_value=bootstrap_value.float(),
    )
    return LossInputs(batch=batch, learner_outputs=learner_outputs,
                      vtrace_returns=returns, target_logits=target_logits,
                      values=values)


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


def _gaussian_loss_inputs(flags, learner_outputs, batch):
    """loss_inputs for a Gaussian policy: V-trace on the log-densities of the actions taken.

    The actions in the batch are the unclipped samples, so log mu(a_t|x_t) and
    log pi(a_t|x_t) are exact, and log_rhos = log pi - log mu is the importance weight of the
    action the environment saw (a clipped action is a function of the sample).
    """
    target_mean = learner_outputs["policy_mean"][:-1].float()
    target_logstd = learner_outputs["policy_logstd"][:-1].float()
    values = learner_outputs["baseline"][:-1].float()
    rewards, discounts = _transitions(flags, batch, values)
    actions = batch["action"][:-1]
    target_log_probs = gaussian_log_probs(target_mean, target_logstd, actions)
    behavior_log_probs = gaussian_log_probs(batch["policy_mean"][:-1], batch["policy_logstd"][:-1],
                                            actions)
    log_rhos = target_log_probs - behavior_log_probs
    returns = vtrace.from_importance_weights(
        log_rhos=log_rhos, discounts=discounts, rewards=rewards, values=values,
        bootstrap_value=learner_outputs["baseline"][-1].float())
    returns = vtrace.VTraceFromLogitsReturns(
        vs=returns.vs, pg_advantages=returns.pg_advantages, log_rhos=log_rhos,
        behavior_action_log_probs=behavior_log_probs, target_action_log_probs=target_log_probs)
    return LossInputs(batch=batch, learner_outputs=learner_outputs, vtrace_returns=returns,
                      target_logits=None, values=values, target_mean=target_mean,
                      target_logstd=target_logstd)


def compute_loss(flags, learner_outputs, batch):
    """The V-trace actor-critic loss for one batch: the sum of LOSS_TERMS.

    Args:
      flags: needs discounting, reward_clipping, reward_scale, pg_clip,
        normalize_advantages and whatever the
        terms read (baseline_cost, entropy_cost for the default ones).
      learner_outputs: dict of the learner's forward pass over the whole
        rollout: policy_logits float32 [T+1, B, A], baseline float32 [T+1, B];
        other keys are passed on to the terms.
      batch: the rollout dict (see module docstring): policy_logits float32
        [T+1, B, A], action int64 [T+1, B], reward float32 [T+1, B], done bool
        [T+1, B]; other keys are passed on to the terms.
      With a Gaussian policy (continuous actions), policy_mean and policy_logstd,
      float32 [T+1, B, A] each, take the place of policy_logits in both, and the
      batch's action is float32 [T+1, B, A].

    Returns:
      (total_loss scalar tensor, dict of detached scalar tensors for logging:
      total_loss and one entry per term, keyed by the term's __name__; with
      flags.pg_clip > 0 also pg_clipped, the share of the T x B samples whose advantage
      the trust region set to 0).
    """
    assert learner_outputs["baseline"].dim() == 2, "baseline must be [T+1, B]"
    policy_key = "policy_mean" if "policy_mean" in learner_outputs else "policy_logits"
    assert learner_outputs[policy_key].dim() == 3, f"{policy_key} must be [T+1, B, A]"
    inputs = loss_inputs(flags, learner_outputs, batch)
    losses = {}
    for term in LOSS_TERMS:
        name = term.__name__
        # The name is the logs.csv column: a clash would hide a term's value.
        if name in losses or name == "total_loss":
            raise ValueError(f"LOSS_TERMS: {name!r} is already a stats entry")
        loss = term(flags, inputs)
        if loss.dim() != 0:
            raise ValueError(f"loss term {name} returned shape {tuple(loss.shape)}, "
                             "expected a scalar")
        losses[name] = loss
    total_loss = sum(losses.values())
    stats = {"total_loss": total_loss.detach()}
    stats.update((name, loss.detach()) for name, loss in losses.items())
    eps = flags.pg_clip
    if eps > 0:
        # How often the trust region binds: the share of the batch's samples it stopped
        # (pg_loss found the same mask; recomputing it costs a few elementwise ops on T x B).
        returns = inputs.vtrace_returns
        stats["pg_clipped"] = outside_trust_region(
            policy_advantages(flags, returns), returns.log_rhos, eps).float().mean()
    return total_loss, stats


def policy_entropy(logits):
    """The mean entropy, in nats, of a softmax policy over a batch's steps; near 0 it has
    turned deterministic, as a policy in a collapse does (bench/learn.py counts those).

    Args: logits float32 [T, B, A]. Returns a scalar tensor, without gradient.
    """
    with torch.no_grad():
        log_policy = F.log_softmax(logits.float(), dim=-1)
        return -(log_policy.exp() * log_policy).sum(dim=-1).mean()


def autocast_context(device, precision):
    """bf16 autocast for the forward pass when asked; V-trace and the losses stay fp32."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def learn_step(flags, model, optimizer, batch, initial_agent_state, average_gradients=None):
    """One optimisation step on one batch; the caller moves the learning-rate schedule.

    Args:
      flags: needs grad_norm_clipping, precision ("fp32" or "bf16") and what
        compute_loss needs.
      model: the learner's model (on the learner device); model(batch, state)
        returns (outputs dict of [T+1, B, ...] tensors, new core state).
      optimizer: a torch optimizer over model's parameters, stepped once.
      batch: rollout dict of tensors [T+1, B, ...] on the learner device.
      initial_agent_state: tuple of the core state before step 0 of each
        rollout (float32 [num_layers, B, hidden] each, or () without a core).
      average_gradients: with several learner ranks, fn(parameters) that replaces
        each gradient by its mean over the ranks (beast/distributed.py), before the
        clipping, so every rank clips, checks and applies the same gradient.

    Returns:
      dict of floats: compute_loss's stats, policy_entropy (a softmax policy's mean entropy
      per step, nats), grad_norm (before clipping) and
      skipped_update (1.0 when the loss or gradient was not finite and the
      weights and optimizer state were left as they were, else 0.0).
    """
    device = next(model.parameters()).device
    with autocast_context(device, flags.precision):
        learner_outputs, _ = model(batch, initial_agent_state)
    learner_outputs = {k: v.float() if v.is_floating_point() else v
                       for k, v in learner_outputs.items()}
    total_loss, stats = compute_loss(flags, learner_outputs, batch)
    if "policy_logits" in learner_outputs:
        stats["policy_entropy"] = policy_entropy(learner_outputs["policy_logits"][:-1])
    optimizer.zero_grad(set_to_none=True)
    total_loss.backward()
    if average_gradients is not None:
        average_gradients(model.parameters())
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), flags.grad_norm_clipping)
    # A non-finite loss or gradient (an infinite reward, a diverged value) must never reach
    # the weights: the update is skipped. Reading the norm is a host sync (a CPU-GPU sync
    # point on a GPU), the one that logging the stats below needs anyway.
    finite = bool(torch.isfinite(grad_norm))
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    stats["grad_norm"] = grad_norm
    stats["skipped_update"] = 0.0 if finite else 1.0
    return {k: float(v) for k, v in stats.items()}


# The flags that the optimizer and its schedule read: RMSprop's hyperparameters (by their
# names in its param_groups) and the schedule's (lr_factor). On a resume each takes effect as
# the flags say, typed or saved (create_optimizer); so does --grad_norm_clipping, which
# learn_step reads at every step.
RMSPROP_FLAGS = {"lr": "learning_rate", "alpha": "alpha", "momentum": "momentum",
                 "eps": "epsilon"}
SCHEDULE_FLAGS = ("learning_rate", "lr_warmup_steps", "total_steps")


def lr_factor(flags, step, steps_per_update):
    """The learning-rate schedule: the factor of --learning_rate for the update that starts
    at environment step `step` (of all learner ranks) and makes `steps_per_update` steps.

    A linear decay to 0 at --total_steps, times a linear warm-up over --lr_warmup_steps.
    It is a function of the step counter and the flags alone, so a resumed run follows the
    schedule of the flags it resumes with: resumed with a longer --total_steps, its rate at
    step s is learning_rate x (1 - s / total_steps) for the new total, the rate of a run
    started with that total, and it decays linearly from there to 0 at the new total. That
    rate is higher than the one before the resume (a jump up, since the old horizon was
    nearer); with a shorter --total_steps it is lower, or 0 past the new total.
    """
    decay = max(0.0, 1.0 - min(step, flags.total_steps) / flags.total_steps)
    if flags.lr_warmup_steps > 0:
        # RMSprop's running mean of squared gradients starts at zero, so its first steps are
        # up to 10x the learning rate per parameter (no bias correction); a warm-up keeps
        # them from throwing the young policy into a deterministic corner. The update is
        # counted at its end, so that the first one does not stand still.
        decay *= min(1.0, (step + steps_per_update) / flags.lr_warmup_steps)
    return decay


def create_optimizer(flags, model, world_size=1, checkpoint=None):
    """RMSprop, as TorchBeast uses it, with the learning rate of lr_factor.

    Args:
      flags: reads RMSPROP_FLAGS' and SCHEDULE_FLAGS' flags, unroll_length and batch_size.
      model: the learner's model, whose parameters it optimizes.
      world_size: the number of learner ranks, each of which makes the same updates.
      checkpoint: on a resume, the checkpoint dict: RMSprop's state (its running mean
        squares, momentum buffers) comes from its optimizer_state_dict, and the schedule
        starts at its step. The hyperparameters are the flags', not the checkpoint's, so a
        flag typed on the resume takes effect and flags.json records what is used.
    Returns (optimizer, scheduler); the scheduler is stepped once per update.
    """
    optimizer = torch.optim.RMSprop(
        model.parameters(), **{name: getattr(flags, flag) for name, flag in RMSPROP_FLAGS.items()})
    start_step = 0 if checkpoint is None else int(checkpoint["step"])

    def lr_lambda(update):
        steps_per_update = flags.unroll_length * flags.batch_size * world_size
        return lr_factor(flags, start_step + update * steps_per_update, steps_per_update)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
        # load_state_dict brought the checkpoint's hyperparameters back: the flags' win.
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
            group.update({name: getattr(flags, flag) for name, flag in RMSPROP_FLAGS.items()})
            group["initial_lr"] = flags.learning_rate
            group["lr"] = lr
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


# ----------------------------------------------------------------------------
# The learner: the model, its optimizer and the step counter.

class Learner:
    """The model being trained, its optimizer and schedule, and the step counter; one lock.

    update() is one learner step; afterwards the acting model (MonoBeast's
    shared-memory copy, PolyBeast's inference replicas) gets the new weights.
    With several learner ranks, the gradients are averaged over them and the step
    counter counts every rank's steps (each rank makes the same number of updates).
    """

    def __init__(self, flags, model, acting_model, checkpoint=None, ranks=None):
        self.flags = flags
        self.model = model
        self.acting_model = acting_model
        self.ranks = ranks or distributed.Single()
        # On a resume: RMSprop's state and the step from the checkpoint, every
        # hyperparameter from the flags (create_optimizer).
        self.optimizer, self.scheduler = create_optimizer(flags, model, self.ranks.world_size,
                                                          checkpoint)
        self.step = 0
        self.skipped_updates = 0  # non-finite updates, all told
        self.skipped_in_a_row = 0
        self.lock = threading.Lock()
        if checkpoint is not None:
            model.load_state_dict(checkpoint["model_state_dict"])
            self.step = int(checkpoint["step"])
        if self.ranks.is_distributed:
            # The same starting weights on every rank, whatever its seed.
            model.load_state_dict(self.ranks.share(self.weights()))
        # The step of the acting model's weights (rollout.POLICY_STEP), beside its
        # state_dict so that checkpoints do not change; shared with MonoBeast's actors.
        acting_model.weights_step = torch.zeros((), dtype=torch.int64).share_memory_()
        self._publish()

    def publish(self):
        """The weights to the acting model again (PolyBeast's new acting process)."""
        with self.lock:
            self._publish()

    def _publish(self):
        """The new weights to the acting model, then their step."""
        self.acting_model.load_state_dict(self.model.state_dict())
        self.acting_model.weights_step.fill_(self.step)

    def update(self, batch, initial_agent_state):
        """flags.epochs updates on a batch [T+1, B, ...] (one by default); returns (step counter
        after it, stats of the last update made).

        An update whose loss or gradient is not finite is skipped, ends the batch's passes and
        is counted (skipped_in_a_row); Run.after_update decides when that ends the run. The
        weights are published when any pass changed them. Returns (step, None)
        without an update once total_steps is reached (another learner thread got there
        first: with several ranks, an extra update would wait forever for the others).
        """
        with self.lock:
            if self.step >= self.flags.total_steps:
                return self.step, None
            average = self.ranks.average_gradients if self.ranks.is_distributed else None
            applied = 0
            for _ in range(self.flags.epochs):
                stats = learn_step(self.flags, self.model, self.optimizer, batch,
                                   initial_agent_state, average)
                if stats["skipped_update"]:
                    break  # the next pass would start from the same weights
                applied += 1
            # Once per batch, skipped or not: the schedule follows environment steps, and
            # every pass over a batch takes the batch's rate.
            self.scheduler.step()
            steps_per_update = (self.flags.unroll_length * self.flags.batch_size *
                                self.ranks.world_size)
            stats["policy_lag"] = policy_lag(batch, self.step, steps_per_update)
            self.step += steps_per_update
            if stats["skipped_update"]:
                self._skipped(stats)
            else:
                self.skipped_in_a_row = 0
            if applied:
                self._publish()
            stats["skipped_updates"] = self.skipped_updates
            stats["learning_rate"] = self.scheduler.get_last_lr()[0]
            return self.step, stats

    def _skipped(self, stats):
        self.skipped_updates += 1
        self.skipped_in_a_row += 1
        losses = ", ".join(f"{k} {v:.4g}" for k, v in stats.items() if "loss" in k)
        print(f"warning: skipped the learner update at step {self.step}: the loss or its "
              f"gradient is not finite ({losses}, grad_norm {stats['grad_norm']:.4g}).",
              file=sys.stderr)

    def weights(self):
        """A CPU copy of the model's weights."""
        with self.lock:
            return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def state_dict(self):
        """The learner's part of a checkpoint."""
        with self.lock:
            return dict(model_state_dict=self.model.state_dict(),
                        optimizer_state_dict=self.optimizer.state_dict(),
                        scheduler_state_dict=self.scheduler.state_dict(),
                        step=self.step)


def policy_lag(batch, step, steps_per_update):
    """How many updates older than the learner's weights at `step` the weights that acted in
    `batch` were, on average over its T transitions (the last of the T+1 steps only
    bootstraps). 0 when every action came from the newest weights."""
    acted = batch[rollout.POLICY_STEP.name][:-1].double().mean().item()
    return (step - acted) / steps_per_update
