import argparse
import errno
import json
import os

import numpy as np
import pytest
import torch

import flag_helpers
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


def test_a_resume_keeps_the_resnets_channels_as_flags_json_reads_them_back(tmp_path):
    """--channels is a list, which flags.json reads back as the same list: a resume without
    the flag fits, another width is refused, and a run saved before the flag (no key) fits."""
    flags = flag_helpers.make_flags("--channels", "8,16,16", model="resnet", kind="atari")
    saved = json.loads(json.dumps(checkpoint.plain_flags(flags)))
    checkpoint.check_compatible(saved, flags)
    wider = flag_helpers.make_flags(model="resnet", kind="atari")
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"trained with --channels \[8, 16, 16\], you gave --channels "):
        checkpoint.check_compatible(saved, wider)
    del saved["channels"]
    checkpoint.check_compatible(saved, wider)
    # A run saved before the flag had the default widths: other widths typed on its resume
    # are refused before flags.json is rewritten, not met by load_state_dict's traceback.
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"trained with --channels \[16, 32, 32\], you gave --channels "
                             r"\[8, 16, 16\]"):
        checkpoint.check_compatible(saved, flags)


@pytest.mark.parametrize("env_id, penalty", [("NetHackScore-v0", -0.01),
                                             ("NetHackChallenge-v0", 0.0),
                                             ("NetHack-v0", None), ("CartPole-v1", None)])
def test_a_nethack_run_saved_before_penalty_step_keeps_nle_s_registered_penalty(env_id, penalty):
    """Its reward must not change on a resume: NLE's own penalty, not today's default."""
    flags = argparse.Namespace(env=env_id, penalty_step=None, pg_clip=None, reward_scale=None,
                               lr_warmup_steps=None, init=None)
    checkpoint.merge_saved_flags(flags, {"env": env_id}, given=set())
    assert flags.penalty_step == penalty
    typed = argparse.Namespace(**{**vars(flags), "penalty_step": -0.5})
    checkpoint.merge_saved_flags(typed, {"env": env_id}, {"penalty_step"})
    assert typed.penalty_step == -0.5


def test_a_flag_a_checkpoint_predates_holds_it_to_the_value_it_had():
    """full_action_space came later: an old checkpoint had the id's own action set."""
    checkpoint.check_compatible({"env": "ALE/Pong-v5"}, {"env": "ALE/Pong-v5",
                                                   "full_action_space": False})
    with pytest.raises(checkpoint.CheckpointError, match="--full_action_space False"):
        checkpoint.check_compatible({"env": "ALE/Pong-v5", "full_action_space": False},
                              {"env": "ALE/Pong-v5", "full_action_space": True})
    # It had the id's own action set: all 18 actions typed on its resume are refused.
    with pytest.raises(checkpoint.CheckpointError, match="--full_action_space False"):
        checkpoint.check_compatible({"env": "ALE/Pong-v5"},
                                    {"env": "ALE/Pong-v5", "full_action_space": True})
