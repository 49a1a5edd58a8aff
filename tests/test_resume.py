"""A resumed run's optimizer and learning-rate schedule follow the flags it resumes with.

On a resume, the checkpoint gives RMSprop its running statistics and the step counter; every
hyperparameter comes from the flags (saved, or typed on the resume: a typed one takes effect),
and the schedule is a function of the step counter and the flags (beast/learner.py lr_factor).
These tests resume at the unit level: an optimizer is built and stepped, its state saved in a
checkpoint, and learner.create_optimizer builds it again from the checkpoint with the flags
that merge_saved_flags gives a resume with one flag typed.
"""

import pytest
import torch

import flag_helpers
from beast import checkpoint as ckpt
from beast import flags as beast_flags
from beast import learner

# A CartPole-like run: 1,280 environment steps per update.
UNROLL, BATCH = 80, 16
STEPS_PER_UPDATE = UNROLL * BATCH
SAVED = dict(optimizer="rmsprop", learning_rate=0.004, alpha=0.99, momentum=0.0, epsilon=0.01,
             lr_warmup_steps=0,
             total_steps=60_160, grad_norm_clipping=50_000.0, unroll_length=UNROLL,
             batch_size=BATCH)


def make_model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def train(flags, model, updates, checkpoint=None):
    """`updates` optimizer and scheduler steps on a fixed loss, as Learner.update makes them."""
    optimizer, scheduler = learner.create_optimizer(flags, model, checkpoint=checkpoint)
    inputs = torch.linspace(-1, 1, 12).view(3, 4)
    for _ in range(updates):
        optimizer.zero_grad()
        model(inputs).pow(2).sum().backward()
        optimizer.step()
        scheduler.step()
    return optimizer, scheduler


def saved_run(tmp_path, updates=20, **saved):
    """(the saved run's flags.json dict, its checkpoint as read back from disk)."""
    flags = flag_helpers.make_flags(**{**SAVED, **saved})
    model = make_model()
    optimizer, scheduler = train(flags, model, updates)
    path = tmp_path / "model.tar"
    ckpt.save_checkpoint(path, dict(model_state_dict=model.state_dict(),
                                    optimizer_state_dict=optimizer.state_dict(),
                                    scheduler_state_dict=scheduler.state_dict(),
                                    step=updates * STEPS_PER_UPDATE, flags=ckpt.plain_flags(flags)))
    return ckpt.plain_flags(flags), ckpt.load_checkpoint(path)


def resumed_flags(saved, *argv):
    """The flags of a resume with argv typed: the learners' own path (merge_saved_flags)."""
    parser = beast_flags.common_parser()
    flags = parser.parse_args(list(argv))
    flags.given = beast_flags.explicit_flags(parser, list(argv))
    ckpt.merge_saved_flags(flags, saved, flags.given)
    beast_flags.apply_optimizer_defaults(flags)
    return beast_flags.apply_env_defaults(flags, "vector")


def expected_lr(flags, step):
    return flags.learning_rate * learner.lr_factor(flags, step, STEPS_PER_UPDATE)


# RMSprop's hyperparameters: the flag, its name in param_groups, a new value to type.
RMSPROP_CASES = [("learning_rate", "initial_lr", 1e-12), ("alpha", "alpha", 0.9),
                 ("momentum", "momentum", 0.5), ("epsilon", "eps", 0.3)]


def test_every_hyperparameter_that_the_optimizer_reads_is_tested():
    tested = {flag for flag, _, _ in RMSPROP_CASES} | set(learner.SCHEDULE_FLAGS)
    read = {flag for _, names in learner.OPTIMIZERS.values() for flag in names.values()}
    assert read | set(learner.SCHEDULE_FLAGS) <= tested


@pytest.mark.parametrize("flag, group_key, value", RMSPROP_CASES,
                         ids=[case[0] for case in RMSPROP_CASES])
def test_a_typed_rmsprop_flag_takes_effect_on_a_resume(tmp_path, flag, group_key, value):
    saved, checkpoint = saved_run(tmp_path)
    flags = resumed_flags(saved, f"--{flag}={value}")
    assert getattr(flags, flag) == value  # what flags.json will record ...
    optimizer, scheduler = learner.create_optimizer(flags, make_model(), checkpoint=checkpoint)
    step = checkpoint["step"]
    for group in optimizer.param_groups:  # ... is what the optimizer uses
        assert group[group_key] == value
        assert group["lr"] == pytest.approx(expected_lr(flags, step), rel=1e-12)
        for name, other in learner.OPTIMIZERS["rmsprop"][1].items():
            assert group[name] == (getattr(flags, other) if name != "lr" else group["lr"])
    assert scheduler.get_last_lr()[0] == pytest.approx(expected_lr(flags, step), rel=1e-12)
    # RMSprop's running statistics are the checkpoint's, not a fresh start.
    restored = optimizer.state_dict()["state"]
    for index, state in checkpoint["optimizer_state_dict"]["state"].items():
        assert torch.equal(restored[index]["square_avg"], state["square_avg"])


def test_adam_resumes_with_its_moments_and_the_typed_epsilon(tmp_path):
    saved, checkpoint = saved_run(tmp_path, optimizer="adam", epsilon=1e-5)
    assert saved["optimizer"] == "adam"
    flags = resumed_flags(saved, "--epsilon=0.001")
    optimizer, _ = learner.create_optimizer(flags, make_model(), checkpoint=checkpoint)
    assert isinstance(optimizer, torch.optim.Adam)
    assert [group["eps"] for group in optimizer.param_groups] == [0.001]
    restored = optimizer.state_dict()["state"]
    for index, state in checkpoint["optimizer_state_dict"]["state"].items():
        assert torch.equal(restored[index]["exp_avg"], state["exp_avg"])
        assert torch.equal(restored[index]["exp_avg_sq"], state["exp_avg_sq"])
        assert restored[index]["step"] == state["step"] > 0


def test_a_resume_that_types_another_optimizer_starts_its_state_afresh(tmp_path):
    """RMSprop's running mean squares do not fit Adam: the weights carry over, the new
    optimizer's state starts empty, and the schedule still follows the step counter."""
    saved, checkpoint = saved_run(tmp_path)
    flags = resumed_flags(saved, "--optimizer=adam")
    assert flags.epsilon == beast_flags.ADAM_EPSILON  # Adam's own, not RMSprop's saved one
    optimizer, scheduler = learner.create_optimizer(flags, make_model(), checkpoint=checkpoint)
    assert isinstance(optimizer, torch.optim.Adam) and optimizer.state_dict()["state"] == {}
    assert scheduler.get_last_lr()[0] == pytest.approx(expected_lr(flags, checkpoint["step"]),
                                                       rel=1e-12)


def test_a_run_saved_before_the_optimizer_flag_resumes_with_rmsprop(tmp_path):
    saved, checkpoint = saved_run(tmp_path)
    del saved["optimizer"], checkpoint["flags"]["optimizer"]
    flags = resumed_flags(saved)
    optimizer, _ = learner.create_optimizer(flags, make_model(), checkpoint=checkpoint)
    assert flags.optimizer == "rmsprop" and isinstance(optimizer, torch.optim.RMSprop)
    assert optimizer.state_dict()["state"]  # the checkpoint's running mean squares


def test_the_typed_learning_rate_is_used_by_the_next_updates(tmp_path):
    """--learning_rate 1e-12 on a resume: the weights barely move (RMSprop's steps are about
    the learning rate), where the saved rate moves them."""
    saved, checkpoint = saved_run(tmp_path, updates=20)
    moved = {}
    for argv in ([], ["--learning_rate=1e-12"]):
        model = make_model()
        model.load_state_dict(checkpoint["model_state_dict"])
        before = model.weight.detach().clone()
        train(resumed_flags(saved, *argv), model, 3, checkpoint)
        moved[bool(argv)] = (model.weight.detach() - before).abs().max().item()
    assert moved[True] < 1e-10 < 1e-4 < moved[False]


@pytest.mark.parametrize("argv", [["--lr_warmup_steps=200000"], ["--total_steps=90000"],
                                  ["--learning_rate=0.001", "--total_steps=70000"]])
def test_typed_schedule_flags_take_effect_on_a_resume(tmp_path, argv):
    saved, checkpoint = saved_run(tmp_path)
    flags = resumed_flags(saved, *argv)
    _, scheduler = train(flags, make_model(), 5, checkpoint)
    step = checkpoint["step"] + 5 * STEPS_PER_UPDATE
    assert scheduler.get_last_lr()[0] == pytest.approx(expected_lr(flags, step), rel=1e-12)


def test_a_typed_grad_norm_clipping_takes_effect_on_a_resume(tmp_path, monkeypatch):
    """learn_step reads --grad_norm_clipping at every step, from the resumed flags."""
    saved, _ = saved_run(tmp_path)
    flags = resumed_flags(saved, "--grad_norm_clipping=0.25")
    clips = []
    real_clip = torch.nn.utils.clip_grad_norm_

    def recording_clip(parameters, max_norm, *args, **kwargs):
        clips.append(max_norm)
        return real_clip(parameters, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording_clip)
    model = Heads()
    optimizer, _ = learner.create_optimizer(flags, model)
    T, B = 3, 2
    batch = dict(frame=torch.randn(T + 1, B, 4), reward=torch.ones(T + 1, B),
                 done=torch.zeros(T + 1, B, dtype=torch.bool),
                 policy_logits=torch.zeros(T + 1, B, 2), action=torch.zeros(T + 1, B,
                                                                           dtype=torch.int64))
    learner.learn_step(flags, model, optimizer, batch, ())
    assert clips == [0.25]


class Heads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.policy, self.baseline = torch.nn.Linear(4, 2), torch.nn.Linear(4, 1)

    def forward(self, inputs, core_state):
        frame = inputs["frame"]
        return dict(policy_logits=self.policy(frame),
                    baseline=self.baseline(frame).squeeze(-1)), core_state


def test_a_longer_total_steps_continues_on_the_new_horizon(tmp_path):
    """Trained towards 60,160 steps and resumed at its end with --total_steps doubled: the
    rate is the one a run started with the new total has at that step (higher than before
    the resume, not continuous), and it decays linearly to 0 at the new total."""
    saved, checkpoint = saved_run(tmp_path, updates=47)  # 47 x 1,280 = 60,160: the end
    step = checkpoint["step"]
    assert step == SAVED["total_steps"]
    old = flag_helpers.make_flags(**SAVED)
    before = old.learning_rate * learner.lr_factor(old, step - STEPS_PER_UPDATE,
                                                   STEPS_PER_UPDATE)
    flags = resumed_flags(saved, "--total_steps=120320")
    optimizer, scheduler = learner.create_optimizer(flags, make_model(), checkpoint=checkpoint)
    after = scheduler.get_last_lr()[0]
    assert after == pytest.approx(0.004 * (1 - 60_160 / 120_320)) == pytest.approx(0.002)
    assert optimizer.param_groups[0]["lr"] == after
    assert after > before  # the jump up that the rule implies
    rates = [after]
    for _ in range(47):
        optimizer.step()
        scheduler.step()
        rates.append(scheduler.get_last_lr()[0])
    steps = [step + i * STEPS_PER_UPDATE for i in range(48)]
    assert rates == pytest.approx([0.004 * (1 - s / 120_320) for s in steps], abs=1e-15)
    assert rates[-1] == 0.0


def test_the_schedule_follows_the_step_counter_when_the_batch_changes(tmp_path):
    """A resume with another --batch_size: the rate at the resumed step is the rule's, though
    the saved scheduler counted updates of another size."""
    saved, checkpoint = saved_run(tmp_path, updates=20)
    flags = resumed_flags(saved, "--batch_size=24", "--total_steps=100000")
    optimizer, scheduler = learner.create_optimizer(flags, make_model(), checkpoint=checkpoint)
    assert scheduler.get_last_lr()[0] == pytest.approx(0.004 * (1 - 20 * 1_280 / 100_000))
    optimizer.step()
    scheduler.step()
    assert scheduler.get_last_lr()[0] == pytest.approx(
        0.004 * (1 - (20 * 1_280 + 80 * 24) / 100_000))
