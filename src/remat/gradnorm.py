"""GradNorm: learn multi-task loss weights that balance the tasks' gradient norms.

Chen et al., "GradNorm: Gradient Normalization for Adaptive Loss Balancing in Deep Multitask
Networks", ICML 2018. Usable in any training loop::

    gn = GradNorm(num_tasks=3, shared_params=model.trunk[-1].weight, alpha=1.5)
    for batch in data:
        losses = [task_loss(model, batch, i) for i in range(3)]
        total = gn.backward(losses)   # model grads from sum_i w_i L_i, weight grads from L_grad
        optimizer.step(); optimizer.zero_grad()
        gn.step()                     # update the weights, renormalise to sum to num_tasks

``GradNorm`` owns its weights and their optimizer (Adam, as in the paper's reference setup), so the
model's optimizer never sees them and their learning rate is chosen here (``lr``).

# NOTE [ GradNorm step ]
With task losses L_i and weights w_i (initially 1):
  * the model is trained on L = sum_i w_i L_i, with the w_i held constant;
  * G_i = ||grad_W (w_i L_i)|| on the shared parameters W (usually the last shared layer);
  * Ltilde_i = L_i(t) / L_i(0) and r_i = Ltilde_i / mean_j Ltilde_j (relative inverse training rate);
  * target_i = mean_j G_j * r_i ** alpha, held constant (the paper: otherwise the weights drift to 0);
  * the weights alone are trained on L_grad = sum_i |G_i - target_i|;
  * after the update the weights are floored at a small positive value and rescaled to sum to T.
A task that trains slowly (large r_i) gets a larger target and so a larger weight; a task whose
gradients are naturally large gets a smaller weight.

# NOTE [ Why no double backward ]
The paper writes G_i with a second-order graph (autograd.grad(..., create_graph=True)) and then
differentiates L_grad with respect to the weights only. Since w_i is a scalar that the model's graph
does not see, grad_W (w_i L_i) = w_i * grad_W L_i exactly, so G_i = w_i * ||grad_W L_i|| and
dL_grad/dw_i = sign(G_i - target_i) * ||grad_W L_i||: the second-order graph through the network
would be built only to be thrown away. We therefore take first-order gradients of each L_i (keeping
the graph for the model's backward) and let only the product with w_i carry gradient. The weights'
gradients are the same as the literal create_graph=True formulation (tests/test_gradnorm.py checks it,
also with a trunk under torch.utils.checkpoint), at less memory, and models whose ops lack a double
backward (fused attention kernels, some custom autograd functions) still work.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from remat.errors import InvalidState, InvalidType, InvalidValue

__all__ = ["GradNorm"]

_STATE_VERSION = 1

#: Weights are floored here before renormalising: a weight at or below zero would flip the sign of
#: its task's loss, and the paper's weights are positive by construction.
_MIN_WEIGHT = 1e-4


class GradNorm:
    """Adaptive task weights by gradient normalisation (see NOTE [ GradNorm step ]).

    Args:
        num_tasks: how many task losses ``backward`` receives each step (at least 2).
        shared_params: the shared parameters W whose per-task gradient norms are balanced; a tensor,
            an iterable of tensors, or a module (its parameters). The paper uses the last shared
            layer's weight: the per-task norms then cost one short backward each.
        alpha: how strongly slow-training tasks are pulled up (``0`` equalises gradient norms only;
            the paper uses 0.12 to 3.0 depending on how different the tasks are).
        lr: learning rate of the weights' own Adam optimizer.
    """

    def __init__(
        self,
        num_tasks: int,
        shared_params: Tensor | Iterable[Tensor] | nn.Module,
        *,
        alpha: float = 1.5,
        lr: float = 0.025,
    ) -> None:
        if isinstance(num_tasks, bool) or not isinstance(num_tasks, int) or num_tasks < 2:
            raise InvalidValue(
                f"num_tasks must be an int >= 2 (GradNorm balances several task losses), "
                f"got {num_tasks!r}"
            )
        if not math.isfinite(alpha) or alpha < 0:
            raise InvalidValue(
                f"alpha must be a finite number >= 0 (the paper uses 0.12-3), got {alpha!r}"
            )
        if not math.isfinite(lr) or lr <= 0:
            raise InvalidValue(f"lr must be a finite number > 0 (the paper uses 0.025), got {lr!r}")
        self.num_tasks = num_tasks
        self.alpha = float(alpha)
        self.shared_params = _as_param_list(shared_params)
        device = self.shared_params[0].device
        self._weights = nn.Parameter(torch.ones(num_tasks, device=device, dtype=torch.float32))
        self._optimizer = torch.optim.Adam([self._weights], lr=lr)
        self._initial_losses: Tensor | None = None
        self._last_grad_loss: Tensor | None = None

    @property
    def weights(self) -> Tensor:
        """The current task weights, a detached copy (for logging; changing it changes nothing)."""
        return self._weights.detach().clone()

    @property
    def initial_losses(self) -> Tensor | None:
        """L_i(0), the losses of the first ``backward`` call (detached copy); None before it."""
        return None if self._initial_losses is None else self._initial_losses.clone()

    @property
    def grad_loss(self) -> Tensor | None:
        """L_grad of the last ``backward`` call, detached (for logging); None before it."""
        return self._last_grad_loss

    def backward(self, losses: Sequence[Tensor]) -> Tensor:
        """Backpropagate one step: model gradients from sum_i w_i L_i, weight gradients from L_grad.

        The model's parameters receive (accumulate into ``.grad``) the gradient of the weighted sum,
        exactly as ``(w * losses).sum().backward()`` with constant weights would; the weights'
        gradient is accumulated until ``step``. The first call records L_i(0).

        Returns:
            The weighted total loss sum_i w_i L_i, detached.
        """
        stacked = self._check_losses(losses)
        initial = self._initial_losses
        if initial is None:
            initial = _check_initial_losses(stacked.detach())
        weights = self._weights

        # First-order gradients only: see NOTE [ Why no double backward ].
        norms = torch.stack([self._shared_grad_norm(loss, i) for i, loss in enumerate(losses)])
        grad_norms = weights * norms  # G_i; differentiable in the weights only
        with torch.no_grad():
            ratios = stacked.detach() / initial
            inverse_rates = ratios / ratios.mean()
            target = grad_norms.mean() * inverse_rates**self.alpha
        grad_loss = (grad_norms - target).abs().sum()
        (weight_grad,) = torch.autograd.grad(grad_loss, [weights])

        total = (weights.detach() * stacked).sum()
        total.backward()
        # State changes only once nothing can fail: an error above leaves GradNorm as it was.
        if weights.grad is None:
            weights.grad = weight_grad
        else:
            weights.grad.add_(weight_grad)
        self._initial_losses = initial
        self._last_grad_loss = grad_loss.detach()
        return total.detach()

    def step(self) -> None:
        """Update the weights from the gradients of ``backward``, then renormalise to sum to T."""
        if self._weights.grad is None:
            raise InvalidState(
                "GradNorm.step() called before GradNorm.backward(losses); call backward each step "
                "before step"
            )
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            self._weights.clamp_(min=_MIN_WEIGHT)
            self._weights.mul_(self.num_tasks / self._weights.sum())

    def state_dict(self) -> dict[str, Any]:
        """Weights, L_i(0), the weights' optimizer state and the settings, for checkpoints."""
        return {
            "version": _STATE_VERSION,
            "num_tasks": self.num_tasks,
            "alpha": self.alpha,
            "weights": self.weights,
            "initial_losses": self.initial_losses,
            "optimizer": self._optimizer.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from ``state_dict()``; the number of tasks must match."""
        version = state.get("version")
        if version != _STATE_VERSION:
            raise InvalidValue(
                f"GradNorm state has version {version!r}, this remat reads version {_STATE_VERSION}; "
                "save it again with this version of remat"
            )
        if state["num_tasks"] != self.num_tasks:
            raise InvalidValue(
                f"GradNorm state is for {state['num_tasks']} tasks, this GradNorm has "
                f"{self.num_tasks}; build it with num_tasks={state['num_tasks']}"
            )
        self.alpha = float(state["alpha"])
        device = self._weights.device
        with torch.no_grad():
            self._weights.copy_(state["weights"].to(device))
        initial = state["initial_losses"]
        self._initial_losses = None if initial is None else initial.to(device).float().clone()
        self._optimizer.load_state_dict(state["optimizer"])

    def _check_losses(self, losses: Sequence[Tensor]) -> Tensor:
        if isinstance(losses, Tensor) or not isinstance(losses, Sequence):
            raise InvalidType(
                f"losses must be a sequence (list or tuple) of {self.num_tasks} scalar tensors, "
                f"got {type(losses).__name__}; pass [loss_0, loss_1, ...]"
            )
        if len(losses) != self.num_tasks:
            raise InvalidValue(
                f"expected {self.num_tasks} task losses (num_tasks={self.num_tasks}), got {len(losses)}"
            )
        for i, loss in enumerate(losses):
            if not isinstance(loss, Tensor):
                raise InvalidType(f"loss {i} must be a tensor, got {type(loss).__name__}")
            if loss.dim() != 0:
                raise InvalidValue(
                    f"loss {i} must be a scalar (0-dim) tensor, got shape {tuple(loss.shape)}; "
                    "reduce it first, e.g. loss.mean()"
                )
            if not loss.requires_grad:
                raise InvalidValue(
                    f"loss {i} does not require grad; compute the losses with autograd enabled "
                    "(not under torch.no_grad()) from the model's outputs"
                )
        return torch.stack([loss.float() for loss in losses])

    def _shared_grad_norm(self, loss: Tensor, index: int) -> Tensor:
        grads = torch.autograd.grad(loss, self.shared_params, retain_graph=True, allow_unused=True)
        if any(g is None for g in grads):
            raise InvalidValue(
                f"loss {index} does not depend on every shared parameter; GradNorm balances the "
                "tasks' gradients on parameters that all tasks use: pass the last shared layer's "
                "weight as shared_params"
            )
        return torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
        )


def _as_param_list(shared_params: Tensor | Iterable[Tensor] | nn.Module) -> list[Tensor]:
    params: list[Tensor]
    if isinstance(shared_params, nn.Module):
        params = list(shared_params.parameters())
    elif isinstance(shared_params, Tensor):
        params = [shared_params]
    else:
        params = list(shared_params)
    if not params:
        raise InvalidValue(
            "shared_params is empty; pass the shared parameters to balance, usually the last shared "
            "layer's weight (e.g. model.trunk[-1].weight)"
        )
    for i, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise InvalidType(f"shared_params[{i}] must be a tensor, got {type(p).__name__}")
        if not p.requires_grad:
            raise InvalidValue(
                f"shared_params[{i}] (shape {tuple(p.shape)}) does not require grad; GradNorm needs "
                "the gradient of each task's loss on it: pass trainable shared parameters"
            )
    return params


def _check_initial_losses(losses: Tensor) -> Tensor:
    if not torch.isfinite(losses).all() or (losses <= 0).any():
        raise InvalidValue(
            f"the first losses set L_i(0) and must be finite and > 0 (loss ratios divide by them), "
            f"got {losses.tolist()}; check the losses, or add a small constant to a loss that can be 0"
        )
    return losses.clone()
