"""NCCL settings, checked: what each variable accepts, what is unsafe or deprecated, and when
setting it still has an effect.

    settings = ct.nccl.Settings(algo="ring;allreduce:tree", buffsize="16MiB", min_ctas=8)
    ct.init_process_group("nccl", settings=settings)   # validates, sets NCCL_*, builds the group

NCCL reads most of these variables once per process (BUFFSIZE, NTHREADS, the CTA and CGA
limits, P2P_LEVEL, DEBUG): they must be set before the first NCCL communicator exists, so
`apply()` refuses once a NCCL process group is up. Token lists follow NCCL 2.24-2.28.
"""
import dataclasses
import json
import os
import re
import warnings
from typing import Optional, Union

from .topology import Topology, parse_topo_matrix, topology  # noqa: F401  (ct.nccl.topology())

ALGORITHMS = ("ring", "tree", "collnetdirect", "collnetchain", "nvls", "nvlstree", "pat")
PROTOCOLS = ("ll", "ll128", "simple")
COLLECTIVES = ("broadcast", "reduce", "allgather", "reducescatter", "allreduce")
NTHREADS = (64, 128, 256, 512)
P2P_LEVELS = ("LOC", "NVL", "PIX", "PXB", "PHB", "SYS")
P2P_LEVEL_NUMBERS = {0: "LOC", 1: "PIX", 2: "PXB", 3: "PHB", 4: "SYS"}  # NCCL's legacy integers
DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE", "ABORT")
DEBUG_SUBSYSTEMS = ("INIT", "COLL", "P2P", "SHM", "NET", "GRAPH", "TUNING", "ENV", "ALLOC", "CALL",
                    "PROXY", "NVLS", "BOOTSTRAP", "REG", "PROFILE", "RAS", "ALL")
MAX_CTAS = 64
DEPRECATED = {"NCCL_MIN_NCHANNELS": "NCCL_MIN_CTAS", "NCCL_MAX_NCHANNELS": "NCCL_MAX_CTAS"}

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30}
_applied = {}  # what the last apply() set, for reports


def parse_size(value, name="buffsize"):
    """Bytes from an int or a string such as "16MiB", "4M" (binary), "1.5GB" (decimal)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a size in bytes (an int, or a string like '16MiB'), got {value!r}")
    if isinstance(value, int):
        size = value
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{name} must be a size in bytes (an int, or a string like '16MiB', '4M', "
                             f"'1GB'), got {value!r}")
        size = float(m.group(1)) * _UNITS[m.group(2).lower()]
        if size != int(size):
            raise ValueError(f"{name} must be a whole number of bytes, got {value!r}")
        size = int(size)
    if size <= 0:
        raise ValueError(f"{name} must be > 0 bytes, got {value!r}")
    return size


def _check_choice_list(variable, value, names, per_collective):
    """Checks NCCL's list syntax: entries split by ';', each [collective:][^]name(,name)*, where
    only the first entry may leave out the collective (it then applies to all). Returns the
    names some entry enables and the names some entry lists without '^'."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{variable} must be a non-empty string such as {names[0]!r}, got {value!r}")
    entries = value.split(";") if per_collective else [value]
    enabled, named = set(), set()
    for i, entry in enumerate(entries):
        head, sep, tail = entry.partition(":")
        if sep:
            if head.strip().lower() not in COLLECTIVES:
                raise ValueError(f"{variable}: unknown collective {head.strip()!r} in {value!r}; "
                                 f"valid collectives: {', '.join(COLLECTIVES)}")
            body = tail
        elif i > 0:
            raise ValueError(f"{variable}: every entry after the first needs a collective prefix "
                             f"(e.g. 'allreduce:tree'), got {entry!r} in {value!r}")
        else:
            body = entry
        body = body.strip()
        exclude = body.startswith("^")
        tokens = [t.strip().lower() for t in body.lstrip("^").split(",")]
        for t in tokens:
            if t not in names:
                raise ValueError(f"{variable}: unknown value {t!r} in {value!r}; valid values: "
                                 f"{', '.join(names)} (case-insensitive, '^' excludes)")
        enabled |= set(names) - set(tokens) if exclude else set(tokens)
        named |= set() if exclude else set(tokens)
    return enabled, named


@dataclasses.dataclass
class Settings:
    """NCCL settings; None leaves a variable as NCCL (or the environment) has it."""

    algo: Optional[str] = None  # NCCL_ALGO, e.g. "ring" or "ring;allreduce:tree"
    proto: Optional[str] = None  # NCCL_PROTO, e.g. "^ll128"
    buffsize: Optional[Union[int, str]] = None  # NCCL_BUFFSIZE, bytes or "16MiB"
    nthreads: Optional[int] = None  # NCCL_NTHREADS
    min_ctas: Optional[int] = None  # NCCL_MIN_CTAS (was NCCL_MIN_NCHANNELS)
    max_ctas: Optional[int] = None  # NCCL_MAX_CTAS (was NCCL_MAX_NCHANNELS)
    p2p_level: Optional[Union[str, int]] = None  # NCCL_P2P_LEVEL
    cga_cluster_size: Optional[int] = None  # NCCL_CGA_CLUSTER_SIZE
    high_priority_stream: bool = False  # ProcessGroupNCCL.Options(is_high_priority_stream=...)
    debug: Optional[str] = None  # NCCL_DEBUG
    debug_subsys: Optional[str] = None  # NCCL_DEBUG_SUBSYS

    def validate(self):
        """Raises ValueError naming the variable and its valid values; warns on settings known to
        be unsafe or deprecated. Returns the warnings' texts."""
        notes = []
        if self.algo is not None:
            algos, _ = _check_choice_list("NCCL_ALGO", self.algo, ALGORITHMS, per_collective=True)
            if "tree" in algos:
                notes.append("NCCL_ALGO: within one node Tree is a chain; it helps across nodes only")
            if algos & {"nvls", "nvlstree"} and os.environ.get("NCCL_NVLS_ENABLE") == "0":
                notes.append("NCCL_ALGO names NVLS but NCCL_NVLS_ENABLE=0 (NVLink multicast off): since "
                             "NCCL 2.24 a list with no usable algorithm fails at init")
        if self.proto is not None:
            _, named = _check_choice_list("NCCL_PROTO", self.proto, PROTOCOLS, per_collective=True)
            if "ll128" in named:
                notes.append("NCCL_PROTO: naming LL128 skips NCCL's platform checks; on platforms without "
                             "LL128 support it can corrupt data")
        if self.buffsize is not None:
            size = parse_size(self.buffsize, "NCCL_BUFFSIZE")
            if size & (size - 1):
                notes.append(f"NCCL_BUFFSIZE: {size} is not a power of two (NCCL recommends one)")
        if self.nthreads is not None and (isinstance(self.nthreads, bool) or self.nthreads not in NTHREADS):
            raise ValueError(f"NCCL_NTHREADS must be one of {', '.join(map(str, NTHREADS))}, got {self.nthreads!r}")
        for variable, value in (("NCCL_MIN_CTAS", self.min_ctas), ("NCCL_MAX_CTAS", self.max_ctas)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 1 <= value <= MAX_CTAS):
                raise ValueError(f"{variable} must be an integer in [1, {MAX_CTAS}], got {value!r}")
        if self.min_ctas is not None and self.max_ctas is not None and self.min_ctas > self.max_ctas:
            raise ValueError(f"NCCL_MIN_CTAS ({self.min_ctas}) must be <= NCCL_MAX_CTAS ({self.max_ctas})")
        if self.p2p_level is not None:
            if isinstance(self.p2p_level, int) and not isinstance(self.p2p_level, bool):
                if self.p2p_level < 0:
                    raise ValueError(f"NCCL_P2P_LEVEL must be one of {', '.join(P2P_LEVELS)}, got {self.p2p_level!r}")
                notes.append("NCCL_P2P_LEVEL: integer levels are discouraged; "
                             f"{self.p2p_level} means {P2P_LEVEL_NUMBERS.get(self.p2p_level, 'SYS')}")
            elif not isinstance(self.p2p_level, str) or self.p2p_level.upper() not in P2P_LEVELS:
                raise ValueError(f"NCCL_P2P_LEVEL must be one of {', '.join(P2P_LEVELS)}, got {self.p2p_level!r}")
        if self.cga_cluster_size is not None and (isinstance(self.cga_cluster_size, bool) or
                                                  not isinstance(self.cga_cluster_size, int) or
                                                  not 0 <= self.cga_cluster_size <= 8):
            raise ValueError(f"NCCL_CGA_CLUSTER_SIZE must be an integer in [0, 8], got {self.cga_cluster_size!r}")
        if not isinstance(self.high_priority_stream, bool):
            raise ValueError(f"high_priority_stream must be True or False, got {self.high_priority_stream!r}")
        if self.debug is not None:
            if not isinstance(self.debug, str) or self.debug.upper() not in DEBUG_LEVELS:
                raise ValueError(f"NCCL_DEBUG must be one of {', '.join(DEBUG_LEVELS)}, got {self.debug!r}")
            if self.debug.upper() in ("INFO", "TRACE"):
                notes.append(f"NCCL_DEBUG={self.debug.upper()} is for debugging: it slows every collective")
        if self.debug_subsys is not None:
            names = [n.strip().upper() for n in str(self.debug_subsys).lstrip("^").split(",")]
            unknown = [n for n in names if n not in DEBUG_SUBSYSTEMS]
            if unknown or not self.debug_subsys:
                raise ValueError(f"NCCL_DEBUG_SUBSYS: unknown subsystem(s) {unknown or [self.debug_subsys]}; "
                                 f"valid: {', '.join(DEBUG_SUBSYSTEMS)} ('^' excludes)")
        for note in notes:
            warnings.warn(note, stacklevel=2)
        return notes

    def environment(self):
        """The NCCL_* variables these settings set, as strings (validated first)."""
        self.validate()
        env = {}
        if self.algo is not None:
            env["NCCL_ALGO"] = self.algo
        if self.proto is not None:
            env["NCCL_PROTO"] = self.proto
        if self.buffsize is not None:
            env["NCCL_BUFFSIZE"] = str(parse_size(self.buffsize, "NCCL_BUFFSIZE"))
        for variable, value in (("NCCL_NTHREADS", self.nthreads), ("NCCL_MIN_CTAS", self.min_ctas),
                                ("NCCL_MAX_CTAS", self.max_ctas), ("NCCL_CGA_CLUSTER_SIZE", self.cga_cluster_size)):
            if value is not None:
                env[variable] = str(value)
        if self.p2p_level is not None:
            level = self.p2p_level
            env["NCCL_P2P_LEVEL"] = P2P_LEVEL_NUMBERS.get(level, "SYS") if isinstance(level, int) else level.upper()
        if self.debug is not None:
            env["NCCL_DEBUG"] = self.debug.upper()
        if self.debug_subsys is not None:
            env["NCCL_DEBUG_SUBSYS"] = str(self.debug_subsys).upper()
        return env

    def apply(self, environ=None):
        """Sets the variables before any NCCL process group exists; refuses after. Returns
        {variable: (old value or None, new value)} for what changed."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()):
            raise RuntimeError("commtune.nccl.Settings.apply: a NCCL process group already exists, and NCCL "
                               "reads these variables once per process; apply the settings before "
                               "init_process_group (or use commtune.init_process_group(settings=...))")
        environ = os.environ if environ is None else environ
        for old, new in DEPRECATED.items():
            if old in environ:
                warnings.warn(f"{old} is deprecated since NCCL 2.17; use {new} (Settings.min_ctas/max_ctas). "
                              "When both are set NCCL takes the stricter", DeprecationWarning, stacklevel=2)
        wanted = self.environment()  # validates (and warns) once
        changed = {}
        for variable, value in wanted.items():
            if environ.get(variable) != value:
                changed[variable] = (environ.get(variable), value)
                environ[variable] = value
        _applied.clear()
        _applied.update(wanted)
        return changed

    @classmethod
    def from_env(cls, environ=None):
        """The settings the environment holds now (deprecated *_NCHANNELS mapped, with a warning)."""
        environ = os.environ if environ is None else environ
        get = environ.get
        min_ctas, max_ctas = get("NCCL_MIN_CTAS"), get("NCCL_MAX_CTAS")
        for old, new in DEPRECATED.items():
            if old in environ:
                warnings.warn(f"{old} is deprecated since NCCL 2.17; read as {new}", DeprecationWarning, stacklevel=2)
        if min_ctas is None and "NCCL_MIN_NCHANNELS" in environ:
            min_ctas = environ["NCCL_MIN_NCHANNELS"]
        if max_ctas is None and "NCCL_MAX_NCHANNELS" in environ:
            max_ctas = environ["NCCL_MAX_NCHANNELS"]
        as_int = lambda v, name: None if v is None else _int(v, name)
        level = get("NCCL_P2P_LEVEL")
        settings = cls(algo=get("NCCL_ALGO"), proto=get("NCCL_PROTO"), buffsize=get("NCCL_BUFFSIZE"),
                       nthreads=as_int(get("NCCL_NTHREADS"), "NCCL_NTHREADS"),
                       min_ctas=as_int(min_ctas, "NCCL_MIN_CTAS"), max_ctas=as_int(max_ctas, "NCCL_MAX_CTAS"),
                       p2p_level=int(level) if level is not None and level.isdigit() else level,
                       cga_cluster_size=as_int(get("NCCL_CGA_CLUSTER_SIZE"), "NCCL_CGA_CLUSTER_SIZE"),
                       debug=get("NCCL_DEBUG"), debug_subsys=get("NCCL_DEBUG_SUBSYS"))
        settings.validate()
        return settings

    def to_dict(self):
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def save_profile(self, path, **extra):
        """Writes a profile JSON: {"settings": ..., plus what the tuner adds (`extra`)}."""
        with open(path, "w") as f:
            json.dump({"commtune_nccl_profile": 1, "settings": self.to_dict(), **extra}, f, indent=2)

    @classmethod
    def from_profile(cls, path):
        """Loads the settings of a profile JSON (as written by save_profile or the tuner)."""
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or "settings" not in data:
            raise ValueError(f"{path} is not a commtune NCCL profile (no 'settings' entry)")
        unknown = set(data["settings"]) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"{path}: unknown setting(s) {sorted(unknown)}")
        settings = cls(**data["settings"])
        settings.validate()
        return settings


def _int(value, name):
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def applied():
    """The NCCL variables the last Settings.apply() set (empty if none), for reports."""
    return dict(_applied)


def init_process_group(backend=None, settings=None, **kwargs):
    """torch.distributed.init_process_group with NCCL settings: validates and applies them first
    and, for NCCL, passes ProcessGroupNCCL.Options (high-priority stream, CGA and CTA limits)."""
    import torch.distributed as dist

    if settings is not None:
        if not isinstance(settings, Settings):
            raise TypeError(f"settings must be a commtune.nccl.Settings, got {type(settings).__name__}")
        settings.apply()
        if backend is not None and "nccl" in str(backend) and "pg_options" not in kwargs:
            kwargs["pg_options"] = _nccl_options(settings)
    dist.init_process_group(backend, **kwargs)


def _nccl_options(settings):
    from torch.distributed import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options(is_high_priority_stream=settings.high_priority_stream)
    for field, value in (("cga_cluster_size", settings.cga_cluster_size), ("min_ctas", settings.min_ctas),
                         ("max_ctas", settings.max_ctas)):
        if value is not None and hasattr(options.config, field):
            setattr(options.config, field, value)
    return options
