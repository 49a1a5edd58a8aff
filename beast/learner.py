"""The IMPALA learner shared by MonoBeast and PolyBeast: the optimisation step on a batch,
the optimizer and its schedule, and the Learner that holds them with the step counter.

The loss itself, V-trace actor-critic as a list of terms, is beast/loss.py.
"""

import contextlib
import sys
import threading

import torch

from beast import distributed
from beast import loss
from beast import policies
from beast import reward_normalization
from beast import rollout


def autocast_context(device, precision):
    """bf16 autocast for the forward pass when asked; V-trace and the losses stay fp32."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def forward_loss(flags, model, batch, initial_agent_state):
    """The learner's forward pass in flags.precision and the loss on it: (total_loss with
    gradient, loss.compute_loss's stats, the model's outputs as float32)."""
    device = next(model.parameters()).device
    with autocast_context(device, flags.precision):
        learner_outputs, _ = model(batch, initial_agent_state)
    learner_outputs = {k: v.float() if v.is_floating_point() else v
                       for k, v in learner_outputs.items()}
    total_loss, stats = loss.compute_loss(flags, learner_outputs, batch)
    return total_loss, stats, learner_outputs


def learn_step(flags, model, optimizer, batch, initial_agent_state, average_gradients=None):
    """One optimisation step on one batch; the caller moves the learning-rate schedule.

    Args:
      flags: needs grad_norm_clipping, precision ("fp32" or "bf16") and what
        loss.compute_loss needs.
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
      dict of floats: loss.compute_loss's stats, the policy's own (policies.Policy.stats: a
      softmax policy's policy_entropy, its mean entropy per step in nats), grad_norm
      (before clipping) and skipped_update (1.0 when the loss or gradient was not finite
      and the weights and optimizer state were left as they were, else 0.0).
    """
    total_loss, stats, learner_outputs = forward_loss(flags, model, batch, initial_agent_state)
    stats.update(policies.from_fields(learner_outputs, slice(None, -1)).stats())
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


# The flags that each optimizer and its schedule read: the optimizer's hyperparameters (by
# their names in its param_groups) and the schedule's (lr_factor). On a resume each takes effect
# as the flags say, typed or saved (create_optimizer); so does --grad_norm_clipping, which
# learn_step reads at every step.
OPTIMIZERS = {
    "rmsprop": (torch.optim.RMSprop, {"lr": "learning_rate", "alpha": "alpha",
                                      "momentum": "momentum", "eps": "epsilon"}),
    "adam": (torch.optim.Adam, {"lr": "learning_rate", "eps": "epsilon"}),
}
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
    """The optimizer of --optimizer (RMSprop, as TorchBeast uses it, or Adam), with the
    learning rate of lr_factor.

    Args:
      flags: reads --optimizer, its OPTIMIZERS flags, SCHEDULE_FLAGS' flags, unroll_length
        and batch_size.
      model: the learner's model, whose parameters it optimizes.
      world_size: the number of learner ranks, each of which makes the same updates.
      checkpoint: on a resume, the checkpoint dict: the optimizer's state (running mean
        squares, moments) comes from its optimizer_state_dict, and the schedule starts at its
        step. The hyperparameters are the flags', not the checkpoint's, so a flag typed on
        the resume takes effect and flags.json records what is used. A resume that types
        another --optimizer keeps the weights and starts the new optimizer's state afresh.
    Returns (optimizer, scheduler); the scheduler is stepped once per update.
    """
    optimizer_class, hyperparameter_flags = OPTIMIZERS[flags.optimizer]

    def hyperparameters():
        return {name: getattr(flags, flag) for name, flag in hyperparameter_flags.items()}

    optimizer = optimizer_class(model.parameters(), **hyperparameters())
    start_step = 0 if checkpoint is None else int(checkpoint["step"])

    def lr_lambda(update):
        steps_per_update = flags.unroll_length * flags.batch_size * world_size
        return lr_factor(flags, start_step + update * steps_per_update, steps_per_update)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    if checkpoint is not None and saved_optimizer(checkpoint) == flags.optimizer:
        optimizer.load_state_dict(checkpoint["optimizer_state_dict"])
        # load_state_dict brought the checkpoint's hyperparameters back: the flags' win.
        for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
            group.update(hyperparameters())
            group["initial_lr"] = flags.learning_rate
            group["lr"] = lr
    return optimizer, scheduler


def saved_optimizer(checkpoint):
    """The --optimizer a checkpoint was trained with; runs saved before the flag used RMSprop."""
    return checkpoint.get("flags", {}).get("optimizer", "rmsprop")


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
        # Once per run, not per step: the terms' names are their logs.csv columns.
        loss.check_loss_terms(loss.LOSS_TERMS)
        # On a resume: RMSprop's state and the step from the checkpoint, every
        # hyperparameter from the flags (create_optimizer).
        self.optimizer, self.scheduler = create_optimizer(flags, model, self.ranks.world_size,
                                                          checkpoint)
        self.step = 0
        self.skipped_updates = 0  # non-finite updates, all told
        self.skipped_in_a_row = 0
        self.lock = threading.Lock()
        # --normalize_rewards: each rank keeps the statistics of its own batches.
        self.rewards = reward_normalization.RewardNormalizer() if flags.normalize_rewards else None
        if checkpoint is not None:
            model.load_state_dict(checkpoint["model_state_dict"])
            self.step = int(checkpoint["step"])
            if self.rewards is not None and "reward_normalizer" in checkpoint:
                self.rewards.load_state_dict(checkpoint["reward_normalizer"])
        if self.ranks.is_distributed:
            # The same starting weights on every rank, whatever its seed.
            model.load_state_dict(self.ranks.share(self.weights()))
        # The learner step of the acting model's weights, which the actors write beside each
        # action (rollout.POLICY_STEP): int64 [], in shared memory, published after the
        # weights, so that it never names newer weights than those that acted.
        self.weights_step = torch.zeros((), dtype=torch.int64).share_memory_()
        self._publish()

    def publish(self):
        """The weights to the acting model again (PolyBeast's new acting process)."""
        with self.lock:
            self._publish()

    def _publish(self):
        """The new weights to the acting model, then their step."""
        self.acting_model.load_state_dict(self.model.state_dict())
        self.weights_step.fill_(self.step)

    def update(self, batch, initial_agent_state):
        """flags.epochs updates on a batch [T+1, B, ...] (one by default); returns (step counter
        after it, stats of the last update made).

        An update whose loss or gradient is not finite is skipped, ends the batch's passes and
        is counted (skipped_in_a_row); Run.record decides when that ends the run. The
        weights are published when any pass changed them. Returns (step, None)
        without an update once total_steps is reached (another learner thread got there
        first: with several ranks, an extra update would wait forever for the others).
        """
        with self.lock:
            if self.step >= self.flags.total_steps:
                return self.step, None
            average = self.ranks.average_gradients if self.ranks.is_distributed else None
            if self.rewards is not None:
                batch = self.rewards.normalized(batch)
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
            if self.rewards is not None:
                stats["reward_std"] = self.rewards.std()
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
            state = dict(model_state_dict=self.model.state_dict(),
                         optimizer_state_dict=self.optimizer.state_dict(),
                         scheduler_state_dict=self.scheduler.state_dict(),
                         step=self.step)
            if self.rewards is not None:
                state["reward_normalizer"] = self.rewards.state_dict()
            return state


def policy_lag(batch, step, steps_per_update):
    """How many updates older than the learner's weights at `step` the weights that acted in
    `batch` were, on average over its T transitions (the last of the T+1 steps only
    bootstraps). 0 when every action came from the newest weights."""
    acted = batch[rollout.POLICY_STEP.name][:-1].double().mean().item()
    return (step - acted) / steps_per_update
