"""python -m bench.precision_grads: does the learner's bf16 autocast change its gradient?

--precision bf16 (the default on CPUs with AMX or AVX-512 BF16) runs the learner's forward
pass under bf16 autocast (beast/learner.py autocast_context); V-trace and the losses stay
float32. This measures what that does to the gradient the learner applies: on real rollouts
of a run's own environment, played with its checkpoint's policy (actions sampled, the acting
policy's logits and baseline recorded, so V-trace's importance weights are the run's), it
computes the loss and its gradient as learn_step does (before the clipping, without the
optimizer's step) once in float32 and once under bf16 autocast, from the same weights, and
reports per batch:

  - the cosine of the whole flattened gradients, bf16 against float32, the relative size of
    their difference (|g_bf16 - g_fp32| / |g_fp32|), the ratio of their norms, and the
    parameter tensor whose two gradients have the lowest cosine;
  - the same cosine and relative difference with the policy and value heads computed in
    float32 under bf16 (fp32_heads), which tells the heads' rounding of the logits and the
    value from the torso's and the backward pass's share;
  - the largest difference of the learner's policy logits and baselines, and the loss terms
    in both precisions;
  - the noise that learning lives with anyway, as the scale to read those against: the
    cosine between the float32 gradients of two different batches (all pairs of the batches
    collected), and between those of the two halves of one batch (its first B/2 columns
    against its last B/2); and the cosine of bf16's error (g_bf16 - g_fp32) between two
    batches: near 0, the error changes direction from batch to batch and averages out over
    updates, where a bias that keeps its direction would add up.

A bf16 cosine near 1 next to a batch-to-batch cosine far below it means that bf16 adds
little to the noise that learning already lives with. The gradient-norm clipping only scales
the gradient, so it leaves every cosine as it is; the norms are printed beside
--grad_norm_clipping to show whether it binds (when it does, the norm ratio does not reach
the update). How RMSprop turns the gradients into updates is not measured.

The batches are B rollouts of T steps ([T+1, B], the run's --unroll_length and --batch_size),
written by MonoBeast's own Sampler into buffers of the run's rollout schema, as its actors
write them, in the run's --acting_precision (--acting_precision here overrides it). One
Sampler plays --batches x B environments together and each batch takes B of them, so that
no two batches share a game: their gradients are independent draws. The environments start
together, and --warmup_unrolls are played and dropped first, so that the batches see games
in play rather than their first frames; they all see the same stretch of the game, though,
--warmup_unrolls x T steps in.

    python -m bench.precision_grads --savedir ~/logs/beast --xpid breakout-v5-s1
    python -m bench.precision_grads --savedir ~/logs/beast --xpid pong --batches 8 --threads 2

The run is read as `python -m monobeast --mode test` reads it (beast/training.py
prepare_run), which writes a probe file into the run's directory and removes it: point
--savedir at a copy of a run that must stay untouched.
"""

import argparse
import contextlib
import itertools
import statistics
import time

import torch

import monobeast
from beast import learner, machine, models, rollout, training


def load_run(savedir, xpid):
    """(flags, EnvSpec, checkpoint) of a saved run, read as --mode test reads them."""
    flags = training.parse_flags(monobeast.make_parser(),
                                 ["--mode", "test", "--savedir", savedir, "--xpid", xpid])
    _, env, _, checkpoint = training.prepare_run(flags, monobeast.resolve_flags)
    return flags, env, checkpoint


def build_models(flags, env, checkpoint, device):
    """(learner model in its learning layout on device, acting model on the CPU in
    flags.acting_precision), both with the checkpoint's weights."""
    model = models.to_learning_layout(training.build_model(flags, env).to(device))
    model.load_state_dict(checkpoint["model_state_dict"])
    acting_model = training.build_acting_model(flags, env)
    acting_model.load_state_dict(model.state_dict())  # as learner.Learner._publish does
    return model, acting_model


def collect_batches(flags, env, model, acting_model, args):
    """args.batches rollouts [(batch dict of [T+1, B, ...] tensors, core state)] in the
    learner's format: one monobeast.Sampler unroll of batches x B environments, cut into
    batches of B environments each, after args.warmup_unrolls unrolls played and dropped."""
    schema = rollout.Schema.of(env.env_fields, model, env.num_actions, env.continuous)
    size = flags.batch_size * args.batches
    buffers = schema.shared_zeros((flags.unroll_length + 1, size))
    state_buffers = monobeast.create_state_buffers(acting_model, size)
    torch.manual_seed(args.seed)  # the sampled actions
    sampler = monobeast.Sampler(flags, acting_model, schema, buffers, state_buffers, size,
                                seed=args.seed, name="precision_grads")
    try:
        for _ in range(args.warmup_unrolls + 1):
            sampler.unroll(list(range(size)))
    finally:
        sampler.close()
    columns = range(0, size, flags.batch_size)
    return [rollout.select_batch(buffers, state_buffers, list(range(k, k + flags.batch_size)))
            for k in columns]


def gradient(flags, model, batch, state, precision, heads_fp32=False):
    """learn_step's loss and gradient without the clipping and the optimizer's step:
    ({parameter name: float32 gradient}, float32 learner outputs, {loss term: float}).
    heads_fp32: the policy and value heads in float32 under bf16 (fp32_heads)."""
    model.zero_grad(set_to_none=True)
    heads = fp32_heads(model) if heads_fp32 else contextlib.nullcontext()
    with heads:
        total_loss, stats, outputs = learner.forward_loss(
            argparse.Namespace(**{**vars(flags), "precision": precision}), model, batch, state)
    total_loss.backward()
    grads = {name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
             for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    outputs = {k: v.detach() for k, v in outputs.items()}
    return grads, outputs, {k: float(v) for k, v in stats.items()}


@contextlib.contextmanager
def fp32_heads(model):
    """The policy and value heads (Linear layers) computed in float32 with autocast off, on
    the core's output as bf16 left it: under bf16 autocast their outputs, the logits and the
    value, are otherwise rounded to bf16 (8 significant bits: a value near 3 in steps of
    1/64), which is not in the code; this shows how much of bf16's difference that is."""
    def forward_fp32(head):
        def forward(x):
            with torch.autocast(x.device.type, enabled=False):
                return torch.nn.functional.linear(x.float(), head.weight, head.bias)
        return forward

    heads = (model.policy, model.baseline)
    for head in heads:
        head.forward = forward_fp32(head)  # an instance attribute: nn.Module calls it
    try:
        yield
    finally:
        for head in heads:
            del head.forward


def flat(grads):
    """The gradients of every parameter as one float64 vector."""
    return torch.cat([g.double().flatten() for g in grads.values()])


def cosine(a, b):
    """Cosine of two vectors; nan when either is zero."""
    norms = a.norm() * b.norm()
    return float(a @ b / norms) if norms > 0 else float("nan")


def half(batch, state, part):
    """Columns [:B/2] (part 0) or [B/2:] (part 1) of a batch and its core state."""
    size = next(iter(batch.values())).shape[1]
    columns = slice(0, size // 2) if part == 0 else slice(size // 2, size)
    return ({k: v[:, columns] for k, v in batch.items()},
            tuple(s[:, columns].contiguous() for s in state))


def compare(flags, model, batch, state):
    """One batch's figures: bf16 against float32, and its halves' float32 cosine."""
    g32, out32, loss32 = gradient(flags, model, batch, state, "fp32")
    g16, out16, loss16 = gradient(flags, model, batch, state, "bf16")
    v32, v16 = flat(g32), flat(g16)
    heads32 = flat(gradient(flags, model, batch, state, "bf16", heads_fp32=True)[0])
    tensors = {name: cosine(g32[name].double().flatten(), g16[name].double().flatten())
               for name in g32}
    worst = min(tensors, key=lambda name: tensors[name])
    halves = [flat(gradient(flags, model, *half(batch, state, part), "fp32")[0])
              for part in (0, 1)]
    return dict(
        cos=cosine(v32, v16), rel_diff=float((v16 - v32).norm() / v32.norm()),
        heads_cos=cosine(v32, heads32), heads_diff=float((heads32 - v32).norm() / v32.norm()),
        norm32=float(v32.norm()), norm16=float(v16.norm()),
        worst=worst, worst_cos=tensors[worst],
        logits=float((out16["policy_logits"] - out32["policy_logits"]).abs().max()),
        logits_scale=float(out32["policy_logits"].abs().max()),
        baseline=float((out16["baseline"] - out32["baseline"]).abs().max()),
        baseline_scale=float(out32["baseline"].abs().max()),
        halves=cosine(*halves), loss32=loss32, loss16=loss16, flat32=v32, error=v16 - v32)


def describe(args, flags, checkpoint, batches, elapsed):
    """The header: the machine, torch, the run and what was collected."""
    cpu, bf16 = machine.this_cpu()
    rewards = sum(float((b["reward"][1:] != 0).sum()) for b, _ in batches)
    games = sum(int(b["game_over"][1:].sum()) for b, _ in batches)
    return "\n".join([
        f"## bf16 autocast against float32: {args.xpid}",
        "",
        f"- machine: {cpu} (bf16: {bf16}), {machine.cores()} cores, torch {torch.__version__}"
        f", {torch.get_num_threads()} thread(s)",
        f"- run: {args.savedir}/{args.xpid}, {flags.env}, --model {flags.model}, checkpoint "
        f"of step {checkpoint['step']:,}; T={flags.unroll_length}, B={flags.batch_size}, "
        f"--pg_clip {flags.pg_clip}, --entropy_cost {flags.entropy_cost}",
        f"- rollouts: {len(batches)} batches of disjoint environments acted in "
        f"{flags.acting_precision} (actions sampled), after {args.warmup_unrolls} warm-up "
        f"unrolls, seed {args.seed}; {rewards:.0f} non-zero rewards, {games} games ended; "
        f"collected in {elapsed:.0f} s",
    ])


def batch_table(flags, rows, pairs):
    """Markdown: one row per batch."""
    lines = [
        "| batch | cos bf16/fp32 | abs(g16 - g32) / abs(g32) | same, heads fp32 | "
        "norm fp32 (bf16/fp32) | lowest tensor cos | max abs dlogits (max abs logit) | "
        "max abs dbaseline (max abs V) | cos halves fp32 | cos other batches fp32 (mean, min) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows):
        others = [c for (a, b), c in pairs.items() if i in (a, b)]
        crossing = (f"{statistics.mean(others):.3f}, {min(others):.3f}" if others else "-")
        clipped = " clipped" if r["norm32"] > flags.grad_norm_clipping else ""
        lines.append(
            f"| {i} | {r['cos']:.5f} | {r['rel_diff']:.4f} | {r['heads_cos']:.5f}, "
            f"{r['heads_diff']:.4f} | {r['norm32']:.3g}{clipped} "
            f"({r['norm16'] / r['norm32']:.4f}) | {r['worst_cos']:.4f} {r['worst']} | "
            f"{r['logits']:.3g} ({r['logits_scale']:.3g}) | {r['baseline']:.3g} "
            f"({r['baseline_scale']:.3g}) | {r['halves']:.3f} | {crossing} |")
    return "\n".join(lines)


def loss_table(rows):
    """Markdown: the loss terms of each batch in both precisions."""
    terms = list(rows[0]["loss32"])
    lines = ["| batch | precision | " + " | ".join(terms) + " |",
             "|---|---|" + "---|" * len(terms)]
    for i, r in enumerate(rows):
        for label, values in (("fp32", r["loss32"]), ("bf16", r["loss16"])):
            lines.append(f"| {i} | {label} | "
                         + " | ".join(f"{values[t]:.6g}" for t in terms) + " |")
    return "\n".join(lines)


def summary(rows, pairs):
    """Markdown: the medians of bf16's cosine and of the two noise floors, and whether bf16's
    error (g_bf16 - g_fp32) points the same way in every batch: a bias that adds up over
    updates, where an error that changes direction from batch to batch averages out."""
    between = list(pairs.values())
    errors = [cosine(rows[a]["error"], rows[b]["error"]) for a, b in pairs]
    median = statistics.median
    lines = [
        "| over the batches | median | min | max |",
        "|---|---|---|---|",
        f"| cos bf16/fp32, same batch | {median(r['cos'] for r in rows):.5f} | "
        f"{min(r['cos'] for r in rows):.5f} | {max(r['cos'] for r in rows):.5f} |",
        f"| cos bf16 with fp32 heads/fp32, same batch | "
        f"{median(r['heads_cos'] for r in rows):.5f} | "
        f"{min(r['heads_cos'] for r in rows):.5f} | {max(r['heads_cos'] for r in rows):.5f} |",
        f"| cos fp32, halves of a batch | {median(r['halves'] for r in rows):.3f} | "
        f"{min(r['halves'] for r in rows):.3f} | {max(r['halves'] for r in rows):.3f} |",
    ]
    if between:
        lines.append(f"| cos fp32, two batches ({len(between)} pairs) | {median(between):.3f} "
                     f"| {min(between):.3f} | {max(between):.3f} |")
        lines.append(f"| cos of bf16's error (g16 - g32), two batches | {median(errors):.3f} "
                     f"| {min(errors):.3f} | {max(errors):.3f} |")
    return "\n".join(lines)


def make_parser():
    parser = argparse.ArgumentParser(prog="python -m bench.precision_grads",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--savedir", default="~/logs/beast",
                        help="The directory that holds the run (its --savedir).")
    parser.add_argument("--xpid", required=True,
                        help="The run: the directory under --savedir with its flags.json and "
                             "model.tar.")
    parser.add_argument("--batches", type=int, default=4,
                        help="Batches of [T+1, B] rollouts to compare on (at least 2 for the "
                             "batch-to-batch cosine).")
    parser.add_argument("--warmup_unrolls", type=int, default=10,
                        help="Unrolls of T steps played and dropped before the one that is "
                             "measured.")
    parser.add_argument("--acting_precision", choices=models.ACTING_PRECISIONS, default=None,
                        help="The acting model's precision (default: the run's).")
    parser.add_argument("--seed", type=int, default=0,
                        help="Seeds the environments and the sampled actions.")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's intra-op threads.")
    return parser


def main(argv=None):
    args = make_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    flags, env, checkpoint = load_run(args.savedir, args.xpid)
    if args.acting_precision is not None:
        flags.acting_precision = args.acting_precision
    device = training.select_device(flags)
    model, acting_model = build_models(flags, env, checkpoint, device)
    start = time.monotonic()
    batches = collect_batches(flags, env, model, acting_model, args)
    elapsed = time.monotonic() - start
    rows = [compare(flags, model, *rollout.to_device(batch, state, device))
            for batch, state in batches]
    pairs = {(a, b): cosine(rows[a]["flat32"], rows[b]["flat32"])
             for a, b in itertools.combinations(range(len(rows)), 2)}
    print(describe(args, flags, checkpoint, batches, elapsed))
    for table in (batch_table(flags, rows, pairs), loss_table(rows), summary(rows, pairs)):
        print()
        print(table)
    print(f"\n(gradients before clipping at --grad_norm_clipping {flags.grad_norm_clipping}; "
          f"{time.monotonic() - start:.0f} s in all)")


if __name__ == "__main__":
    main()
