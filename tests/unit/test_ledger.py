"""Tests of core.store.ledger: what a consumed rollout gave the trainer, and the one line that
says why it trained nothing (pure)."""

from hypothesis import given
from hypothesis import strategies as st

from core.merge.values import EXCLUSION_CAUSES
from core.store.ledger import CAUSES, FLAGS, account, merge_reason, nothing_trained


@st.composite
def consumed(draw):
    """A rollout's merge statistics and a delivery log that splits its trainable tokens."""
    excluded = {c: draw(st.integers(0, 50)) for c in EXCLUSION_CAUSES}
    log = []
    for _ in range(draw(st.integers(0, 4))):
        outcome = draw(st.sampled_from(["trained", "stale", "too_long", "untrained"]))
        took = draw(st.integers(0, 40)) if outcome == "trained" else 0
        aside = 0 if outcome == "untrained" else draw(st.integers(0, 40))
        log.append((outcome, took, aside))
    trainable = sum(t + a for _, t, a in log)
    return {"trained_tokens": trainable, "excluded_by_cause": excluded}, log


@given(consumed(), st.sampled_from([None, 0.0, 1.5, -0.5]), st.booleans())
def test_every_sampled_token_is_trained_or_excluded_under_one_cause(rollout, advantage, dropped):
    stats, log = rollout
    ledger = account(stats, advantage, [] if dropped else log, dropped=dropped)
    assert set(ledger.excluded_tokens) == set(CAUSES)
    sampled = stats["trained_tokens"] + sum(stats["excluded_by_cause"].values())
    assert ledger.trained_tokens + sum(ledger.excluded_tokens.values()) == sampled
    assert (ledger.reason is None) == (ledger.trained_tokens > 0)
    if advantage == 0:
        assert ledger.trained_tokens == 0
    if dropped:
        assert ledger.excluded_tokens["dropped"] == stats["trained_tokens"]


def test_a_side_call_only_rollout_says_why_and_what_changes_it():
    stats = {"trained_tokens": 0, "excluded_by_cause": {"auxiliary": 16}}
    line = account(stats, 0.5, []).reason
    assert line.startswith("trained nothing: 16 sampled tokens excluded as auxiliary.")
    assert FLAGS["auxiliary"] in line and "\n" not in line
    assert merge_reason(stats) == line
    assert merge_reason({"trained_tokens": 3, "excluded_by_cause": {"auxiliary": 16}}) is None


def test_the_largest_cause_leads_and_the_others_follow():
    line = nothing_trained(0, {"stale": 4, "too_long": 30, "auxiliary": 0})
    assert line.startswith("trained nothing: 30 sampled tokens excluded as too_long; also stale 4.")
    assert "--token-budget" in line
    assert nothing_trained(0, {}) == "trained nothing: no call of this rollout sampled a token"


def test_equal_rewards_train_nothing_and_say_so():
    ledger = account({"trained_tokens": 12}, 0.0, [("trained", 12, 0)])
    assert ledger.trained_tokens == 0 and ledger.excluded_tokens["zero_advantage"] == 12
    assert "zero_advantage" in ledger.reason
