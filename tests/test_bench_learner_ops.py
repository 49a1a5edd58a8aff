"""bench.learner_ops: a learner step's time per sample and the operators that take it."""

import argparse

import pytest

from bench import learner_ops


def test_a_net_is_read_from_its_model_channels_and_batch():
    net, batch_size = learner_ops.parse_net("resnet:8,16,16@8")
    assert (net.model, net.channels, batch_size) == ("resnet", "8,16,16", 8)
    net, batch_size = learner_ops.parse_net("atari@4")
    assert (net.model, net.observation_shape, batch_size) == ("atari", (4, 84, 84), 4)
    for text in ("mlp@4", "resnet:8,16,16", "atari@four"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected atari@B"):
            learner_ops.parse_net(text)


def test_the_report_times_each_net_and_names_its_convolutions(capsys):
    learner_ops.main(["--net", "atari@1", "--net", "resnet:2,2,2@1", "--calls", "1",
                      "--no_compile", "--threads", "1", "--top", "40"])
    report = capsys.readouterr().out
    rows = [line for line in report.splitlines() if "| eager |" in line]
    assert [row.split(" | ")[0] for row in rows] == ["| Atari net (4x84x84, 6 actions)",
                                                     "| ResNet 2,2,2 (4x84x84, 6 actions)"]
    assert all(float(row.split(" | ")[-1].rstrip(" |")) > 0 for row in rows)
    # The ResNet's step pools; the Atari net's does not.
    atari, resnet = report.split("operators by their own time")[1:]
    assert "convolution" in atari and "max_pool2d" not in atari
    assert "convolution" in resnet and "max_pool2d" in resnet
