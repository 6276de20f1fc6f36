"""GPU topology from `nvidia-smi topo -m`, against saved outputs of three kinds of machine."""
import os
import shutil

import pytest

import commtune as ct
from commtune.topology import from_nvml
from conftest import needs_cuda

DATA = os.path.join(os.path.dirname(__file__), "data")


def load(name):
    with open(os.path.join(DATA, name)) as f:
        return ct.nccl.parse_topo_matrix(f.read())


def test_nvswitch_machine_has_every_pair_on_nvlink():
    t = load("topo_8gpu_nvswitch.txt")
    assert [g.index for g in t.gpus] == list(range(8))
    assert t.kind == "nvlink"
    assert all(t.nvlinks(i, j) == 18 for i in range(8) for j in range(8) if i != j)
    assert [g.numa for g in t.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert t.gpus[5].cpu_affinity == "52-103,156-207"
    assert t.summary() == "8 GPUs, every pair over NVLink (18 links per pair); NUMA node(s) 0, 1"


def test_pcie_machine_reports_its_longest_path():
    t = load("topo_4gpu_pcie.txt")
    assert t.kind == "pcie" and t.links[0, 1] == "PIX" and t.links[1, 2] == "SYS" and t.nvlinks(0, 1) == 0
    assert t.summary() == "4 GPUs over PCIe only (longest path SYS); NUMA node(s) 0, 1"


def test_mixed_machine_counts_its_nvlink_pairs():
    t = load("topo_4gpu_mixed.txt")
    assert t.kind == "mixed" and t.nvlinks(0, 1) == 4 and t.nvlinks(2, 3) == 4 and t.nvlinks(1, 2) == 0
    assert t.summary() == "4 GPUs, 2 of 6 pairs over NVLink, the rest over PCIe; NUMA node(s) 0"


def test_terminal_escapes_and_bad_input():
    with open(os.path.join(DATA, "topo_4gpu_mixed.txt")) as f:
        text = f.read()
    bold = text.replace("\tGPU0", "\t\x1b[4mGPU0", 1).replace("GPU NUMA ID", "GPU NUMA ID\x1b[0m", 1)
    assert ct.nccl.parse_topo_matrix(bold).kind == "mixed"
    with pytest.raises(ValueError, match="unknown path 'NVX'"):
        ct.nccl.parse_topo_matrix(text.replace("NV4", "NVX", 1))
    with pytest.raises(ValueError, match="no header row"):
        ct.nccl.parse_topo_matrix("No devices were found\n")


def test_no_gpu_machine_gets_a_plain_answer(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    t = ct.nccl.topology()
    assert t.gpus == [] and t.kind == "none" and t.summary() == "no GPU (nvidia-smi not found)"


class FakeNvml:
    """Stands in for pynvml: GPUs with NVLinks to given peers (bus ids) and PCIe ancestors."""

    NVML_FEATURE_ENABLED = 1

    class NVMLError(Exception):
        pass

    class Pci:
        def __init__(self, bus):
            self.busId = bus.encode()

    def __init__(self, links, ancestor=40, numa=None, cpus=None):
        self.links, self.ancestor, self.numa, self.cpus = links, ancestor, numa or {}, cpus or {}
        self.shut = False

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetCount(self):
        return len(self.links)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetPciInfo(self, h):
        return self.Pci(f"00000000:{h + 0x10:02X}:00.0")

    def nvmlDeviceGetNvLinkState(self, h, link):
        if link >= len(self.links[h]):
            raise self.NVMLError("no such link")
        return self.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkRemotePciInfo_v2(self, h, link):
        return self.Pci(self.links[h][link])

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return self.ancestor

    @staticmethod
    def mask(ids, words):
        out = [0] * words
        for i in ids:
            out[i // 64] |= 1 << (i % 64)
        return out

    def nvmlDeviceGetCpuAffinity(self, h, words):
        return self.mask(self.cpus.get(h, []), words)

    def nvmlDeviceGetMemoryAffinity(self, h, words, scope):
        assert scope == 0  # NVML_AFFINITY_SCOPE_NODE: NUMA nodes, not sockets
        return self.mask([self.numa[h]] if h in self.numa else [], words)

    def nvmlDeviceGetNumaNodeId(self, h):  # the GPU's own memory node: not the affinity
        raise self.NVMLError("Not Supported")


def gpu_bus(i):
    return f"00000000:{i + 0x10:02X}:00.0"


def test_nvml_nvswitch_machine_matches_nvidia_smis_view():
    switch = "00000000:C0:00.0"
    sockets = [list(range(0, 52)) + list(range(104, 156)), list(range(52, 104)) + list(range(156, 208))]
    nvml = FakeNvml({i: [switch] * 18 for i in range(8)}, numa={i: i // 4 for i in range(8)},
                    cpus={i: sockets[i // 4] for i in range(8)})
    t = from_nvml(nvml)
    assert t.source == "nvml" and nvml.shut
    smi = load("topo_8gpu_nvswitch.txt")
    assert t.links == smi.links and t.gpus == smi.gpus  # the CPU lists and NUMA nodes as nvidia-smi gives them
    assert t.summary() == smi.summary()


def test_nvml_bridged_pairs_and_pcie_paths():
    nvml = FakeNvml({0: [gpu_bus(1)] * 4, 1: [gpu_bus(0)] * 4, 2: [gpu_bus(3)] * 4, 3: [gpu_bus(2)] * 4}, ancestor=40)
    t = from_nvml(nvml)
    assert t.links == load("topo_4gpu_mixed.txt").links  # NV4 within a pair, NODE across
    assert t.kind == "mixed" and all(g.numa is None for g in t.gpus)


@needs_cuda
@pytest.mark.needs_cuda
def test_both_readers_see_this_machines_gpus():
    import subprocess

    import torch

    if os.environ.get("CUDA_VISIBLE_DEVICES"):
        pytest.skip("CUDA_VISIBLE_DEVICES hides GPUs from torch, not from NVML or nvidia-smi")
    smi = ct.nccl.parse_topo_matrix(subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                                                   timeout=60).stdout)
    assert smi.source == "nvidia-smi" and len(smi.gpus) == torch.cuda.device_count()
    assert ct.nccl.topology().kind == smi.kind
    pynvml = pytest.importorskip("pynvml")
    nvml = from_nvml(pynvml)
    assert nvml.gpus == smi.gpus and nvml.links == smi.links  # CPU lists and NUMA nodes too
