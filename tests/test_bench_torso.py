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
