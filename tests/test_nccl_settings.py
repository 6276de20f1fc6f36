"""commtune.nccl.Settings: validation, the environment it sets, apply/refuse, profiles."""
import json
import os
import warnings

import pytest
import torch.distributed as dist

import commtune as ct
from commtune.nccl import Settings
from conftest import needs_cuda


def test_settings_map_to_nccls_variables():
    s = Settings(algo="ring;allreduce:tree", proto="^ll128", buffsize="16MiB", nthreads=256, min_ctas=8,
                 max_ctas=32, p2p_level="nvl", cga_cluster_size=4, debug="warn", debug_subsys="^init,coll")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert s.environment() == {
            "NCCL_ALGO": "ring;allreduce:tree", "NCCL_PROTO": "^ll128", "NCCL_BUFFSIZE": str(16 * 2**20),
            "NCCL_NTHREADS": "256", "NCCL_MIN_CTAS": "8", "NCCL_MAX_CTAS": "32", "NCCL_CGA_CLUSTER_SIZE": "4",
            "NCCL_P2P_LEVEL": "NVL", "NCCL_DEBUG": "WARN", "NCCL_DEBUG_SUBSYS": "^INIT,COLL"}
    assert Settings().environment() == {}


@pytest.mark.parametrize("size,expected", [(4096, 4096), ("4M", 4 * 2**20), ("16MiB", 16 * 2**20),
                                           ("1GB", 10**9), ("1.5KiB", 1536), (" 8 kib ", 8192)])
def test_sizes_accept_units(size, expected):
    assert ct.nccl.parse_size(size) == expected


@pytest.mark.parametrize("bad,variable,hint", [
    (dict(algo="ring,fast"), "NCCL_ALGO", "unknown value 'fast'"),
    (dict(algo="ring;tree"), "NCCL_ALGO", "needs a collective prefix"),
    (dict(algo="alltoall:ring"), "NCCL_ALGO", "unknown collective 'alltoall'"),
    (dict(algo=""), "NCCL_ALGO", "non-empty"),
    (dict(proto="ll256"), "NCCL_PROTO", "valid values: ll, ll128, simple"),
    (dict(buffsize="16 parsecs"), "NCCL_BUFFSIZE", "like '16MiB'"),
    (dict(buffsize=0), "NCCL_BUFFSIZE", "> 0"),
    (dict(nthreads=100), "NCCL_NTHREADS", "64, 128, 256, 512"),
    (dict(min_ctas=0), "NCCL_MIN_CTAS", r"\[1, 64\]"),
    (dict(max_ctas=65), "NCCL_MAX_CTAS", r"\[1, 64\]"),
    (dict(min_ctas=16, max_ctas=8), "NCCL_MIN_CTAS", "must be <= NCCL_MAX_CTAS"),
    (dict(p2p_level="NVLINK"), "NCCL_P2P_LEVEL", "LOC, NVL, PIX, PXB, PHB, SYS"),
    (dict(cga_cluster_size=9), "NCCL_CGA_CLUSTER_SIZE", r"\[0, 8\]"),
    (dict(debug="LOUD"), "NCCL_DEBUG", "VERSION, WARN, INFO, TRACE"),
    (dict(debug_subsys="INIT,GPU"), "NCCL_DEBUG_SUBSYS", "GPU"),
    (dict(high_priority_stream="yes"), "high_priority_stream", "True or False"),
])
def test_bad_values_name_the_variable_and_what_it_accepts(bad, variable, hint):
    with pytest.raises(ValueError, match=variable) as err:
        Settings(**bad).validate()
    assert err.match(hint)


@pytest.mark.parametrize("settings,warning", [
    (dict(algo="tree"), "Tree is a chain"),
    (dict(proto="ll,ll128,simple"), "can corrupt data"),
    (dict(proto="simple;allreduce:ll128"), "can corrupt data"),
    (dict(p2p_level=2), "PXB"),
    (dict(buffsize=3_000_000), "not a power of two"),
    (dict(debug="trace"), "slows every collective"),
])
def test_unsafe_settings_warn(settings, warning):
    with pytest.warns(UserWarning, match=warning):
        Settings(**settings).validate()


def test_safe_settings_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Settings(algo="ring", proto="^ll128", buffsize="8MiB", p2p_level="NVL").validate()


def test_nvls_with_multicast_off_warns(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    with pytest.warns(UserWarning, match="NVLink multicast off"):
        Settings(algo="nvls,ring").validate()


def test_apply_sets_what_changed_and_reports_it():
    env = {"NCCL_ALGO": "tree", "PATH": "/bin"}
    changed = Settings(algo="ring", buffsize="8MiB").apply(env)
    assert changed == {"NCCL_ALGO": ("tree", "ring"), "NCCL_BUFFSIZE": (None, str(8 * 2**20))}
    assert env["NCCL_ALGO"] == "ring" and env["PATH"] == "/bin"
    assert Settings(algo="ring", buffsize="8MiB").apply(env) == {}  # nothing left to change
    assert ct.nccl.applied() == {"NCCL_ALGO": "ring", "NCCL_BUFFSIZE": str(8 * 2**20)}


def test_apply_warns_on_deprecated_nchannels():
    with pytest.warns(DeprecationWarning, match="NCCL_MIN_NCHANNELS is deprecated"):
        Settings(min_ctas=4).apply({"NCCL_MIN_NCHANNELS": "2"})


def test_apply_refuses_once_a_nccl_group_exists(monkeypatch):
    # NCCL is not available here: stand in for an initialized NCCL default group.
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(RuntimeError, match="NCCL process group already exists"):
        Settings(algo="ring").apply({})


def test_from_env_reads_and_maps_deprecated_names():
    env = {"NCCL_ALGO": "Ring", "NCCL_MAX_NCHANNELS": "16", "NCCL_P2P_LEVEL": "3", "NCCL_BUFFSIZE": "8388608"}
    with pytest.warns(DeprecationWarning, match="NCCL_MAX_NCHANNELS"), \
         pytest.warns(UserWarning, match="integer levels are discouraged"):
        s = Settings.from_env(env)
    assert (s.algo, s.max_ctas, s.p2p_level, s.buffsize) == ("Ring", 16, 3, "8388608")
    with pytest.raises(ValueError, match="NCCL_NTHREADS must be an integer"):
        Settings.from_env({"NCCL_NTHREADS": "lots"})


def test_profile_round_trip(tmp_path):
    s = Settings(algo="ring", proto="^ll128", buffsize=8 * 2**20, min_ctas=4, high_priority_stream=True)
    path = tmp_path / "profile.json"
    s.save_profile(path, sizes={"1MiB": "ring"})
    assert json.loads(path.read_text())["sizes"] == {"1MiB": "ring"}
    assert Settings.from_profile(path) == s
    path.write_text(json.dumps({"settings": {"algo": "ring", "colour": "blue"}}))
    with pytest.raises(ValueError, match="unknown setting"):
        Settings.from_profile(path)
    path.write_text(json.dumps({"algo": "ring"}))
    with pytest.raises(ValueError, match="not a commtune NCCL profile"):
        Settings.from_profile(path)


def test_init_process_group_applies_settings_before_the_group(tmp_path, monkeypatch):
    for variable in ("NCCL_BUFFSIZE", "NCCL_ALGO"):
        monkeypatch.delenv(variable, raising=False)
    ct.init_process_group("gloo", settings=Settings(buffsize="2MiB", algo="ring"),
                          init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert os.environ["NCCL_BUFFSIZE"] == str(2 * 2**20) and os.environ["NCCL_ALGO"] == "ring"
        ddp = ct.wrap(__import__("torch").nn.Linear(4, 2), hook=ct.hooks.AllReduce())
        assert ct.stats(ddp)["nccl"] == {"NCCL_ALGO": "ring", "NCCL_BUFFSIZE": str(2 * 2**20)}
        assert "NCCL settings: NCCL_ALGO=ring NCCL_BUFFSIZE=2097152" in ct.report(ddp)
    finally:
        dist.destroy_process_group()
    with pytest.raises(TypeError, match="commtune.nccl.Settings"):
        ct.init_process_group("gloo", settings={"algo": "ring"})


def _one_nccl_rank(extra_env):
    """tests/nccl_one_rank.py in a fresh process with NCCL's INFO log; returns its output."""
    import subprocess
    import sys

    from commtune.launch import _free_port

    env = dict(os.environ, NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,ENV,TUNING", **extra_env)
    script = os.path.join(os.path.dirname(__file__), "nccl_one_rank.py")
    run = subprocess.run([sys.executable, script, str(_free_port())], env=env, capture_output=True, text=True,
                         timeout=240)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    return out


@needs_cuda
@pytest.mark.needs_cuda
def test_settings_reach_nccl_and_the_process_group_on_a_gpu():
    out = _one_nccl_rank({})
    # NCCL's own log: it read the variables apply() set (ALGO and PROTO are read only to tune
    # collectives of two ranks or more)
    for line in ("NCCL_BUFFSIZE set by environment to 8388608", "NCCL_NTHREADS set by environment to 256",
                 "NCCL_MIN_CTAS set by environment to 2", "NCCL_MAX_CTAS set by environment to 8"):
        assert line in out, out[-3000:]
    assert "options: high_priority=True min_ctas=2 max_ctas=8" in out  # ProcessGroupNCCL.Options
    assert ("stats nccl: [('NCCL_BUFFSIZE', '8388608'), ('NCCL_MAX_CTAS', '8'), ('NCCL_MIN_CTAS', '2'), "
            "('NCCL_NTHREADS', '256')]") in out


@needs_cuda
@pytest.mark.needs_cuda
def test_nccl_loads_the_tuner_plugin_and_its_rules(tmp_path):
    import shutil
    import subprocess

    if shutil.which("make") is None or shutil.which("cc") is None:
        pytest.skip("needs make and a C compiler to build the plugin")
    plugin_dir = os.path.join(os.path.dirname(__file__), os.pardir, "csrc", "nccl_tuner")
    subprocess.run(["make", "-C", plugin_dir], check=True, capture_output=True)
    rules = tmp_path / "profile.rules"
    rules.write_text("# commtune NCCL tuner rules\nallreduce 0 1073741824 ring simple\n* 0 0 tree ll\n")
    out = _one_nccl_rank({"NCCL_TUNER_PLUGIN": os.path.abspath(os.path.join(plugin_dir, "libcommtune_nccl_tuner.so")),
                          "COMMTUNE_TUNER_RULES": str(rules)})
    assert "TUNER/Plugin: Using commtune (v5)" in out, out[-3000:]
    assert "commtune tuner: 2 rule(s) for 1 ranks on 1 node(s)" in out
