"""Small training problems for the optimizer tests: least squares and a small MLP.

Parameters may be fp64 (reference), fp32 or bf16; the loss and gradients are always computed
in fp64 from the parameters' values so the only difference between runs is the optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Problem:
    init: list[torch.Tensor]  # fp64 initial parameters
    loss: Callable[[list[torch.Tensor]], torch.Tensor]  # fp64 params -> fp64 scalar


def least_squares(
    seed: int = 0,
    n: int = 512,
    d: int = 64,
    out: int = 16,
    noise: float = 0.5,
    offset: float = 0.0,
    spread: float = 1.0,
) -> Problem:
    """Y = X W*^T + b* + noise; params W [out, d], b [out]. Loss = mean squared error."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=torch.float64)
    W0 = offset + torch.rand(out, d, generator=g, dtype=torch.float64)
    W_true = W0 + spread * torch.randn(out, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    b_true = torch.randn(out, generator=g, dtype=torch.float64)
    Y = X @ W_true.T + b_true + noise * torch.randn(n, out, generator=g, dtype=torch.float64)

    def loss(ps):
        W, b = ps
        return ((X @ W.T + b - Y) ** 2).mean()

    return Problem([W0, torch.zeros(out, dtype=torch.float64)], loss)


def mlp(seed: int = 0, n: int = 512, d: int = 16, hidden: int = 64, noise: float = 0.3) -> Problem:
    """Student tanh MLP fitting a teacher tanh MLP plus noise."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=torch.float64)
    T1 = torch.randn(hidden, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    T2 = torch.randn(1, hidden, generator=g, dtype=torch.float64) / math.sqrt(hidden)
    Y = torch.tanh(X @ T1.T) @ T2.T * 3 + noise * torch.randn(n, 1, generator=g, dtype=torch.float64)
    init = [
        torch.randn(hidden, d, generator=g, dtype=torch.float64) / math.sqrt(d),
        torch.zeros(hidden, dtype=torch.float64),
        torch.randn(1, hidden, generator=g, dtype=torch.float64) / math.sqrt(hidden),
        torch.zeros(1, dtype=torch.float64),
    ]

    def loss(ps):
        W1, b1, W2, b2 = ps
        return ((torch.tanh(X @ W1.T + b1) @ W2.T + b2 - Y) ** 2).mean()

    return Problem(init, loss)


def train(
    problem: Problem,
    make_opt,
    dtype: torch.dtype,
    steps: int = 300,
    lr: float = 1e-2,
    schedule: bool = True,
    on_step=None,
) -> tuple[float, list[torch.Tensor], object]:
    """Train from problem.init with parameters of ``dtype``; lr decays linearly to 0 over the
    run when ``schedule`` (a well-defined end point). Returns (final fp64 loss, params, opt)."""
    params = [t.clone().to(dtype).requires_grad_() for t in problem.init]
    opt = make_opt(params, lr)
    for t in range(steps):
        if schedule:
            for group in opt.param_groups:
                group["lr"] = lr * (1 - t / steps)
        set_grads(problem, params)
        opt.step()
        if on_step is not None:
            on_step(t, params, opt)
    with torch.no_grad():
        final = problem.loss([p.detach().double() for p in params]).item()
    return final, params, opt


def set_grads(problem: Problem, params: list[torch.Tensor]) -> None:
    ps = [p.detach().double().requires_grad_() for p in params]
    problem.loss(ps).backward()
    for p, q in zip(params, ps):
        p.grad = q.grad.to(p.dtype)
