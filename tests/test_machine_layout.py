"""The layout a run takes when no layout flag is typed: the laptop's (2 actor processes, at
most 4 local env servers, one learner thread) unless the learner is on a GPU with at least
machine.GPU_MACHINE_MIN_CORES cores, where both variants fill the machine as the layout
measured on one GPU with 16 cores does. The machine's cores and its GPU are faked here."""

import pytest
import torch

import monobeast
import polybeast
from beast import checkpoint as ckpt
from beast import machine
from beast import training


def resolved(monkeypatch, variant, cores, gpu, *args, env="CartPole-v1"):
    """The flags of `python -m <variant> --env env *args` once resolved on a machine of
    `cores` cores, with a GPU or not."""
    monkeypatch.setattr(machine, "cores", lambda: cores)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    flags = training.parse_flags(variant.make_parser(), ["--env", env, *args])
    training.resolve_flags_for_env(flags, variant.resolve_flags, None)
    return flags


def layout(flags, *names):
    return tuple(getattr(flags, name) for name in names)


MONO = ("num_actors", "num_learner_threads", "num_torch_threads", "batch_size")
POLY = ("num_actors", "envs_per_stream", "num_inference_threads", "num_learner_threads",
        "batch_size")


def test_the_gpu_machine_threshold():
    assert machine.is_gpu_machine("cuda", machine.GPU_MACHINE_MIN_CORES)
    assert not machine.is_gpu_machine("cuda", machine.GPU_MACHINE_MIN_CORES - 1)
    assert not machine.is_gpu_machine("cpu", 64)


def test_monobeast_fills_a_gpu_machine_and_keeps_the_laptop_layout_elsewhere(monkeypatch):
    """16 cores and a GPU: 14 actors (the two other cores for the 2 learner threads) and
    batches of 8 on Atari, the 5-minute Pong layout. Without the GPU, or with too few cores,
    or with --disable_cuda: the laptop's 2 actors, one learner thread, batches of 4."""
    assert layout(resolved(monkeypatch, monobeast, 16, True, env="PongNoFrameskip-v4"),
                  *MONO) == (14, 2, 2, 8)
    assert layout(resolved(monkeypatch, monobeast, 16, False, env="PongNoFrameskip-v4"),
                  *MONO) == (2, 1, 14, 4)
    assert layout(resolved(monkeypatch, monobeast, 4, True, env="PongNoFrameskip-v4"),
                  *MONO) == (2, 1, 2, 4)
    assert layout(resolved(monkeypatch, monobeast, 16, True, "--disable_cuda",
                           env="PongNoFrameskip-v4"), *MONO) == (2, 1, 14, 4)
    # Sticky actions have batches of 8 on any machine.
    assert layout(resolved(monkeypatch, monobeast, 16, False, env="ALE/Pong-v5"),
                  *MONO) == (2, 1, 14, 8)
    # The batch of 8 is Atari's; other kinds keep their own on a GPU machine.
    assert layout(resolved(monkeypatch, monobeast, 16, True), *MONO) == (14, 2, 2, 16)


def test_typed_layout_flags_win_on_a_gpu_machine(monkeypatch):
    flags = resolved(monkeypatch, monobeast, 16, True, "--num_actors", "6", "--batch_size",
                     "32", "--num_learner_threads", "1", env="PongNoFrameskip-v4")
    assert layout(flags, *MONO) == (6, 1, 10, 32)
    flags = resolved(monkeypatch, polybeast, 16, True, "--num_actors", "8",
                     "--envs_per_stream", "4", "--num_inference_threads", "1",
                     env="PongNoFrameskip-v4")
    assert layout(flags, *POLY) == (8, 4, 1, 2, 8)


def test_deterministic_runs_learn_in_one_thread_on_a_gpu_machine(monkeypatch):
    flags = resolved(monkeypatch, monobeast, 16, True, "--deterministic")
    assert (flags.num_actors, flags.num_learner_threads) == (14, 1)
    with pytest.raises(training.UserError, match="--deterministic learns in one thread"):
        resolved(monkeypatch, monobeast, 16, True, "--deterministic",
                 "--num_learner_threads", "2")


def test_polybeast_starts_a_server_per_core_on_a_gpu_machine(monkeypatch):
    """16 cores and a GPU: 16 local servers of 16 Atari games and 2 inference threads, the
    layout measured there; elsewhere at most 4 servers, one per core, and one thread."""
    assert layout(resolved(monkeypatch, polybeast, 16, True, env="PongNoFrameskip-v4"),
                  *POLY) == (16, 16, 2, 2, 8)
    assert layout(resolved(monkeypatch, polybeast, 16, False, env="PongNoFrameskip-v4"),
                  *POLY) == (4, 2, 1, 1, 4)
    assert layout(resolved(monkeypatch, polybeast, 2, False, env="PongNoFrameskip-v4"),
                  *POLY) == (2, 4, 1, 1, 4)
    # Servers elsewhere: one actor per address, as on any machine.
    flags = resolved(monkeypatch, polybeast, 16, True, "--server_addresses",
                     "h:4000,h:4001,h:4002", env="PongNoFrameskip-v4")
    assert layout(flags, "num_actors", "envs_per_stream") == (3, 16)


def test_a_run_resumed_on_a_gpu_machine_keeps_its_own_layout(monkeypatch):
    """A run saved on a laptop and resumed on a GPU machine keeps the layout of its
    flags.json (checkpoint.merge_saved_flags runs before the defaults are filled)."""
    saved = vars(resolved(monkeypatch, monobeast, 2, False, env="PongNoFrameskip-v4")).copy()
    monkeypatch.setattr(machine, "cores", lambda: 16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    flags = training.parse_flags(monobeast.make_parser(), ["--env", "PongNoFrameskip-v4"])
    ckpt.merge_saved_flags(flags, saved, flags.given)
    training.resolve_flags_for_env(flags, monobeast.resolve_flags, None)
    assert layout(flags, "num_actors", "num_learner_threads", "batch_size") == (2, 1, 4)
