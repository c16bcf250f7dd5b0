"""Policy loss against hand-computed values on tiny tensors.

    .venv/bin/python -m pytest tests/training/rl/test_loss.py -q -p no:django
"""

import math

import pytest
import torch

from training.rl.loss import KL_TOKEN_BOUND, LossInputs, k3, k3_bounded, policy_loss

EPS, EPS_HIGH, CAP = 0.2, 0.28, 2.0


def one_token(ratio: float, adv: float, **extra: torch.Tensor) -> LossInputs:
    old = torch.tensor([[-1.0]])
    logp = (old + math.log(ratio)).requires_grad_()
    return LossInputs(logprobs=logp, old_logprobs=old, advantages=torch.tensor([adv]),
                      mask=torch.tensor([[True]]), **extra)


def run(inputs: LossInputs, beta: float = 0.0):
    return policy_loss(inputs, eps=EPS, eps_high=EPS_HIGH, is_cap=CAP, beta=beta)


@pytest.mark.parametrize(
    ("ratio", "adv", "expected", "clipped"),
    [
        (1.1, 1.0, -1.1, False),  # inside the trust region
        (1.5, 1.0, -1.28, True),  # above 1 + eps_high with A > 0: clipped
        (0.5, -1.0, 0.8, True),  # below 1 - eps with A < 0: clipped
        (0.5, 1.0, -0.5, False),  # below 1 - eps with A > 0: the min keeps the unclipped term
        (1.5, -1.0, 1.5, False),  # above with A < 0: unclipped (pessimistic) term
    ],
)
def test_ppo_clip_matches_hand_computed_values(ratio, adv, expected, clipped):
    inputs = one_token(ratio, adv)
    out = run(inputs)
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    assert out.clip_fraction.item() == float(clipped)
    out.loss.backward()
    grad = inputs.logprobs.grad.item()
    assert (grad == 0.0) == clipped  # a clipped token gives no gradient
    if not clipped:
        assert grad == pytest.approx(-adv * ratio, rel=1e-6)  # d(-rho A)/d log pi = -rho A


def test_truncated_importance_weight_caps_pi_old_over_mu():
    # pi_old / mu = 3 > C = 2: the weight is 2 and the token counts as truncated.
    inputs = one_token(1.1, 1.0, behaviour_logprobs=torch.tensor([[-1.0 - math.log(3.0)]]))
    out = run(inputs)
    assert out.loss.item() == pytest.approx(-2.0 * 1.1, rel=1e-6)
    assert out.is_truncated.item() == 1.0
    assert out.mismatch_kl.item() == pytest.approx(3.0 - 1.0 - math.log(3.0), rel=1e-6)


def test_importance_weight_below_the_cap_is_used_as_is():
    inputs = one_token(1.0, 1.0, behaviour_logprobs=torch.tensor([[-1.0 + math.log(2.0)]]))
    out = run(inputs)
    assert out.loss.item() == pytest.approx(-0.5, rel=1e-6)  # weight pi_old/mu = 1/2
    assert out.is_truncated.item() == 0.0


def test_kl_term_is_beta_times_k3():
    # ref / pi_theta = 0.5 at ratio 1: k3 = 0.5 - 1 - log 0.5
    inputs = one_token(1.0, 0.0, ref_logprobs=torch.tensor([[-1.0 + math.log(0.5)]]))
    out = run(inputs, beta=0.1)
    expected_kl = 0.5 - 1.0 - math.log(0.5)
    assert out.kl_ref.item() == pytest.approx(expected_kl, rel=1e-6)
    assert out.loss.item() == pytest.approx(0.1 * expected_kl, rel=1e-6)
    out.loss.backward()
    assert inputs.logprobs.grad.item() == pytest.approx(0.1 * (1 - 0.5), rel=1e-6)  # pulls towards ref


def test_k3_is_zero_at_equal_policies_and_positive_elsewhere():
    assert k3(torch.tensor(0.0)).item() == 0.0
    assert (k3(torch.tensor([-2.0, -0.1, 0.3, 4.0])) > 0).all()


def test_it_takes_a_token_mean_over_the_whole_batch_and_ignores_masked_tokens():
    old = torch.zeros(2, 3)
    logp = old.clone().requires_grad_()
    mask = torch.tensor([[True, True, True], [True, False, False]])
    out = policy_loss(
        LossInputs(logprobs=logp, old_logprobs=old, advantages=torch.tensor([1.0, -2.0]), mask=mask,
                   behaviour_logprobs=torch.tensor([[0.0, 0.0, 0.0], [0.0, 99.0, -99.0]])),
        eps=EPS, eps_high=EPS_HIGH, is_cap=CAP, beta=0.0,
    )
    assert out.loss.item() == pytest.approx((-1.0 * 3 + 2.0) / 4)  # 4 tokens, not a mean of row means
    assert out.mismatch_kl.item() == 0.0  # the wild mu values sit on masked tokens


def test_normalizer_and_entropy_are_passed_through():
    inputs = one_token(1.0, 1.0, entropy=torch.tensor([[0.7]]))
    inputs.normalizer = 4.0
    out = run(inputs)
    assert out.loss.item() == pytest.approx(-0.25)
    assert out.entropy.item() == pytest.approx(0.7)


def _stale_rows(beta: float):
    """Two rows: one served by the run's base weights (mu = pi_old), one served by an older version
    on which pi_theta has moved far off the reference: log(pi_ref / pi_theta) = 30 and 17 nats."""
    old = torch.tensor([[-1.0, -1.0], [-40.0, -25.0]])
    logp = old.clone().requires_grad_()
    return LossInputs(logprobs=logp, old_logprobs=old, advantages=torch.tensor([1.0, 1.0]),
                      mask=torch.ones(2, 2, dtype=torch.bool),
                      behaviour_logprobs=torch.tensor([[-1.0, -1.0], [-0.5, -24.0]]),
                      ref_logprobs=torch.tensor([[-1.0, -1.0], [-10.0, -8.0]]),
                      same_weights=torch.tensor([True, False])), logp


def test_kl_ref_on_stale_rows_stays_finite_and_its_gradient_bounded():
    inputs, logp = _stale_rows(beta=0.1)
    unbounded = k3(inputs.ref_logprobs - inputs.old_logprobs)[1]  # exp(30): what the demo's 22,767,958 was
    assert float(unbounded.max()) > 1e12
    out = run(inputs, beta=0.1)
    assert math.isfinite(out.kl_ref.item()) and out.kl_ref.item() == pytest.approx((0 + 0 + 10 + 10) / 4)
    out.loss.backward()
    assert torch.isfinite(logp.grad).all()
    # PPO's part is -rho A / 4 per token (rho = 1) and the clamped tokens add no KL gradient.
    assert logp.grad.abs().max().item() == pytest.approx(0.25, rel=1e-6)


def test_the_bounded_k3_is_k3_inside_its_bounds_and_clamped_outside():
    x = torch.tensor([-30.0, -1.0, 0.0, 0.5, 2.0, 3.0, 30.0], requires_grad=True)
    y = k3_bounded(x)
    assert y[1:5].tolist() == pytest.approx(k3(x[1:5].detach()).tolist())
    assert y[0].item() == KL_TOKEN_BOUND and y[5].item() == KL_TOKEN_BOUND and y[6].item() == KL_TOKEN_BOUND
    y.sum().backward()
    assert x.grad.abs().max().item() < 12.6  # |e^x - 1| below x ~ 2.53, where k3 reaches the bound


def test_staleness_is_measured_apart_from_the_engine_mismatch():
    inputs, _ = _stale_rows(beta=0.0)
    out = run(inputs)
    assert out.mismatch_kl.item() == 0.0 and out.mismatch_tokens == 2  # the base's own rows: no engine fault
    expected = (KL_TOKEN_BOUND + k3(torch.tensor(-1.0)).item()) / 2  # log(pi_old / mu) = -39.5 (bounded) and -1
    assert out.staleness_kl.item() == pytest.approx(expected, rel=1e-6) and out.staleness_tokens == 2
    everyone = run(LossInputs(**{**inputs.__dict__, "same_weights": None}))
    assert everyone.staleness_tokens == 0 and everyone.mismatch_tokens == 4  # unknown origin: all the base's
