"""Rollout correction by hand: each weight mode, each of the 11 rejection options, their AND,
and every diagnostic, from the definitions on three short responses.

The responses' token ratios rho = pi_old / mu are 2, 1/2, 3 | 3/2, 1 | 1/4 (padding holds nan,
which must not leak), so each expected number below is written from the ratios.
"""

import math

import pytest
import torch

from honing.algorithms.rollout_correction import (
    PEAK,
    REJECTION_OPTIONS,
    SUM,
    CorrectionSettings,
    Rejection,
    correct,
    correction_metrics,
    parse_bounds,
    parse_rejections,
)

NAN = math.nan
RATIOS = [[2.0, 0.5, 3.0], [1.5, 1.0], [0.25]]
ROWS = [row + [NAN] * (3 - len(row)) for row in RATIOS]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
BEHAVIOUR = torch.where(MASK > 0, torch.full((3, 3), -1.0), torch.full((3, 3), NAN))
OLD = BEHAVIOUR + torch.log(torch.tensor(ROWS))  # log pi_old = log mu + log rho
TOKENS = [rho for row in RATIOS for rho in row]  # the 6 response tokens' ratios


def _corrected(**settings):
    return correct(OLD, BEHAVIOUR, MASK, CorrectionSettings(**settings))


def _metrics(**settings):
    corrected = _corrected(**settings)
    return corrected, correction_metrics(corrected.tally, CorrectionSettings(**settings))


def _weights(rows):
    """[3, 3] weights from per-response lists (0 on padding)."""
    return torch.tensor([row + [0.0] * (3 - len(row)) for row in rows])


# --- importance weights ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("level", "threshold", "want"),
    [
        # token TIS: min(rho, 2)
        ("token", "2.0", [[2.0, 0.5, 2.0], [1.5, 1.0], [0.25]]),
        # token IcePop [0.5, 2]: rho outside set to 0 (3 and 1/4)
        ("token", "0.5_2.0", [[2.0, 0.5, 0.0], [1.5, 1.0], [0.0]]),
        # sequence TIS: min(prod rho, 2) on every token: prod = 3, 3/2, 1/4
        ("sequence", "2.0", [[2.0, 2.0, 2.0], [1.5, 1.5], [0.25]]),
        # sequence IcePop [0.5, 2]: 3 and 1/4 are outside
        ("sequence", "0.5_2.0", [[0.0, 0.0, 0.0], [1.5, 1.5], [0.0]]),
    ],
)
def test_importance_weights(level, threshold, want):
    lower, upper = parse_bounds(threshold)
    corrected = _corrected(level=level, upper=upper, lower=lower)
    torch.testing.assert_close(corrected.weights, _weights(want))
    assert corrected.keep is None


@pytest.mark.parametrize(
    ("level", "raw", "mean"),
    [
        # token: divided by the mean over the 6 tokens of min(rho, 2)
        ("token", [[2.0, 0.5, 2.0], [1.5, 1.0], [0.25]], (2 + 0.5 + 2 + 1.5 + 1 + 0.25) / 6),
        # sequence: divided by the mean over the 3 responses of min(prod rho, 2)
        ("sequence", [[2.0, 2.0, 2.0], [1.5, 1.5], [0.25]], (2 + 1.5 + 0.25) / 3),
    ],
)
def test_batch_normalised_weights(level, raw, mean):
    corrected, metrics = _metrics(level=level, upper=2.0, batch_normalize=True)
    torch.testing.assert_close(corrected.weights, _weights(raw) / mean)
    assert metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(mean)
    # the other weight metrics describe the weights before normalisation
    assert metrics["rollout_corr/rollout_is_max"] == pytest.approx(2.0)


def test_weights_carry_no_gradient():
    old = OLD.clone().requires_grad_(True)
    corrected = correct(old, BEHAVIOUR, MASK, CorrectionSettings(level="token"))
    assert not corrected.weights.requires_grad


def test_token_weight_metrics():
    _, m = _metrics(level="token", upper=2.0)
    weights = [2.0, 0.5, 2.0, 1.5, 1.0, 0.25]
    mean = sum(weights) / 6
    square = sum(w * w for w in weights) / 6
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(mean)
    assert m["rollout_corr/rollout_is_std"] == pytest.approx(math.sqrt(square - mean**2))
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(mean**2 / square)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(2.0)
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(0.25)
    # raw ratios above 2 (the 3) and below 1/2 (the 1/4; 1/2 itself is not below)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 6)
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(1 / 6)
    assert "rollout_corr/rollout_is_batch_norm_factor" not in m


def test_sequence_weight_metrics():
    _, m = _metrics(level="sequence", upper=2.0)
    weights = [2.0, 2.0, 2.0, 1.5, 1.5, 0.25]  # per token
    mean = sum(weights) / 6
    square = sum(w * w for w in weights) / 6
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(mean)
    assert m["rollout_corr/rollout_is_std"] == pytest.approx(math.sqrt(square - mean**2))
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(mean**2 / square)
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(0.25)
    # responses: prod rho = 3 (above 2), 3/2, 1/4 (below 1/2): one of three each
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(1 / 3)


def test_icepop_weight_metrics_count_the_zeroed_weights():
    _, m = _metrics(level="token", upper=2.0, lower=0.5)
    weights = [2.0, 0.5, 0.0, 1.5, 1.0, 0.0]
    mean = sum(weights) / 6
    square = sum(w * w for w in weights) / 6
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(mean)
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(mean**2 / square)
    assert m["rollout_corr/rollout_is_min"] == 0.0
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(1 / 6)


# --- rejection -------------------------------------------------------------------------

# k1 = -log rho, k2 = (log rho)^2 / 2, k3 = rho - 1 - log rho per token:
K1 = [[-math.log(r) for r in row] for row in RATIOS]
K2 = [[0.5 * math.log(r) ** 2 for r in row] for row in RATIOS]
K3 = [[r - 1 - math.log(r) for r in row] for row in RATIOS]


def _inside(value, lower, upper):
    return math.log(lower) <= value <= math.log(upper)


# Each option's kept tokens, written from the statistics above (not from the code).
CASES = {
    # k1 within [log 0.4, log 2.5] (float 2.5: lower = 1/2.5): rho 3 and 1/4 out
    "token_k1": ("2.5", [[_inside(v, 0.4, 2.5) for v in row] for row in K1]),
    # (log rho)^2 / 2 <= 0.3: 0.24, 0.24, 0.60 | 0.08, 0 | 0.96
    "token_k2": ("0.3", [[v <= 0.3 for v in row] for row in K2]),
    # rho - 1 - log rho <= 0.2: 0.31, 0.19, 0.90 | 0.09, 0 | 0.64
    "token_k3": ("0.2", [[v <= 0.2 for v in row] for row in K3]),
    # sum k1 = -log prod rho within [log 0.5, log 2]: prod 3 and 1/4 out
    "seq_sum_k1": ("0.5_2.0", [[_inside(sum(row), 0.5, 2.0)] * len(row) for row in K1]),
    "seq_sum_k2": ("0.5", [[sum(row) <= 0.5] * len(row) for row in K2]),  # 1.08 | 0.08 | 0.96
    "seq_sum_k3": ("1.0", [[sum(row) <= 1.0] * len(row) for row in K3]),  # 1.40 | 0.09 | 0.64
    # mean k1 within [log 0.8, log 1.5]: -0.37 | -0.20 | 1.39
    "seq_mean_k1": (
        "0.8_1.5",
        [[_inside(sum(row) / len(row), 0.8, 1.5)] * len(row) for row in K1],
    ),
    "seq_mean_k2": ("0.3", [[sum(row) / len(row) <= 0.3] * len(row) for row in K2]),
    "seq_mean_k3": ("0.5", [[sum(row) / len(row) <= 0.5] * len(row) for row in K3]),  # .47|.05|.64
    "seq_max_k2": ("0.7", [[max(row) <= 0.7] * len(row) for row in K2]),  # 0.60 | 0.08 | 0.96
    "seq_max_k3": ("0.8", [[max(row) <= 0.8] * len(row) for row in K3]),  # 0.90 | 0.09 | 0.64
}


def test_every_option_is_tested():
    assert set(CASES) == set(REJECTION_OPTIONS) and len(REJECTION_OPTIONS) == 11


def _keep(rows):
    """[3, 3] 0/1 from per-response lists of kept flags (padding shown kept: it is masked)."""
    return torch.tensor([[float(k) for k in row] + [1.0] * (3 - len(row)) for row in rows])


@pytest.mark.parametrize("option", sorted(CASES))
def test_each_rejection_option(option):
    threshold, kept = CASES[option]
    rejections = parse_rejections(option, threshold)
    corrected, m = _metrics(rejections=rejections)
    torch.testing.assert_close(corrected.keep * MASK, _keep(kept) * MASK)
    rejected = sum(not k for row in kept for k in row)
    responses = sum(not all(row) for row in kept)
    assert 0 < rejected < 6  # each case keeps some and rejects some
    for name in ("rollout_rs", f"rollout_rs_{option}"):
        assert m[f"rollout_corr/{name}_masked_fraction"] == pytest.approx(rejected / 6)
        assert m[f"rollout_corr/{name}_seq_masked_fraction"] == pytest.approx(responses / 3)
    assert corrected.weights is None


def test_options_combine_by_and():
    """token_k2 <= 0.3 rejects the 3 and the 1/4; seq_max_k3 <= 0.8 rejects response 0.
    Together: response 0 whole and the 1/4."""
    rejections = parse_rejections("token_k2, seq_max_k3", "0.3,0.8")
    corrected, m = _metrics(rejections=rejections)
    kept = [[False, False, False], [True, True], [False]]
    torch.testing.assert_close(corrected.keep * MASK, _keep(kept) * MASK)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(4 / 6)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(2 / 3)
    assert m["rollout_corr/rollout_rs_token_k2_masked_fraction"] == pytest.approx(2 / 6)
    assert m["rollout_corr/rollout_rs_token_k2_seq_masked_fraction"] == pytest.approx(2 / 3)
    assert m["rollout_corr/rollout_rs_seq_max_k3_masked_fraction"] == pytest.approx(3 / 6)
    assert m["rollout_corr/rollout_rs_seq_max_k3_seq_masked_fraction"] == pytest.approx(1 / 3)


def test_weights_and_rejection_together_read_the_same_tokens():
    """The weights are made over the response tokens before the rejection, as verl does."""
    rejections = parse_rejections("seq_sum_k1", "0.5_2.0")
    corrected = _corrected(level="token", upper=2.0, rejections=rejections)
    torch.testing.assert_close(corrected.weights, _weights([[2.0, 0.5, 2.0], [1.5, 1.0], [0.25]]))
    torch.testing.assert_close(corrected.keep * MASK, _keep([[0, 0, 0], [1, 1], [0]]) * MASK)


# --- diagnostics -----------------------------------------------------------------------


def test_diagnostics_by_hand():
    _, m = _metrics()
    logs = [math.log(r) for r in TOKENS]
    assert m["rollout_corr/kl"] == pytest.approx(-sum(logs) / 6)  # mean log mu - log pi_old
    assert m["rollout_corr/k3_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in TOKENS) / 6)
    assert m["rollout_corr/chi2_token"] == pytest.approx(sum(r * r for r in TOKENS) / 6 - 1)
    products = [math.prod(row) for row in RATIOS]  # 3, 3/2, 1/4
    assert m["rollout_corr/chi2_seq"] == pytest.approx(sum(p * p for p in products) / 3 - 1)
    # per response: mean log mu = -1, mean log pi_old = -1 + mean log rho
    mean_log_rho = [sum(map(math.log, row)) / len(row) for row in RATIOS]
    assert m["rollout_corr/rollout_log_ppl"] == pytest.approx(1.0)
    assert m["rollout_corr/rollout_ppl"] == pytest.approx(math.e)
    train = [1 - x for x in mean_log_rho]  # -mean log pi_old
    assert m["rollout_corr/training_log_ppl"] == pytest.approx(sum(train) / 3)
    assert m["rollout_corr/training_ppl"] == pytest.approx(sum(math.exp(t) for t in train) / 3)
    diffs = [-x for x in mean_log_rho]  # mean log mu - mean log pi_old
    assert m["rollout_corr/log_ppl_diff"] == pytest.approx(sum(diffs) / 3)
    assert m["rollout_corr/log_ppl_abs_diff"] == pytest.approx(sum(map(abs, diffs)) / 3)
    assert m["rollout_corr/log_ppl_diff_max"] == pytest.approx(max(diffs))
    assert m["rollout_corr/log_ppl_diff_min"] == pytest.approx(min(diffs))
    assert m["rollout_corr/ppl_ratio"] == pytest.approx(sum(math.exp(d) for d in diffs) / 3)
    assert not any(name.startswith("rollout_corr/rollout_") and "ppl" not in name for name in m)
    assert all(math.isfinite(v) for v in m.values())  # the nan padding stays out


def test_the_tally_adds_up_over_micro_batches_and_ranks():
    """Two parts of different sizes (two micro-batches, or two ranks' rows): summed sums and
    the maxima of their peaks give the whole batch's metrics, not a mean of the two means."""
    settings = CorrectionSettings(
        level="sequence", upper=2.0, rejections=parse_rejections("token_k3", "0.2")
    )
    whole = correct(OLD, BEHAVIOUR, MASK, settings)
    parts = [correct(OLD[rows], BEHAVIOUR[rows], MASK[rows], settings) for rows in ([0, 1], [2])]
    tally = {
        name: max(p.tally[name] for p in parts)
        if name.startswith(PEAK)
        else sum(p.tally[name] for p in parts)
        for name in whole.tally
    }
    assert all(name.startswith((SUM, PEAK)) for name in tally)
    want = correction_metrics(whole.tally, settings)
    got = correction_metrics(tally, settings)
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name] == pytest.approx(value), name
    halves = [correction_metrics(p.tally, settings)["rollout_corr/kl"] for p in parts]
    assert sum(halves) / 2 != pytest.approx(want["rollout_corr/kl"])


def test_nothing_counted_gives_no_metrics():
    empty = correct(OLD, BEHAVIOUR, torch.zeros_like(MASK), CorrectionSettings(level="token"))
    assert correction_metrics(empty.tally, CorrectionSettings(level="token")) == {}


# --- thresholds ------------------------------------------------------------------------


def test_thresholds_parse_as_verl_reads_them():
    assert parse_bounds("2") == (None, 2.0)
    assert parse_bounds("0.5_5.0") == (0.5, 5.0)
    k1, k3 = parse_rejections("token_k1,seq_mean_k3", "2.0")  # one broadcast to both
    assert k1 == Rejection("token_k1", upper=2.0, lower=0.5)
    assert k3 == Rejection("seq_mean_k3", upper=2.0)
    assert parse_rejections("", "") == ()


@pytest.mark.parametrize(
    ("options", "thresholds", "error"),
    [
        ("token_k4", "1.0", "'token_k4' is not known; choose from: token_k1"),
        ("seq_max_k1", "2.0", "'seq_max_k1' is not known"),
        ("token_k1,token_k1", "2.0", "token_k1 is named twice"),
        ("token_k1,token_k2,token_k3", "2.0,1.0", "2 thresholds for 3 options"),
        ("token_k2", "0.5_2.0", "token_k2 takes an upper bound only"),
        ("token_k1", "2.0_0.5", "the lower bound is above the upper"),
        ("token_k1", "0_2", "bounds must be positive"),
        ("token_k3", "-1", "bounds must be positive"),
        ("token_k3", "inf", "bounds must be positive and finite"),
        ("token_k3", "high", "'high' is not a number or lower_upper"),
        ("token_k1", "_2.0", "is not a number or lower_upper"),
    ],
)
def test_bad_thresholds_are_refused(options, thresholds, error):
    with pytest.raises(ValueError, match=error):
        parse_rejections(options, thresholds)
