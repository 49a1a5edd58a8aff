"""bench.precision_grads: the learner's gradient in float32 and under bf16 autocast.

The batches are real CartPole rollouts of an LSTM MLP (T=5, B=4), written by MonoBeast's
Sampler through the script's own collect_batches, so that the core state before step 0 is
one a played game left (not zeros) and V-trace's importance weights are the acting policy's.
"""

import argparse
import copy

import pytest
import torch

import flag_helpers
import monobeast
from beast import learner, loss, models, training
from bench import precision_grads

T, B = 5, 4


def relative_difference(a, b):
    """|a - b| / |b| of two flattened gradients (precision_grads.flat)."""
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def cartpole():
    """flags, EnvSpec, learner model (precision_grads.build_models, from a 'checkpoint') and
    two batches (precision_grads.collect_batches) of CartPole rollouts."""
    flags = flag_helpers.make_flags(parser=monobeast.make_parser(), env="CartPole-v1",
                                    unroll_length=T, batch_size=B, use_lstm=True,
                                    entropy_cost=0.1)
    env = training.env_spec(flags)
    torch.manual_seed(0)
    weights = models.to_learning_layout(training.build_model(flags, env)).state_dict()
    # The policy head starts near uniform, where the entropy's gradient is 0: larger weights
    # give the entropy term a gradient of its own, so that leaving it out shows.
    weights["policy.weight"] = weights["policy.weight"] * 30
    model, acting_model = precision_grads.build_models(flags, env, {"model_state_dict": weights},
                                                       torch.device("cpu"))
    args = argparse.Namespace(batches=2, warmup_unrolls=1, seed=0)
    batches = precision_grads.collect_batches(flags, env, model, acting_model, args)
    return argparse.Namespace(flags=flags, env=env, model=model, batches=batches)


def test_collect_batches_gives_disjoint_rollouts_after_the_warmup(cartpole):
    assert len(cartpole.batches) == 2
    for batch, state in cartpole.batches:
        assert batch["frame"].shape == (T + 1, B, 4) and batch["action"].shape == (T + 1, B)
        assert batch["policy_logits"].shape == (T + 1, B, 2)
        # After a warm-up unroll, the core state before step 0 is a played game's.
        assert len(state) == 2 and state[0].shape == (1, B, cartpole.model.core.hidden_size)
        assert all(bool((s.abs().sum(-1) > 0).all()) for s in state)
        # The step counters run on from the warm-up unroll: no column starts afresh at step 0.
        assert bool((batch["episode_step"][0] > 0).all())
    (first, _), (second, _) = cartpole.batches
    assert not torch.equal(first["frame"], second["frame"])  # different environments


def learn_step_gradient(flags, model, batch, state, precision):
    """The gradient that learner.learn_step hands its optimizer (after its clipping, which
    does not bind: checked), on a copy of model, and learn_step's stats."""
    model = copy.deepcopy(model)
    names = [name for name, _ in model.named_parameters()]
    seen = {}

    class RecordingSGD(torch.optim.SGD):
        def step(self, closure=None):
            params = [p for group in self.param_groups for p in group["params"]]
            seen.update((n, p.grad.detach().clone()) for n, p in zip(names, params))
            return super().step(closure)

    flags = copy.copy(flags)
    flags.precision = precision
    stats = learner.learn_step(flags, model, RecordingSGD(model.parameters(), lr=0.0),
                               batch, state)
    assert stats["grad_norm"] < flags.grad_norm_clipping and stats["skipped_update"] == 0
    return seen, stats


def reference_gradient(flags, model, batch, state):
    """The float32 loss's gradient by loss.compute_loss and backward on a copy of model."""
    model = copy.deepcopy(model)
    outputs, _ = model(batch, state)
    total_loss, stats = loss.compute_loss(flags, outputs, batch)
    total_loss.backward()
    return ({n: p.grad for n, p in model.named_parameters()}, outputs,
            {k: float(v) for k, v in stats.items()})


def test_float32_gradient_is_repeatable_and_that_of_compute_loss(cartpole):
    flags, model = cartpole.flags, cartpole.model
    batch, state = cartpole.batches[0]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads, outputs, stats = precision_grads.gradient(flags, model, batch, state, "fp32")
    again, _, _ = precision_grads.gradient(flags, model, batch, state, "fp32")
    assert precision_grads.cosine(precision_grads.flat(grads),
                                  precision_grads.flat(again)) == pytest.approx(1, abs=1e-6)
    assert all(torch.equal(grads[n], again[n]) for n in grads)

    expected, expected_outputs, expected_stats = reference_gradient(flags, model, batch, state)
    assert list(grads) == list(expected)
    assert all(g.dtype == torch.float32 for g in grads.values())
    flat, flat_expected = precision_grads.flat(grads), precision_grads.flat(expected)
    assert precision_grads.cosine(flat, flat_expected) == pytest.approx(1, abs=1e-6)
    assert relative_difference(flat, flat_expected) < 1e-6
    for name in ("policy_logits", "baseline"):
        assert outputs[name].dtype == torch.float32 and not outputs[name].requires_grad
        torch.testing.assert_close(outputs[name], expected_outputs[name].detach())
    assert stats == pytest.approx(expected_stats, rel=1e-6)
    # It leaves the model as it found it: the same weights, no gradients.
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]) and param.grad is None, name


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gradient_is_the_one_learn_step_applies(cartpole, precision):
    flags, model = cartpole.flags, cartpole.model
    batch, state = cartpole.batches[1]
    grads, _, stats = precision_grads.gradient(flags, model, batch, state, precision)
    expected, expected_stats = learn_step_gradient(flags, model, batch, state, precision)
    assert set(grads) == set(expected)
    flat = precision_grads.flat(grads)
    assert relative_difference(flat, precision_grads.flat(expected)) < 1e-6
    assert float(flat.norm()) == pytest.approx(expected_stats["grad_norm"], rel=1e-5)
    # The loss terms of learn_step's stats (which adds the policy's entropy and grad_norm).
    assert list(stats) == ["total_loss", "pg_loss", "baseline_loss", "entropy_loss"]
    assert stats == pytest.approx({k: expected_stats[k] for k in stats}, rel=1e-5)


@pytest.mark.parametrize("term", loss.LOSS_TERMS, ids=lambda term: term.__name__)
def test_every_loss_term_moves_the_gradient(cartpole, monkeypatch, term):
    """Guards the comparisons above: a gradient without any one of the loss terms is far
    outside their tolerance (1e-6 relative)."""
    flags, model = cartpole.flags, cartpole.model
    batch, state = cartpole.batches[0]
    full = precision_grads.flat(precision_grads.gradient(flags, model, batch, state, "fp32")[0])
    monkeypatch.setattr(loss, "LOSS_TERMS", tuple(t for t in loss.LOSS_TERMS if t is not term))
    without = precision_grads.gradient(flags, model, batch, state, "fp32")[0]
    assert relative_difference(precision_grads.flat(without), full) > 1e-3


def test_bf16_changes_the_gradient_a_little(cartpole):
    flags, model = cartpole.flags, cartpole.model
    batch, state = cartpole.batches[0]
    g32, out32, loss32 = precision_grads.gradient(flags, model, batch, state, "fp32")
    g16, out16, loss16 = precision_grads.gradient(flags, model, batch, state, "bf16")
    v32, v16 = precision_grads.flat(g32), precision_grads.flat(g16)
    # bf16's rounding (8 significant bits) shows in the gradient and the outputs...
    assert relative_difference(v16, v32) > 1e-5
    assert not torch.equal(out16["policy_logits"], out32["policy_logits"])
    # ...which come back in float32 all the same, and point the same way.
    assert all(g.dtype == torch.float32 for g in g16.values())
    assert out16["policy_logits"].dtype == out16["baseline"].dtype == torch.float32
    assert precision_grads.cosine(v16, v32) > 0.99
    assert relative_difference(v16, v32) < 0.05
    assert loss16 == pytest.approx(loss32, rel=1e-2)


def test_cosine_and_flat():
    cosine = precision_grads.cosine
    a = torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert cosine(a, a) == pytest.approx(1)
    assert cosine(a, -2 * a) == pytest.approx(-1)
    assert cosine(a, torch.tensor([-4.0, 3.0], dtype=torch.float64)) == pytest.approx(0)
    assert cosine(a, torch.tensor([1.0, 0.0], dtype=torch.float64)) == pytest.approx(0.6)
    assert cosine(a, torch.zeros(2, dtype=torch.float64)) != cosine(a, a)  # nan
    assert isinstance(cosine(a, a), float)
    flat = precision_grads.flat({"w": torch.tensor([[1.0, 2.0]]), "b": torch.tensor([3.0])})
    assert flat.dtype == torch.float64 and flat.tolist() == [1.0, 2.0, 3.0]


def test_the_halves_of_a_batch_make_the_batch(cartpole):
    flags, model = cartpole.flags, cartpole.model
    batch, state = cartpole.batches[0]
    halves = [precision_grads.half(batch, state, part) for part in (0, 1)]
    for (part_batch, part_state), columns in zip(halves, (slice(0, B // 2), slice(B // 2, B))):
        assert set(part_batch) == set(batch)
        for key, value in part_batch.items():
            assert value.shape[:2] == (T + 1, B // 2), key
            assert torch.equal(value, batch[key][:, columns]), key
        assert len(part_state) == len(state)
        for s, whole in zip(part_state, state):
            assert s.shape == (1, B // 2, whole.shape[-1]) and s.is_contiguous()
            assert torch.equal(s, whole[:, columns])
    # The loss sums over the columns, each with its own core state: the halves' gradients
    # and losses add up to the batch's (a half paired with the wrong state would not).
    grads, _, stats = precision_grads.gradient(flags, model, batch, state, "fp32")
    parts = [precision_grads.gradient(flags, model, *h, "fp32") for h in halves]
    summed = precision_grads.flat(parts[0][0]) + precision_grads.flat(parts[1][0])
    assert relative_difference(summed, precision_grads.flat(grads)) < 1e-5
    assert parts[0][2]["total_loss"] + parts[1][2]["total_loss"] == pytest.approx(
        stats["total_loss"], rel=1e-5)
    zero_state = tuple(torch.zeros_like(s) for s in halves[0][1])
    other = precision_grads.gradient(flags, model, halves[0][0], zero_state, "fp32")[0]
    assert relative_difference(precision_grads.flat(other),
                               precision_grads.flat(parts[0][0])) > 1e-3


def test_fp32_heads_compute_the_heads_in_float32_under_bf16(cartpole):
    model = cartpole.model
    batch, state = cartpole.batches[0]
    seen = {}

    def record(name):
        def hook(module, args, output):
            seen[name] = (args[0], output)
        return hook

    hooks = [model.policy.register_forward_hook(record("policy")),
             model.baseline.register_forward_hook(record("baseline"))]
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            model(batch, state)
            assert {seen[name][1].dtype for name in seen} == {torch.bfloat16}
            seen.clear()
            with precision_grads.fp32_heads(model):
                model(batch, state)
            # The heads' outputs: float32, the heads' float32 Linear of the core's output.
            for name, head in (("policy", model.policy), ("baseline", model.baseline)):
                x, output = seen[name]
                assert output.dtype == torch.float32, name
                with torch.autocast("cpu", enabled=False):
                    expected = torch.nn.functional.linear(x.float(), head.weight, head.bias)
                assert torch.equal(output, expected), name
            seen.clear()
            model(batch, state)  # put back on leaving: bf16 again
            assert {seen[name][1].dtype for name in seen} == {torch.bfloat16}
    finally:
        for hook in hooks:
            hook.remove()
    assert "forward" not in vars(model.policy) and "forward" not in vars(model.baseline)
    with pytest.raises(RuntimeError, match="inside"):  # put back after an error as well
        with precision_grads.fp32_heads(model):
            raise RuntimeError("inside")
    assert "forward" not in vars(model.policy) and "forward" not in vars(model.baseline)


def test_fp32_heads_bring_the_outputs_closer_to_float32(cartpole):
    flags, model = cartpole.flags, cartpole.model
    batch, state = cartpole.batches[0]
    g32, out32, _ = precision_grads.gradient(flags, model, batch, state, "fp32")
    g16, out16, _ = precision_grads.gradient(flags, model, batch, state, "bf16")
    gh, outh, _ = precision_grads.gradient(flags, model, batch, state, "bf16", heads_fp32=True)
    for name in ("policy_logits", "baseline"):
        heads_error = (outh[name] - out32[name]).abs().mean()
        bf16_error = (out16[name] - out32[name]).abs().mean()
        assert 0 < heads_error < bf16_error, name
    v32 = precision_grads.flat(g32)
    assert 0 < relative_difference(precision_grads.flat(gh), v32) < relative_difference(
        precision_grads.flat(g16), v32)
    assert "forward" not in vars(model.policy)


def test_main_prints_one_row_per_batch(tmp_path, capsys, keep_process_state):
    """End to end on a run of a few updates trained here (MonoBeast in serial mode)."""
    assert monobeast.main(["--env", "CartPole-v1", "--savedir", str(tmp_path), "--xpid", "tiny",
                           "--no_progress", "--num_actors", "0", "--total_steps", "40",
                           "--unroll_length", str(T), "--batch_size", str(B),
                           "--use_lstm"]) == 0
    files = sorted(p.name for p in (tmp_path / "tiny").iterdir())
    capsys.readouterr()
    precision_grads.main(["--savedir", str(tmp_path), "--xpid", "tiny", "--batches", "3",
                          "--warmup_unrolls", "1", "--threads", "1"])
    out = capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "tiny").iterdir()) == files  # probe removed
    assert out.startswith("## bf16 autocast against float32: tiny")
    assert f"T={T}, B={B}" in out and "3 batches of disjoint environments" in out
    tables = {block.splitlines()[0]: block.splitlines()[2:] for block in out.split("\n\n")
              if block.startswith("| ")}
    (rows,) = [rows for header, rows in tables.items()
               if header.startswith("| batch | cos bf16/fp32 |")]
    assert [row.split(" | ")[0] for row in rows] == ["| 0", "| 1", "| 2"]
    for row in rows:
        cells = row.strip("| ").split(" | ")
        assert len(cells) == 10
        assert 0.99 < float(cells[1]) <= 1.0  # cos bf16/fp32
        assert -1 <= float(cells[8]) <= 1  # cos of the halves
        assert len(cells[9].split(", ")) == 2  # two other batches: mean, min
    (losses,) = [rows for header, rows in tables.items()
                 if header.startswith("| batch | precision | total_loss |")]
    assert [row.split(" | ")[:2] for row in losses] == [
        [f"| {i}", p] for i in range(3) for p in ("fp32", "bf16")]
    assert "| cos fp32, two batches (3 pairs) |" in out
    assert "(gradients before clipping at --grad_norm_clipping" in out
