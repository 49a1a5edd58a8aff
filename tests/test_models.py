"""Shapes, dtypes, LSTM resets, gradients and errors of beast/models.py."""

import pytest
import torch

import flag_helpers
from beast import flags as beast_flags
from beast import models

NUM_ACTIONS = 5
# Small frames keep the convolutional tests fast; 36x36 is the least the
# Atari net accepts. One test below uses the real Atari shape.
IMAGE_SHAPE = (4, 36, 36)
VECTOR_SHAPE = (7,)
MODEL_SHAPES = [("atari", IMAGE_SHAPE), ("resnet", IMAGE_SHAPE), ("small", IMAGE_SHAPE),
                ("mlp", VECTOR_SHAPE)]


def make_flags(model, use_lstm, hidden_size=16):
    return flag_helpers.make_flags(model=model, use_lstm=use_lstm, hidden_size=hidden_size)


def make_model(model, observation_shape, use_lstm, seed=0):
    torch.manual_seed(seed)
    return models.create_model(make_flags(model, use_lstm), observation_shape, NUM_ACTIONS)


def make_inputs(T, B, observation_shape, seed=0, uint8=None, done=None):
    generator = torch.Generator().manual_seed(seed)
    if uint8 is None:
        uint8 = len(observation_shape) == 3
    if uint8:
        frame = torch.randint(0, 256, (T, B, *observation_shape), generator=generator,
                              dtype=torch.uint8)
    else:
        frame = torch.randn((T, B, *observation_shape), generator=generator)
    if done is None:
        done = torch.rand((T, B), generator=generator) < 0.3
    return dict(
        frame=frame,
        reward=torch.randn((T, B), generator=generator) * 3,
        done=done,
        last_action=torch.randint(0, NUM_ACTIONS, (T, B), generator=generator),
    )


@pytest.mark.parametrize("model_name,observation_shape", MODEL_SHAPES)
@pytest.mark.parametrize("use_lstm", [False, True])
@pytest.mark.parametrize("T,B", [(1, 3), (5, 2)])
def test_output_shapes_and_dtypes(model_name, observation_shape, use_lstm, T, B):
    model = make_model(model_name, observation_shape, use_lstm)
    state = model.initial_state(B)
    if use_lstm:
        assert len(state) == 2
        for s in state:
            assert s.dim() == 3 and s.shape[:2] == (1, B) and s.dtype == torch.float32
    else:
        assert state == ()

    outputs, new_state = model(make_inputs(T, B, observation_shape), state)
    assert set(outputs) == {"policy_logits", "baseline", "action"}
    assert outputs["policy_logits"].shape == (T, B, NUM_ACTIONS)
    assert outputs["policy_logits"].dtype == torch.float32
    assert outputs["baseline"].shape == (T, B)
    assert outputs["baseline"].dtype == torch.float32
    assert outputs["action"].shape == (T, B)
    assert outputs["action"].dtype == torch.int64
    assert ((outputs["action"] >= 0) & (outputs["action"] < NUM_ACTIONS)).all()
    assert len(new_state) == len(state)
    for old, new in zip(state, new_state):
        assert old.shape == new.shape


@pytest.mark.parametrize("kind, shape, cls", [("atari", (4, 84, 84), models.AtariNet),
                                              ("image", (4, 10, 10), models.ResNet),
                                              ("vector", (8,), models.MLP),
                                              ("continuous", (3,), models.MLP)])
def test_create_model_builds_what_the_env_defaults_say(kind, shape, cls):
    """The flags' defaults (beast/flags.py ENV_DEFAULTS) are the only ones: create_model has
    none of its own, so the net of each kind is the one the table names, at its width."""
    flags = flag_helpers.make_flags(kind=kind)
    net = models.create_model(flags, shape, 3)
    assert type(net) is cls and net.core is None  # --use_lstm is off by default
    if cls is models.MLP:
        assert net.layers[0].out_features == beast_flags.ENV_DEFAULTS[kind]["hidden_size"]


def test_create_model_picks_classes():
    assert type(models.create_model(make_flags("resnet", False), (3, 64, 64), 3)) is models.ResNet
    wide = models.create_model(make_flags("mlp", False, hidden_size=32), (8,), 3)
    assert wide.layers[0].out_features == 32 and isinstance(wide.layers[1], torch.nn.Tanh)
    relu = models.MLP((8,), 3, hidden_size=32, activation="relu")
    assert isinstance(relu.layers[1], torch.nn.ReLU)


class TinyNet(models.ActorCritic):
    """A forker's network: a torso of one linear layer, of --hidden_size."""

    FLAGS = ("hidden_size",)

    def __init__(self, observation_shape, num_actions, use_lstm=False, hidden_size=4,
                 continuous=False):
        super().__init__(observation_shape, num_actions, hidden_size, use_lstm, continuous)
        self.fc = torch.nn.Linear(observation_shape[0], hidden_size)

    def torso(self, x):
        return self.fc(x)


def test_models_is_the_one_list_of_networks(monkeypatch):
    """--model's choices are MODELS' keys, and a network added to MODELS is what create_model
    builds for its name, with the flags its FLAGS names."""
    parser = beast_flags.common_parser()
    (action,) = (a for a in parser._actions if a.dest == "model")
    assert list(action.choices) == list(models.MODELS)
    monkeypatch.setitem(models.MODELS, "tiny", TinyNet)
    net = models.create_model(make_flags("tiny", False, hidden_size=6), VECTOR_SHAPE, NUM_ACTIONS)
    assert type(net) is TinyNet and net.fc.out_features == 6
    outputs, _ = net(make_inputs(2, 3, VECTOR_SHAPE))
    assert outputs["policy_logits"].shape == (2, 3, NUM_ACTIONS)


def test_small_net_is_the_minatar_papers():
    """One 3x3 conv of 16 channels without padding, then fc 128 (hidden_size): on MinAtar's
    [C, 10, 10] frames, 16 x 8 x 8 features into the fc."""
    net = models.create_model(flag_helpers.make_flags(model="small", kind="image"), (4, 10, 10),
                              NUM_ACTIONS)
    assert type(net) is models.SmallConvNet
    assert (net.conv.in_channels, net.conv.out_channels, net.conv.kernel_size) == (4, 16, (3, 3))
    assert net.conv.padding == (0, 0) and net.conv.stride == (1, 1)
    assert (net.fc.in_features, net.fc.out_features) == (16 * 8 * 8, 128)
    assert sum(isinstance(m, torch.nn.Conv2d) for m in net.modules()) == 1
    outputs, _ = net(make_inputs(2, 3, (4, 10, 10), uint8=False))
    assert outputs["policy_logits"].shape == (2, 3, NUM_ACTIONS)


@pytest.mark.parametrize("text, channels", [("16,32,32", [16, 32, 32]), ("8,16,16", [8, 16, 16]),
                                             ("4,8", [4, 8])])
def test_resnet_sections_take_the_channels_flag(text, channels):
    """--channels sets each section's width, one section a number; each section halves the
    frame (84 -> 42 -> 21 -> 11), so the fc reads the last width x the last frame's area."""
    flags = flag_helpers.make_flags("--channels", text, model="resnet", kind="atari")
    assert flags.channels == channels
    net = models.create_model(flags, (4, 84, 84), NUM_ACTIONS)
    convs = [m for m in net.sections.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 5 * len(channels)  # a conv and two blocks of two a section
    assert [s[0].out_channels for s in net.sections] == channels
    side = [42, 21, 11][len(channels) - 1]
    assert net.fc.in_features == channels[-1] * side * side
    outputs, _ = net(make_inputs(2, 3, (4, 84, 84)))
    assert outputs["policy_logits"].shape == (2, 3, NUM_ACTIONS)


@pytest.mark.parametrize("text", ["", "16,,32", "16,0,32", "a,b", "16.5"])
def test_channels_that_are_not_positive_integers_are_refused(text, capsys):
    with pytest.raises(SystemExit):
        flag_helpers.make_flags("--channels", text)
    assert "comma-separated list of integers >= 1" in capsys.readouterr().err


def test_atari_shape_end_to_end():
    for name in ["atari", "resnet"]:
        model = make_model(name, (4, 84, 84), use_lstm=True)
        outputs, _ = model(make_inputs(2, 2, (4, 84, 84)), model.initial_state(2))
        assert outputs["policy_logits"].shape == (2, 2, NUM_ACTIONS)


@pytest.mark.parametrize("model_name,observation_shape", MODEL_SHAPES)
def test_uint8_frames_are_scaled(model_name, observation_shape):
    model = make_model(model_name, observation_shape, use_lstm=False).eval()
    inputs = make_inputs(3, 2, observation_shape, uint8=True)
    as_float = dict(inputs, frame=inputs["frame"].float() / 255.0)
    out_uint8, _ = model(inputs)
    out_float, _ = model(as_float)
    torch.testing.assert_close(out_uint8["policy_logits"], out_float["policy_logits"])
    torch.testing.assert_close(out_uint8["baseline"], out_float["baseline"])
    # Float frames are used as given, not scaled again.
    out_unscaled, _ = model(dict(inputs, frame=inputs["frame"].float()))
    assert not torch.allclose(out_unscaled["baseline"], out_float["baseline"])


def test_reward_is_clipped():
    model = make_model("mlp", VECTOR_SHAPE, use_lstm=False).eval()
    inputs = make_inputs(2, 3, VECTOR_SHAPE)
    big = model(dict(inputs, reward=torch.full((2, 3), 50.0)))[0]
    one = model(dict(inputs, reward=torch.full((2, 3), 1.0)))[0]
    half = model(dict(inputs, reward=torch.full((2, 3), 0.5)))[0]
    torch.testing.assert_close(big["baseline"], one["baseline"])
    assert not torch.allclose(half["baseline"], one["baseline"])


def done_pattern(kind, T, B):
    done = torch.zeros(T, B, dtype=torch.bool)
    if kind == "some":
        done[2, 0] = done[4, 1] = done[4, 2] = done[5, 0] = True
    elif kind == "first_and_last":
        done[0, 1] = done[T - 1, 2] = True
    elif kind == "dense":
        done = torch.rand((T, B), generator=torch.Generator().manual_seed(3)) < 0.5
    elif kind == "all":
        done[:] = True
    return done


@pytest.mark.parametrize("model_name,observation_shape", MODEL_SHAPES)
@pytest.mark.parametrize("done_kind", ["none", "some", "first_and_last", "dense", "all"])
def test_lstm_all_at_once_equals_step_by_step(model_name, observation_shape, done_kind):
    # Running T=1 at a time and carrying the state is the plain definition of
    # the reset rule; the T-step call must agree with it for any done pattern.
    T, B = 6, 3
    model = make_model(model_name, observation_shape, use_lstm=True)
    inputs = make_inputs(T, B, observation_shape, done=done_pattern(done_kind, T, B))
    initial = tuple(torch.randn_like(s) for s in model.initial_state(B))

    whole, whole_state = model(inputs, initial)
    state = initial
    logits, baselines = [], []
    for t in range(T):
        step_inputs = {key: value[t : t + 1] for key, value in inputs.items()}
        out, state = model(step_inputs, state)
        logits.append(out["policy_logits"])
        baselines.append(out["baseline"])
    torch.testing.assert_close(whole["policy_logits"], torch.cat(logits))
    torch.testing.assert_close(whole["baseline"], torch.cat(baselines))
    for a, b in zip(whole_state, state):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("model_name,observation_shape", MODEL_SHAPES)
def test_done_resets_lstm_state(model_name, observation_shape):
    T, B, reset_step = 5, 2, 3
    model = make_model(model_name, observation_shape, use_lstm=True)
    done = torch.zeros(T, B, dtype=torch.bool)
    done[reset_step, 0] = True  # entry 0 starts a new episode at step 3
    inputs_a = make_inputs(T, B, observation_shape, seed=1, done=done)
    inputs_b = make_inputs(T, B, observation_shape, seed=2, done=done)
    # Same steps from reset_step on; different history and initial state.
    for key in ["frame", "reward", "last_action"]:
        inputs_b[key][reset_step:] = inputs_a[key][reset_step:]
    state_a = tuple(torch.randn_like(s) for s in model.initial_state(B))
    state_b = tuple(torch.randn_like(s) for s in model.initial_state(B))

    out_a, _ = model(inputs_a, state_a)
    out_b, _ = model(inputs_b, state_b)
    # Entry 0 forgets everything before the reset...
    torch.testing.assert_close(out_a["policy_logits"][reset_step:, 0],
                               out_b["policy_logits"][reset_step:, 0])
    torch.testing.assert_close(out_a["baseline"][reset_step:, 0],
                               out_b["baseline"][reset_step:, 0])
    # ...and the output at the reset equals that of a fresh state.
    fresh, _ = model({k: v[reset_step:] for k, v in inputs_a.items()},
                     model.initial_state(B))
    torch.testing.assert_close(out_a["baseline"][reset_step:, 0], fresh["baseline"][:, 0])
    # Entry 1 has no reset, so its history still matters.
    assert not torch.allclose(out_a["baseline"][reset_step:, 1],
                              out_b["baseline"][reset_step:, 1])


def test_lstm_accepts_empty_core_state():
    model = make_model("mlp", VECTOR_SHAPE, use_lstm=True)
    inputs = make_inputs(3, 2, VECTOR_SHAPE)
    from_empty, _ = model(inputs, ())
    from_zeros, _ = model(inputs, model.initial_state(2))
    torch.testing.assert_close(from_empty["baseline"], from_zeros["baseline"])


@pytest.mark.parametrize("model_name,observation_shape", MODEL_SHAPES)
def test_eval_mode_takes_argmax(model_name, observation_shape):
    model = make_model(model_name, observation_shape, use_lstm=True).eval()
    inputs = make_inputs(4, 3, observation_shape)
    first, _ = model(inputs, model.initial_state(3))
    second, _ = model(inputs, model.initial_state(3))
    torch.testing.assert_close(first["action"], second["action"])
    torch.testing.assert_close(first["action"], first["policy_logits"].argmax(-1))


def test_training_mode_samples_from_softmax():
    model = make_model("mlp", VECTOR_SHAPE, use_lstm=False).train()
    with torch.no_grad():
        model.policy.weight.zero_()
        model.policy.bias.copy_(torch.tensor([0.0, 1.0, 2.0, 0.5, -1.0]))
    T, B = 500, 8
    torch.manual_seed(0)
    outputs, _ = model(make_inputs(T, B, VECTOR_SHAPE))
    counts = torch.bincount(outputs["action"].flatten(), minlength=NUM_ACTIONS).float()
    expected = torch.softmax(model.policy.bias.detach(), 0) * T * B
    # 4000 samples: frequencies within a few standard deviations.
    assert ((counts - expected).abs() < 5 * expected.sqrt() + 5).all()
    assert (counts > 0).sum() == NUM_ACTIONS


@pytest.mark.parametrize("model_name,observation_shape", MODEL_SHAPES)
@pytest.mark.parametrize("use_lstm", [False, True])
def test_gradients_reach_all_parameters(model_name, observation_shape, use_lstm):
    model = make_model(model_name, observation_shape, use_lstm)
    B = 3
    outputs, _ = model(make_inputs(4, B, observation_shape, uint8=False),
                       tuple(torch.randn_like(s) for s in model.initial_state(B)))
    loss = outputs["policy_logits"].logsumexp(-1).sum() + outputs["baseline"].pow(2).sum()
    loss.backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, name
        assert parameter.grad.abs().sum() > 0, name


@pytest.mark.parametrize(
    "model_name,observation_shape,message",
    [
        ("atari", (7,), "use --model mlp"),
        ("resnet", (7,), "use --model mlp"),
        ("small", (7,), "use --model mlp"),
        ("small", (4, 2, 2), "at least 3x3"),
        ("mlp", (4, 84, 84), "use --model atari or --model resnet"),
        ("atari", (4, 16, 16), "use --model resnet"),
        ("nope", (7,), "unknown --model 'nope'"),
    ],
)
def test_bad_observation_shape_errors(model_name, observation_shape, message):
    with pytest.raises(ValueError, match=message):
        models.create_model(make_flags(model_name, False), observation_shape, NUM_ACTIONS)


def test_no_model_fits_other_ranks():
    for model in models.MODELS:
        with pytest.raises(ValueError):
            models.create_model(make_flags(model, False), (3, 4), NUM_ACTIONS)
    with pytest.raises(ValueError, match="unknown --model 'transformer'"):
        models.create_model(make_flags("transformer", False), (8,), NUM_ACTIONS)


def test_frame_shape_mismatch_in_forward():
    model = make_model("mlp", VECTOR_SHAPE, use_lstm=False)
    with pytest.raises(ValueError, match=r"built for observations of shape \(7,\)"):
        model(make_inputs(2, 2, (8,)))


@pytest.mark.parametrize("model_name,observation_shape", MODEL_SHAPES)
@pytest.mark.parametrize("use_lstm", [False, True])
def test_a_bf16_acting_model_acts_like_the_float32_one(model_name, observation_shape, use_lstm):
    """--acting_precision bf16: the acting model holds bfloat16 weights, copied from the
    learner's float32 ones as Learner._publish copies them, and hands back float32 outputs
    and core state (the buffers' dtypes) that differ from the float32 model's by bf16's
    rounding only."""
    learner_model = make_model(model_name, observation_shape, use_lstm)
    acting = models.to_acting_precision(make_model(model_name, observation_shape, use_lstm,
                                                   seed=1), "bf16")
    acting.load_state_dict(learner_model.state_dict())
    for name, weight in learner_model.named_parameters():
        copied = dict(acting.named_parameters())[name]
        assert copied.dtype == torch.bfloat16
        assert torch.equal(copied, weight.detach().bfloat16()), name
    learner_model.eval()  # the argmax, so that actions can be compared
    acting.eval()
    inputs = make_inputs(1, 8, observation_shape)
    state = learner_model.initial_state(8)
    if use_lstm:  # a state from earlier steps, not zeros
        state = tuple(torch.randn_like(s) for s in state)
    expected, expected_state = models.act(learner_model, inputs, state)
    outputs, new_state = models.act(acting, inputs, state)
    assert set(outputs) == set(expected)
    for key, value in outputs.items():
        assert value.dtype == expected[key].dtype and value.shape == expected[key].shape, key
    for ours, theirs in zip(new_state, expected_state):
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, theirs, atol=0.03, rtol=0.03)
    scale = expected["policy_logits"].abs().max() + expected["baseline"].abs().max()
    for key in ("policy_logits", "baseline"):
        error = (outputs[key] - expected[key]).abs().max()
        assert error <= 0.03 * scale, (key, error, scale)
    # Where float32's best action leads clearly, bf16 picks it too.
    top2 = expected["policy_logits"][0].topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1 * scale
    assert torch.equal(outputs["action"][0][clear], expected["action"][0][clear])


def test_a_float32_acting_model_is_left_as_it_is():
    model = make_model("mlp", VECTOR_SHAPE, False)
    assert models.to_acting_precision(model, "fp32") is model
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with pytest.raises(ValueError, match="acting precision 'fp16'"):
        models.to_acting_precision(model, "fp16")


@pytest.mark.parametrize("model_name, observation_shape, nhwc", [
    ("atari", (4, 84, 84), False), ("resnet", (4, 84, 84), True), ("resnet", (4, 10, 10), True)])
def test_the_acting_layout_is_the_nets_own_and_takes_the_learners_weights(
        model_name, observation_shape, nhwc):
    """The acting model's conv weights are NHWC for the ResNet and NCHW for the Atari net
    (models.to_acting_layout); the learner's weights, copied in as Learner._publish copies
    them, give the same outputs as the learner's model."""
    acting = models.to_acting_layout(make_model(model_name, observation_shape, False, seed=1))
    conv_weights = [p for p in acting.parameters() if p.dim() == 4]
    assert conv_weights and all(
        p.is_contiguous(memory_format=torch.channels_last) == nhwc and p.is_contiguous() != nhwc
        for p in conv_weights)
    learning = models.to_learning_layout(make_model(model_name, observation_shape, False))
    acting.load_state_dict(learning.state_dict())
    assert all(p.is_contiguous(memory_format=torch.channels_last) == nhwc for p in conv_weights)
    inputs = make_inputs(1, 4, observation_shape, uint8=True)
    expected, _ = learning.eval()(inputs, ())
    got, _ = models.act(acting.eval(), inputs, ())
    torch.testing.assert_close(got["policy_logits"], expected["policy_logits"],
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got["baseline"], expected["baseline"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model_name, observation_shape", [("atari", (4, 84, 84)),
                                                           ("resnet", (4, 10, 10))])
def test_the_learning_layout_computes_what_the_nchw_model_does(model_name, observation_shape):
    """NHWC weights (models.to_learning_layout) change the memory order, not the function:
    outputs and gradients match those of the same weights in NCHW."""
    nchw = make_model(model_name, observation_shape, use_lstm=False)
    nhwc = models.to_learning_layout(make_model(model_name, observation_shape, use_lstm=False))
    conv_weights = [p for p in nhwc.parameters() if p.dim() == 4]
    assert conv_weights and all(p.is_contiguous(memory_format=torch.channels_last)
                                and not p.is_contiguous() for p in conv_weights)
    inputs = make_inputs(3, 2, observation_shape, uint8=True)
    results = []
    for net in (nchw, nhwc):
        outputs, _ = net(inputs, ())
        (outputs["policy_logits"].sum() + outputs["baseline"].sum()).backward()
        results.append((outputs, [p.grad for p in net.parameters()]))
    (out_a, grads_a), (out_b, grads_b) = results
    for key in ("policy_logits", "baseline"):
        torch.testing.assert_close(out_a[key], out_b[key], rtol=1e-4, atol=1e-5)
    for grad_a, grad_b in zip(grads_a, grads_b):
        torch.testing.assert_close(grad_a, grad_b, rtol=1e-3, atol=1e-4)


def pong_like_frames(positions, background=87, ball=236):
    """uint8 [N, 4, 84, 84] frames of one grey background with a 2x2 ball at each position."""
    frames = torch.full((len(positions), 4, 84, 84), background, dtype=torch.uint8)
    for i, (row, col) in enumerate(positions):
        frames[i, :, row:row + 2, col:col + 2] = ball
    return frames


def feature_spread(net, frames):
    """How much the Atari net's features move with the ball: their std across frames,
    averaged over the features."""
    with torch.no_grad():
        return float(net.torso(frames.float() / 255).std(0).mean())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_orthogonal_init_is_what_baselines_draw_and_sees_the_ball(seed):
    """--init orthogonal: every conv and linear layer orthogonal (W W^T = gain^2 I over the
    flattened fan-in, or W^T W for a tall matrix), gain sqrt(2) in the torso, 0.01 for the
    policy, 1 for the value head, biases 0. On frames that differ only where a small ball
    is, its features differ ten times more than with PyTorch's default draw, whose layers
    each shrink the signal."""
    torch.manual_seed(seed)
    net = models.create_model(flag_helpers.make_flags(kind="atari", init="orthogonal"),
                              (4, 84, 84), NUM_ACTIONS)
    gains = {net.policy: 0.01, net.baseline: 1.0}
    for layer in [net.conv1, net.conv2, net.conv3, net.fc, net.policy, net.baseline]:
        weight = layer.weight.detach().flatten(1).double()
        gram = weight @ weight.T if weight.shape[0] <= weight.shape[1] else weight.T @ weight
        gain = gains.get(layer, 2 ** 0.5)
        torch.testing.assert_close(gram, gain ** 2 * torch.eye(len(gram), dtype=torch.double),
                                   atol=1e-5, rtol=1e-5)
        assert not layer.bias.any()
    torch.manual_seed(seed)
    default = models.create_model(flag_helpers.make_flags(kind="atari", init="torch"),
                                  (4, 84, 84), NUM_ACTIONS)
    frames = pong_like_frames([(20 + 7 * i, 10 + 11 * i) for i in range(6)])
    assert feature_spread(net, frames) > 10 * feature_spread(default, frames)
