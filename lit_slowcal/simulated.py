"""Simulated machines: m copies of one ``nn.Module`` hosted in one process, run as one vectorized call.

The paper runs M = 16 ... 64 machines on one device. Here the m machines of a process keep their
parameters stacked along a new leading dimension, and the forward/backward of all of them is one
``torch.vmap`` over ``torch.func.functional_call``, never a Python loop over machines. Any module
whose forward is a function of its parameters, buffers and inputs can be simulated this way.

Because every optimizer update in ``torch.optim`` (and ``SlowcalSGD``) is elementwise, an optimizer
that holds the stacked parameters updates the m machines independently, exactly as m optimizers
would. The periodic averaging (``PeriodicAveragingStrategy``) finds ``SimulatedMachines`` modules and
averages over the leading dimension as well as over the processes.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from lit_slowcal._validation import check_int

__all__ = ["SimulatedMachines"]


def _key(name: str) -> str:
    # nn.Module attribute names cannot contain dots.
    return name.replace(".", "__")


class SimulatedMachines(nn.Module):
    """``num_machines`` copies of ``module`` with parameters stacked along dimension 0.

    Every copy starts from the same weights (those of ``module``), so the machines start at the same
    point x_0 as Algorithm 2 requires.

    ``forward(*inputs)`` takes inputs with a leading machine dimension ``(m, ...)`` and returns outputs
    with the same leading dimension: machine i sees ``inputs[i]`` and its own parameters.
    The loss to back-propagate is the *sum* over machines of each machine's own loss, so that the
    gradient in slice i of every stacked parameter is the gradient of machine i's loss alone.

    Limitation: modules with tied (shared) parameters are not supported by ``forward``:
    ``torch.func.functional_call`` under ``vmap`` does not restore tied parameters (torch 2.14).

    Args:
        module: the model one machine trains. It is copied; its parameters are not used afterwards.
        num_machines: m, the number of machines hosted by this process.

    Example:
        >>> machines = SimulatedMachines(nn.Linear(784, 10), num_machines=4)
        >>> machines.weight.shape
        torch.Size([4, 10, 784])
        >>> machines(torch.randn(4, 32, 784)).shape
        torch.Size([4, 32, 10])
    """

    def __init__(self, module: nn.Module, num_machines: int) -> None:
        super().__init__()
        self.num_machines = check_int("num_machines", num_machines)
        self._param_names = [name for name, _ in module.named_parameters()]
        self._buffer_names = [name for name, _ in module.named_buffers()]
        for name, p in module.named_parameters():
            stacked = p.detach().unsqueeze(0).repeat(num_machines, *([1] * p.dim())).clone()
            self.register_parameter(_key(name), nn.Parameter(stacked, requires_grad=p.requires_grad))
        for name, b in module.named_buffers():
            self.register_buffer(_key(name), b.detach().unsqueeze(0).repeat(num_machines, *([1] * b.dim())).clone())
        # nn.Linear (the paper's model) takes a direct batched-matmul path, see forward.
        self._linear = type(module) is nn.Linear
        # The template holds no data: functional_call supplies every parameter and buffer.
        # Kept out of the module tree so it is neither saved, moved, nor seen by optimizers.
        self.__dict__["_template"] = copy.deepcopy(module).to("meta")

    @property
    def template(self) -> nn.Module:
        """The wrapped module's structure, on the meta device (holds no data)."""
        return self.__dict__["_template"]

    def train(self, mode: bool = True) -> SimulatedMachines:
        """``nn.Module.train``, reaching the wrapped module too (it is not a submodule): in ``eval()`` Dropout keeps
        every value and BatchNorm uses its running statistics, in ``forward`` and ``forward_averaged`` alike."""
        super().train(mode)
        self.template.train(mode)
        return self

    def stacked_parameters(self) -> dict[str, Tensor]:
        """The stacked parameters under the wrapped module's own names, shape ``(m, *shape)``."""
        return {name: getattr(self, _key(name)) for name in self._param_names}

    def stacked_buffers(self) -> dict[str, Tensor]:
        return {name: getattr(self, _key(name)) for name in self._buffer_names}

    def forward(self, *inputs: Tensor) -> Any:
        for i, x in enumerate(inputs):
            if x.shape[:1] != (self.num_machines,):
                raise ValueError(
                    f"input {i} has shape {tuple(x.shape)}; its leading dimension must be the number of "
                    f"machines ({self.num_machines})"
                )

        if self._linear:
            return self._linear_forward(*inputs)

        def one_machine(params: dict[str, Tensor], buffers: dict[str, Tensor], *xs: Tensor) -> Any:
            return functional_call(self.template, (params, buffers), xs)

        return torch.vmap(one_machine, randomness="different")(
            self.stacked_parameters(), self.stacked_buffers(), *inputs
        )

    def _linear_forward(self, x: Tensor) -> Tensor:
        """vmap of nn.Linear without vmap's per-call cost: one batched matmul for all machines.

        Computed as (W x^T)^T rather than x W^T so that autograd produces the weight gradient in
        W's own memory layout: no strided copy into ``.grad`` on every step (the larger cost at
        large M). Same result as the vmap path (tested).
        """
        weight, bias = self.weight, getattr(self, "bias", None)
        flat = x.reshape(x.shape[0], -1, x.shape[-1]).transpose(1, 2)  # (m, in, n)
        out = torch.bmm(weight, flat) if bias is None else torch.baddbmm(bias.unsqueeze(-1), weight, flat)
        return out.transpose(1, 2).reshape(*x.shape[:-1], weight.shape[1])

    def averaged_state(self) -> dict[str, Tensor]:
        """Parameters and floating buffers averaged over the machines (the parameter server's x)."""
        state = {name: p.detach().mean(0) for name, p in self.stacked_parameters().items()}
        for name, b in self.stacked_buffers().items():
            state[name] = b.mean(0) if b.is_floating_point() or b.is_complex() else b[0]
        return state

    def forward_averaged(self, *inputs: Tensor) -> Any:
        """Forward of the averaged model on inputs without a machine dimension.

        Right after a synchronisation every machine holds the same x, so this is the synchronised
        model the paper evaluates.
        """
        return functional_call(self.template, self.averaged_state(), inputs)

    def averaged_module(self) -> nn.Module:
        """A plain copy of the wrapped module holding the averaged parameters (for export)."""
        tensors = [*self.parameters(), *self.buffers()]
        module = copy.deepcopy(self.template).to_empty(device=tensors[0].device if tensors else "cpu")
        state = self.averaged_state()
        # By name rather than load_state_dict: covers non-persistent buffers and tied parameters
        # (named_parameters lists a shared parameter once, state_dict under every name).
        with torch.no_grad():
            for name, t in (*module.named_parameters(), *module.named_buffers()):
                t.copy_(state[name])
        return module

    def extra_repr(self) -> str:
        return f"num_machines={self.num_machines}, module={self.template.__class__.__name__}"
