"""The rollout schema (beast/rollout.py): declared once, extended without edits.

The end-to-end test adds an environment-side field (declared by a wrapper, in
tests/extra_fields_env.py) and a model output (a head defined here) and sees both
arrive in the learner's batch, in MonoBeast (actor processes and serial mode) and
PolyBeast (single-environment and batched streams), with nothing edited outside
this test: the model and a loss term that records the batch are patched in.
"""


import os
import subprocess
import sys

import gymnasium
import numpy as np
import pytest
import torch

import flag_helpers
import monobeast
from beast import envs, loss, models, rollout

EXTRA_ENV = "tests.extra_fields_env:ExtraFieldsCartPole-v0"


class AuxMLP(models.MLP):
    """An MLP with one more head: `aux`, float32 [T, B, 2], read from the frame."""

    def __init__(self, observation_shape, num_actions):
        super().__init__(observation_shape, num_actions, hidden_size=16)
        self.aux = torch.nn.Linear(observation_shape[0], 2)

    def forward(self, inputs, core_state=()):
        outputs, core_state = super().forward(inputs, core_state)
        outputs["aux"] = self.aux(inputs["frame"].float())
        return outputs, core_state


def train_recording_batches(variant, tmp_path, monkeypatch, *args):
    """Trains in this process with AuxMLP and a loss term that records each batch."""
    seen = []

    def record_batch(flags, inputs):
        seen.append(dict({k: v.detach().clone() for k, v in inputs.batch.items()},
                         learner_aux=inputs.learner_outputs["aux"].detach().clone()))
        return inputs.learner_outputs["aux"].sum() * 0.0

    monkeypatch.setattr(loss, "LOSS_TERMS", loss.LOSS_TERMS + (record_batch,))
    monkeypatch.setattr(models, "create_model",
                        lambda flags, shape, num_actions: AuxMLP(shape, num_actions))
    code = variant.main(["--env", EXTRA_ENV, "--savedir", str(tmp_path), "--no_progress",
                         "--total_steps", "400", "--unroll_length", "10", "--batch_size", "4",
                         *args])
    assert code == 0 and seen, "the run did not train"
    return seen


def check_batch(batch, T=10, B=4):
    assert batch["steps"].dtype == torch.int32 and batch["steps"].shape == (T + 1, B)
    assert batch["position"].dtype == torch.float32 and batch["position"].shape == (T + 1, B, 2)
    assert batch["aux"].dtype == torch.float32 and batch["aux"].shape == (T + 1, B, 2)
    assert batch["learner_aux"].shape == (T + 1, B, 2)
    # The wrapper counts the steps of the episode: the adapter's episode_step, step by step.
    assert torch.equal(batch["steps"], batch["episode_step"])
    # position is obs[:2] of its own step, except where the step ended an episode (the frame
    # is then the next episode's first, while info describes the step that ended it).
    same = ~batch["done"]
    assert same.sum() > 0
    assert torch.equal(batch["position"][same], batch["frame"][..., :2][same])
    assert batch["aux"].abs().sum() > 0 and torch.isfinite(batch["aux"]).all()


@pytest.mark.parametrize("args", [
    pytest.param(["--num_actors", "1", "--envs_per_actor", "4"], id="actors"),
    pytest.param(["--num_actors", "0"], id="serial", marks=pytest.mark.slow)])
def test_monobeast_batches_carry_new_fields(tmp_path, monkeypatch, keep_process_state, args):
    for batch in train_recording_batches(monobeast, tmp_path, monkeypatch, *args):
        check_batch(batch)


@pytest.mark.parametrize("envs_per_stream", ["1", "2"], ids=["single", "batched"])
@pytest.mark.slow
def test_polybeast_batches_carry_new_fields(tmp_path, monkeypatch, keep_process_state,
                                             envs_per_stream):
    import polybeast  # needs libpolybeast (bash scripts/setup.sh): without it this fails
    for batch in train_recording_batches(polybeast, tmp_path, monkeypatch, "--num_actors", "2",
                                         "--envs_per_stream", envs_per_stream):
        check_batch(batch)


# ----------------------------------------------------------------------------------------------
# The schema's own rules.

def cartpole_fields():
    return envs.RolloutAdapter(envs.create_env(flag_helpers.make_flags(env="CartPole-v1"))).fields


def test_schema_of_a_model_lists_every_output():
    schema = rollout.Schema.of(cartpole_fields(), AuxMLP((4,), 2), num_actions=2)
    assert schema.names("env") == rollout.CORE_NAMES[:8]
    assert schema.model_names() == ("policy_logits", "baseline", "action", "aux")
    # The acting code adds which weights acted; the model does not return it.
    assert schema.names("agent") == schema.model_names() + ("policy_step",)
    assert schema.fields["policy_step"].dtype == np.int64
    assert schema.fields["aux"].shape == (2,) and schema.fields["aux"].dtype == np.float32
    zeros = schema.zeros((3, 5))
    assert zeros["policy_logits"].shape == (3, 5, 2) and zeros["done"].dtype == np.bool_


def test_probing_the_model_leaves_the_rng_alone():
    """The probe samples an action; seeded runs must not change because of it."""
    model, fields = AuxMLP((4,), 2), cartpole_fields()
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    rollout.Schema.of(fields, model, num_actions=2)
    assert torch.equal(torch.rand(3), expected)


class NoBaseline(AuxMLP):
    def forward(self, inputs, core_state=()):
        outputs, core_state = super().forward(inputs, core_state)
        del outputs["baseline"]
        return outputs, core_state


class ClashingHead(AuxMLP):
    def forward(self, inputs, core_state=()):
        outputs, core_state = super().forward(inputs, core_state)
        outputs["reward"] = outputs["baseline"]
        return outputs, core_state


def test_models_that_do_not_fit_are_refused_by_name():
    with pytest.raises(ValueError, match="'baseline'"):
        rollout.Schema.of(cartpole_fields(), NoBaseline((4,), 2), num_actions=2)
    with pytest.raises(ValueError, match="'reward'"):
        rollout.Schema.of(cartpole_fields(), ClashingHead((4,), 2), num_actions=2)
    with pytest.raises(ValueError, match="policy_logits"):
        rollout.Schema.of(cartpole_fields(), AuxMLP((4,), 3), num_actions=2)


def test_check_names_the_field_that_does_not_fit():
    schema = rollout.Schema.of(cartpole_fields(), AuxMLP((4,), 2), num_actions=2)
    batch = schema.zeros((11, 4))
    schema.check(batch, 2, "test")
    batch["done"] = batch["done"].astype(np.uint8)  # a server that sends done as bytes
    with pytest.raises(ValueError, match="'done' is uint8"):
        schema.check(batch, 2, "test")
    batch["done"] = batch["done"].astype(bool)
    del batch["aux"]
    with pytest.raises(ValueError, match="'aux' is missing"):
        schema.check(batch, 2, "test")


class Declares(gymnasium.Wrapper):
    rollout_fields = (rollout.Field("lives", np.int32),)


def test_fields_are_declared_by_any_wrapper_and_required_in_step():
    env = Declares(gymnasium.wrappers.RecordEpisodeStatistics(
        envs.create_env(flag_helpers.make_flags(env="CartPole-v1"))))
    adapter = envs.RolloutAdapter(env)
    assert [f.name for f in adapter.extra_fields] == ["lives"]
    assert adapter.initial()["lives"] == 0  # absent from reset's info: zero
    with pytest.raises(KeyError, match="'lives'"):
        adapter.step(0)  # declared but not in step's info
    with pytest.raises(ValueError, match="lives"):
        rollout.declared_fields(Declares(Declares(env)))  # declared twice


def test_an_env_server_steps_its_environments_without_torch():
    """What an env server runs (polybeast_env's EnvFactory: one environment or a vector env
    per stream, and the schema's fields) never imports torch, so that each server process
    starts without loading it."""
    code = ("import sys, polybeast_env\n"
            "flags = polybeast_env.make_parser().parse_args(['--env', 'CartPole-v1'])\n"
            "polybeast_env.resolve_env_flags(flags)\n"
            "for num_envs in (1, 4):\n"
            "    env = polybeast_env.EnvFactory(flags, 0)(num_envs)\n"
            "    env.initial()\n"
            "    env.step([0] * num_envs if num_envs > 1 else 0)\n"
            "sys.exit(3 if 'torch' in sys.modules else 0)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode != 3, "an env server imported torch"
    assert result.returncode == 0, result.stderr
