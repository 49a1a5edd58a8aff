"""The actor-critic networks.

Every network has the same data path; only the torso differs:

    frame [T, B, *obs] --torso--> features [T*B, F]
    core input = features ++ clip(reward, -1, 1) ++ one_hot(last_action)
    core input --(optional LSTM, reset at episode starts)--> core output
    core output --> policy_logits [T, B, A], baseline [T, B]; action sampled
                    from softmax(policy_logits) in train mode, its argmax in eval
                    mode (model.eval(): offline evaluation and --mode test)

To try a new network, subclass ActorCritic, build the torso layers in
__init__, pass their feature size to ActorCritic.__init__, write torso(), and
add it to create_model. The core, the heads and the interface the learners use
(forward, initial_state) come with the base class.

Every key that forward returns becomes a field of the rollout (beast/rollout.py),
in both variants: a new head only needs to return its output, [T, B, ...], and a
loss term in beast/learner.py LOSS_TERMS can read it from the batch.
"""

import torch
from torch import nn
from torch.nn import functional as F


def _conv_output_size(size, kernel_size, stride, padding=0):
    return (size + 2 * padding - kernel_size) // stride + 1


class ActorCritic(nn.Module):
    """Core and heads shared by all networks; subclasses supply torso().

    Args:
      observation_shape: tuple, the shape of one observation (no [T, B]).
      num_actions: int, size of the discrete action space.
      feature_size: int, width of the torso's output.
      use_lstm: bool, whether to put a one-layer LSTM between torso and heads.
    """

    def __init__(self, observation_shape, num_actions, feature_size, use_lstm):
        super().__init__()
        self.observation_shape = tuple(observation_shape)
        self.num_actions = num_actions
        # The reward and last action let the policy condition on what its
        # previous action did, which matters most with a recurrent core.
        core_input_size = feature_size + 1 + num_actions
        if use_lstm:
            # Hidden size equal to the input size, as in the IMPALA/TorchBeast
            # Atari nets: the core adds memory without narrowing the features.
            self.core = nn.LSTM(core_input_size, core_input_size, num_layers=1)
            core_output_size = core_input_size
        else:
            self.core = None
            core_output_size = core_input_size
        self.policy = nn.Linear(core_output_size, num_actions)
        self.baseline = nn.Linear(core_output_size, 1)

    def torso(self, x):
        """Features of a flat batch of observations.

        Args:
          x: float32 [N, *observation_shape], pixels already scaled to [0, 1].

        Returns:
          float32 [N, feature_size].
        """
        raise NotImplementedError

    def initial_state(self, batch_size, device=None):
        """Core state at the start of an episode.

        Args:
          batch_size: int, B.
          device: where to put the tensors (default: CPU, where actors keep
            them and from where they are copied into rollout buffers).

        Returns:
          () without an LSTM; otherwise (h, c), each float32
          [num_layers, B, hidden_size] of zeros.
        """
        if self.core is None:
            return ()
        shape = (self.core.num_layers, batch_size, self.core.hidden_size)
        return tuple(torch.zeros(shape, device=device) for _ in range(2))

    def forward(self, inputs, core_state=()):
        """Run the network over T steps of B environments.

        Args:
          inputs: dict of tensors with leading dims [T, B]:
            frame: uint8 (pixels, scaled by 1/255 here) or float32 (used as
              is) [T, B, *observation_shape];
            reward: float32 [T, B], reward of the step that led to frame;
            done: bool [T, B], True where frame starts a new episode (the
              core state is reset before that step);
            last_action: int64 [T, B], the action that led to frame.
          core_state: the state before step 0, as from initial_state(B); ()
            without an LSTM. An empty tuple given to an LSTM model means
            "start from zeros".

        Returns:
          (outputs, core_state): outputs is a dict with policy_logits float32
          [T, B, A], baseline float32 [T, B] and action int64 [T, B];
          core_state is the state after step T-1.
        """
        frame = inputs["frame"]
        if tuple(frame.shape[2:]) != self.observation_shape:
            raise ValueError(
                f"{type(self).__name__} was built for observations of shape "
                f"{self.observation_shape}, got frames of shape "
                f"{tuple(frame.shape)} (expected [T, B, *observation_shape])"
            )
        T, B = frame.shape[:2]
        x = frame.flatten(0, 1)
        if x.dtype == torch.uint8:
            # Frames travel as uint8 to keep buffers and messages 4x smaller.
            x = x.float() / 255.0
        else:
            x = x.float()
        features = self.torso(x)

        reward = inputs["reward"].reshape(T * B, 1).float().clamp(-1.0, 1.0)
        last_action = F.one_hot(inputs["last_action"].reshape(T * B), self.num_actions)
        core_input = torch.cat([features, reward, last_action.float()], dim=-1)

        if self.core is None:
            core_output = core_input
        else:
            core_output, core_state = self._run_core(core_input.view(T, B, -1),
                                                     inputs["done"], core_state)

        policy_logits = self.policy(core_output)
        baseline = self.baseline(core_output)
        if self.training:
            action = torch.multinomial(F.softmax(policy_logits, dim=1), num_samples=1)
        else:
            # Greedy actions in eval mode (evaluation episodes, --mode test).
            action = torch.argmax(policy_logits, dim=1)

        outputs = dict(
            policy_logits=policy_logits.view(T, B, self.num_actions),
            baseline=baseline.view(T, B),
            action=action.view(T, B),
        )
        return outputs, core_state


    def _run_core(self, core_input, done, core_state):
        """The LSTM over [T, B, F] inputs; returns (outputs [T*B, F], state after T-1).

        The state of an environment whose episode starts at step t is zeroed
        before step t, so that no memory crosses an episode boundary. That is the
        same as stepping the LSTM one step at a time with the reset before each
        step; but one LSTM call per step costs several times more than one call
        over many steps, so we call it once per stretch of steps in which no
        environment of the batch starts an episode. Finding the stretches reads
        `done` on the host: one device sync per forward on GPU, skipped at T=1.
        """
        T, B = done.shape
        if not core_state:
            core_state = self.initial_state(B, device=core_input.device)
        notdone = torch.logical_not(done).float()
        if T == 1:
            starts = [0]
        else:
            starts = [0] + (done[1:].any(dim=1).nonzero().flatten() + 1).tolist()
        core_outputs = []
        for start, end in zip(starts, starts[1:] + [T]):
            mask = notdone[start].view(1, B, 1)
            core_state = tuple(mask * s for s in core_state)
            output, core_state = self.core(core_input[start:end], core_state)
            core_outputs.append(output)
        return torch.cat(core_outputs).flatten(0, 1), core_state


class AtariNet(ActorCritic):
    """The convolutional net of the DQN Nature paper, as TorchBeast's default.

    conv 32 8x8 stride 4, conv 64 4x4 stride 2, conv 64 3x3 stride 1, fc 512,
    ReLU after each. Observations are [C, H, W] (stacked grayscale frames,
    [4, 84, 84] for Atari).
    """

    def __init__(self, observation_shape, num_actions, use_lstm=False):
        observation_shape = tuple(observation_shape)
        if len(observation_shape) != 3:
            raise ValueError(
                f"--model atari needs image observations [C, H, W], got shape "
                f"{observation_shape}; use --model mlp for vector observations"
            )
        channels, height, width = observation_shape
        for kernel_size, stride in [(8, 4), (4, 2), (3, 1)]:
            height = _conv_output_size(height, kernel_size, stride)
            width = _conv_output_size(width, kernel_size, stride)
        if height < 1 or width < 1:
            raise ValueError(
                f"--model atari needs frames of at least 36x36 pixels, got "
                f"shape {observation_shape}; use --model resnet for small frames"
            )
        feature_size = 512
        super().__init__(observation_shape, num_actions, feature_size, use_lstm)
        self.conv1 = nn.Conv2d(channels, 32, kernel_size=8, stride=4)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=4, stride=2)
        self.conv3 = nn.Conv2d(64, 64, kernel_size=3, stride=1)
        self.fc = nn.Linear(64 * height * width, feature_size)

    def torso(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.relu(self.conv3(x))
        return F.relu(self.fc(x.flatten(1)))


class ResidualBlock(nn.Module):
    """relu, conv 3x3, relu, conv 3x3, plus the input (pre-activation)."""

    def __init__(self, channels):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, kernel_size=3, padding=1)

    def forward(self, x):
        out = self.conv1(F.relu(x))
        out = self.conv2(F.relu(out))
        return x + out


class ResNet(ActorCritic):
    """The deep network of the IMPALA paper (figure 3, right).

    Three sections of [conv 3x3, max-pool 3x3 stride 2, two residual blocks]
    with 16, 32 and 32 channels, then ReLU and fc 256. Each pooling halves the
    frame (rounding up), so any [C, H, W] frame fits: 84x84 ends at 11x11.
    """

    def __init__(self, observation_shape, num_actions, use_lstm=False,
                 channels=(16, 32, 32), feature_size=256):
        observation_shape = tuple(observation_shape)
        if len(observation_shape) != 3:
            raise ValueError(
                f"--model resnet needs image observations [C, H, W], got shape "
                f"{observation_shape}; use --model mlp for vector observations"
            )
        in_channels, height, width = observation_shape
        super().__init__(observation_shape, num_actions, feature_size, use_lstm)
        sections = []
        for out_channels in channels:
            sections.append(
                nn.Sequential(
                    nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1),
                    nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
                    ResidualBlock(out_channels),
                    ResidualBlock(out_channels),
                )
            )
            in_channels = out_channels
            height = _conv_output_size(height, 3, 2, padding=1)
            width = _conv_output_size(width, 3, 2, padding=1)
        self.sections = nn.Sequential(*sections)
        self.fc = nn.Linear(in_channels * height * width, feature_size)

    def torso(self, x):
        x = F.relu(self.sections(x))
        return F.relu(self.fc(x.flatten(1)))


class MLP(ActorCritic):
    """Two fully connected layers for vector observations [D].

    Args (besides ActorCritic's):
      hidden_size: int, width of both layers.
      activation: "tanh" (the usual choice for small control tasks) or "relu".
    """

    def __init__(self, observation_shape, num_actions, use_lstm=False,
                 hidden_size=64, activation="tanh"):
        observation_shape = tuple(observation_shape)
        if len(observation_shape) != 1:
            raise ValueError(
                f"--model mlp needs vector observations [D], got shape "
                f"{observation_shape}; use --model atari or --model resnet for "
                f"image observations"
            )
        activations = {"tanh": nn.Tanh, "relu": nn.ReLU}
        if activation not in activations:
            raise ValueError(
                f"MLP activation must be one of {sorted(activations)}, got {activation!r}"
            )
        super().__init__(observation_shape, num_actions, hidden_size, use_lstm)
        self.layers = nn.Sequential(
            nn.Linear(observation_shape[0], hidden_size),
            activations[activation](),
            nn.Linear(hidden_size, hidden_size),
            activations[activation](),
        )

    def torso(self, x):
        return self.layers(x)


MODELS = ("atari", "resnet", "mlp")


def create_model(flags, observation_shape, num_actions):
    """Build the network that flags ask for.

    Reads flags.model ("atari", "resnet" or "mlp"; when missing or None,
    "atari" for [C, H, W] observations and "mlp" for [D]), flags.use_lstm
    (default False) and flags.hidden_size (MLP width, default 64).

    Args:
      flags: argparse.Namespace (or any object with those attributes).
      observation_shape: tuple, shape of one observation, e.g. (4, 84, 84).
      num_actions: int.

    Raises:
      ValueError: with a message naming the --model to use, when the model is
        unknown or the observations do not fit it.
    """
    observation_shape = tuple(observation_shape)
    use_lstm = bool(getattr(flags, "use_lstm", False))
    model = getattr(flags, "model", None)
    if model is None:
        if len(observation_shape) == 3:
            model = "atari"
        elif len(observation_shape) == 1:
            model = "mlp"
        else:
            raise ValueError(
                f"no model fits observations of shape {observation_shape}: "
                f"--model atari and resnet take [C, H, W], --model mlp takes [D]"
            )
    if model == "atari":
        return AtariNet(observation_shape, num_actions, use_lstm=use_lstm)
    if model == "resnet":
        return ResNet(observation_shape, num_actions, use_lstm=use_lstm)
    if model == "mlp":
        return MLP(
            observation_shape,
            num_actions,
            use_lstm=use_lstm,
            hidden_size=getattr(flags, "hidden_size", 64),
        )
    raise ValueError(f"unknown --model {model!r}; choose one of {', '.join(MODELS)}")
