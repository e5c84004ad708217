"""Counting what a piece of torch work dispatches: every op (a kernel launch on a GPU) and the ops that would make the
host wait for a GPU (a value read back, a shape that depends on data), so both can be measured and tested on CPU."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
# Ops whose result the host needs before it can go on: on a GPU each one waits for every kernel queued before it.
# `.tolist()`, `.item()` and `bool(tensor)` of a device tensor all reach _local_scalar_dense (or is_nonzero); nonzero,
# masked_select and unique size their output from the data; equal answers a Python bool.
_SYNCING = {
    _aten._local_scalar_dense.default,
    _aten.item.default,
    _aten.is_nonzero.default,
    _aten.equal.default,
    _aten.nonzero.default,
    _aten.nonzero_static.default,
    _aten.masked_select.default,
    _aten._unique2.default,
    _aten.unique_consecutive.default,
}
# Ops that only describe a tensor (a view, a shape): no kernel runs for them on a GPU.
_METADATA = {
    _aten.view.default, _aten._unsafe_view.default, _aten.reshape.default, _aten.expand.default,
    _aten.transpose.int, _aten.t.default, _aten.permute.default, _aten.unsqueeze.default, _aten.squeeze.dim,
    _aten.squeeze.default, _aten.slice.Tensor, _aten.select.int, _aten.alias.default, _aten.detach.default,
    _aten.split.Tensor, _aten.split_with_sizes.default, _aten.unbind.int, _aten.as_strided.default,
    _aten.narrow.default, _aten.lift_fresh.default, _aten.chunk.default, _aten.diagonal.default,
}


def _is_bool_index(func, args) -> bool:
    """index / index_put with a boolean mask: the result's size depends on how many entries are True."""
    if func not in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


@dataclass
class OpCounts:
    """What ran under one OpCounter: kernels (ops that are not views) and syncs, with the names of each."""

    kernels: int = 0
    syncs: int = 0
    kernel_names: Counter = field(default_factory=Counter)
    sync_names: Counter = field(default_factory=Counter)


class OpCounter(TorchDispatchMode):
    """Counts the ops dispatched inside `with OpCounter() as counter:` (counter.counts)."""

    def __init__(self):
        super().__init__()
        self.counts = OpCounts()
        self._tolist = None

    def __enter__(self):
        # .tolist() reads the data without dispatching an op: count it by wrapping the method while the mode is on.
        self._tolist = original = torch.Tensor.tolist
        counts = self.counts

        def tolist(tensor: torch.Tensor):
            counts.syncs += 1
            counts.sync_names["tolist"] += 1
            return original(tensor)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket.__name__)
        # repeat_interleave sizes its output from the data unless it is told the size
        unsized = func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None
        if func in _SYNCING or unsized or _is_bool_index(func, args):
            self.counts.syncs += 1
            self.counts.sync_names[name] += 1
        if func not in _METADATA:
            self.counts.kernels += 1
            self.counts.kernel_names[name] += 1
        return func(*args, **kwargs)
