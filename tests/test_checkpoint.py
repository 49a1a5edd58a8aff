import argparse
import errno
import os

import numpy as np
import pytest
import torch

from beast import checkpoint


def make_state(step):
    """A checkpoint as a run writes it, with real optimizer and scheduler state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.RMSprop(model.parameters(), lr=0.01, momentum=0.9, eps=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1 - epoch / 100)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(5, 4)).sum().backward()
        optimizer.step()
        scheduler.step()
    flags = argparse.Namespace(env="CartPole-v1", model="mlp", use_lstm=False, hidden_size=64,
                               savedir=os.path.expanduser("~"), learning_rate=0.01)
    return {
        "model_state_dict": model.state_dict(),
        "optimizer_state_dict": optimizer.state_dict(),
        "scheduler_state_dict": scheduler.state_dict(),
        "step": step,
        "flags": checkpoint.plain_flags(flags),
        "episode_stats": {"returns": [1.0, 2.0], "lengths": [10, 20], "count": 2},
    }


def test_round_trip_with_weights_only(tmp_path):
    path = tmp_path / "model.tar"
    state = make_state(step=123)
    checkpoint.save_checkpoint(path, state)
    loaded = checkpoint.load_checkpoint(path)
    assert loaded["step"] == 123
    assert loaded["flags"] == state["flags"]
    for key, tensor in state["model_state_dict"].items():
        torch.testing.assert_close(loaded["model_state_dict"][key], tensor)

    # The loaded state must restore into fresh objects.
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.RMSprop(model.parameters(), lr=0.01, momentum=0.9, eps=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1 - epoch / 100)
    model.load_state_dict(loaded["model_state_dict"])
    optimizer.load_state_dict(loaded["optimizer_state_dict"])
    scheduler.load_state_dict(loaded["scheduler_state_dict"])
    assert scheduler.last_epoch == 3
    assert optimizer.state_dict()["state"][0]["step"] == 3
    assert os.listdir(tmp_path) == ["model.tar"]  # no temporary file left


def test_failed_save_keeps_old_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "model.tar"
    checkpoint.save_checkpoint(path, make_state(step=1))

    def crashing_save(obj, f, *args, **kwargs):
        # As torch.save reports a full disk: its zip writer's RuntimeError, raised while
        # handling the OSError that says what happened.
        f.write(b"half a checkpoint")
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")

    monkeypatch.setattr(torch, "save", crashing_save)
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"cannot write the checkpoint .*model.tar: No space left on device$"):
        checkpoint.save_checkpoint(path, make_state(step=2))
    monkeypatch.undo()
    assert checkpoint.load_checkpoint(path)["step"] == 1
    assert os.listdir(tmp_path) == ["model.tar"]


def test_non_plain_value_is_refused_before_writing(tmp_path):
    path = tmp_path / "model.tar"
    with pytest.raises(checkpoint.CheckpointError, match=r"\['flags'\]\['seed'\].*int64"):
        checkpoint.save_checkpoint(path, {"step": 1, "flags": {"seed": np.int64(3)}})
    assert not path.exists()


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="no checkpoint at"):
        checkpoint.load_checkpoint(tmp_path / "absent.tar")
    corrupt = tmp_path / "corrupt.tar"
    corrupt.write_bytes(b"not a checkpoint at all")
    with pytest.raises(checkpoint.CheckpointError, match="cannot read the checkpoint"):
        checkpoint.load_checkpoint(corrupt)


def test_compat_lists_every_differing_key():
    saved = {"env": "PongNoFrameskip-v4", "model": "resnet", "use_lstm": True, "hidden_size": 64}
    given = argparse.Namespace(env="PongNoFrameskip-v4", model="atari", use_lstm=False,
                               hidden_size=64)
    with pytest.raises(checkpoint.CheckpointError) as info:
        checkpoint.check_compatible(saved, given)
    message = str(info.value)
    assert "checkpoint was trained with --model resnet, you gave --model atari" in message
    assert "checkpoint was trained with --use_lstm True, you gave --use_lstm False" in message
    assert "--env" not in message and "--hidden_size" not in message
    assert "--xpid" in message
    assert "cannot change on a resume" in message and message.count("\n") == 3  # one message
    checkpoint.check_compatible(saved, argparse.Namespace(**saved))  # same flags: no error
