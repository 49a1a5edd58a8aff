"""Where a learner step's time goes: its time per sample for each network, eager and under
torch.compile, and the operators that take that time.

    python -m bench.learner_ops          # the Atari net at B=4, the ResNet at 8,16,16 at B=8
    python -m bench.learner_ops --net resnet:16,32,32@32 --precision fp32 --no_compile

Each case is bench.ceilings' learner step (`beast.learner.learn_step` on a random Atari
rollout of the Atari kind's T and other defaults, the learner's layout) with --threads
intra-op threads. Under torch.compile the torso (the part the network defines) is compiled
with the default backend; the first steps, which compile it, are not timed. The operator
table is torch.profiler's, over --calls more eager steps of each network after the timed
ones (the profiler adds its own time to each operator's).
Measured, not asserted: a markdown report on stdout.
"""

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from beast import flags as beast_flags
from bench import ceilings

DEFAULT_NETS = ("atari@4", "resnet:8,16,16@8")
UNROLL_LENGTH = beast_flags.ENV_DEFAULTS["atari"]["unroll_length"]


def parse_net(text):
    """(NetSpec, batch size) of 'atari@4' or 'resnet:8,16,16@8' (model[:channels]@B)."""
    spec, _, batch = text.partition("@")
    model, _, channels = spec.partition(":")
    if model not in ("atari", "resnet") or not batch.isdigit():
        raise argparse.ArgumentTypeError(
            f"--net {text!r}: expected atari@B or resnet:C1,C2,C3@B, e.g. resnet:8,16,16@8")
    net = ceilings.ATARI_NET._replace(model=model)
    if channels:
        net = net._replace(channels=channels)
    return net, int(batch)


def top_operators(step, calls, rows):
    """[(operator, share of the self time, ms per step)] of the `rows` costliest operators."""
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for _ in range(calls):
            step()
    events = sorted(profiler.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [(e.key, e.self_cpu_time_total / total, e.self_cpu_time_total / 1e3 / calls)
            for e in events[:rows]]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--net", action="append", type=parse_net,
                        help="model[:channels]@B, repeatable (default: "
                             f"{' and '.join(DEFAULT_NETS)}).")
    parser.add_argument("--precision", default="bf16", choices=["fp32", "bf16"],
                        help="The learner's --precision.")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="Intra-op threads (default: this process's).")
    parser.add_argument("--calls", type=int, default=20, help="Timed steps per case.")
    parser.add_argument("--no_compile", action="store_true",
                        help="Leave out the torch.compile case.")
    parser.add_argument("--top", type=int, default=8, help="Operators listed per network.")
    args = parser.parse_args(argv)
    nets = args.net or [parse_net(text) for text in DEFAULT_NETS]
    torch.set_num_threads(args.threads)
    print(f"{args.precision}, {args.threads} thread(s), {args.calls} timed steps a case\n")
    print("| network | B | torso | ms a step (median) | us a sample |")
    print("|---|---|---|---|---|")
    operators = {}
    for net, batch_size in nets:
        for compiled in (False,) if args.no_compile else (False, True):
            step = ceilings.learner_step(net, args.precision, UNROLL_LENGTH, batch_size, compiled)
            median = ceilings.summary(ceilings.time_calls(step, args.calls, 0, warmup=3))["median"]
            label = ceilings.net_label(net)
            print(f"| {label} | {batch_size} | {'torch.compile' if compiled else 'eager'} | "
                  f"{median * 1e3:.1f} | {median * 1e6 / (UNROLL_LENGTH * batch_size):.0f} |",
                  flush=True)
            if not compiled:
                operators[(label, batch_size)] = top_operators(step, args.calls, args.top)
    for (label, batch_size), rows in operators.items():
        print(f"\n{label}, B={batch_size}, eager: operators by their own time\n")
        print("| operator | share | ms a step |\n|---|---|---|")
        for name, share, ms in rows:
            print(f"| {name} | {share:.0%} | {ms:.1f} |")


if __name__ == "__main__":
    sys.exit(main())
