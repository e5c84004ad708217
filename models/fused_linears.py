"""Pre-packed linears that read the same input (a layer's query/key/value projections, its gate and up projections),
run as one wider GEMM whose output each of them takes its slice of."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from models.prepack import PrepackedLinear, pack_weight, packed_linear


class FusedGroup:
    """Linears found reading one input: their weights concatenated along the output and packed once, and the last
    call's input with its output slices, held until the last member in call order has taken its slice."""

    def __init__(self, linears: list[nn.Linear]):
        self.sizes = [linear.out_features for linear in linears]
        self.packed_weight = pack_weight(torch.cat([linear.weight.detach() for linear in linears]))  # [sum, in]
        biases = [linear.bias for linear in linears]
        self.bias = None
        if any(bias is not None for bias in biases):  # a member without a bias adds zeros
            self.bias = torch.cat([torch.zeros(linear.out_features, dtype=linear.weight.dtype)
                                   if bias is None else bias.detach() for linear, bias in zip(linears, biases)])
        # (input, its output slices): one tuple, replaced whole, so a member reads a consistent pair
        self.last: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None

    def slice_for(self, x: torch.Tensor, index: int, packed_weight: torch.Tensor, bias: torch.Tensor | None
                  ) -> torch.Tensor:  # [..., in] -> [..., sizes[index]]
        """Member `index`'s slice of the group's GEMM on `x`; packed_weight and bias are the group's own tensors."""
        last = self.last
        if last is None or last[0] is not x:
            last = (x, packed_linear(x, packed_weight, bias).split(self.sizes, dim=-1))
            self.last = last
        if index == len(self.sizes) - 1:
            self.last = None  # the group's last member: drop the input and the output before the layer goes on
        return last[1][index]


class FusedMember(nn.Module):
    """One linear of a FusedGroup: its output is its slice of the group's GEMM on the same input object, computed
    by whichever member is called first with it (a member called with another input computes the group's GEMM)."""

    def __init__(self, group: FusedGroup, index: int, in_features: int):
        super().__init__()
        self.group, self.index = group, index
        self.in_features, self.out_features = in_features, group.sizes[index]
        # The group's tensors as buffers of every member (module.buffers() yields each tensor once), so what counts a
        # model's tensors (models/memory.py) sees them, as it saw the linears' own.
        self.register_buffer("packed_weight", group.packed_weight)
        self.register_buffer("bias", group.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in_features] -> [..., out_features]
        # The group's tensors read as this module's buffers: a compiled layer takes a module's buffers as fixed in
        # size, and would take them as inputs of varying size if read from the group (a plain object).
        return self.group.slice_for(x, self.index, self.packed_weight, self.bias)

    def extra_repr(self) -> str:
        return f"slice {self.index} of {len(self.group.sizes)}, out_features={self.out_features}"


def find_groups(body: nn.Module, run: Callable[[], object]) -> list[list[tuple[nn.Module, str]]]:
    """Pre-packed linears under `body` that `run()` (a forward of the body) calls once each on one input tensor
    shared by two or more of them, as groups of (parent, name) in call order. A linear called more than once (shared
    across layers) is left alone: its calls may not share inputs the same way."""
    places: dict[int, tuple[nn.Module, str]] = {}
    linears: list[nn.Module] = []  # a module held in two places appears twice: its hook counts two calls
    for parent in body.modules():
        for name, child in parent.named_children():
            if type(child) is PrepackedLinear:
                places[id(child)] = (parent, name)
                linears.append(child)
    calls: dict[int, int] = {}
    inputs: list[tuple[torch.Tensor, list[int]]] = []  # (input, ids of the linears called on it), held alive

    def record(module: nn.Module, args: tuple) -> None:
        calls[id(module)] = calls.get(id(module), 0) + 1
        x = args[0]
        for seen, members in inputs:
            if seen is x:
                members.append(id(module))
                return
        inputs.append((x, [id(module)]))

    handles = [linear.register_forward_pre_hook(record) for linear in linears]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    groups = []
    for _, members in inputs:
        members = [member for member in members if calls[member] == 1]
        if len(members) > 1:
            groups.append([places[member] for member in members])
    return groups


def fuse_linears(groups: list[list[tuple[nn.Module, str]]], originals: dict[int, nn.Linear]
                 ) -> list[tuple[nn.Module, str, nn.Module]]:
    """Swap each group's pre-packed linears for FusedMembers of one FusedGroup built from their original weights
    (`originals`: id of each PrepackedLinear -> the nn.Linear it was packed from); returns the swaps, for
    restore_members."""
    swaps = []
    for places in groups:
        linears = [getattr(parent, name) for parent, name in places]
        group = FusedGroup([originals[id(linear)] for linear in linears])
        for index, ((parent, name), linear) in enumerate(zip(places, linears)):
            setattr(parent, name, FusedMember(group, index, linear.in_features))
            swaps.append((parent, name, linear))
    return swaps


def restore_members(swaps: list[tuple[nn.Module, str, nn.Module]]) -> None:
    """Undo fuse_linears: put the pre-packed linears back."""
    for parent, name, linear in swaps:
        setattr(parent, name, linear)
