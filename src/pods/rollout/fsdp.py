"""Reading full weights out of a model sharded by PyTorch FSDP2 (``fully_shard``, accelerate's
``fsdp_version: 2``), one FSDP unit at a time.

Under FSDP2 each parameter is a ``DTensor`` holding this process's shard. :class:`UnitGatherer` unshards the
unit (a decoder layer, or the root with the embeddings and head) that owns the module being read, as the
unit's forward does, and reshards the previous one: the engine gets full tensors while memory holds at most
one gathered unit, and a LoRA layer's base and adapter weights are full together, so peft computes the delta
as usual. Unsharding is a collective: every process must read the same modules in the same order.
"""

from __future__ import annotations

import torch

__all__ = ["UnitGatherer"]


def _fsdp_module_class() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return None
    return FSDPModule


class UnitGatherer:
    """Context manager over ``model``: :meth:`hold` makes the parameters registered on a module full (its
    FSDP2 unit unsharded); leaving the context reshards. Without FSDP2, :meth:`hold` does nothing."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._owner: dict[int, torch.nn.Module] = {}  # id(module) -> the FSDP unit that shards its parameters
        self._held: torch.nn.Module | None = None
        unit_class = _fsdp_module_class()
        if unit_class is not None:
            self._map_units(model, None, unit_class)

    def _map_units(self, module: torch.nn.Module, unit: torch.nn.Module | None, unit_class: type) -> None:
        unit = module if isinstance(module, unit_class) else unit
        if unit is not None:
            self._owner[id(module)] = unit
        for child in module.children():
            self._map_units(child, unit, unit_class)

    def hold(self, module: torch.nn.Module) -> None:
        """Gather the unit that owns ``module``'s parameters (releasing the one held before), if any."""
        unit = self._owner.get(id(module))
        if unit is self._held:
            return
        self.release()
        if unit is not None:
            unit.unshard()
            self._held = unit

    @property
    def holding(self) -> bool:
        """Whether a unit is gathered now (its full tensors are freed when it is released: copy them out)."""
        return self._held is not None

    def release(self) -> None:
        if self._held is not None:
            self._held.reshard()
            self._held = None

    def __enter__(self) -> UnitGatherer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
