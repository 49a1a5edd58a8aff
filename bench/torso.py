"""Does a trained network see its observations? How much each layer moves with them.

    python -m bench.torso --savedir ~/logs/beast pong-s1 pong-s2 [--steps 3000]

Each run's final checkpoint is fed the same observations, those of a random policy in the
run's environment, and the report gives the share of each layer's channels (a Conv2d's) or
units (a Linear's) whose output after a ReLU differs between observations, the value's
standard deviation across them and the policy's mean entropy. A torso whose ReLUs have died
gives the same features for every observation: no unit of its last layer responds, the
value's deviation is 0 and the policy is the same in every state, whatever it has learnt to
weigh the last action and reward with.

From the checkpoint's optimizer state (RMSprop's running mean square of each gradient), the
report also gives each layer's channels that no gradient has reached for thousands of updates
(dead: their ReLU is 0 on everything the learner saw) and the share of its weights whose
gradients' root mean square exceeds RMSprop's epsilon: those step at about the learning rate,
the others at a fraction of it (their root mean square over epsilon).
"""

import argparse

import numpy as np
import torch
import torch.nn.functional as F

import monobeast
from beast import envs, training


def observations(flags, steps, seed=0):
    """uint8 or float [N, *obs] observations of a random policy, every third step of `steps`
    (an episode that ends starts the next)."""
    env = envs.create_env(flags)
    rng = np.random.default_rng(seed)
    observation, _ = env.reset(seed=seed)
    env.action_space.seed(seed)
    kept = []
    for step in range(steps):
        observation, _, terminated, truncated, _ = env.step(env.action_space.sample())
        if step % 3 == 0:
            kept.append(observation)
        if terminated or truncated:
            observation, _ = env.reset(seed=int(rng.integers(2**31)))
    env.close()
    return torch.as_tensor(np.stack(kept))


def torso_layers(model):
    """[(name, module)] of the model's Conv2d and Linear layers but the policy and value
    heads, in the order the model registers them."""
    heads = (model.policy, model.baseline)
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, (torch.nn.Conv2d, torch.nn.Linear)) and module not in heads]


def responses(model, frames):
    """(share of responding channels by torso layer name, value std, mean policy entropy) of
    the model on frames [N, *obs], fed as N steps of one environment."""
    shares, hooks = {}, []

    def record(name):
        def hook(module, inputs, output):
            out = F.relu(output).flatten(2) if output.dim() > 2 else F.relu(output)[..., None]
            varies = out.std(dim=0).amax(dim=-1) > 1e-6  # per channel, anywhere in the map
            shares[name] = float(varies.float().mean())
        return hook

    for name, module in torso_layers(model):
        hooks.append(module.register_forward_hook(record(name)))
    n = len(frames)
    inputs = dict(frame=frames[:, None], reward=torch.zeros(n, 1), done=torch.zeros(n, 1).bool(),
                  last_action=torch.zeros(n, 1, dtype=torch.int64))
    try:
        with torch.no_grad():
            outputs, _ = model.eval()(inputs, model.initial_state(1))
    finally:
        for hook in hooks:
            hook.remove()
    log_policy = F.log_softmax(outputs["policy_logits"].float(), dim=-1)
    entropy = float(-(log_policy.exp() * log_policy).sum(-1).mean())
    return shares, float(outputs["baseline"].float().std()), entropy


def gradient_shares(model, optimizer_state):
    """{torso layer name: (dead channels, channels, share of weights stepping at about the
    learning rate)} from an RMSprop state_dict of model.parameters(). A channel is dead when
    its bias's mean square gradient is below 1e-24 (exactly 0 for thousands of updates, as
    it decays by alpha at each)."""
    eps = optimizer_state["param_groups"][0]["eps"]
    order = optimizer_state["param_groups"][0]["params"]
    mean_squares = {name: optimizer_state["state"].get(index, {}).get("square_avg")
                    for index, (name, _) in zip(order, model.named_parameters())}
    shares = {}
    for name, _ in torso_layers(model):
        weight, bias = mean_squares.get(f"{name}.weight"), mean_squares.get(f"{name}.bias")
        if weight is None or bias is None:
            continue  # no update yet, or a layer without a bias
        shares[name] = (int((bias < 1e-24).sum()), bias.numel(),
                        float((weight.sqrt() > eps).float().mean()))
    return shares


def report(savedir, xpid, steps):
    """One line per run: its step, the value's deviation, the entropy, each layer's share."""
    flags = training.parse_flags(monobeast.make_parser(),
                                 ["--mode", "test", "--savedir", savedir, "--xpid", xpid])
    run_dir, info, _, checkpoint = training.prepare_run(flags, monobeast.resolve_flags)
    model = training.build_model(flags, info)
    model.load_state_dict(checkpoint["model_state_dict"])
    shares, value_std, entropy = responses(model, observations(flags, steps))
    layers = " ".join(f"{name} {share:.2f}" for name, share in shares.items())
    print(f"{xpid}: step {checkpoint['step']:,}, value std {value_std:.4f}, "
          f"entropy {entropy:.2f} nats; responding: {layers}")
    gradients = gradient_shares(model, checkpoint["optimizer_state_dict"])
    print("  no gradient (dead) / stepping at the rate: " + " ".join(
        f"{name} {dead}/{total} {stepping:.2f}" for name, (dead, total, stepping)
        in gradients.items()))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("xpids", nargs="+", help="Runs (their --xpid) under --savedir.")
    parser.add_argument("--savedir", default="~/logs/beast", help="Where the runs are.")
    parser.add_argument("--steps", type=int, default=3000,
                        help="Random-policy steps whose observations (every third) are fed.")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for xpid in args.xpids:
        report(args.savedir, xpid, args.steps)


if __name__ == "__main__":
    main()
