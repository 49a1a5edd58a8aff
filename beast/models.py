"""The actor-critic networks.

Every network has the same data path; only the torso differs:

    frame [T, B, *obs] --torso--> features [T*B, F]
    core input = features ++ clip(reward, -1, 1) ++ the last action (one-hot)
    core input --(optional LSTM, reset at episode starts)--> core output
    core output --> policy_logits [T, B, A], baseline [T, B]; action sampled
                    from softmax(policy_logits) in train mode, its argmax in eval
                    mode (model.eval(): offline evaluation and --mode test)

The policy is an object of beast/policies.py, chosen once when the model is built: a
softmax over num_actions (Categorical), or with a Box action space of A dimensions
(continuous=True) a diagonal Gaussian (DiagonalGaussian: policy_mean and policy_logstd
[T, B, A] in place of policy_logits, the last action entering the core as itself, clipped to
[-1, 1], the action [T, B, A] sampled in train mode, the mean in eval mode). The model asks
it for the head's fields and the action; the loss asks it for log-probabilities and the
entropy.

To try a new network, subclass ActorCritic, build the torso layers in
__init__, pass their feature size to ActorCritic.__init__, write torso(), and
add it to MODELS. The core, the heads and the interface the learners use
(forward, initial_state) come with the base class.

Every key that forward returns becomes a field of the rollout (beast/rollout.py),
in both variants: a new head only needs to return its output, [T, B, ...], and a
loss term in beast/loss.py LOSS_TERMS can read it from the batch.
"""

import math

import torch
from torch import nn
from torch.nn import functional as F

from beast import policies
from beast.rollout import OBSERVATION_PREFIX


def _conv_output_size(size, kernel_size, stride, padding=0):
    return (size + 2 * padding - kernel_size) // stride + 1


def _image_shape(observation_shape, model):
    """observation_shape as a tuple (C, H, W); ValueError naming --model otherwise."""
    observation_shape = tuple(observation_shape)
    if len(observation_shape) != 3:
        raise ValueError(f"--model {model} needs image observations [C, H, W], got shape "
                         f"{observation_shape}; use --model mlp for vector observations")
    return observation_shape


def _as_float(x):
    """An observation tensor as float32; uint8 pixels scaled to [0, 1]."""
    if x.dtype == torch.uint8:
        # Frames travel as uint8 to keep buffers and messages 4x smaller. In place: a
        # learner's batch of Atari frames is large enough for a second copy to cost.
        return x.float().mul_(1.0 / 255.0)
    return x.float()


class ActorCritic(nn.Module):
    """Core and heads shared by all networks; subclasses supply torso().

    Args:
      observation_shape: tuple, the shape of one observation (no [T, B]).
      num_actions: int, size of the discrete action space, or the length A of
        the action vector when continuous.
      feature_size: int, width of the torso's output.
      use_lstm: bool, whether to put a one-layer LSTM between torso and heads.
      continuous: bool, a Gaussian policy over float actions [A] (a Box action
        space) instead of a softmax over num_actions.

    FLAGS: the flags (by name) that create_model passes to the constructor besides
    use_lstm, for a subclass that takes them (SmallConvNet, MLP: hidden_size).
    READS_DICT: whether the net reads a Dict observation's entries itself (NetHackNet);
    create_model gives a Dict observation DictNet unless --model names such a net.
    """

    FLAGS = ()
    READS_DICT = False
    # The memory layout of the acting model's convolution weights (to_acting_layout).
    ACTING_LAYOUT = torch.contiguous_format

    def __init__(self, observation_shape, num_actions, feature_size, use_lstm,
                 continuous=False):
        super().__init__()
        self.observation_shape = tuple(observation_shape)
        self.num_actions = num_actions
        # The kind of policy (beast/policies.py), chosen once: the heads, the last action's
        # entry into the core and acting go through it.
        self.policy_type = policies.DiagonalGaussian if continuous else policies.Categorical
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
        self.policy_type.init_head(self)

    def torso(self, x):
        """Features of a flat batch of observations.

        Args:
          x: float32 [N, *observation_shape], pixels already scaled to [0, 1].

        Returns:
          float32 [N, feature_size].
        """
        raise NotImplementedError

    def encode(self, inputs):
        """The torso's features of the observations in `inputs` (see forward).

        Reads frame [T, B, *observation_shape]; DictNet reads its entries instead.
        Returns float32 [T*B, feature_size].
        """
        frame = inputs["frame"]
        if tuple(frame.shape[2:]) != self.observation_shape:
            raise ValueError(
                f"{type(self).__name__} was built for observations of shape "
                f"{self.observation_shape}, got frames of shape "
                f"{tuple(frame.shape)} (expected [T, B, *observation_shape])"
            )
        return self.torso(_as_float(frame.flatten(0, 1)))

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
              is) [T, B, *observation_shape] (a Dict observation: one
              frame/<key> per entry instead, see DictNet);
            reward: float32 [T, B], reward of the step that led to frame;
            done: bool [T, B], True where frame starts a new episode (the
              core state is reset before that step);
            last_action: int64 [T, B], the action that led to frame (continuous:
              float32 [T, B, A], as the agent chose it, before clipping).
          core_state: the state before step 0, as from initial_state(B); ()
            without an LSTM. An empty tuple given to an LSTM model means
            "start from zeros".

        Returns:
          (outputs, core_state): outputs is a dict with the policy's fields
          (policy_logits float32 [T, B, A]; continuous: policy_mean and policy_logstd,
          float32 [T, B, A] each), baseline float32 [T, B] and action (int64 [T, B];
          continuous: float32 [T, B, A]); core_state is the state after step T-1.
        """
        features = self.encode(inputs)
        T, B = inputs["reward"].shape[:2]

        reward = inputs["reward"].reshape(T * B, 1).float().clamp(-1.0, 1.0)
        last_action = self.policy_type.action_features(inputs["last_action"], self.num_actions)
        core_input = torch.cat([features, reward, last_action], dim=-1)

        if self.core is None:
            core_output = core_input
        else:
            core_output, core_state = self._run_core(core_input.view(T, B, -1),
                                                     inputs["done"], core_state)

        baseline = self.baseline(core_output)
        policy = self.policy_type.from_head(self, core_output)
        # Greedy actions in eval mode (evaluation episodes, --mode test).
        action = policy.sample() if self.training else policy.mode()
        outputs = {name: _steps(value, T, B) for name, value in policy.fields().items()}
        outputs.update(baseline=baseline.view(T, B), action=_steps(action, T, B))
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
            output, core_state = self._lstm(core_input[start:end], core_state)
            core_outputs.append(output)
        return torch.cat(core_outputs).flatten(0, 1), core_state

    def _lstm(self, x, state):
        """One call of the LSTM, in the dtype of its weights with autocast off: under bf16
        autocast the CPU's LSTM kernel (oneDNN's) needs bf16 instructions (AMX, AVX-512
        BF16) and fails without them, where a bf16 LSTM outside autocast runs on any CPU. So
        the learner's LSTM stays float32 under --precision bf16; the acting model's is bf16."""
        dtype = self.core.weight_ih_l0.dtype
        with torch.autocast(x.device.type, enabled=False):
            return self.core(x.to(dtype), tuple(s.to(dtype) for s in state))


def _steps(x, T, B):
    """A tensor [T*B, ...] as [T, B, ...]."""
    return x.view(T, B, *x.shape[1:])


class AtariNet(ActorCritic):
    """The convolutional net of the DQN Nature paper, as TorchBeast's default.

    conv 32 8x8 stride 4, conv 64 4x4 stride 2, conv 64 3x3 stride 1, fc 512,
    ReLU after each. Observations are [C, H, W] (stacked grayscale frames,
    [4, 84, 84] for Atari).
    """

    def __init__(self, observation_shape, num_actions, use_lstm=False, continuous=False):
        observation_shape = _image_shape(observation_shape, "atari")
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
        super().__init__(observation_shape, num_actions, feature_size, use_lstm, continuous)
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
    with 16, 32 and 32 channels (--channels: one number a section), then ReLU and
    fc 256. Each pooling halves the frame (rounding up), so any [C, H, W] frame
    fits: 84x84 ends at 11x11.
    """

    FLAGS = ("channels",)
    # Its 3x3 convolutions run faster NHWC on a CPU (oneDNN) at acting's batches of a few
    # frames too, on Atari's frames and on MinAtar's (docs/performance.md).
    ACTING_LAYOUT = torch.channels_last

    def __init__(self, observation_shape, num_actions, use_lstm=False,
                 channels=(16, 32, 32), feature_size=256, continuous=False):
        observation_shape = _image_shape(observation_shape, "resnet")
        in_channels, height, width = observation_shape
        super().__init__(observation_shape, num_actions, feature_size, use_lstm, continuous)
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


class SmallConvNet(ActorCritic):
    """The network of the MinAtar paper (Young & Tian 2019), for small frames such as MinAtar's.

    conv 16 3x3 stride 1 (no padding), ReLU, fc hidden_size (128 by default), ReLU: a
    [C, 10, 10] frame becomes 16x8x8 = 1,024 features before the fc. A fraction of the
    ResNet's compute, so its actors and learner run several times faster on small frames;
    on large frames (84x84) its fc grows with the frame and it is the wrong choice.
    """

    FLAGS = ("hidden_size",)

    def __init__(self, observation_shape, num_actions, use_lstm=False, hidden_size=128,
                 continuous=False):
        observation_shape = _image_shape(observation_shape, "small")
        channels, height, width = observation_shape
        height, width = _conv_output_size(height, 3, 1), _conv_output_size(width, 3, 1)
        if height < 1 or width < 1:
            raise ValueError(f"--model small needs frames of at least 3x3 pixels, got shape "
                             f"{observation_shape}")
        super().__init__(observation_shape, num_actions, hidden_size, use_lstm, continuous)
        self.conv = nn.Conv2d(channels, 16, kernel_size=3, stride=1)
        self.fc = nn.Linear(16 * height * width, hidden_size)

    def torso(self, x):
        x = F.relu(self.conv(x))
        return F.relu(self.fc(x.flatten(1)))


class MLP(ActorCritic):
    """Two fully connected layers for vector observations [D].

    Args (besides ActorCritic's):
      hidden_size: int, width of both layers.
      activation: "tanh" (the usual choice for small control tasks) or "relu".
    """

    FLAGS = ("hidden_size",)

    def __init__(self, observation_shape, num_actions, use_lstm=False,
                 hidden_size=64, activation="tanh", continuous=False):
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
        super().__init__(observation_shape, num_actions, hidden_size, use_lstm, continuous)
        self.layers = nn.Sequential(
            nn.Linear(observation_shape[0], hidden_size),
            activations[activation](),
            nn.Linear(hidden_size, hidden_size),
            activations[activation](),
        )

    def torso(self, x):
        return self.layers(x)


class DictNet(ActorCritic):
    """The network for Dict observations: one encoder per entry, then one layer over all.

        frame/<key> [T, B, *shape] --encoder of the entry--> [T*B, hidden_size], each entry
        concatenation [T*B, entries * hidden_size] --fc hidden_size, ReLU--> features

    An entry's encoder depends on its rank: an image [C, H, W] gets conv 16 3x3 (padding 1),
    the small net of the MinAtar paper, then conv 32 3x3 stride 2 (padding 1) for as long as
    the map is wider than 12 px (so that an 84x84 frame reaches the fc at 11x11), ReLU after
    each, then fc hidden_size, ReLU; anything else ([D] vectors, scalars, [H, W]) is
    flattened and gets two fc layers of hidden_size with ReLU. The layer over the
    concatenation lets the policy depend on the entries jointly (which cue one entry points
    at in the other); without it the heads would only add up one term per entry.

    Args (besides ActorCritic's):
      observation_shapes: {entry: shape of one step}, in the order of the env's Dict.
      hidden_size: int, the width of every encoder's output and of the features.
    """

    FLAGS = ("hidden_size",)

    def __init__(self, observation_shapes, num_actions, use_lstm=False, hidden_size=64,
                 continuous=False):
        shapes = {key: tuple(shape) for key, shape in observation_shapes.items()}
        if not shapes:
            raise ValueError("a Dict observation needs at least one entry")
        super().__init__((), num_actions, hidden_size, use_lstm, continuous)
        self.observation_shape = shapes
        # A list, not a ModuleDict: entry names may hold characters ("." say) that
        # parameter names cannot.
        self.encoders = nn.ModuleList(_entry_encoder(shape, hidden_size)
                                      for shape in shapes.values())
        self.mix = nn.Sequential(nn.Linear(len(shapes) * hidden_size, hidden_size), nn.ReLU())

    def encode(self, inputs):
        """Reads frame/<key> [T, B, *shape] for every entry; returns float32 [T*B, hidden_size]."""
        features = []
        for (key, shape), encoder in zip(self.observation_shape.items(), self.encoders):
            entry = inputs[OBSERVATION_PREFIX + key]
            if tuple(entry.shape[2:]) != shape:
                raise ValueError(f"DictNet was built for entry {key!r} of shape {shape}, got "
                                 f"{tuple(entry.shape)} (expected [T, B, *shape])")
            x = _as_float(entry.flatten(0, 1))
            features.append(encoder(x if len(shape) == 3 else x.reshape(len(x), -1)))
        return self.mix(torch.cat(features, dim=1))


def _entry_encoder(shape, hidden_size):
    """DictNet's encoder of one entry: float32 [N, C, H, W] images, [N, size] otherwise ->
    [N, hidden_size]."""
    if len(shape) != 3:
        return nn.Sequential(nn.Linear(math.prod(shape), hidden_size), nn.ReLU(),
                             nn.Linear(hidden_size, hidden_size), nn.ReLU())
    channels, height, width = shape
    layers = [nn.Conv2d(channels, 16, kernel_size=3, padding=1), nn.ReLU()]
    channels = 16
    while max(height, width) > 12:
        layers += [nn.Conv2d(channels, 32, kernel_size=3, stride=2, padding=1), nn.ReLU()]
        channels = 32
        height = _conv_output_size(height, 3, 2, padding=1)
        width = _conv_output_size(width, 3, 2, padding=1)
    layers += [nn.Flatten(), nn.Linear(channels * height * width, hidden_size), nn.ReLU()]
    return nn.Sequential(*layers)


class NetHackNet(ActorCritic):
    """The NetHack Learning Environment paper's network, for NLE's glyphs and blstats.

        glyphs [21, 79] --embedding--> [E, 21, 79] --conv stack--> the whole map's features
        glyphs of the crop x crop square centred on the agent --embedding--> convs
        blstats [27] --signed log--> MLP
        the three concatenated --fc hidden_size, ELU--> features (then ActorCritic's core)

    Each glyph (one of nle.nethack.MAX_GLYPH: a monster, an object, a piece of the map)
    gets a learnt vector of `embedding` numbers, and one more stands for "off the map"
    around a crop at the edge. The crop shows what is next to the agent at full resolution
    wherever it stands; the whole map, at about a quarter of the resolution along each side
    after two stride-2 convolutions, where it stands on the level. The bottom-line stats run
    from 0 or 1 (flags) to the score and the turn in the thousands, so they enter as
    sign(b) log(1 + |b|).
    The paper's net is wider (five convolutions over the whole map, at full resolution);
    this one is sized to train on a laptop's CPU. blstats[0] and blstats[1] are the agent's
    column x and row y on the map.

    Args (besides ActorCritic's):
      observation_shapes: {entry: shape}, with glyphs [H, W] and blstats [S].
      hidden_size: int, the width of the features.
      embedding: int, the width E of a glyph's vector.
      crop: int, odd, the side of the square around the agent.
    """

    FLAGS = ("hidden_size",)
    READS_DICT = True

    def __init__(self, observation_shapes, num_actions, use_lstm=False, hidden_size=256,
                 embedding=16, crop=9, continuous=False):
        shapes = _nethack_shapes(observation_shapes)
        super().__init__((), num_actions, hidden_size, use_lstm, continuous)
        from nle import nethack  # here: models.py imports without nle

        self.observation_shape = shapes
        self.off_map = nethack.MAX_GLYPH  # the index after the last glyph's
        self.crop = crop
        self.embed = nn.Embedding(nethack.MAX_GLYPH + 1, embedding)
        height, width = shapes["glyphs"]
        self.map_convs = nn.Sequential(
            nn.Conv2d(embedding, 16, kernel_size=3, stride=2, padding=1), nn.ELU(),
            nn.Conv2d(16, 32, kernel_size=3, stride=2, padding=1), nn.ELU(), nn.Flatten())
        for _ in range(2):
            height = _conv_output_size(height, 3, 2, padding=1)
            width = _conv_output_size(width, 3, 2, padding=1)
        self.crop_convs = nn.Sequential(
            nn.Conv2d(embedding, 16, kernel_size=3, padding=1), nn.ELU(),
            nn.Conv2d(16, 16, kernel_size=3, padding=1), nn.ELU(), nn.Flatten())
        (stats,) = shapes["blstats"]
        self.stats_mlp = nn.Sequential(nn.Linear(stats, 64), nn.ELU(), nn.Linear(64, 64), nn.ELU())
        self.fc = nn.Sequential(
            nn.Linear(32 * height * width + 16 * crop * crop + 64, hidden_size), nn.ELU())

    def encode(self, inputs):
        """Reads frame/glyphs int16 [T, B, H, W] and frame/blstats [T, B, S];
        returns float32 [T*B, hidden_size]."""
        glyphs = inputs[OBSERVATION_PREFIX + "glyphs"]
        blstats = inputs[OBSERVATION_PREFIX + "blstats"]
        for name, entry in (("glyphs", glyphs), ("blstats", blstats)):
            if tuple(entry.shape[2:]) != self.observation_shape[name]:
                raise ValueError(f"NetHackNet was built for {name} of shape "
                                 f"{self.observation_shape[name]}, got {tuple(entry.shape)} "
                                 "(expected [T, B, *shape])")
        glyphs, blstats = glyphs.flatten(0, 1).long(), blstats.flatten(0, 1)
        x, y = blstats[:, 0].long(), blstats[:, 1].long()
        around = crop_around(glyphs, x, y, self.crop, self.off_map)
        blstats = blstats.float()
        features = torch.cat([self.map_convs(self._embedded(glyphs)),
                              self.crop_convs(self._embedded(around)),
                              self.stats_mlp(blstats.sign() * blstats.abs().log1p())], dim=1)
        return self.fc(features)

    def _embedded(self, glyphs):
        """int64 [N, H, W] glyphs as float32 [N, E, H, W]."""
        return self.embed(glyphs).permute(0, 3, 1, 2)


def _nethack_shapes(observation_shapes):
    """{"glyphs": (H, W), "blstats": (S,)} from the env's Dict; ValueError naming --model."""
    shapes = observation_shapes if isinstance(observation_shapes, dict) else {}
    shapes = {key: tuple(shape) for key, shape in shapes.items()}
    if (len(shapes.get("glyphs", ())), len(shapes.get("blstats", ()))) != (2, 1):
        raise ValueError(f"--model nethack needs NLE's glyphs [H, W] and blstats [S] entries "
                         f"(--env NetHackScore-v0 and the other NetHack ids), got "
                         f"{observation_shapes}")
    return {key: shapes[key] for key in ("glyphs", "blstats")}


def crop_around(glyphs, x, y, size, fill):
    """The size x size square of `glyphs` centred on column x, row y; `fill` off the map.

    Args:
      glyphs: int64 [N, H, W].
      x, y: int64 [N], the centre's column and row (clamped onto the map).
      size: int, odd.
      fill: int, the value of the squares outside the map.
    Returns int64 [N, size, size]: out[n, i, j] = glyphs[n, y - size//2 + i, x - size//2 + j].
    """
    half = size // 2
    height, width = glyphs.shape[1:]
    padded = F.pad(glyphs, (half, half, half, half), value=fill)
    # In the padded map the square's top-left corner is at (y, x) itself.
    offsets = torch.arange(size, device=glyphs.device)
    rows = (y.clamp(0, height - 1).view(-1, 1) + offsets).view(-1, size, 1)
    columns = (x.clamp(0, width - 1).view(-1, 1) + offsets).view(-1, 1, size)
    batch = torch.arange(len(glyphs), device=glyphs.device).view(-1, 1, 1)
    return padded[batch, rows, columns]


# The networks that --model names: its choices are these keys (beast/flags.py reads them).
# A Dict observation gets DictNet unless --model names a net that reads Dict observations
# (READS_DICT: nethack); the others are nets for one array.
MODELS = {"atari": AtariNet, "resnet": ResNet, "small": SmallConvNet, "mlp": MLP,
          "nethack": NetHackNet}
# The flags that set a network's widths, each read by the nets that name it in their FLAGS
# (a net that does not is refused the flag, rather than ignoring it).
WIDTH_FLAGS = ("hidden_size", "channels")


def create_model(flags, observation_shape, num_actions, continuous=False):
    """Build the network that flags ask for, its weights initialized as flags.init says.

    Reads flags.model (a key of MODELS), flags.use_lstm, the flags the network's class
    names in its FLAGS (hidden_size: the width of the MLP's layers, of the small net's fc
    and of DictNet's encoders and core; channels: the ResNet's sections) and flags.init
    ("torch" or "orthogonal", see init_orthogonal).

    Args:
      flags: argparse.Namespace (or any object with those attributes).
      observation_shape: tuple, shape of one observation, e.g. (4, 84, 84);
        for a Dict observation a dict {entry: shape}, which gets DictNet unless
        flags.model names a net that reads Dict observations (READS_DICT).
      num_actions: int; with continuous, the length A of the action vector.
      continuous: a Gaussian policy for a Box action space (see ActorCritic).

    Raises:
      ValueError: with a message naming the --model to use, when the model is
        unknown or the observations do not fit it.
    """
    net = net_class(flags, observation_shape)
    if not isinstance(observation_shape, dict):
        observation_shape = tuple(observation_shape)
    options = {name: getattr(flags, name) for name in net.FLAGS}
    net = net(observation_shape, num_actions, use_lstm=flags.use_lstm, continuous=continuous,
              **options)
    if flags.init == "orthogonal":
        init_orthogonal(net)
    return net


def net_class(flags, observation_shape):
    """The class create_model builds: DictNet for a Dict observation unless --model reads
    one, else MODELS[--model]; ValueError for an unknown --model."""
    if isinstance(observation_shape, dict):
        net = MODELS.get(flags.model)
        return net if getattr(net, "READS_DICT", False) else DictNet
    if flags.model not in MODELS:
        raise ValueError(f"unknown --model {flags.model!r}; choose one of {', '.join(MODELS)}")
    return MODELS[flags.model]


def init_orthogonal(model):
    """Orthogonal weights and zero biases (in place; returned): gain sqrt(2) in the torso,
    0.01 for the policy head, 1 for the value head, as OpenAI's baselines initialize.

    PyTorch's default draws weights with a sixth of the variance that keeps a ReLU layer's
    output as large as its input, so the signal shrinks by sqrt(6) at each layer: the Atari
    net's features come out small, and so do their differences between frames that differ in
    a few pixels (Pong's ball and paddles). The heads then read nearly the same input from
    every frame; their biases learn the mean return long before RMSprop's steps, about a
    learning rate per weight, have grown the weights enough to tell frames apart. The small
    policy head starts every policy near uniform (a Gaussian policy's means near 0). An
    LSTM keeps PyTorch's init.
    """
    for module in model.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            nn.init.orthogonal_(module.weight, math.sqrt(2))
            nn.init.zeros_(module.bias)
    nn.init.orthogonal_(model.baseline.weight, 1.0)
    nn.init.orthogonal_(model.policy.weight, 0.01)
    return model


def to_learning_layout(model):
    """The learner's model with its convolution weights in NHWC (channels_last; in place,
    returned): oneDNN's convolutions on a CPU, and cuDNN's in bf16, run forward and backward
    faster on it than on NCHW, and every later tensor of the network follows the weights.
    The acting model takes its net's own layout (to_acting_layout)."""
    return model.to(memory_format=torch.channels_last)


def to_acting_layout(model):
    """The acting model with its convolution weights in its net's ACTING_LAYOUT (in place,
    returned): at acting's batches of a few frames the Atari net's strided 8x8 first layer
    runs a little faster NCHW, the ResNet's 3x3 convolutions faster NHWC. A
    model that names no layout (not an ActorCritic) keeps its own."""
    layout = getattr(model, "ACTING_LAYOUT", None)
    return model if layout is None else model.to(memory_format=layout)


# Acting precision (--acting_precision). The learner's model stays float32; the acting
# model (MonoBeast's shared copy, PolyBeast's inference replicas) may hold its weights in
# bfloat16, which Learner._publish's load_state_dict converts on every copy.

ACTING_PRECISIONS = ("fp32", "bf16")


def to_acting_precision(model, precision):
    """The acting model with its floating weights in `precision` (in place; returned).

    bf16 halves the bytes a forward pass reads: at the batches acting runs (a few
    environments), the Atari net's fc layer reads its 6.4 MB of weights for a handful of
    rows, so its time is the memory traffic, not the arithmetic."""
    if precision not in ACTING_PRECISIONS:
        raise ValueError(f"unknown acting precision {precision!r}; choose one of "
                         f"{', '.join(ACTING_PRECISIONS)}")
    if precision == "bf16":
        model.to(torch.bfloat16)
    return model


def act(model, inputs, core_state):
    """The acting forward pass: no gradients, and float32 outputs and core state whatever
    the model's precision, since the rollout buffers and messages hold float32 (and NumPy
    has no bfloat16). A bf16 model runs under bf16 autocast, which casts its float32 inputs
    (frames, rewards, the core state) as each layer takes them."""
    weight = next(model.parameters())
    with torch.no_grad():
        if weight.dtype != torch.bfloat16:
            return model(inputs, core_state)
        with torch.autocast(device_type=weight.device.type, dtype=torch.bfloat16):
            outputs, core_state = model(inputs, core_state)
    return ({k: _as_float32(v) for k, v in outputs.items()},
            tuple(_as_float32(s) for s in core_state))


def _as_float32(tensor):
    return tensor.float() if tensor.is_floating_point() else tensor
