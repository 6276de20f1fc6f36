"""Hiding work behind communication, on the Python side: the optimizer that WithOptimizer runs
inside backward, seen as a torch optimizer, and gradient accumulation."""
import contextlib

import torch

from .hooks import OPTIMIZER_DEFAULTS, WithOptimizer, _C, _check_hyperparameters, optimizer_options
from .registration import _HANDLE_ATTR, handle_of


class OverlappedOptimizer(torch.optim.Optimizer):
    """The optimizer of a DDP module whose hook is `WithOptimizer`: the update already ran during
    backward, so `step()` only runs the closure. `param_groups` (one group) carries the
    hyperparameters: LR schedulers and manual changes reach the hook before the next forward.
    `state_dict()` has torch.optim.SGD's / AdamW's layout and loads into them, and back."""

    def __init__(self, ddp):
        handle = handle_of(ddp)
        if not isinstance(handle.config, WithOptimizer):
            raise TypeError(f"OverlappedOptimizer needs a DDP module whose hook is commtune.hooks.WithOptimizer, "
                            f"got {handle.config!r}")
        self._handle = handle
        self._kind = handle.config.optimizer
        params = [p for p in ddp.module.parameters() if p.requires_grad]
        # The hook keeps state by index in module.parameters(); the group by index in `params`.
        index = {id(p): i for i, p in enumerate(ddp.module.parameters())}
        self._module_index = [index[id(p)] for p in params]
        super().__init__(params, handle.config.defaults())
        self._pre_forward = ddp.register_forward_pre_hook(lambda module, args: self._push_hyperparameters())

    def _push_hyperparameters(self):
        if len(self.param_groups) != 1:
            raise ValueError("OverlappedOptimizer keeps one param_group (the hook updates every parameter alike)")
        group = self.param_groups[0]
        values = {k: (float(v) if isinstance(v, torch.Tensor) else v)
                  for k, v in group.items() if k in OPTIMIZER_DEFAULTS[self._kind]}
        _check_hyperparameters(self._kind, values, where="OverlappedOptimizer")
        _C.set_hyperparameters(self._handle._native, optimizer_options(self._kind, values))

    @torch.no_grad()
    def step(self, closure=None):
        """The update ran in backward; this only evaluates `closure` (if given) and returns it."""
        if closure is not None:
            with torch.enable_grad():
                return closure()
        return None

    def state_dict(self):
        out = super().state_dict()
        by_module_index = {m: i for i, m in enumerate(self._module_index)}
        for key, value in self._handle.state_dict().items():
            if key.startswith("optim."):
                _, module_index, name = key.split(".", 2)
                out["state"].setdefault(by_module_index[int(module_index)], {})[name] = value.clone()
        return out

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)  # param_groups, and self.state in torch's form
        entries = {}
        for position, p in enumerate(self.param_groups[0]["params"]):
            for name, value in self.state.get(p, {}).items():
                entries[f"optim.{self._module_index[position]}.{name}"] = value
        self.state.clear()  # the hook holds the state; keep no second copy
        _C.load_optimizer_state(self._handle._native, entries)
        self._push_hyperparameters()


class _MicroStep:
    def __init__(self, ddp, index, steps, average):
        self.ddp, self.index, self.steps, self.average = ddp, index, steps, average
        self.last = index == steps - 1
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        handle = getattr(self.ddp, _HANDLE_ATTR, None)
        if not self.last:
            self._stack.enter_context(self.ddp.no_sync())
        elif self.average and handle is not None:
            # Each bucket is scaled by 1/steps as it goes out, in the hook (no extra pass).
            handle._native.input_scale = 1.0 / self.steps
            self._stack.callback(setattr, handle._native, "input_scale", 1.0)
        if handle is not None:
            self._stack.callback(handle._count_micro_step)
        return self

    def __exit__(self, *exc):
        handle = getattr(self.ddp, _HANDLE_ATTR, None)
        if self.last and self.average and handle is None and exc[0] is None:
            grads = [p.grad for p in self.ddp.module.parameters() if p.grad is not None]
            torch._foreach_div_(grads, self.steps)  # plain DDP: averaged after the fact
        return self._stack.__exit__(*exc)


def accumulate(ddp, steps, average=True):
    """Gradient accumulation over `steps` micro-steps: yields one context per micro-step; run
    each micro-step's forward and backward inside it. Only the last one communicates; with
    `average` the result is the mean over every micro-batch of every rank (the gradient of one
    large batch), without it the sum over micro-steps of the ranks' mean.

        for micro in ct.accumulate(ddp, 4):
            with micro:
                loss_fn(ddp(x[micro.index]), y[micro.index]).backward()
        optimizer.step()
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"accumulate: steps must be an integer >= 1, got {steps!r}")
    for index in range(steps):
        yield _MicroStep(ddp, index, steps, average)
