"""The policies: what the model's head gives, what acting samples and what the loss reads.

A policy kind is one class. Its instance is the distribution pi(.|x_t) of a batch of steps,
built from the rollout fields that carry its parameters (FIELDS); its class methods build
and read the model's policy head. The loss asks it for log-probabilities and the entropy,
acting for a sample or the greedy action, whatever the kind:

    Categorical       a Discrete action space: softmax(policy_logits [..., A]);
                      actions int64 [...]
    DiagonalGaussian  a Box action space of A dimensions: N(policy_mean, exp(policy_logstd)^2)
                      per dimension, [..., A] each; actions float32 [..., A]

To add a kind, write a class with the same methods and add it to POLICIES.
"""

import math

import torch
from torch import nn
from torch.nn import functional as F

# log(2 pi) / 2 and log(2 pi e) / 2, the constants of a Gaussian's log-density and entropy.
HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)
HALF_LOG_2PIE = 0.5 * math.log(2 * math.pi * math.e)

# The Gaussian policy's initial log-std: std 1 in the policy's [-1, 1] action units, i.e.
# half of each action range, so that the first episodes try the whole range.
INITIAL_LOGSTD = 0.0


class Policy:
    """What every policy kind provides. Tensors [...] are any leading dims ([T, B] in the
    loss, [T*B] in the model's forward); the policy's own dims follow them.

    FIELDS: the names of the rollout fields that hold its parameters, in the order its
    constructor takes them.
    """

    FIELDS = ()

    def log_prob(self, actions):
        """log pi(actions), float32 [...]; with gradient to the parameters."""
        raise NotImplementedError

    def entropy(self):
        """The entropy of pi at each step, float32 [...], in nats; with gradient."""
        raise NotImplementedError

    def entropy_sum(self):
        """entropy() summed over every step: a scalar, with gradient."""
        return self.entropy().sum()

    def sample(self):
        """An action per step, drawn from pi (train mode)."""
        raise NotImplementedError

    def mode(self):
        """The most likely action per step (eval mode: evaluation, --mode test)."""
        raise NotImplementedError

    def fields(self):
        """The parameters by their rollout field names: {name: tensor [..., *shape]}."""
        return {name: getattr(self, name) for name in self.FIELDS}

    def stats(self):
        """Detached scalars that logs.csv shows for this kind of policy, by column name."""
        return {}

    @staticmethod
    def action_features(actions, num_actions):
        """The actions [T, B, ...] as the core's input, float32 [T*B, num_actions]."""
        raise NotImplementedError

    @staticmethod
    def init_head(model):
        """Sets up the model's head for this policy: model.policy (a Linear layer onto
        num_actions) is there; a kind may change its initial weights or add parameters."""

    @classmethod
    def from_head(cls, model, core_output):
        """The policy that the model's head gives on core outputs [N, F], over N steps."""
        raise NotImplementedError


class Categorical(Policy):
    """A softmax policy over A discrete actions. policy_logits: float32 [..., A],
    unnormalised log-probabilities; actions int64 [...], indices into them."""

    FIELDS = ("policy_logits",)

    def __init__(self, policy_logits):
        self.policy_logits = policy_logits

    def log_prob(self, actions):
        log_policy = F.log_softmax(self.policy_logits, dim=-1)
        return log_policy.gather(-1, actions.unsqueeze(-1)).squeeze(-1)

    def entropy(self):
        log_policy = F.log_softmax(self.policy_logits, dim=-1)
        return -(log_policy.exp() * log_policy).sum(dim=-1)

    def entropy_sum(self):
        # One sum over [..., A], as TorchBeast's loss adds it up: the sum of entropy() is the
        # same number but rounds differently in its last bits.
        log_policy = F.log_softmax(self.policy_logits, dim=-1)
        return -(log_policy.exp() * log_policy).sum()

    def sample(self):
        probs = F.softmax(self.policy_logits, dim=-1)
        actions = torch.multinomial(probs.reshape(-1, probs.shape[-1]), num_samples=1)
        return actions.view(probs.shape[:-1])

    def mode(self):
        return torch.argmax(self.policy_logits, dim=-1)

    def stats(self):
        """policy_entropy: the mean entropy per step, in nats; near 0 the policy has turned
        deterministic, as a policy in a collapse does (bench/learn.py counts those)."""
        with torch.no_grad():
            return {"policy_entropy": self.entropy().mean()}

    @staticmethod
    def action_features(actions, num_actions):
        return F.one_hot(actions.reshape(-1), num_actions).float()

    @classmethod
    def from_head(cls, model, core_output):
        return cls(model.policy(core_output))


class DiagonalGaussian(Policy):
    """A Gaussian over float actions [A] with independent dimensions. policy_mean and
    policy_logstd: float32 [..., A]; actions float32 [..., A].

    The model's head: policy_mean = tanh of a linear layer, policy_logstd one learned
    parameter per dimension (state-independent). Actions live in [-1, 1] per dimension, which
    the environment side clips and maps to the Box's bounds; the sample is stored unclipped,
    so that its log-probability is exact (a clipped action is a function of the sample).
    """

    FIELDS = ("policy_mean", "policy_logstd")

    def __init__(self, policy_mean, policy_logstd):
        self.policy_mean = policy_mean
        self.policy_logstd = policy_logstd

    def log_prob(self, actions):
        """log N(actions; mean, exp(logstd)^2), summed over the action dims."""
        z = (actions - self.policy_mean) * torch.exp(-self.policy_logstd)
        return -(0.5 * z * z + self.policy_logstd + HALF_LOG_2PI).sum(dim=-1)

    def entropy(self):
        """Summed over the action dims; it depends on the log-std only."""
        return (self.policy_logstd + HALF_LOG_2PIE).sum(dim=-1)

    def sample(self):
        mean = self.policy_mean
        return mean + self.policy_logstd.exp() * torch.randn_like(mean)

    def mode(self):
        return self.policy_mean

    # stats: none. A differential entropy has no floor at 0 that would mark a deterministic
    # policy, so policy_entropy (read as such by bench/learn.py) is a softmax policy's only.

    @staticmethod
    def action_features(actions, num_actions):
        # Clipped: what the environment applied, in the policy's [-1, 1] units.
        return actions.reshape(-1, num_actions).clamp(-1.0, 1.0).float()

    @staticmethod
    def init_head(model):
        # Means start near 0, the middle of every action range, so that the first episodes
        # explore the whole range with the initial std rather than one end.
        with torch.no_grad():
            model.policy.weight.mul_(0.01)
            model.policy.bias.zero_()
        # State-independent, as PPO's usual Gaussian policy: simple and stable, and the
        # entropy term (which depends on the log-std only) acts alike in every state.
        model.policy_logstd = nn.Parameter(
            torch.full((model.policy.out_features,), INITIAL_LOGSTD))

    @classmethod
    def from_head(cls, model, core_output):
        # tanh keeps the mean inside [-1, 1]: a mean beyond a bound would act like the bound,
        # so its samples, all clipped alike, would carry no gradient to bring it back. Only
        # the mean is squashed; the distribution stays a Gaussian, whose log-density and
        # entropy are exact.
        mean = torch.tanh(model.policy(core_output))
        # A new tensor, not a view of the parameter: under no_grad (acting) it must not
        # require a gradient, and acting stores it in buffers.
        return cls(mean, torch.zeros_like(mean) + model.policy_logstd)


# The policy kinds. A rollout (and a model's outputs) holds the FIELDS of exactly one.
POLICIES = (Categorical, DiagonalGaussian)


def from_fields(fields, steps=slice(None)):
    """The policy whose FIELDS are in `fields` (a rollout or a model's outputs, tensors
    [T+1, B, ...]), over the steps `steps` of their leading dim."""
    for kind in POLICIES:
        if kind.FIELDS[0] in fields:
            return kind(*(fields[name][steps] for name in kind.FIELDS))
    raise ValueError(f"none of the policies' fields "
                     f"({', '.join(k.FIELDS[0] for k in POLICIES)}) is among "
                     f"{', '.join(sorted(fields))}")
