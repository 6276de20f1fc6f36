"""Putting a commtune hook on a DDP module, and the handle that reads it back."""
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .stats import from_counters
from . import nccl
from .hooks import HookConfig, _C

SUPPORTED_BACKENDS = ("gloo", "nccl")
_HANDLE_ATTR = "_commtune_handle"


class Handle:
    """What `register` returns: counters and hook state of one registered hook."""

    def __init__(self, native, config, ranks):
        self._native = native
        self.config = config
        self.ranks = ranks  # the process group's size, for wire_ratio
        self._micro_steps = 0  # backward passes under commtune.accumulate, communicating or not

    def _count_micro_step(self):
        self._micro_steps += 1

    @property
    def name(self):
        return self._native.name

    @property
    def iteration(self):
        """Iterations the hook has seen (kept in state_dict, not cleared by reset_stats)."""
        return self._native.iteration

    def stats(self):
        """Counters of every finished iteration since the last reset (see README), and the NCCL
        variables commtune.nccl applied in this process (`nccl`)."""
        stats = from_counters(self._native.counters(), self.ranks)
        stats["nccl"] = nccl.applied()
        stats["micro_steps"] = self._micro_steps
        return stats

    @property
    def timing(self):
        """Whether comm_us/exposed_comm_us are measured (CUDA events or host clock); default on."""
        return self._native.timing

    @timing.setter
    def timing(self, on):
        self._native.timing = bool(on)

    @property
    def timing_every(self):
        """On GPUs, CUDA events time one iteration in this many (default 10; 1: every one)."""
        return self._native.timing_every

    @timing_every.setter
    def timing_every(self, every):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"timing_every must be an integer >= 1, got {every!r}")
        self._native.timing_every = every

    @property
    def launch_thread(self):
        """Whether the hook's launches run on a thread of its own (default off; see README).
        Set it before training or between iterations."""
        return self._native.launch_thread

    @launch_thread.setter
    def launch_thread(self, on):
        self._native.launch_thread = bool(on)

    def reset_stats(self):
        self._native.reset_counters()
        self._micro_steps = 0

    def state_dict(self):
        return dict(self._native.state_dict())

    def load_state_dict(self, state_dict):
        if not isinstance(state_dict, dict):
            raise TypeError(f"load_state_dict expects a dict, got {type(state_dict).__name__}")
        self._native.load_state_dict(state_dict)

    def __repr__(self):
        return f"commtune.Handle({self.config!r}, iteration={self.iteration})"


def _backend_names(process_group):
    # "gloo", "nccl", or a device map such as "cpu:gloo,cuda:nccl".
    spec = str(dist.get_backend(process_group))
    return [part.split(":")[-1] for part in spec.split(",")]


def _existing_hook(ddp):
    if getattr(ddp, _HANDLE_ATTR, None) is not None:
        return f"commtune.{getattr(ddp, _HANDLE_ATTR).name}"
    try:
        return ddp._get_ddp_logging_data().get("comm_hook") or None
    except (AttributeError, RuntimeError):
        return None


def _check_config(hook):
    if not isinstance(hook, HookConfig):
        raise TypeError(
            f"hook must be a commtune.hooks config such as commtune.hooks.AllReduce(), got {hook!r}"
        )
    hook.validate()


def register(ddp, hook):
    """Registers `hook` (a `commtune.hooks` config) on an existing DDP module's reducer."""
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(
            "commtune.register expects a torch.nn.parallel.DistributedDataParallel module, got "
            f"{type(ddp).__name__}; wrap the model first, or use commtune.wrap(model, hook=...)"
        )
    _check_config(hook)
    backends = _backend_names(ddp.process_group)
    unsupported = [b for b in backends if b not in SUPPORTED_BACKENDS]
    if unsupported:
        raise ValueError(
            f"commtune hooks support the {' and '.join(SUPPORTED_BACKENDS)} backends; this DDP "
            f"module's process group uses {', '.join(unsupported)}"
        )
    existing = _existing_hook(ddp)
    if existing:
        raise RuntimeError(
            f"this DDP module already has a communication hook ({existing}); a reducer takes one "
            "hook, once: build a new DDP module to use another"
        )
    native = _C.register_built(ddp.reducer, hook._build(ddp.process_group))
    native.set_parameters(list(ddp.module.parameters()))
    ddp.logger._set_comm_hook_name(f"commtune.{hook.name}")
    handle = Handle(native, hook, ddp.process_group.size())
    setattr(ddp, _HANDLE_ATTR, handle)
    return handle


def wrap(model, hook, **ddp_kwargs):
    """Builds DistributedDataParallel(model, **ddp_kwargs) and registers `hook` on it."""
    if isinstance(model, DistributedDataParallel):
        raise TypeError("commtune.wrap expects the bare model; for a DDP module use commtune.register")
    _check_config(hook)  # before DDP's constructor talks to the other ranks
    ddp = DistributedDataParallel(model, **ddp_kwargs)
    register(ddp, hook)
    return ddp


def handle_of(ddp_or_handle):
    """The Handle of a DDP module that commtune registered a hook on (or the handle itself)."""
    if isinstance(ddp_or_handle, Handle):
        return ddp_or_handle
    handle = getattr(ddp_or_handle, _HANDLE_ATTR, None)
    if handle is None:
        raise ValueError("this module has no commtune hook: use commtune.register or commtune.wrap")
    return handle
