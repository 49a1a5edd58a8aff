"""V-trace against a slow NumPy ground truth written like the paper.

The reference below evaluates the explicit sum/product formula of IMPALA
(Espeholt et al. 2018, eq. 1) with a double loop over s and t; the
implementation under test uses the backward recursion instead, so agreement
checks one against the other.
"""

import itertools

import numpy as np
import pytest
import torch

from beast import vtrace

SHAPES = [(1, 1), (1, 4), (2, 3), (5, 2), (16, 5), (80, 3)]
THRESHOLDS = [None, 0.5, 1.0, 3.7]


def reference_vtrace(log_rhos, discounts, rewards, values, bootstrap_value,
                     clip_rho_threshold, clip_pg_rho_threshold):
    """Paper formula in float64. Arrays are [T, B] except bootstrap_value [B]."""
    log_rhos, discounts, rewards, values = (
        np.asarray(x, dtype=np.float64) for x in (log_rhos, discounts, rewards, values)
    )
    bootstrap_value = np.asarray(bootstrap_value, dtype=np.float64)
    T, B = log_rhos.shape
    rhos = np.exp(log_rhos)
    rho_bar = np.inf if clip_rho_threshold is None else clip_rho_threshold
    rho_pg_bar = np.inf if clip_pg_rho_threshold is None else clip_pg_rho_threshold
    clipped_rhos = np.minimum(rho_bar, rhos)
    cs = np.minimum(1.0, rhos)
    # V(x_0..x_T): the learner's values followed by the bootstrap value.
    V = np.concatenate([values, bootstrap_value[None]], axis=0)

    vs = np.zeros((T, B))
    for b in range(B):
        for s in range(T):
            total = V[s, b]
            for t in range(s, T):
                # gamma^{t-s} prod_{i=s}^{t-1} c_i, with per-step discounts.
                weight = 1.0
                for i in range(s, t):
                    weight *= discounts[i, b] * cs[i, b]
                delta = clipped_rhos[t, b] * (
                    rewards[t, b] + discounts[t, b] * V[t + 1, b] - V[t, b]
                )
                total += weight * delta
            vs[s, b] = total

    vs_next = np.concatenate([vs[1:], bootstrap_value[None]], axis=0)
    pg_advantages = np.minimum(rho_pg_bar, rhos) * (
        rewards + discounts * vs_next - values
    )
    return vs, pg_advantages


def log_softmax_np(logits):
    logits = np.asarray(logits, dtype=np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def random_inputs(T, B, seed):
    rng = np.random.default_rng(seed)
    # Wide log_rhos so that ratios fall on both sides of every threshold.
    log_rhos = rng.normal(0.0, 1.5, size=(T, B))
    # Discount 0 marks an episode end; roughly one step in four ends one.
    discounts = np.where(rng.random((T, B)) < 0.25, 0.0, 0.9)
    rewards = rng.normal(size=(T, B))
    values = rng.normal(size=(T, B))
    bootstrap_value = rng.normal(size=(B,))
    return log_rhos, discounts, rewards, values, bootstrap_value


def to_torch(*arrays):
    return [torch.tensor(a, dtype=torch.float32) for a in arrays]


def test_reference_matches_n_step_return_on_policy():
    # Sanity check of the reference itself: on-policy (rho = 1, no clipping
    # active) V-trace is the discounted n-step return bootstrapped from V(x_T).
    T, B = 6, 2
    _, discounts, rewards, values, bootstrap_value = random_inputs(T, B, seed=0)
    vs, _ = reference_vtrace(np.zeros((T, B)), discounts, rewards, values,
                             bootstrap_value, 1.0, 1.0)
    expected = np.zeros((T, B))
    following = bootstrap_value.copy()
    for t in reversed(range(T)):
        following = rewards[t] + discounts[t] * following
        expected[t] = following
    np.testing.assert_allclose(vs, expected, rtol=1e-12)


@pytest.mark.parametrize("T,B", SHAPES)
@pytest.mark.parametrize("clip_rho_threshold", THRESHOLDS)
@pytest.mark.parametrize("clip_pg_rho_threshold", THRESHOLDS)
def test_from_importance_weights_matches_reference(T, B, clip_rho_threshold,
                                                   clip_pg_rho_threshold):
    inputs = random_inputs(T, B, seed=T * 100 + B)
    expected_vs, expected_pg = reference_vtrace(
        *inputs, clip_rho_threshold, clip_pg_rho_threshold)
    out = vtrace.from_importance_weights(
        *to_torch(*inputs),
        clip_rho_threshold=clip_rho_threshold,
        clip_pg_rho_threshold=clip_pg_rho_threshold,
    )
    assert isinstance(out, vtrace.VTraceReturns)
    assert out.vs.shape == (T, B) and out.vs.dtype == torch.float32
    assert out.pg_advantages.shape == (T, B)
    assert out.pg_advantages.dtype == torch.float32
    np.testing.assert_allclose(out.vs.numpy(), expected_vs, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out.pg_advantages.numpy(), expected_pg,
                               rtol=1e-4, atol=1e-4)


def test_t_equals_one_by_hand():
    # With one step: v_0 = V0 + min(rho_bar, rho) (r + d * bootstrap - V0) and
    # the advantage bootstraps straight from bootstrap_value.
    log_rhos = torch.tensor([[np.log(2.0), np.log(0.5)]], dtype=torch.float32)
    discounts = torch.tensor([[0.9, 0.0]])
    rewards = torch.tensor([[1.0, 2.0]])
    values = torch.tensor([[0.5, -1.0]])
    bootstrap_value = torch.tensor([3.0, 7.0])
    out = vtrace.from_importance_weights(log_rhos, discounts, rewards, values,
                                         bootstrap_value, 1.0, None)
    expected_vs = [0.5 + 1.0 * (1.0 + 0.9 * 3.0 - 0.5), -1.0 + 0.5 * (2.0 + 1.0)]
    expected_pg = [2.0 * (1.0 + 0.9 * 3.0 - 0.5), 0.5 * (2.0 + 1.0)]
    np.testing.assert_allclose(out.vs.numpy()[0], expected_vs, rtol=1e-6)
    np.testing.assert_allclose(out.pg_advantages.numpy()[0], expected_pg, rtol=1e-6)


def test_episode_end_stops_the_trace():
    # A zero discount at step k means nothing after k reaches v_s for s <= k.
    T, B = 8, 3
    log_rhos, discounts, rewards, values, bootstrap_value = random_inputs(T, B, 1)
    discounts[:] = 0.9
    discounts[3] = 0.0
    base = vtrace.from_importance_weights(
        *to_torch(log_rhos, discounts, rewards, values, bootstrap_value)).vs
    rewards[4:] += 10.0
    values[4:] -= 5.0
    bootstrap_value += 3.0
    changed = vtrace.from_importance_weights(
        *to_torch(log_rhos, discounts, rewards, values, bootstrap_value)).vs
    torch.testing.assert_close(changed[:4], base[:4])
    assert not torch.allclose(changed[4:], base[4:])


def test_thresholds_change_the_output():
    # Guards against a threshold argument that is silently ignored.
    inputs = to_torch(*random_inputs(10, 4, seed=2))
    outputs = {
        (rho, pg): vtrace.from_importance_weights(
            *inputs, clip_rho_threshold=rho, clip_pg_rho_threshold=pg)
        for rho, pg in itertools.product(THRESHOLDS, THRESHOLDS)
    }
    for pg in THRESHOLDS:
        for rho_a, rho_b in itertools.combinations(THRESHOLDS, 2):
            assert not torch.allclose(outputs[rho_a, pg].vs, outputs[rho_b, pg].vs)
    for rho in THRESHOLDS:
        for pg_a, pg_b in itertools.combinations(THRESHOLDS, 2):
            assert not torch.allclose(outputs[rho, pg_a].pg_advantages,
                                      outputs[rho, pg_b].pg_advantages)
            # vs does not depend on the policy gradient clip.
            torch.testing.assert_close(outputs[rho, pg_a].vs, outputs[rho, pg_b].vs)


@pytest.mark.parametrize("T,B,A", [(1, 1, 2), (1, 3, 4), (5, 2, 3), (20, 4, 6)])
@pytest.mark.parametrize("clip_rho_threshold", [None, 1.0])
@pytest.mark.parametrize("clip_pg_rho_threshold", [None, 0.5])
def test_from_logits_matches_reference(T, B, A, clip_rho_threshold,
                                       clip_pg_rho_threshold):
    rng = np.random.default_rng(T * 1000 + B * 10 + A)
    behavior_logits = rng.normal(0.0, 2.0, size=(T, B, A))
    target_logits = rng.normal(0.0, 2.0, size=(T, B, A))
    actions = rng.integers(0, A, size=(T, B))
    _, discounts, rewards, values, bootstrap_value = random_inputs(T, B, seed=A)

    rows, cols = np.meshgrid(np.arange(T), np.arange(B), indexing="ij")
    expected_behavior = log_softmax_np(behavior_logits)[rows, cols, actions]
    expected_target = log_softmax_np(target_logits)[rows, cols, actions]
    expected_log_rhos = expected_target - expected_behavior
    expected_vs, expected_pg = reference_vtrace(
        expected_log_rhos, discounts, rewards, values, bootstrap_value,
        clip_rho_threshold, clip_pg_rho_threshold)

    out = vtrace.from_logits(
        behavior_policy_logits=torch.tensor(behavior_logits, dtype=torch.float32),
        target_policy_logits=torch.tensor(target_logits, dtype=torch.float32),
        actions=torch.tensor(actions, dtype=torch.int64),
        discounts=torch.tensor(discounts, dtype=torch.float32),
        rewards=torch.tensor(rewards, dtype=torch.float32),
        values=torch.tensor(values, dtype=torch.float32),
        bootstrap_value=torch.tensor(bootstrap_value, dtype=torch.float32),
        clip_rho_threshold=clip_rho_threshold,
        clip_pg_rho_threshold=clip_pg_rho_threshold,
    )
    assert isinstance(out, vtrace.VTraceFromLogitsReturns)
    for name, expected in [
        ("behavior_action_log_probs", expected_behavior),
        ("target_action_log_probs", expected_target),
        ("log_rhos", expected_log_rhos),
        ("vs", expected_vs),
        ("pg_advantages", expected_pg),
    ]:
        got = getattr(out, name)
        assert got.shape == (T, B), name
        assert got.dtype == torch.float32, name
        np.testing.assert_allclose(got.detach().numpy(), expected, rtol=1e-4,
                                   atol=1e-4, err_msg=name)


def test_no_gradient_through_targets_but_through_target_log_probs():
    T, B, A = 6, 3, 4
    torch.manual_seed(0)
    target_logits = torch.randn(T, B, A, requires_grad=True)
    values = torch.randn(T, B, requires_grad=True)
    bootstrap_value = torch.randn(B, requires_grad=True)
    actions = torch.randint(0, A, (T, B))
    out = vtrace.from_logits(
        behavior_policy_logits=torch.randn(T, B, A),
        target_policy_logits=target_logits,
        actions=actions,
        discounts=torch.full((T, B), 0.9),
        rewards=torch.randn(T, B),
        values=values,
        bootstrap_value=bootstrap_value,
    )
    assert not out.vs.requires_grad
    assert not out.pg_advantages.requires_grad
    assert out.target_action_log_probs.requires_grad

    # d/dlogits of log softmax(logits)[a] is onehot(a) - softmax(logits).
    out.target_action_log_probs.sum().backward()
    expected = (torch.nn.functional.one_hot(actions, A).float()
                - torch.softmax(target_logits.detach(), dim=-1))
    torch.testing.assert_close(target_logits.grad, expected)
    assert values.grad is None and bootstrap_value.grad is None


def test_no_gradient_from_importance_weights():
    T, B = 4, 2
    log_rhos, discounts, rewards, values, bootstrap_value = (
        t.requires_grad_() for t in to_torch(*random_inputs(T, B, seed=3)))
    out = vtrace.from_importance_weights(log_rhos, discounts, rewards, values,
                                         bootstrap_value)
    assert not out.vs.requires_grad
    assert not out.pg_advantages.requires_grad


def test_does_not_modify_inputs():
    inputs = to_torch(*random_inputs(7, 3, seed=4))
    copies = [t.clone() for t in inputs]
    vtrace.from_importance_weights(*inputs)
    for before, after in zip(copies, inputs):
        torch.testing.assert_close(before, after)


@pytest.mark.parametrize("bad", range(5))
def test_rank_errors(bad):
    """Ranks are checked once, where from_importance_weights is entered."""
    T, B = 3, 2
    args = [torch.zeros(T, B) for _ in range(4)] + [torch.zeros(B)]
    args[bad] = args[bad].unsqueeze(-1)
    names = ["log_rhos", "discounts", "rewards", "values", "bootstrap_value"]
    with pytest.raises(ValueError, match=f"vtrace: {names[bad]} must have "):
        vtrace.from_importance_weights(*args)


def test_shape_mismatch_errors():
    T, B = 3, 2
    with pytest.raises(ValueError, match=r"rewards must have shape \(3, 2\)"):
        vtrace.from_importance_weights(torch.zeros(T, B), torch.zeros(T, B),
                                       torch.zeros(T + 1, B), torch.zeros(T, B),
                                       torch.zeros(B))
    with pytest.raises(ValueError, match=r"bootstrap_value must have shape \(2,\)"):
        vtrace.from_importance_weights(torch.zeros(T, B), torch.zeros(T, B),
                                       torch.zeros(T, B), torch.zeros(T, B),
                                       torch.zeros(B + 1))


def test_from_logits_rank_errors():
    T, B, A = 3, 2, 4
    good = dict(
        behavior_policy_logits=torch.zeros(T, B, A),
        target_policy_logits=torch.zeros(T, B, A),
        actions=torch.zeros(T, B, dtype=torch.int64),
        discounts=torch.zeros(T, B),
        rewards=torch.zeros(T, B),
        values=torch.zeros(T, B),
        bootstrap_value=torch.zeros(B),
    )
    vtrace.from_logits(**good)
    for name in ["behavior_policy_logits", "target_policy_logits", "actions", "discounts",
                 "bootstrap_value"]:
        args = dict(good)
        args[name] = args[name][0]
        with pytest.raises(ValueError, match=f"vtrace: {name} must have "):
            vtrace.from_logits(**args)
    # Logits of other steps than the actions'.
    with pytest.raises(ValueError, match="target_policy_logits must have shape"):
        vtrace.from_logits(**dict(good, target_policy_logits=torch.zeros(T + 1, B, A)))
