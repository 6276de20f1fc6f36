"""Hook configurations. Each one validates its values and builds its C++ hook."""
from dataclasses import dataclass

import torch

from ._native import load

_C = load()


class HookConfig:
    """Base of every hook configuration: validate(), then build the C++ hook that a reducer
    (or a wrapping hook) takes."""

    name = "Hook"

    def validate(self):
        """Raises ValueError naming the parameter and its accepted values."""

    def _build(self, process_group):
        raise NotImplementedError


@dataclass(frozen=True)
class AllReduce(HookConfig):
    """Mean allreduce, as DDP does without a hook; the 1/world_size factor rides in the
    collective on NCCL (PREMUL_SUM) and is one scale pass on gloo."""

    name = "AllReduce"

    def _build(self, process_group):
        return _C.make_allreduce(process_group, _C.AllReduceOptions())


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

    def _build(self, process_group):
        options = _C.CastOptions()
        options.dtype = self.dtype
        return _C.make_cast(process_group, options)



@dataclass(frozen=True)
class Quantize(HookConfig):
    """Quantized mean (see README): per-chunk absmax codes, an all-to-all of shards, each rank
    averaging and re-encoding its own shard, an all-gather. `format` "int" sends integer codes of
    `bits` (8, or 4 packed two per byte); "e4m3" sends fp8 bytes (torch.float8_e4m3fn's layout,
    bits must be 8). Buckets under `min_size` bytes go as a plain mean allreduce."""

    bits: int = 8
    format: str = "int"
    chunk: int = 1024
    stochastic: bool = True
    error_feedback: bool = True
    seed: int = 0
    min_size: int = 1 << 16
    name = "Quantize"

    def validate(self):
        if self.bits not in (8, 4) or isinstance(self.bits, bool):
            raise ValueError(f"Quantize: bits must be 8 or 4, got {self.bits!r}")
        if self.format not in ("int", "e4m3"):
            raise ValueError(f"Quantize: format must be 'int' or 'e4m3' (fp8), got {self.format!r}")
        if self.format == "e4m3" and self.bits != 8:
            raise ValueError(f"Quantize: format 'e4m3' is 8 bits per value; got bits={self.bits!r}")
        if not _is_int(self.chunk) or not 8 <= self.chunk <= 8192 or self.chunk % 8:
            raise ValueError(f"Quantize: chunk must be a multiple of 8 between 8 and 8192, got {self.chunk!r}")
        for flag in ("stochastic", "error_feedback"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"Quantize: {flag} must be True or False, got {getattr(self, flag)!r}")
        _check_count(self, "seed")
        _check_count(self, "min_size", " (bytes)")

    def _build(self, process_group):
        options = _options(self, _C.QuantizeOptions(), ("chunk", "stochastic", "error_feedback", "seed", "min_size"))
        options.codes = self.codes
        return _C.make_quantize(process_group, options)

    @property
    def codes(self):
        """The kernels' name for the codes: "int8", "int4" or "e4m3"."""
        return "e4m3" if self.format == "e4m3" else f"int{self.bits}"


@dataclass(frozen=True)
class SignSGD(HookConfig):
    """1-bit SignSGD with error feedback (see README): signs and one scale (the mean absolute
    value) per chunk, all-gathered and averaged. Buckets under `min_size` bytes go as a plain
    mean allreduce."""

    error_feedback: bool = True
    chunk: int = 1024
    min_size: int = 1 << 16
    name = "SignSGD"

    def validate(self):
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"SignSGD: error_feedback must be True or False, got {self.error_feedback!r}")
        if not _is_int(self.chunk) or self.chunk < 32 or self.chunk % 32:
            raise ValueError(f"SignSGD: chunk must be a positive multiple of 32, got {self.chunk!r}")
        _check_count(self, "min_size", " (bytes)")

    def _build(self, process_group):
        options = _options(self, _C.SignSgdOptions(), ("chunk", "error_feedback", "min_size"))
        return _C.make_signsgd(process_group, options)


def _check_sparsifier(config):
    """The checks TopK and RandomK share."""
    if isinstance(config.ratio, bool) or not isinstance(config.ratio, (int, float)) or not 0 < config.ratio <= 1:
        raise ValueError(f"{config.name}: ratio must be a number in (0, 1], got {config.ratio!r}")
    if not isinstance(config.error_feedback, bool):
        raise ValueError(f"{config.name}: error_feedback must be True or False, got {config.error_feedback!r}")
    _check_count(config, "min_size", " (bytes)")


def _check_count(config, field, unit=""):
    """An integer field the C++ options hold as int64: 0 to 2**63 - 1."""
    value = getattr(config, field)
    if not _is_int(value) or not 0 <= value < 2**63:
        raise ValueError(f"{config.name}: {field} must be an integer in [0, 2**63){unit}, got {value!r}")


def _options(config, options, fields):
    for field in fields:
        setattr(options, field, getattr(config, field))
    return options


@dataclass(frozen=True)
class TopK(HookConfig):
    """Top-k sparsification with error feedback (see README): the `ratio` share of entries of
    largest magnitude, values and indices all-gathered and averaged. `selection="exact"` picks
    exactly k (torch.topk); `"threshold"` picks up to k above a threshold estimated from a sample
    of the bucket, in one pass (much faster on GPUs); how many qualified against k shows in the
    stats as topk_qualifying_per_k."""

    ratio: float = 0.01
    error_feedback: bool = True
    min_size: int = 1 << 16
    selection: str = "exact"
    name = "TopK"

    def validate(self):
        _check_sparsifier(self)
        if self.selection not in ("exact", "threshold"):
            raise ValueError(f"TopK: selection must be 'exact' or 'threshold', got {self.selection!r}")

    def _build(self, process_group):
        options = _options(self, _C.TopKOptions(), ("ratio", "error_feedback", "min_size", "selection"))
        return _C.make_topk(process_group, options)


@dataclass(frozen=True)
class RandomK(HookConfig):
    """Random-k sparsification with error feedback (see README): the same seeded positions on
    every rank, one in each of k strata of the bucket, so only the values are allreduced."""

    ratio: float = 0.01
    seed: int = 0
    error_feedback: bool = True
    min_size: int = 1 << 16
    name = "RandomK"

    def validate(self):
        _check_sparsifier(self)
        _check_count(self, "seed")

    def _build(self, process_group):
        options = _options(self, _C.RandomKOptions(), ("ratio", "seed", "error_feedback", "min_size"))
        return _C.make_randomk(process_group, options)


# torch.optim.SGD's and AdamW's hyperparameters and defaults (amsgrad and foreach/fused/capturable
# flags are not offered: the update is always torch's fused kernel).
OPTIMIZER_DEFAULTS = {
    "sgd": {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0, "maximize": False},
    "adamw": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2, "maximize": False},
}


def _check_hyperparameters(optimizer, hparams, where="WithOptimizer"):
    if optimizer not in OPTIMIZER_DEFAULTS:
        raise ValueError(f"{where}: optimizer must be 'sgd' or 'adamw', got {optimizer!r}")
    accepted = OPTIMIZER_DEFAULTS[optimizer]
    for key, value in hparams.items():
        if key not in accepted:
            raise ValueError(f"{where}: {optimizer} takes {', '.join(accepted)}; got an unknown {key!r}")
        if isinstance(accepted[key], bool):
            if not isinstance(value, bool):
                raise ValueError(f"{where}: {key} must be True or False, got {value!r}")
        elif key == "betas":
            if (not isinstance(value, (tuple, list)) or len(value) != 2
                    or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in value)):
                raise ValueError(f"{where}: betas must be two numbers in [0, 1), got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{where}: {key} must be a number >= 0, got {value!r}")
    if hparams.get("nesterov") and (hparams.get("momentum", 0) <= 0 or hparams.get("dampening", 0) != 0):
        raise ValueError(f"{where}: nesterov needs momentum > 0 and dampening 0")


def optimizer_options(optimizer, hparams):
    """The C++ options for these hyperparameters (defaults filled in)."""
    values = {**OPTIMIZER_DEFAULTS[optimizer], **hparams}
    options = _C.OptimizerOptions()
    options.optimizer = optimizer
    for key, value in values.items():
        if key == "betas":
            options.beta1, options.beta2 = (float(b) for b in value)
        else:
            setattr(options, key, float(value) if not isinstance(value, bool) else value)
    return options


@dataclass(frozen=True, init=False)
class WithOptimizer(HookConfig):
    """Runs the optimizer update of a bucket's parameters as soon as that bucket is reduced by
    `inner` (see README); pair it with `commtune.OverlappedOptimizer(ddp)` in the training loop.
    `optimizer` is "sgd" or "adamw", with torch.optim.SGD's / AdamW's hyperparameters."""

    inner: HookConfig
    optimizer: str
    hyperparameters: tuple  # sorted (name, value) pairs
    name = "WithOptimizer"

    def __init__(self, inner, optimizer="sgd", **hyperparameters):
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "hyperparameters", tuple(sorted(hyperparameters.items())))

    def validate(self):
        if not isinstance(self.inner, HookConfig) or isinstance(self.inner, WithOptimizer):
            raise ValueError(f"WithOptimizer: inner must be a commtune hook config other than WithOptimizer, "
                             f"got {self.inner!r}")
        self.inner.validate()
        _check_hyperparameters(self.optimizer, dict(self.hyperparameters))

    def defaults(self):
        """Every hyperparameter, defaults filled in (the param_group of OverlappedOptimizer)."""
        return {**OPTIMIZER_DEFAULTS[self.optimizer], **dict(self.hyperparameters)}

    def _build(self, process_group):
        options = optimizer_options(self.optimizer, dict(self.hyperparameters))
        return _C.make_with_optimizer(process_group, self.inner._build(process_group), options)


@dataclass(frozen=True)
class Fused(HookConfig):
    """Holds buckets smaller than `min_bytes` and sends them with the next one through `inner`
    (the last bucket always sends); stats count the held buckets and the fused sends."""

    inner: HookConfig
    min_bytes: int = 1 << 20
    name = "Fused"

    def validate(self):
        if not isinstance(self.inner, HookConfig):
            raise ValueError(f"Fused: inner must be a commtune hook config, got {self.inner!r}")
        self.inner.validate()
        if not _is_int(self.min_bytes) or self.min_bytes < 0:
            raise ValueError(f"Fused: min_bytes must be an integer >= 0, got {self.min_bytes!r}")

    def _build(self, process_group):
        options = _C.FusedOptions()
        options.min_bytes = self.min_bytes
        return _C.make_fused(process_group, self.inner._build(process_group), options)


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class PowerSGD(HookConfig):
    """PowerSGD low-rank compression with torch's powerSGD_hook semantics (see README)."""

    rank: int = 1
    start_iter: int = 1000
    min_compression_rate: float = 2.0
    error_feedback: bool = True
    warm_start: bool = True
    orthogonalization_epsilon: float = 0.0
    seed: int = 0
    batch_same_shape: bool = False
    approx_error_every: int = 100
    name = "PowerSGD"

    def validate(self):
        if not _is_int(self.rank) or self.rank < 1:
            raise ValueError(f"PowerSGD: rank must be an integer >= 1, got {self.rank!r}")
        if not _is_int(self.start_iter) or self.start_iter < 0:
            raise ValueError(f"PowerSGD: start_iter must be an integer >= 0, got {self.start_iter!r}")
        if not isinstance(self.min_compression_rate, (int, float)) or not self.min_compression_rate > 0:
            raise ValueError(f"PowerSGD: min_compression_rate must be a number > 0, got {self.min_compression_rate!r}")
        for flag in ("error_feedback", "warm_start", "batch_same_shape"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"PowerSGD: {flag} must be True or False, got {getattr(self, flag)!r}")
        if (self.error_feedback or self.warm_start) and self.start_iter <= 1:
            raise ValueError("PowerSGD: start_iter must be > 1 when error_feedback or warm_start is on "
                             f"(DDP rebuilds its buckets after iteration 1), got {self.start_iter}")
        eps = self.orthogonalization_epsilon
        if not isinstance(eps, (int, float)) or not eps >= 0:
            raise ValueError(f"PowerSGD: orthogonalization_epsilon must be a number >= 0, got {eps!r}")
        if not _is_int(self.approx_error_every) or self.approx_error_every < 0:
            raise ValueError("PowerSGD: approx_error_every must be an integer >= 0 (0: never), "
                             f"got {self.approx_error_every!r}")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**32:
            raise ValueError(f"PowerSGD: seed must be an integer in [0, 2**32), got {self.seed!r}")

    def _build(self, process_group):
        options = _C.PowerSgdOptions()
        for field in ("rank", "start_iter", "min_compression_rate", "error_feedback", "warm_start",
                      "orthogonalization_epsilon", "seed", "batch_same_shape", "approx_error_every"):
            setattr(options, field, getattr(self, field))
        return _C.make_powersgd(process_group, options)


__all__ = ["HookConfig", "AllReduce", "Cast", "PowerSGD", "Quantize", "SignSGD", "TopK", "RandomK", "WithOptimizer",
           "Fused"]
