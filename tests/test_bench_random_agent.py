"""bench.random_agent: the floor a learning curve is read against."""


from bench import random_agent


def cartpole():
    flags = random_agent.make_parser().parse_args(["--env", "CartPole-v1"])
    flags.episodic_life = False
    return random_agent.envs.create_env(flags)


def test_random_cartpole_falls_within_a_few_dozen_steps():
    played = random_agent.play(cartpole(), episodes=100, seed=0)
    returns = [r for r, _ in played]
    # Uniform actions keep the pole up about 22 steps on average (a reward of 1 a step).
    assert 15 < sum(returns) / len(returns) < 35
    assert all(r == n for r, n in played)
    assert max(returns) < 200  # no policy: a long episode would mean actions are not random


def test_the_same_seed_plays_the_same_episodes():
    first = random_agent.play(cartpole(), episodes=5, seed=3)
    assert first == random_agent.play(cartpole(), episodes=5, seed=3)
    assert first != random_agent.play(cartpole(), episodes=5, seed=4)


def test_summary_and_exit_codes(capsys):
    assert "return 2.0 ± 1.4" in random_agent.summary([(1.0, 1), (3.0, 3)])
    assert random_agent.main(["--env", "CartPole-v1", "--episodes", "3"]) == 0
    assert "uniformly random actions: return" in capsys.readouterr().out
    assert random_agent.main(["--env", "Nope-v0"]) == 2
    assert "Unknown environment id" in capsys.readouterr().err
