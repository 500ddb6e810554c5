"""The thread balancer tries each plan once, runs the fastest, and re-tries the runner-up."""

from lockstep.runtime.balancer import RETRY_EVERY, ThreadBalancer, candidate_plans


def test_candidates_cover_an_even_split_and_each_stage_first():
    assert candidate_plans(2) == [(1, 1), (2, 1), (1, 2)]
    assert candidate_plans(8) == [(4, 4), (8, 2), (2, 8)]
    assert candidate_plans(1) == [(1, 1)]


def test_explores_then_exploits_the_measured_best():
    rates = {(1, 1): 6.0, (2, 1): 4.0, (1, 2): 5.0}  # steps/s under each plan
    b = ThreadBalancer(2)
    assert b.current == (1, 1)
    seen = [b.current]
    for _ in range(3 * RETRY_EVERY):
        seen.append(b.next_plan(rates[b.current]))
    assert seen[:4] == [(1, 1), (2, 1), (1, 2), (1, 1)]  # each tried once, then the fastest
    assert seen.count((1, 1)) > len(seen) * 0.6 and (2, 1) not in seen[4:]  # the slowest is not re-tried
    assert (1, 2) in seen[4:]  # the runner-up is


def test_follows_a_drifting_machine():
    b = ThreadBalancer(2)
    for _ in range(3):
        b.next_plan({(1, 1): 6.0, (2, 1): 4.0, (1, 2): 5.0}[b.current])
    for _ in range(4 * RETRY_EVERY):  # the runner-up became the fastest
        b.next_plan({(1, 1): 3.0, (2, 1): 4.0, (1, 2): 7.0}[b.current])
    assert b.current == (1, 2)
