"""Hook configurations. Each one validates its values and builds its C++ hook."""
from dataclasses import dataclass

import torch

from ._native import load

_C = load()


class HookConfig:
    """Base of every hook configuration: validate() then register on a reducer."""

    name = "Hook"

    def validate(self):
        """Raises ValueError naming the parameter and its accepted values."""

    def _register(self, reducer, process_group):
        raise NotImplementedError


@dataclass(frozen=True)
class AllReduce(HookConfig):
    """Mean allreduce, as DDP does without a hook; the 1/world_size factor rides in the
    collective on NCCL (PREMUL_SUM) and is one scale pass on gloo."""

    name = "AllReduce"

    def _register(self, reducer, process_group):
        return _C.register_allreduce(reducer, process_group, _C.AllReduceOptions())


@dataclass(frozen=True)
class Cast(HookConfig):
    """Sends gradients as fp16 or bf16: scaled by 1/world_size and cast in one pass, summed,
    and copied back into the bucket. Scaling first keeps fp16 from overflowing."""

    dtype: torch.dtype = torch.bfloat16
    name = "Cast"

    _DTYPES = (torch.float16, torch.bfloat16)

    def validate(self):
        if self.dtype not in self._DTYPES:
            raise ValueError(
                f"Cast: dtype must be torch.float16 or torch.bfloat16, got {self.dtype!r}"
            )

    def _register(self, reducer, process_group):
        options = _C.CastOptions()
        options.dtype = self.dtype
        return _C.register_cast(reducer, process_group, options)


__all__ = ["HookConfig", "AllReduce", "Cast"]
