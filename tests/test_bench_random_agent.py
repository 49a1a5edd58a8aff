"""bench.random_agent: the floor a learning curve is read against; bench.nethack_ends: how
games ended."""

import collections
import enum

import gymnasium

from bench import nethack_ends, random_agent


def cartpole():
    flags = random_agent.make_parser().parse_args(["--env", "CartPole-v1"])
    flags.episodic_life = False
    return random_agent.envs.create_env(flags)


def test_random_cartpole_falls_within_a_few_dozen_steps():
    played = random_agent.play(cartpole(), episodes=100, seed=0)
    returns = [r for r, _ in played]
    # Uniform actions keep the pole up 22-25 steps on average (a reward of 1 a step).
    assert 15 < sum(returns) / len(returns) < 35
    assert all(r == n for r, n in played)
    assert max(returns) < 200  # no policy: a long episode would mean actions are not random


def test_the_same_seed_plays_the_same_episodes():
    first = random_agent.play(cartpole(), episodes=5, seed=3)
    assert first == random_agent.play(cartpole(), episodes=5, seed=3)
    assert first != random_agent.play(cartpole(), episodes=5, seed=4)


def test_summary_and_exit_codes(capsys):
    assert "return 2.0 ± 1.4 (median 2.0, min 1.0, max 3.0)" in random_agent.summary(
        [(1.0, 1), (3.0, 3)])
    assert random_agent.main(["--env", "CartPole-v1", "--episodes", "3"]) == 0
    out = capsys.readouterr().out
    assert "uniformly random actions: return" in out and "Ends of the games: terminated 3" in out
    assert random_agent.main(["--env", "Nope-v0"]) == 2
    assert "Unknown environment id" in capsys.readouterr().err


StepStatus = enum.Enum("StepStatus", "DEATH TASK_SUCCESSFUL")  # the names of NLE's


class EndsAfterTwoSteps(gymnasium.Env):
    """Two steps a game; odd games end in a death, even ones in the task's success."""
    observation_space = gymnasium.spaces.Discrete(1)
    action_space = gymnasium.spaces.Discrete(2)

    def reset(self, seed=None, options=None):
        self.game, self.t = (seed or 0), 0
        return 0, {}

    def step(self, action):
        self.t += 1
        status = StepStatus.DEATH if self.game % 2 else StepStatus.TASK_SUCCESSFUL
        return 0, 1.0, self.t == 2, False, {"end_status": status} if self.t == 2 else {}


def test_the_ends_an_env_reports_are_counted_once_a_game():
    ends = collections.Counter()
    played = random_agent.play(nethack_ends.CountEnds(EndsAfterTwoSteps(), ends), episodes=5,
                               seed=0)
    assert played == [(2.0, 2)] * 5
    assert ends == {"TASK_SUCCESSFUL": 3, "DEATH": 2}
    plain = collections.Counter()  # an env without end_status: Gymnasium's own ends
    random_agent.play(nethack_ends.CountEnds(cartpole(), plain), episodes=4, seed=0)
    assert plain == {"terminated": 4}


Action = enum.Enum("Action", "WAIT SEARCH")  # NLE's actions are enums like these


def test_the_actions_taken_are_counted_by_name():
    env = EndsAfterTwoSteps()
    env.actions = (Action.WAIT, Action.SEARCH)  # what NLE's env.unwrapped.actions holds
    ends, actions = collections.Counter(), collections.Counter()
    counted = nethack_ends.CountEnds(env, ends, actions)
    counted.reset(seed=0)
    for action in (1, 0, 1):
        counted.step(action)
    assert actions == {"Action.SEARCH": 2, "Action.WAIT": 1}
    unnamed = collections.Counter()  # an env without names: the action's number
    counted = nethack_ends.CountEnds(EndsAfterTwoSteps(), collections.Counter(), unnamed)
    counted.reset(seed=0)
    counted.step(1)
    assert unnamed == {"1": 1}
    assert nethack_ends.shares(actions) == "Action.SEARCH 2 (67%), Action.WAIT 1 (33%)"
