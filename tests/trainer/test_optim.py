"""The learning-rate schedule against hand-computed values, and the optimizer it drives."""

import math

import pytest
import torch

from honing.trainer.optim import build_optimizer, lr_factor


def factor(step, schedule="cosine", warmup_steps=2, total_steps=10, min_ratio=0.0):
    return lr_factor(
        step,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        schedule=schedule,
        min_ratio=min_ratio,
    )


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
def test_linear_warmup(schedule):
    # Step s of w warmup steps runs at (s + 1) / w: the first step already learns.
    assert factor(0, schedule, warmup_steps=4) == 0.25
    assert factor(1, schedule, warmup_steps=4) == 0.5
    assert factor(3, schedule, warmup_steps=4) == 1.0


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (2, 1.0),  # decay starts at the end of warmup: progress 0
        (4, 0.5 * (1 + math.cos(math.pi / 4))),  # progress 2 / 8 = 0.25 -> 0.853553
        (6, 0.5),  # progress 0.5: halfway down
        (10, 0.0),  # progress 1
        (15, 0.0),  # past the end: stays at the floor
    ],
)
def test_cosine_decay(step, expected):
    assert factor(step) == pytest.approx(expected, abs=1e-12)


def test_cosine_decays_to_the_minimum_ratio():
    # min_ratio + (1 - min_ratio) * decay: 0.1 + 0.9 * 0.5 = 0.55 halfway, 0.1 at the end.
    assert factor(6, min_ratio=0.1) == pytest.approx(0.55)
    assert factor(10, min_ratio=0.1) == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("step", "min_ratio", "expected"),
    [
        (2, 0.0, 1.0),
        (4, 0.0, 0.75),  # progress 0.25
        (8, 0.0, 0.25),  # progress 0.75
        (4, 0.2, 0.8),  # 0.2 + 0.8 * 0.75
        (10, 0.2, 0.2),
    ],
)
def test_linear_decay(step, min_ratio, expected):
    assert factor(step, "linear", min_ratio=min_ratio) == pytest.approx(expected, abs=1e-12)


def test_constant_after_warmup_and_without_warmup():
    assert factor(7, "constant") == 1.0
    assert factor(0, "constant", warmup_steps=0) == 1.0
    assert factor(0, "cosine", warmup_steps=0) == 1.0


def test_unknown_schedule():
    with pytest.raises(ValueError, match="unknown lr schedule 'step'"):
        factor(5, "step")


def test_build_optimizer_applies_the_schedule_per_step():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    model[1].requires_grad_(False)
    optimizer, scheduler = build_optimizer(
        model,
        lr=0.1,
        weight_decay=0.01,
        betas=[0.8, 0.9],
        warmup_steps=2,
        total_steps=10,
        schedule="linear",
        min_ratio=0.0,
    )
    assert isinstance(optimizer, torch.optim.AdamW)
    group = optimizer.param_groups[0]
    assert group["betas"] == (0.8, 0.9)
    assert group["weight_decay"] == 0.01
    # Frozen parameters are left out.
    assert [p.shape for p in group["params"]] == [(2, 2), (2,)]
    lrs = []
    for _ in range(5):
        lrs.append(group["lr"])
        optimizer.step()
        scheduler.step()
    # 0.1 x factor(0..4): 0.5, 1, then linear 1, 0.875, 0.75.
    assert lrs == pytest.approx([0.05, 0.1, 0.1, 0.0875, 0.075])


def test_the_optimizer_is_fused_on_cpu_and_takes_adamws_step():
    """Fused AdamW (one kernel per parameter) where torch has it; the same update as the
    reference implementation up to rounding."""
    torch.manual_seed(0)
    fused_model, plain_model = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    plain_model.load_state_dict(fused_model.state_dict())
    settings = dict(
        lr=0.1, weight_decay=0.01, betas=(0.9, 0.99), warmup_steps=0, total_steps=3,
        schedule="constant", min_ratio=0.0,
    )  # fmt: skip
    optimizer, _ = build_optimizer(fused_model, **settings)
    assert optimizer.param_groups[0]["fused"] is True
    reference = torch.optim.AdamW(
        plain_model.parameters(), lr=0.1, weight_decay=0.01, betas=(0.9, 0.99), foreach=False
    )
    inputs = torch.randn(16, 8)
    for _ in range(3):
        for model, opt in ((fused_model, optimizer), (plain_model, reference)):
            opt.zero_grad()
            model(inputs).square().sum().backward()
            opt.step()
    for fused, plain in zip(fused_model.parameters(), plain_model.parameters(), strict=True):
        torch.testing.assert_close(fused, plain, atol=1e-6, rtol=1e-5)
