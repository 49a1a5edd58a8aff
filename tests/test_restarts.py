"""beast/restarts.py: when a dead actor or env server is started again."""

from beast import restarts

Q = restarts.QUICK_EXIT_S


def test_a_first_start_that_ends_at_once_never_came_up():
    policy = restarts.RestartPolicy()
    assert "too soon to have come up" in policy.why_not(Q / 2)
    assert policy.restarts == 0


def test_processes_that_served_are_restarted_until_they_keep_dying_at_once():
    policy = restarts.RestartPolicy()
    assert policy.why_not(Q * 10) is None and policy.restarts == 1  # it served: again
    assert policy.why_not(Q * 10) is None and policy.restarts == 2  # and again
    for n in range(1, restarts.MAX_QUICK_RESTARTS):  # quick deaths, fewer than the limit
        assert policy.why_not(Q / 2) is None and policy.quick == n
    assert policy.why_not(Q * 2) is None and policy.quick == 0  # one that served resets it
    for _ in range(restarts.MAX_QUICK_RESTARTS - 1):
        assert policy.why_not(Q / 2) is None
    reason = policy.why_not(Q / 2)
    assert reason == (f"the last {restarts.MAX_QUICK_RESTARTS} starts each ended within "
                      f"{Q:g} s")


def test_how_a_process_ended_in_words():
    assert restarts.how_it_ended(-9) == "was killed by signal 9 (SIGKILL)"
    assert restarts.how_it_ended(-40) == "was killed by signal 40"  # real-time: no name
    assert restarts.how_it_ended(1) == "exited with status 1"
