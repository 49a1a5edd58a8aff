"""The rollout schema: every field of a rollout, declared once.

A rollout is a dict of arrays with leading dims [T+1, B]. Index t holds the
environment's output x_t and the agent's output computed on it
(obs[t] -> action[t]; beast/loss.py states the indexing the loss uses).
Each field is written by one side:

  env    the environment adapter (beast/envs.py RolloutAdapter, the vector envs
         of beast/vector_envs.py), which PolyBeast's env servers send over gRPC;
  agent  the acting model's forward pass (beast/models.py).

CORE_FIELDS are the fields the learner needs. Others ride along without an
edit here or anywhere else in the code:

  * an environment, or any wrapper around it, declares fields of its own in a
    `rollout_fields` attribute, a tuple of `Field`s; RolloutAdapter reads their
    values from the `info` dict of every step (see beast/envs.py);
  * every key that a model's forward returns is an agent field.

`Schema` holds one run's fields with their dtypes and per-step shapes.
MonoBeast's shared buffers, the vector envs' output arrays, PolyBeast's
required env keys and the learner's check of each batch all derive from it;
the C++ extension moves whatever named arrays arrive without knowing names.

Only numpy is imported at the top; torch is imported by the functions that make tensors
(torch_module), so that an env server, which uses the schema's fields but no tensors, starts
without loading torch.
"""

import dataclasses

import numpy as np

ENV = "env"
AGENT = "agent"
# Per-step shapes that depend on the environment (core_env_fields, Schema fill them in).
OBSERVATION = "observation"
NUM_ACTIONS = "num_actions"
# A Gymnasium Dict observation has one field per entry, "frame/<key>", in place of `frame`:
# each entry keeps its own dtype and shape. No other field can take such a name (core
# fields and model outputs have no "/", declared_fields refuses the prefix), so an entry
# called "reward" or "steps" cannot collide with the field of that name.
OBSERVATION_PREFIX = "frame/"


def torch_module():
    """torch, imported on first use (see the module's docstring)."""
    import torch

    return torch


@dataclasses.dataclass(frozen=True)
class Field:
    """One rollout field.

    name:   the key in every rollout dict.
    dtype:  a NumPy dtype (anything np.dtype accepts).
    shape:  the shape of one step of one environment, without [T, B].
    source: ENV or AGENT, the side that writes it.
    doc:    what it means, for readers of the schema.
    """

    name: str
    dtype: object
    shape: tuple = ()
    source: str = ENV
    doc: str = ""

    def __post_init__(self):
        if self.source not in (ENV, AGENT):
            raise ValueError(f"field {self.name!r}: source must be {ENV!r} or {AGENT!r}, "
                             f"got {self.source!r}")
        if not isinstance(self.shape, str):
            # A placeholder (NUM_ACTIONS) stays a name; Schema checks against the real size.
            shape = tuple(n if isinstance(n, str) else int(n) for n in self.shape)
            object.__setattr__(self, "shape", shape)
        if self.dtype is not None:
            object.__setattr__(self, "dtype", np.dtype(self.dtype))

    @property
    def torch_dtype(self):
        return torch_module().from_numpy(np.zeros(0, dtype=self.dtype)).dtype


CORE_FIELDS = (
    Field("frame", None, OBSERVATION, ENV,
          "the observation x_t (uint8 [4, 84, 84] on Atari, float32 [D] on vector tasks); a "
          "Dict observation has one field per entry instead (OBSERVATION_PREFIX)"),
    Field("reward", np.float32, (), ENV, "reward of the step that led to x_t; 0 at the first"),
    Field("done", np.bool_, (), ENV,
          "x_t is the first observation of a training episode (the step that led here "
          "ended the previous one, or nothing came before)"),
    Field("truncated", np.bool_, (), ENV,
          "x_t is the final observation of an episode cut short by a time limit: the "
          "return is bootstrapped from V(x_t), and the next step starts a new episode "
          "(done) without a transition to learn from"),
    Field("game_over", np.bool_, (), ENV,
          "the step that led to x_t ended the real game (differs from done with "
          "end-of-life episodes)"),
    Field("episode_return", np.float32, (), ENV,
          "the real game's return so far; at game_over the finished game's total"),
    Field("episode_step", np.int32, (), ENV,
          "the real game's steps so far; at game_over the finished game's length"),
    Field("last_action", np.int64, (), ENV, "the action that led to x_t; 0 at the first"),
    Field("policy_logits", np.float32, (NUM_ACTIONS,), AGENT,
          "logits of the behaviour policy mu(.|x_t)"),
    Field("baseline", np.float32, (), AGENT, "the value estimate V(x_t)"),
    Field("action", np.int64, (), AGENT, "the action a_t taken on x_t"),
)
CORE_NAMES = tuple(f.name for f in CORE_FIELDS)

# Written by the acting code, not the model: which weights acted. The learner logs how far
# behind its own they were (policy_lag in logs.csv, beast/training.py): the off-policyness
# that V-trace corrects for, which grows with the environments in flight and the queues.
POLICY_STEP = Field("policy_step", np.int64, (), AGENT,
                    "the learner's step counter when the weights that chose action[t] were "
                    "written (read just before the forward pass)")

# A Box action space of shape [A] changes the action fields: actions are float vectors, and
# the behaviour policy is a diagonal Gaussian (beast/models.py) whose parameters replace
# policy_logits. The agent acts in [-1, 1] per dimension, which the environment side maps to
# the Box's bounds (beast/envs.py RolloutAdapter).
CONTINUOUS_FIELDS = (
    Field("last_action", np.float32, (NUM_ACTIONS,), ENV,
          "the action that led to x_t, as the agent chose it (before clipping); 0 at the first"),
    Field("policy_mean", np.float32, (NUM_ACTIONS,), AGENT,
          "mean of the Gaussian behaviour policy mu(.|x_t)"),
    Field("policy_logstd", np.float32, (NUM_ACTIONS,), AGENT,
          "log standard deviation of mu(.|x_t), per action dimension"),
    Field("action", np.float32, (NUM_ACTIONS,), AGENT,
          "the action a_t sampled on x_t, before clipping: its log-probability under mu is "
          "exact, which V-trace needs"),
)


def core_fields(continuous=False):
    """CORE_FIELDS for a Discrete action space; for a Box one, with CONTINUOUS_FIELDS in
    place of last_action, policy_logits and action."""
    if not continuous:
        return CORE_FIELDS
    by_name = {f.name: f for f in CONTINUOUS_FIELDS}
    by_name["policy_logits"] = (by_name.pop("policy_mean"), by_name.pop("policy_logstd"))
    fields = []
    for f in CORE_FIELDS:  # in CORE_FIELDS' order
        new = by_name.get(f.name, f)
        fields.extend(new if isinstance(new, tuple) else (new,))
    return tuple(fields)


def core_env_fields(observation_shape, observation_dtype, continuous_actions=None):
    """The core env fields, with the frame's shape and dtype filled in.

    continuous_actions: None for a Discrete action space, else A, the length of the action
    vector of a Box action space (last_action becomes float32 [A]).
    """
    fields = []
    for f in core_fields(continuous_actions is not None):
        if f.source != ENV:
            continue
        if f.shape == OBSERVATION and isinstance(observation_shape, dict):
            fields += [dataclasses.replace(f, name=OBSERVATION_PREFIX + key, shape=tuple(shape),
                                           dtype=observation_dtype[key],
                                           doc=f"entry {key!r} of the Dict observation x_t")
                       for key, shape in observation_shape.items()]
            continue
        if f.shape == OBSERVATION:
            f = dataclasses.replace(f, shape=tuple(observation_shape), dtype=observation_dtype)
        elif f.shape == (NUM_ACTIONS,):
            f = dataclasses.replace(f, shape=(int(continuous_actions),))
        fields.append(f)
    return tuple(fields)


def observation_names(names):
    """The names among `names` that hold the observation: `frame`, or one per Dict entry."""
    return tuple(n for n in names if n == "frame" or n.startswith(OBSERVATION_PREFIX))


def declared_fields(env):
    """The extra env fields declared by `env` and every wrapper inside it (outermost first).

    Each layer may have a `rollout_fields` attribute: a tuple of Fields with source ENV.
    """
    fields, layer = [], env
    while layer is not None:
        for f in getattr(layer, "rollout_fields", ()):
            if f.source != ENV:
                raise ValueError(f"{type(layer).__name__}.rollout_fields: {f.name!r} must have "
                                 f"source {ENV!r}, got {f.source!r}")
            fields.append(f)
        layer = getattr(layer, "env", None)
    names = [f.name for f in fields]
    clash = sorted({n for n in names if names.count(n) > 1 or n in CORE_NAMES
                    or n.startswith(OBSERVATION_PREFIX)})
    if clash:
        raise ValueError(f"rollout_fields of {type(env).__name__} declare {', '.join(clash)} "
                         f"twice, with the name of a core field or with the prefix "
                         f"{OBSERVATION_PREFIX!r} of observation entries; rename them")
    return tuple(fields)


def agent_fields(model, env_fields):
    """The agent fields of `model`: one per key its forward returns, probed on zeros.

    The probe runs one [T=1, B=1] step without a gradient and leaves the global
    RNG as it was, so seeded runs do not change because of it.
    """
    torch = torch_module()
    inputs = {f.name: torch.zeros((1, 1) + f.shape, dtype=f.torch_dtype) for f in env_fields}
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in inputs.items()}
    state = tuple(s.to(device) for s in model.initial_state(1))
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        outputs, _ = model(inputs, state)
    fields = []
    for name, value in outputs.items():
        if tuple(value.shape[:2]) != (1, 1):
            raise ValueError(f"the model's output {name!r} has shape {tuple(value.shape)}; "
                             "every output must have leading dims [T, B]")
        dtype = torch.empty(0, dtype=value.dtype).numpy().dtype
        fields.append(Field(name, dtype, tuple(value.shape[2:]), AGENT))
    return tuple(fields)


class Schema:
    """The fields of one run's rollouts, by name, env fields first.

    Args:
      fields: Fields with concrete shapes and dtypes (no OBSERVATION/NUM_ACTIONS).
      num_actions: the size of the action space (a Box's: the length A of its action
        vector), to check the core fields.
      continuous: whether the action space is a Box (core_fields(True) apply).
    """

    def __init__(self, fields, num_actions, continuous=False):
        self.num_actions = num_actions
        self.continuous = continuous
        self.fields = {}
        for f in sorted(fields, key=lambda f: f.source != ENV):
            if f.name in self.fields:
                raise ValueError(f"two rollout fields are called {f.name!r}: the model's outputs "
                                 "and the environment's fields must have different names")
            self.fields[f.name] = f
        self._check_core(num_actions)

    @classmethod
    def of(cls, env_fields, model, num_actions, continuous=False):
        """The schema of a run: the environment's fields, what `model` returns and
        POLICY_STEP."""
        return cls(tuple(env_fields) + agent_fields(model, env_fields) + (POLICY_STEP,),
                   num_actions, continuous)

    def model_names(self):
        """The agent fields that the model's forward returns (all but POLICY_STEP)."""
        return tuple(n for n in self.names(AGENT) if n != POLICY_STEP.name)

    def _check_core(self, num_actions):
        for core in core_fields(self.continuous):
            f = self.fields.get(core.name)
            if core.shape == OBSERVATION and observation_names(self.fields):
                continue  # `frame`, or the entries of a Dict observation: any shape and dtype
            if f is None:
                writer = "the model's forward" if core.source == AGENT else "the environment"
                raise ValueError(f"{writer} must provide the rollout field {core.name!r} "
                                 f"({core.doc})")
            shape = (num_actions,) if core.shape == (NUM_ACTIONS,) else core.shape
            if core.shape != OBSERVATION and (f.shape != shape or f.dtype != core.dtype):
                raise ValueError(f"rollout field {core.name!r} must be {core.dtype} with per-step "
                                 f"shape {shape}, got {f.dtype} {f.shape}")

    def names(self, source=None):
        return tuple(n for n, f in self.fields.items() if source in (None, f.source))

    def zeros(self, leading_shape, source=None):
        """A dict of zero arrays [*leading_shape, *shape] for the fields of `source` (all: None)."""
        return {n: np.zeros(tuple(leading_shape) + f.shape, dtype=f.dtype)
                for n, f in self.fields.items() if source in (None, f.source)}

    def shared_zeros(self, leading_shape):
        """A dict of zero tensors [*leading_shape, *shape] in shared memory, one per field:
        MonoBeast's buffers, PolyBeast's batch slots."""
        torch = torch_module()
        return {n: torch.zeros(tuple(leading_shape) + f.shape, dtype=f.torch_dtype).share_memory_()
                for n, f in self.fields.items()}

    def check(self, arrays, leading_dims, where, source=None):
        """Raises ValueError naming the first field of `arrays` that is missing or does not fit.

        arrays: dict of numpy arrays or tensors [*leading, *shape]; leading_dims: how many
        leading dims to skip; source: check only the fields of ENV or AGENT (None: all). A
        value that crosses a boundary is checked where it enters.
        """
        for name, f in self.fields.items():
            if source not in (None, f.source):
                continue
            value = arrays.get(name)
            if value is None:
                raise ValueError(f"{where}: the rollout field {name!r} is missing")
            dtype = value.dtype
            if not isinstance(dtype, np.dtype):  # a tensor's
                dtype = torch_module().empty(0, dtype=dtype).numpy().dtype
            if dtype != f.dtype or tuple(value.shape[leading_dims:]) != f.shape:
                raise ValueError(f"{where}: rollout field {name!r} is {dtype} "
                                 f"{tuple(value.shape[leading_dims:])} per step; the run expects "
                                 f"{f.dtype} {f.shape}")


def select_batch(buffers, state_buffers, indices):
    """Copies the rollouts of buffers `indices` (B of them, in this order) out of shared
    memory: (batch dict of [T+1, B, ...] tensors, core state tuple of [L, B, H] tensors)."""
    index = torch_module().tensor(indices)
    batch = {k: v.index_select(1, index) for k, v in buffers.items()}
    state = tuple(s.index_select(0, index).transpose(0, 1).contiguous() for s in state_buffers)
    return batch, state


def to_device(batch, state, device):
    """A batch and its core state (select_batch) on `device`."""
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    state = tuple(s.to(device, non_blocking=True) for s in state)
    return batch, state
