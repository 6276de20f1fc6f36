"""How this machine's GPUs are connected: NVML (nvidia-ml-py) when it can be loaded, else
`nvidia-smi topo -m`.

`topology()` answers with a Topology: the GPUs, the path between each pair (NV# = # bonded
NVLinks; PIX, PXB, PHB, NODE, SYS = PCIe paths of growing length, as nvidia-smi's legend says),
each GPU's CPU and NUMA affinity, and a one-line summary for reports. On a machine without GPUs
(or without nvidia-smi) it answers with an empty Topology that says so.
"""
import dataclasses
import re
import shutil
import subprocess
from typing import Dict, List, Optional, Tuple

PCIE_PATHS = ("PIX", "PXB", "PHB", "NODE", "SYS")  # shortest to longest


@dataclasses.dataclass
class Gpu:
    index: int
    cpu_affinity: Optional[str] = None
    numa: Optional[int] = None


@dataclasses.dataclass
class Topology:
    gpus: List[Gpu]
    links: Dict[Tuple[int, int], str]  # (i, j), i != j -> "NV18", "PIX", "SYS", ...
    source: str  # "nvml", "nvidia-smi", or "none" with the reason in `note`
    note: str = ""

    def nvlinks(self, i, j):
        """Bonded NVLinks between GPUs i and j (0 for a PCIe path)."""
        m = re.fullmatch(r"NV(\d+)", self.links.get((i, j), ""))
        return int(m.group(1)) if m else 0

    @property
    def kind(self):
        """'none', 'single', 'nvlink' (every pair over NVLink, e.g. NVSwitch), 'pcie', or 'mixed'."""
        if not self.gpus:
            return "none"
        if len(self.gpus) == 1:
            return "single"
        pairs = [(a.index, b.index) for a in self.gpus for b in self.gpus if a.index != b.index]
        linked = sum(1 for p in pairs if self.nvlinks(*p))
        return "nvlink" if linked == len(pairs) else "pcie" if linked == 0 else "mixed"

    def summary(self):
        if not self.gpus:
            return f"no GPU ({self.note})" if self.note else "no GPU"
        n = len(self.gpus)
        kind = self.kind
        if kind == "single":
            text = "1 GPU"
        elif kind == "nvlink":
            counts = sorted({self.nvlinks(*p) for p in self.links})
            text = f"{n} GPUs, every pair over NVLink ({'/'.join(map(str, counts))} links per pair)"
        elif kind == "pcie":
            worst = max(self.links.values(), key=PCIE_PATHS.index)
            text = f"{n} GPUs over PCIe only (longest path {worst})"
        else:
            linked = sum(1 for p in self.links if self.nvlinks(*p)) // 2
            text = f"{n} GPUs, {linked} of {n * (n - 1) // 2} pairs over NVLink, the rest over PCIe"
        numa = sorted({g.numa for g in self.gpus if g.numa is not None})
        if numa:
            text += f"; NUMA node(s) {', '.join(map(str, numa))}"
        return text


def parse_topo_matrix(text):
    """Parses the output of `nvidia-smi topo -m` (the matrix; the legend after it is ignored)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # a terminal gets the header in bold
    lines = text.splitlines()
    header_at = next((i for i, line in enumerate(lines) if re.match(r"\s+GPU0\b", line)), None)
    if header_at is None:
        raise ValueError("not the output of `nvidia-smi topo -m`: no header row starting with GPU0")
    header = [h.strip() for h in lines[header_at].split("\t") if h.strip()]
    gpus, links = [], {}
    for line in lines[header_at + 1:]:
        if not line.strip():
            break  # the legend follows a blank line
        cells = [c.strip() for c in line.split("\t")]
        name, values = cells[0], cells[1:]
        m = re.fullmatch(r"GPU(\d+)", name)
        if not m:
            continue  # NIC rows
        i = int(m.group(1))
        row = dict(zip(header, values))
        for column, value in row.items():
            c = re.fullmatch(r"GPU(\d+)", column)
            if c and int(c.group(1)) != i:
                if value not in PCIE_PATHS and not re.fullmatch(r"NV\d+", value):
                    raise ValueError(f"GPU{i} -> {column}: unknown path {value!r}")
                links[i, int(c.group(1))] = value
        numa = row.get("NUMA Affinity", "")
        gpus.append(Gpu(i, row.get("CPU Affinity") or None, int(numa) if numa.isdigit() else None))
    if not gpus:
        raise ValueError("no GPU rows in the `nvidia-smi topo -m` output")
    return Topology(gpus, links, "nvidia-smi")


# NVML's common-ancestor levels, as nvidia-smi names them.
_NVML_LEVELS = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
_NVML_MAX_LINKS = 18  # NVML_NVLINK_MAX_LINKS on Hopper


_NVML_AFFINITY_SCOPE_NODE = 0
_NVML_MASK_WORDS = 64  # 64-bit words asked for: up to 4096 CPUs or NUMA nodes


def _set_bits(words):
    """The indices set in an NVML mask (an array of 64-bit words, lowest first)."""
    return [64 * w + b for w, word in enumerate(words) for b in range(64) if int(word) >> b & 1]


def _ranges(ids):
    """[0, 1, 2, 5] -> "0-2,5", as nvidia-smi writes a CPU list."""
    spans = []
    for i in ids:
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)


def _nvml_affinity(nvml, handle):
    """(CPU list, NUMA node) nearest the GPU, as nvidia-smi's "CPU Affinity" and "NUMA Affinity"
    columns give them (not nvmlDeviceGetNumaNodeId: the GPU's own memory node, which only
    coherent-memory systems have). None where NVML does not know."""
    try:
        cpus = _ranges(_set_bits(nvml.nvmlDeviceGetCpuAffinity(handle, _NVML_MASK_WORDS))) or None
    except (AttributeError, nvml.NVMLError):
        cpus = None
    try:
        nodes = _set_bits(nvml.nvmlDeviceGetMemoryAffinity(handle, _NVML_MASK_WORDS, _NVML_AFFINITY_SCOPE_NODE))
    except (AttributeError, nvml.NVMLError):
        nodes = []
    return cpus, nodes[0] if nodes else None


def _bus_id(pci):
    bus = pci.busId
    return (bus.decode() if isinstance(bus, bytes) else bus).lower()


def from_nvml(nvml):
    """The topology through NVML (`nvml`: the pynvml module of nvidia-ml-py). NVLinks to a GPU
    count for that pair; NVLinks to an NVSwitch connect every pair of GPUs that has them (as
    nvidia-smi shows it: NV<the fewer of the two counts>). Other pairs get their PCIe path."""
    nvml.nvmlInit()
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        bus = {_bus_id(nvml.nvmlDeviceGetPciInfo(h)): i for i, h in enumerate(handles)}
        direct, to_switch = {}, [0] * len(handles)
        for i, h in enumerate(handles):
            for link in range(_NVML_MAX_LINKS):
                try:
                    if nvml.nvmlDeviceGetNvLinkState(h, link) != nvml.NVML_FEATURE_ENABLED:
                        continue
                    remote = _bus_id(nvml.nvmlDeviceGetNvLinkRemotePciInfo_v2(h, link))
                except nvml.NVMLError:
                    continue  # no such link on this GPU
                if remote in bus:
                    direct[i, bus[remote]] = direct.get((i, bus[remote]), 0) + 1
                else:
                    to_switch[i] += 1
        links = {}
        for i, hi in enumerate(handles):
            for j, hj in enumerate(handles):
                if i == j:
                    continue
                count = direct.get((i, j), 0) + min(to_switch[i], to_switch[j])
                if count:
                    links[i, j] = f"NV{count}"
                else:
                    level = nvml.nvmlDeviceGetTopologyCommonAncestor(hi, hj)
                    links[i, j] = _NVML_LEVELS.get(int(level), "SYS")
        gpus = [Gpu(i, *_nvml_affinity(nvml, h)) for i, h in enumerate(handles)]
        return Topology(gpus, links, "nvml")
    finally:
        nvml.nvmlShutdown()


def topology():
    """This machine's GPU topology (see the module's docstring)."""
    try:
        import pynvml

        return from_nvml(pynvml)
    except Exception:  # no nvidia-ml-py, no driver, no GPU: nvidia-smi may still answer
        pass
    if shutil.which("nvidia-smi") is None:
        return Topology([], {}, "none", "nvidia-smi not found")
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return Topology([], {}, "none", f"nvidia-smi topo -m failed: {e}")
    if out.returncode != 0:
        return Topology([], {}, "none", f"nvidia-smi topo -m failed: {out.stderr.strip() or out.returncode}")
    return parse_topo_matrix(out.stdout)
