"""The learner's loss and step against an independent reference written like the paper.

The reference computes the IMPALA loss (Espeholt et al. 2018, section 4) in
float64 NumPy from the rollout as the actors write it (see beast/loss.py's
module docstring): agent-side keys cut to [:-1], environment-side keys
(reward, done) to [1:], the last baseline bootstrapping. It never calls
beast.vtrace, beast.policies or beast.loss, so agreement checks the indexing, the reward
clipping, the V-trace recursion and the three loss terms together.
"""

import copy

import numpy as np
import pytest
import torch
from torch import nn

from beast import learner, loss, policies
import flag_helpers

T, B, A, OBS = 3, 2, 3, 4
RTOL, ATOL = 1e-5, 1e-6

# Index t holds x_t and the agent's output on x_t; reward[t] / done[t] belong
# to the step that led to x_t, so row 0 of reward and done is never used.
TARGET_LOGITS = [[[0.2, -0.5, 1.0], [0.0, 0.3, -0.2]],
                 [[1.5, 0.1, -1.0], [-0.7, 0.4, 0.9]],
                 [[0.3, 0.3, -0.6], [1.1, -1.2, 0.2]],
                 [[-0.4, 0.8, 0.0], [0.5, 0.5, 0.5]]]
BEHAVIOUR_LOGITS = [[[0.0, 0.0, 0.0], [1.0, -1.0, 0.5]],
                    [[0.2, 0.9, -0.3], [0.0, -0.5, 0.1]],
                    [[-1.0, 1.2, 0.4], [0.3, 0.3, -0.9]],
                    [[0.6, -0.2, 0.1], [0.0, 1.0, -1.0]]]
ACTIONS = [[2, 0], [0, 1], [1, 2], [0, 1]]
BASELINE = [[0.5, -0.2], [1.0, 0.3], [-0.6, 0.8], [2.0, -1.0]]
# 2.5 and -4.0 exceed [-1, 1], so "abs_one" changes them.
REWARDS = [[9.0, 9.0], [2.5, -0.3], [0.7, -4.0], [-1.5, 1.0]]
# done[2, 0]: an episode ends inside the rollout; done[3, 1]: at its end, so
# the bootstrap value must not reach column 1.
DONE = [[True, False], [False, False], [True, False], [False, True]]


def make_flags(**overrides):
    values = dict(discounting=0.9, reward_clipping="abs_one", baseline_cost=0.5,
                  entropy_cost=0.1, grad_norm_clipping=1e6, precision="fp32", pg_clip=0.0,
                  reward_scale=1.0)
    values.update(overrides)
    return flag_helpers.make_flags(**values)


def make_batch():
    """The rollout dict, with an extra key that the default terms must ignore."""
    rng = np.random.default_rng(0)
    return dict(
        frame=torch.tensor(rng.normal(size=(T + 1, B, OBS)), dtype=torch.float32),
        policy_logits=torch.tensor(BEHAVIOUR_LOGITS, dtype=torch.float32),
        action=torch.tensor(ACTIONS, dtype=torch.int64),
        reward=torch.tensor(REWARDS, dtype=torch.float32),
        done=torch.tensor(DONE),
        episode_step=torch.zeros(T + 1, B, dtype=torch.int32),
    )


def make_learner_outputs():
    return dict(
        policy_logits=torch.tensor(TARGET_LOGITS, dtype=torch.float32),
        baseline=torch.tensor(BASELINE, dtype=torch.float32),
        action=torch.tensor(ACTIONS, dtype=torch.int64),
        aux=torch.ones(T + 1, B),  # An extra model output.
    )


def log_softmax_np(logits):
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def to_np(tensor):
    return tensor.detach().numpy().astype(np.float64)


def log_probs_of_actions_np(logits, actions):
    """log softmax(logits)[t, b, actions[t, b]] for [T, B, A] logits."""
    return np.take_along_axis(log_softmax_np(to_np(logits)),
                              actions.numpy()[..., None], -1)[..., 0]


def reference_targets(flags, learner_outputs, batch):
    """V-trace targets vs [T, B] and pg advantages [T, B] by the paper's recursion."""
    actions = batch["action"][:-1]
    rho = np.exp(log_probs_of_actions_np(learner_outputs["policy_logits"][:-1], actions)
                 - log_probs_of_actions_np(batch["policy_logits"][:-1], actions))
    rho_clipped, c, rho_pg = np.minimum(1.0, rho), np.minimum(1.0, rho), np.minimum(1.0, rho)
    # V(x_0..x_T): the last entry is the bootstrap value.
    V = to_np(learner_outputs["baseline"])
    r = to_np(batch["reward"][1:])
    if flags.reward_clipping == "abs_one":
        r = np.clip(r, -1.0, 1.0)
    gamma = (~batch["done"][1:]).numpy() * flags.discounting
    vs = V.copy()  # vs_T = V(x_T), so vs_T - V(x_T) = 0 starts the recursion.
    for s in reversed(range(T)):
        delta = rho_clipped[s] * (r[s] + gamma[s] * V[s + 1] - V[s])
        vs[s] = V[s] + delta + gamma[s] * c[s] * (vs[s + 1] - V[s + 1])
    advantages = rho_pg * (r + gamma * vs[1:] - V[:-1])
    return vs[:-1], advantages


def reference_loss_np(flags, learner_outputs, batch):
    """The loss terms, summed over T and B, as float64 numbers."""
    vs, advantages = reference_targets(flags, learner_outputs, batch)
    log_pi = log_softmax_np(to_np(learner_outputs["policy_logits"][:-1]))
    log_pi_a = log_probs_of_actions_np(learner_outputs["policy_logits"][:-1],
                                       batch["action"][:-1])
    values = to_np(learner_outputs["baseline"][:-1])
    stats = dict(
        pg_loss=-(log_pi_a * advantages).sum(),
        baseline_loss=flags.baseline_cost * 0.5 * ((vs - values) ** 2).sum(),
        entropy_loss=flags.entropy_cost * (np.exp(log_pi) * log_pi).sum(),
    )
    stats["total_loss"] = sum(stats.values())
    return stats


def reference_loss_torch(flags, learner_outputs, batch):
    """The same loss in torch ops, for autograd. The V-trace targets are
    constants (no gradient, as in the paper), so they come from the NumPy
    reference; the gradient flows through log pi and V only."""
    vs, advantages = (torch.tensor(x, dtype=torch.float32)
                      for x in reference_targets(flags, learner_outputs, batch))
    log_pi = torch.log_softmax(learner_outputs["policy_logits"][:-1], dim=-1)
    log_pi_a = log_pi.gather(-1, batch["action"][:-1, :, None])[..., 0]
    values = learner_outputs["baseline"][:-1]
    return (-(log_pi_a * advantages).sum()
            + flags.baseline_cost * 0.5 * ((vs - values) ** 2).sum()
            + flags.entropy_cost * (log_pi.exp() * log_pi).sum())


def assert_stats_match(stats, expected):
    assert set(stats) >= set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(float(stats[name]), value, rtol=RTOL, atol=ATOL,
                                   err_msg=name)


# ---- compute_loss ----


def test_fixture_exercises_every_rule():
    # Guards the fixed data: without these, a broken rule could still agree.
    flags = make_flags()
    outputs, batch = make_learner_outputs(), make_batch()
    base = reference_loss_np(flags, outputs, batch)
    unclipped = reference_loss_np(make_flags(reward_clipping="none"), outputs, batch)
    assert abs(base["total_loss"] - unclipped["total_loss"]) > 1e-3
    no_dones = reference_loss_np(flags, outputs, dict(batch, done=torch.zeros_like(batch["done"])))
    assert abs(base["total_loss"] - no_dones["total_loss"]) > 1e-3
    log_rho = (log_probs_of_actions_np(outputs["policy_logits"], batch["action"])
               - log_probs_of_actions_np(batch["policy_logits"], batch["action"]))[:-1]
    assert (log_rho > 0).any() and (log_rho < 0).any()  # rho clipped and not


@pytest.mark.parametrize("reward_clipping", ["abs_one", "none"])
def test_compute_loss_matches_reference(reward_clipping):
    flags = make_flags(reward_clipping=reward_clipping)
    outputs, batch = make_learner_outputs(), make_batch()
    total_loss, stats = loss.compute_loss(flags, outputs, batch)
    # The logs.csv columns, in this order.
    assert list(stats) == ["total_loss", "pg_loss", "baseline_loss", "entropy_loss"]
    assert total_loss.dim() == 0
    assert_stats_match(stats, reference_loss_np(flags, outputs, batch))
    np.testing.assert_allclose(float(total_loss), float(stats["total_loss"]))


def test_compute_loss_sums_over_time_and_batch():
    # Doubling B by repeating the batch doubles every term (a mean would not).
    flags = make_flags()
    outputs, batch = make_learner_outputs(), make_batch()
    _, stats = loss.compute_loss(flags, outputs, batch)
    doubled = lambda d: {k: torch.cat([v, v], dim=1) for k, v in d.items()}
    _, stats2 = loss.compute_loss(flags, doubled(outputs), doubled(batch))
    for name in stats:
        np.testing.assert_allclose(float(stats2[name]), 2 * float(stats[name]), rtol=RTOL)


# ---- learn_step ----


class TinyModel(nn.Module):
    """Linear heads on a float frame; deterministic, no core state."""

    def __init__(self, with_aux=False):
        super().__init__()
        torch.manual_seed(0)
        self.policy = nn.Linear(OBS, A)
        self.baseline = nn.Linear(OBS, 1)
        self.aux = nn.Linear(OBS, 1) if with_aux else None

    def initial_state(self, batch_size):
        return ()

    def forward(self, inputs, core_state):
        frame = inputs["frame"]
        outputs = dict(policy_logits=self.policy(frame),
                       baseline=self.baseline(frame).squeeze(-1))
        outputs["action"] = outputs["policy_logits"].argmax(-1)
        if self.aux is not None:
            outputs["aux"] = self.aux(frame).squeeze(-1)
        return outputs, core_state


def sgd_step(flags, model, batch, lr):
    """learn_step with plain SGD; returns its stats."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return learner.learn_step(flags, model, optimizer, batch, model.initial_state(B))


def reference_gradient(flags, model, batch):
    """Gradient of the reference loss w.r.t. model's parameters, by name."""
    model = copy.deepcopy(model)
    outputs, _ = model(batch, ())
    loss = reference_loss_torch(flags, outputs, batch)
    names, params = zip(*model.named_parameters())
    return dict(zip(names, torch.autograd.grad(loss, params)))


def test_learn_step_is_one_sgd_step_on_the_reference_loss():
    flags, batch, model, lr = make_flags(), make_batch(), TinyModel(), 0.1
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = reference_gradient(flags, model, batch)
    with torch.no_grad():
        expected_stats = reference_loss_np(flags, model(batch, ())[0], batch)
    stats = sgd_step(flags, model, batch, lr)
    assert_stats_match(stats, expected_stats)
    grad_norm = torch.sqrt(sum((g ** 2).sum() for g in grads.values()))
    np.testing.assert_allclose(stats["grad_norm"], float(grad_norm), rtol=RTOL)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), before[name] - lr * grads[name],
                                   rtol=RTOL, atol=ATOL)


def test_learn_step_applies_the_clipped_gradient():
    clip, lr = 1e-2, 0.1
    flags, batch, model = make_flags(grad_norm_clipping=clip), make_batch(), TinyModel()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = reference_gradient(flags, model, batch)
    grad_norm = torch.sqrt(sum((g ** 2).sum() for g in grads.values()))
    assert grad_norm > 10 * clip  # Otherwise nothing is clipped.
    stats = sgd_step(flags, model, batch, lr)
    # grad_norm is logged before clipping.
    np.testing.assert_allclose(stats["grad_norm"], float(grad_norm), rtol=RTOL)
    updates = {n: p.detach() - before[n] for n, p in model.named_parameters()}
    update_norm = torch.sqrt(sum((u ** 2).sum() for u in updates.values()))
    np.testing.assert_allclose(float(update_norm), lr * clip, rtol=1e-4)
    for name, update in updates.items():  # Same direction as the gradient.
        torch.testing.assert_close(update, -lr * clip * grads[name] / grad_norm,
                                   rtol=1e-4, atol=1e-7)


def ppo_surrogate_loss(flags, learner_outputs, batch):
    """The reference loss with PPO's clipped surrogate (Schulman et al. 2017, eq. 7) in place
    of the policy gradient term: -sum min(rho A, clip(rho, 1 - eps, 1 + eps) A), rho =
    pi / mu with gradient through pi. With A = the V-trace advantage / rho (a constant), its
    gradient is IMPALA's wherever the clip is not what the min picks, and zero where it is."""
    vs, advantages = reference_targets(flags, learner_outputs, batch)
    actions = batch["action"][:-1, :, None]
    log_pi = torch.log_softmax(learner_outputs["policy_logits"][:-1], dim=-1)
    log_mu = torch.log_softmax(batch["policy_logits"][:-1], dim=-1)
    rho = torch.exp(log_pi.gather(-1, actions) - log_mu.gather(-1, actions))[..., 0]
    adv = torch.tensor(advantages, dtype=torch.float32) / rho.detach()
    eps = flags.pg_clip
    surrogate = torch.minimum(rho * adv, torch.clamp(rho, 1 - eps, 1 + eps) * adv)
    values = learner_outputs["baseline"][:-1]
    return (-surrogate.sum()
            + flags.baseline_cost * 0.5
            * ((torch.tensor(vs, dtype=torch.float32) - values) ** 2).sum()
            + flags.entropy_cost * (log_pi.exp() * log_pi).sum())


def test_pg_clip_has_the_gradient_of_ppos_clipped_surrogate():
    eps = 0.5
    flags = make_flags(pg_clip=eps)
    batch = make_batch()
    logits = torch.tensor(TARGET_LOGITS, dtype=torch.float32, requires_grad=True)
    outputs = dict(make_learner_outputs(), policy_logits=logits)
    vs, advantages = reference_targets(flags, outputs, batch)
    rho = np.exp(log_probs_of_actions_np(logits[:-1], batch["action"][:-1])
                 - log_probs_of_actions_np(batch["policy_logits"][:-1], batch["action"][:-1]))
    cut = ((advantages > 0) & (rho > 1 + eps)) | ((advantages < 0) & (rho < 1 - eps))
    kept = ~cut & (np.abs(rho - 1) > eps)  # outside the region, but pushing back towards it
    # The fixture has samples of all three kinds; otherwise the clip could be a no-op here.
    assert cut.any() and kept.any() and (np.abs(rho - 1) < eps - 0.1).any()
    total, stats = loss.compute_loss(flags, outputs, batch)
    (grad,) = torch.autograd.grad(total, logits)
    (expected,) = torch.autograd.grad(ppo_surrogate_loss(flags, outputs, batch), logits)
    torch.testing.assert_close(grad, expected, rtol=RTOL, atol=ATOL)
    (unclipped,) = torch.autograd.grad(loss.compute_loss(make_flags(), outputs, batch)[0],
                                       logits)
    assert not torch.allclose(grad, unclipped, atol=1e-4)  # the clip changed the step
    # The logged pg_loss is the clipped one: the cut samples add nothing.
    log_pi_a = log_probs_of_actions_np(logits[:-1], batch["action"][:-1])
    np.testing.assert_allclose(float(stats["pg_loss"]), -(log_pi_a * advantages * ~cut).sum(),
                               rtol=RTOL, atol=ATOL)
    # pg_clipped logs how often the region binds: the share of samples cut.
    assert float(stats["pg_clipped"]) == pytest.approx(cut.mean())
    assert "pg_clipped" not in loss.compute_loss(make_flags(), outputs, batch)[1]


@pytest.mark.parametrize("mode", ["mean", "mean_std"])
@pytest.mark.parametrize("pg_clip", [0.0, 0.5])
def test_normalized_advantages_are_centred_and_scaled_over_the_batch(mode, pg_clip):
    """--normalize_advantages: the policy gradient weighs log pi(a_t) with the reference's
    V-trace advantages less their mean over the T x B samples (mean), and over their standard
    deviation, n - 1 (mean_std); the value and entropy terms stay as they were; the trust
    region reads the signs of the normalized advantages."""
    flags = make_flags(normalize_advantages=mode, pg_clip=pg_clip)
    outputs, batch = make_learner_outputs(), make_batch()
    _, advantages = reference_targets(flags, outputs, batch)
    normalized = advantages - advantages.mean()
    if mode == "mean_std":
        normalized /= advantages.std(ddof=1)
        assert advantages.std(ddof=1) < 0.9  # the division changes the scale here
    assert (np.sign(normalized) != np.sign(advantages)).any()  # centring flips a sign here
    log_pi_a = log_probs_of_actions_np(outputs["policy_logits"][:-1], batch["action"][:-1])
    kept = np.ones_like(normalized, dtype=bool)
    if pg_clip:
        rho = np.exp(log_pi_a - log_probs_of_actions_np(batch["policy_logits"][:-1],
                                                        batch["action"][:-1]))
        kept = ~(((normalized > 0) & (rho > 1 + pg_clip)) |
                 ((normalized < 0) & (rho < 1 - pg_clip)))
        assert not kept.all()
    _, stats = loss.compute_loss(flags, outputs, batch)
    plain = reference_loss_np(make_flags(pg_clip=pg_clip), outputs, batch)
    expected = dict(pg_loss=-(log_pi_a * normalized * kept).sum(),
                    baseline_loss=plain["baseline_loss"], entropy_loss=plain["entropy_loss"])
    assert_stats_match(stats, expected)
    if pg_clip:
        assert float(stats["pg_clipped"]) == pytest.approx(1 - kept.mean())


def test_learn_step_logs_the_policy_entropy():
    flags, batch, model = make_flags(), make_batch(), TinyModel()
    with torch.no_grad():
        logits = to_np(model(batch, ())[0]["policy_logits"][:-1])
    log_pi = log_softmax_np(logits)
    stats = sgd_step(flags, model, batch, lr=0.1)
    np.testing.assert_allclose(stats["policy_entropy"],
                               -(np.exp(log_pi) * log_pi).sum(-1).mean(), rtol=RTOL)
    assert stats["policy_entropy"] == pytest.approx(-stats["entropy_loss"] /
                                                    (flags.entropy_cost * T * B), rel=1e-5)
    def policy_entropy(logits):
        return policies.Categorical(logits).stats()["policy_entropy"]

    assert policy_entropy(torch.tensor([[[50.0, 0.0, 0.0]]])) < 1e-15  # deterministic
    assert float(policy_entropy(torch.zeros(1, 1, A))) == pytest.approx(np.log(A))


# ---- the LOSS_TERMS contract ----


def aux_loss(flags, inputs):
    return inputs.learner_outputs["aux"][:-1].pow(2).sum()


def test_added_term_is_summed_and_logged(monkeypatch):
    monkeypatch.setattr(loss, "LOSS_TERMS", loss.LOSS_TERMS + (aux_loss,))
    flags, outputs, batch = make_flags(), make_learner_outputs(), make_batch()
    outputs["aux"] = torch.full((T + 1, B), 3.0)
    total_loss, stats = loss.compute_loss(flags, outputs, batch)
    expected = reference_loss_np(flags, outputs, batch)
    expected["aux_loss"] = 9.0 * T * B
    expected["total_loss"] += expected["aux_loss"]
    assert list(stats)[-1] == "aux_loss"
    assert_stats_match(stats, expected)
    np.testing.assert_allclose(float(total_loss), expected["total_loss"], rtol=RTOL)


@pytest.mark.parametrize("with_term", [False, True])
def test_added_term_trains_what_only_it_reaches(monkeypatch, with_term):
    if with_term:
        monkeypatch.setattr(loss, "LOSS_TERMS", loss.LOSS_TERMS + (aux_loss,))
    flags, batch, model = make_flags(), make_batch(), TinyModel(with_aux=True)
    before = model.aux.weight.detach().clone()
    stats = sgd_step(flags, model, batch, lr=0.1)
    assert ("aux_loss" in stats) == with_term
    assert (not torch.equal(model.aux.weight, before)) == with_term


def test_removing_a_term_removes_it(monkeypatch):
    monkeypatch.setattr(loss, "LOSS_TERMS", (loss.pg_loss,))
    flags, outputs, batch = make_flags(), make_learner_outputs(), make_batch()
    total_loss, stats = loss.compute_loss(flags, outputs, batch)
    assert list(stats) == ["total_loss", "pg_loss"]
    expected = reference_loss_np(flags, outputs, batch)["pg_loss"]
    np.testing.assert_allclose(float(total_loss), expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", ["pg_loss", "total_loss"])
def test_term_name_clash_is_refused_at_start_up(monkeypatch, name):
    """A term's name is its logs.csv column: the check runs on import (the shipped list) and
    when a Learner starts (the list the run uses), not on every step."""
    def extra(flags, inputs):
        return inputs.values.sum()

    extra.__name__ = name
    loss.check_loss_terms(loss.LOSS_TERMS)
    with pytest.raises(ValueError, match="already a stats entry"):
        loss.check_loss_terms(loss.LOSS_TERMS + (extra,))
    monkeypatch.setattr(loss, "LOSS_TERMS", loss.LOSS_TERMS + (extra,))
    flags = make_flags(unroll_length=T, batch_size=B, total_steps=100)
    with pytest.raises(ValueError, match="already a stats entry"):
        learner.Learner(flags, TinyModel(), TinyModel())


def test_non_scalar_term_is_refused(monkeypatch):
    def per_step_loss(flags, inputs):
        return inputs.values

    monkeypatch.setattr(loss, "LOSS_TERMS", loss.LOSS_TERMS + (per_step_loss,))
    with pytest.raises(ValueError, match=r"per_step_loss \(3, 2\)"):
        loss.compute_loss(make_flags(), make_learner_outputs(), make_batch())


def test_a_wrong_rank_is_refused_where_it_enters():
    """The loss asserts no shapes per step: a model's outputs are checked when the run starts
    (rollout.Schema.of refuses a value head left [T+1, B, 1]), the [T, B] inputs of V-trace
    where it is entered, which names what does not fit."""
    outputs = make_learner_outputs()
    outputs["baseline"] = outputs["baseline"].unsqueeze(-1)
    with pytest.raises(ValueError, match=r"values must have shape \(3, 2\)"):
        loss.compute_loss(make_flags(), outputs, make_batch())


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_loss_never_reaches_the_weights(bad):
    """An infinite (or NaN) reward makes the loss non-finite: the update is skipped, the
    weights and the optimizer state stay as they were, and the stats say so."""
    flags, batch, model = make_flags(reward_clipping="none"), make_batch(), TinyModel()
    optimizer = torch.optim.RMSprop(model.parameters(), lr=0.1)
    assert learner.learn_step(flags, model, optimizer, batch, ())["skipped_update"] == 0
    before = copy.deepcopy(model.state_dict())
    optimizer_before = copy.deepcopy(optimizer.state_dict())
    batch["reward"][2, 1] = bad
    stats = learner.learn_step(flags, model, optimizer, batch, ())
    assert stats["skipped_update"] == 1.0 and not np.isfinite(stats["grad_norm"])
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    for key, value in optimizer.state_dict()["state"].items():
        for name, tensor in value.items():
            assert torch.equal(tensor, optimizer_before["state"][key][name]), name


def test_learning_rate_warms_up_then_decays():
    """--lr_warmup_steps: the rate rises linearly to --learning_rate, then decays to 0 at
    total_steps; without it, the rate starts at --learning_rate."""
    flags = make_flags(learning_rate=0.01, momentum=0.0, epsilon=0.01, alpha=0.99,
                       unroll_length=10, batch_size=10, total_steps=10_000, lr_warmup_steps=1_000)
    optimizer, scheduler = learner.create_optimizer(flags, TinyModel())
    rates = []
    for _ in range(100):  # 100 updates of 100 steps: the whole schedule
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert rates[0] == pytest.approx(0.01 * 0.1)  # the first update: 100 of 1000 steps
    assert rates[:10] == sorted(rates[:10]) and rates[9] == pytest.approx(0.01 * 0.91)
    assert max(rates) == rates[9] and rates[10:] == sorted(rates[10:], reverse=True)
    flags.lr_warmup_steps = 0
    _, scheduler = learner.create_optimizer(flags, TinyModel())
    assert scheduler.get_last_lr()[0] == 0.01
