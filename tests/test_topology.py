"""GPU topology from `nvidia-smi topo -m`, against saved outputs of three kinds of machine."""
import os
import shutil

import pytest

import commtune as ct

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
