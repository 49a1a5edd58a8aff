"""bench.torso: a network whose torso has died responds to no observation."""

import torch

import flag_helpers
from beast import models
from bench import torso


def test_a_dead_torso_responds_to_nothing():
    torch.manual_seed(0)
    net = models.create_model(flag_helpers.make_flags(kind="image"), (4, 10, 10), 3)
    frames = torch.rand(40, 4, 10, 10)
    shares, value_std, entropy = torso.responses(net, frames)
    assert len(shares) > 3 and all(share > 0 for share in shares.values())
    assert value_std > 0 and 0 < entropy <= torch.log(torch.tensor(3.0))
    last = [m for m in net.modules() if isinstance(m, torch.nn.Linear)
            and m not in (net.policy, net.baseline)][-1]
    with torch.no_grad():
        last.bias.fill_(-1e3)  # every unit of the last torso layer below zero: dead ReLUs
    shares, value_std, _ = torso.responses(net, frames)
    assert list(shares.values())[-1] == 0 and value_std == 0
    assert list(shares.values())[0] > 0  # the layers before it still see the frames


def test_gradient_shares_finds_the_dead_channels_and_the_damped_weights():
    torch.manual_seed(0)
    net = models.create_model(flag_helpers.make_flags(kind="image"), (4, 10, 10), 3)
    layers = torso.torso_layers(net)
    name, last = layers[-1]
    with torch.no_grad():
        last.bias[:5] = -1e3  # five units of the last torso layer dead, at least
    frames = torch.rand(40, 4, 10, 10)
    inputs = dict(frame=frames[:, None], reward=torch.zeros(40, 1),
                  done=torch.zeros(40, 1).bool(), last_action=torch.zeros(40, 1, dtype=torch.int64))
    silent = []  # the units of the last layer whose ReLU is 0 on every frame
    hook = last.register_forward_hook(
        lambda module, args, output: silent.append(int((output.amax(0) <= 0).sum())))
    for eps, stepping in ((1e-12, True), (1e6, False)):
        optimizer = torch.optim.RMSprop(net.parameters(), lr=0.0, eps=eps)
        for _ in range(3):
            optimizer.zero_grad()
            outputs, _ = net(inputs, net.initial_state(1))
            (outputs["baseline"].sum() + outputs["policy_logits"].square().sum()).backward()
            optimizer.step()
        shares = torso.gradient_shares(net, optimizer.state_dict())
        assert set(shares) == {n for n, _ in layers}
        assert silent[-1] >= 5 and shares[name][:2] == (silent[-1], last.bias.numel())
        # Live weights have had gradients above 1e-12, and none one above 1e6.
        first = shares[layers[0][0]][2]
        assert first > 0.5 if stepping else first == 0.0
    hook.remove()
