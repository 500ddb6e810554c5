"""The thread plans: an even split and each stage first, ordered from generator- to trainer-heavy."""

from lockstep.runtime.balancer import candidate_plans, ladder


def test_candidates_cover_an_even_split_and_each_stage_first():
    assert candidate_plans(2) == [(1, 1), (2, 1), (1, 2)]
    assert candidate_plans(8) == [(4, 4), (8, 2), (2, 8)]
    assert candidate_plans(1) == [(1, 1)]


def test_ladder_goes_from_the_generator_to_the_trainer():
    assert ladder(2) == [(1, 2), (1, 1), (2, 1)]
    assert ladder(8) == [(2, 8), (4, 4), (8, 2)]
    assert ladder(1) == [(1, 1)]
