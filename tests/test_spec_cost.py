"""The speculative step's cost model (worker/spec_cost.py): a verification is taken only at a
width whose expected tokens per second beat a plain step's, with the cost of a position
learned from the steps. The figures are this CPU's (bench/verify_width.py, 2026-12-03): a
batch-16 plain step of 0.2 s and 0.0228 plain steps per extra verified position, so a
width-5 verification costs 2.46x a plain step; at batch 1 a position costs 0.1 plain steps."""

from __future__ import annotations

import pytest

from mlxgw.shared.config import SpeculativeConfig
from mlxgw.worker.spec_cost import (
    ACCEPTANCE_PRIOR,
    WIDTH_MARGIN,
    Acceptance,
    Calibration,
    HitRate,
    WidthCost,
    choose_width,
    expected_tokens,
    slope_near,
)
from mlxgw.worker.speculative import EARLY_SAMPLES, OpenStep, RowState, Speculator

STEP_16 = 0.2  # seconds of a plain step of 16 rows
SLOPE_16 = 0.0228 * STEP_16  # seconds per extra verified position at batch 16


def test_a_few_short_drafts_in_a_batch_of_16_do_not_make_every_row_pay_a_wide_pass():
    """c = 16, distinct prompts: 4 rows hold 4-token drafts accepted half the time. Verified
    whole, the 16 x 5 rectangle costs 2.46 plain steps for 1.23x the tokens (0.91x measured)."""
    drafts = [4] * 4 + [0] * 12
    assert choose_width(drafts, [0.5] * 16, STEP_16, SLOPE_16, uniform=False) == 1


def test_a_batch_of_16_copying_its_context_verifies():
    """c = 16 on code edits: every row quotes its file, nearly every draft holds up."""
    width = choose_width([4] * 16, [0.95] * 16, STEP_16, SLOPE_16, uniform=False)
    assert width == 5


def test_one_row_verifies_as_wide_as_its_acceptance_pays():
    step, slope = 0.05, 0.1 * 0.05  # batch 1: a position costs a tenth of a plain step
    assert choose_width([8], [0.9], step, slope, uniform=False) == 9
    # 1.3 tokens for 1.1 steps at width 2; width 3 gives 1.39 for 1.2: the narrow one wins
    assert choose_width([8], [0.3], step, slope, uniform=False) == 2
    assert choose_width([8], [0.05], step, slope, uniform=False) == 1  # 1.05 for 1.1: plain


def test_where_positions_are_free_drafts_are_verified_whole():
    assert choose_width([3, 7, 0], [0.3, 0.3, 0.5], 0.05, 0.0, uniform=False) == 8


def test_until_the_costs_are_known_the_cheapest_verification_measures_them():
    assert choose_width([2, 6], [0.1, 0.1], None, None, uniform=False) == 2
    assert choose_width([2, 6], [0.5, 0.5], 0.1, None, uniform=False) == 2
    assert choose_width([0, 0], [0.5, 0.5], None, None, uniform=False) == 1  # nothing to verify


def test_what_verifications_delivered_against_the_model_scales_its_promises():
    copying = [4] * 16, [0.95] * 16, STEP_16, SLOPE_16
    assert choose_width(*copying, uniform=False, calibration=1.0) == 5
    assert choose_width(*copying, uniform=False, calibration=0.3) == 1  # they emitted 30% of what was expected
    calibration = Calibration()
    assert calibration.ratio() == 1.0
    for _ in range(40):
        calibration.add(expected=30.0, emitted=9.0)
    assert calibration.ratio() == pytest.approx(0.3, abs=0.01)


def test_where_every_row_keeps_the_same_count_a_position_counts_only_if_all_rows_accept_it():
    # replayed families: two rows, one that rarely holds up, drag the other down with it
    together = expected_tokens([2, 2], [0.9, 0.1], 3, uniform=True)
    assert together == pytest.approx(2 * (1 + 0.9 * 0.1 + 0.81 * 0.01))
    assert expected_tokens([2, 2], [0.9, 0.1], 3, uniform=False) == pytest.approx(1 + 0.9 + 0.81 + 1 + 0.1 + 0.01)
    assert expected_tokens([1, 0], [0.9, 0.9], 2, uniform=True) == 2  # a row without a draft keeps 1


def test_the_slope_is_fitted_through_the_origin_from_the_steps_excess_time():
    cost = WidthCost()
    assert cost.per_position() is None
    for positions in (16, 64, 32):
        cost.add(positions, SLOPE_16 * positions)
    assert cost.per_position() == pytest.approx(SLOPE_16)
    quick = WidthCost()
    quick.add(16, -0.01)  # a verification faster than the plain average (noise): positions are free
    assert quick.per_position() == 0.0


def test_drafts_not_yet_made_count_as_often_as_the_drafter_finds_them():
    """Asking drains mlx-lm's one-step-ahead pipeline even when nothing is found, so the
    question before asking is whether drafts found this often would pay."""
    assert expected_tokens([4, 4], [0.5, 0.5], 2, uniform=False, found=[0.2, 1.0]) == pytest.approx(2 + 0.1 + 0.5)
    assert expected_tokens([4, 4], [0.5, 0.5], 2, uniform=True, found=[0.2, 1.0]) == pytest.approx(2 * (1 + 0.2 * 0.25))
    rarely = [0.1] * 16  # distinct prompts at c = 16: few rows find a draft
    assert choose_width([4] * 16, [0.9] * 16, STEP_16, SLOPE_16, uniform=False, found=rarely) == 1
    found = HitRate()
    assert found.rate() == 0.5
    for hit in [False] * 9 + [True]:
        found.add(hit)
    assert found.rate() == pytest.approx((1 + 1) / (10 + 2))


def test_a_new_batch_size_borrows_the_nearest_measured_slope():
    costs = {1: WidthCost(), 16: WidthCost(), 4: WidthCost()}  # 4 has no sample yet
    costs[1].add(4, 4 * 0.0077)
    costs[16].add(64, 64 * 0.0035)
    assert slope_near({}, 8) is None
    assert slope_near(costs, 16) == pytest.approx(0.0035)
    assert slope_near(costs, 32) == pytest.approx(0.0035)
    assert slope_near(costs, 2) == pytest.approx(0.0077)
    assert slope_near(costs, 4) == pytest.approx(0.0077)  # as near to 1 as to 16: the smaller


def test_acceptance_starts_at_its_prior_learns_and_fades_back():
    acceptance = Acceptance()
    assert acceptance.rate() == ACCEPTANCE_PRIOR[0]
    for _ in range(3):
        acceptance.add(3, 4)  # 3 of 4 accepted, then a rejection
    assert acceptance.rate() == pytest.approx((9 + 1) / (12 + 2))
    acceptance.add(4, 4)  # accepted whole: no rejection
    assert acceptance.rate() == pytest.approx((13 + 1) / (16 + 2))
    for _ in range(5000):
        acceptance.decay()
    assert acceptance.rate() == pytest.approx(ACCEPTANCE_PRIOR[0], abs=0.01)


def test_the_speculator_chooses_the_width_from_its_meters_and_each_rows_acceptance():
    spec = Speculator(SpeculativeConfig())
    for i in range(EARLY_SAMPLES):  # plain steps of 16 rows, 0.2 s each
        spec._open = OpenStep(spec.plain_cost, 16, 10.0 * i, 16)
        spec._close_step(10.0 * i + STEP_16)
    # a verification of 16 rows x 5 positions that took what the slope says: the slope is learned
    spec._open = OpenStep(spec.spec_cost, 16, 100.0, 20, 16, 64)
    spec._close_step(100.0 + STEP_16 + 64 * SLOPE_16)
    assert spec.width_cost[16].per_position() == pytest.approx(SLOPE_16)
    few = [4] * 4 + [0] * 12  # draft lengths
    states = [RowState(8) for _ in few]
    assert spec._width(few, spec._rates(states), uniform=False) == 1
    copying = [RowState(8) for _ in range(16)]
    for state in copying:
        state.acceptance.add(40, 40)  # rows that have copied 40 tokens without a miss
    assert spec._width([4] * 16, spec._rates(copying), uniform=False) == 5
    assert WIDTH_MARGIN > 1
