"""The link model, DDP's bucketing replayed on a timeline (hand-computed cases), the fit from an
allreduce sweep, the backward measurement and the bucket planner."""
import pytest
import torch

from commtune import sim
from commtune.sim import MB, BackwardTimeline, Link, replay


def test_allreduce_time_is_nccl_tests_bus_formula():
    link = Link("l", alpha_us=10.0, busbw_GBps=100.0)
    assert link.allreduce_us(1 << 30, 1) == 0.0
    # 1 GiB on 8 ranks: 2*7/8 of it over 100 GB/s
    assert link.allreduce_us(1 << 30, 8) == pytest.approx(10.0 + (1 << 30) * 1.75 / 100e3)


def test_fully_exposed_pure_bandwidth():
    link = Link("bw", alpha_us=0.0, busbw_GBps=10.0)
    grads = [(MB, 100.0)] * 4  # all ready when backward ends
    pred = replay(BackwardTimeline(grads, backward_us=100.0), link, 2, bucket_cap_mb=1)
    assert len(pred.buckets) == 4
    assert pred.exposed_us == pytest.approx(4 * MB / 10e3)  # 2(n-1)/n = 1 on 2 ranks
    assert pred.comm_us == pytest.approx(pred.exposed_us)


def test_pure_latency_counts_buckets():
    link = Link("lat", alpha_us=50.0, busbw_GBps=1e12)
    grads = [(MB // 2, 0.0)] * 6
    for cap, buckets in [(1, 3), (3, 1), (0.5, 6)]:
        pred = replay(BackwardTimeline(grads, backward_us=0.0), link, 8, bucket_cap_mb=cap)
        assert len(pred.buckets) == buckets
        assert pred.exposed_us == pytest.approx(50.0 * buckets, rel=1e-6)


def test_fully_hidden_when_sends_finish_before_backward():
    link = Link("fast", alpha_us=1.0, busbw_GBps=1000.0)
    grads = [(MB, 10.0 * i) for i in range(5)]
    pred = replay(BackwardTimeline(grads, backward_us=1000.0), link, 8, bucket_cap_mb=1)
    assert pred.exposed_us == 0.0 and pred.comm_us > 0


def test_sends_queue_behind_each_other_and_the_first_bucket_has_its_own_cap():
    link = Link("l", alpha_us=100.0, busbw_GBps=1e12)
    grads = [(MB // 4, 0.0)] * 8  # 2 MB, ready at once
    pred = replay(BackwardTimeline(grads, backward_us=150.0), link, 2, bucket_cap_mb=1, first_bucket_mb=0.25)
    assert [b[0] for b in pred.buckets] == [MB // 4, MB, 3 * MB // 4]
    assert [b[3] for b in pred.buckets] == pytest.approx([100.0, 200.0, 300.0])
    assert pred.exposed_us == pytest.approx(150.0)


def test_link_fitted_from_a_sweep_recovers_alpha_and_bandwidth():
    truth = Link("t", alpha_us=12.0, busbw_GBps=80.0)
    rows = [{"op": "all_reduce", "bytes": s, "time_us": truth.allreduce_us(s, 4)} for s in (1 << 10, 1 << 20, 1 << 26)]
    fitted = Link.from_sweep({"world_size": 4, "rows": rows + [{"op": "all_gather", "bytes": 8, "time_us": 1e6}]})
    assert fitted.alpha_us == pytest.approx(12.0) and fitted.busbw_GBps == pytest.approx(80.0)
    with pytest.raises(ValueError, match="2 or more ranks"):
        Link.from_sweep({"world_size": 1, "rows": rows})


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 10))


def test_backward_timeline_has_every_gradient_in_ready_order():
    model = _model()
    t = sim.measure_backward(model, torch.randn(32, 64))
    assert sorted(g[0] for g in t.gradients) == sorted(p.numel() * 4 for p in model.parameters())
    times = [g[1] for g in t.gradients]
    assert times == sorted(times) and 0 <= times[0] and times[-1] <= t.backward_us
    assert t.gradients[0][0] in (10 * 4, 10 * 256 * 4)  # the last layer's gradients come first
    assert sorted(g[2] for g in t.gradients) == sorted(tuple(p.shape) for p in model.parameters())
    assert t.forward_us > 0 and t.backward_us > 0
    with pytest.raises(ValueError, match="iters must be >= 1"):
        sim.measure_backward(model, torch.randn(32, 64), iters=0)


def test_planner_picks_the_least_exposed_candidate():
    plan = sim.plan_buckets(_model(), torch.randn(32, 64), link="ib-100g", ranks=8, caps_mb=(0.05, 0.2, 1))
    exposed = [c.exposed_us for c in plan.candidates]
    assert plan.predicted_exposed_us == min(exposed) == exposed[0]
    assert plan.ddp_kwargs() == {"bucket_cap_mb": plan.bucket_cap_mb}
    assert {c.bucket_cap_mb for c in plan.candidates} == {0.05, 0.2, 1}


def test_bad_links_and_ranks_are_refused():
    with pytest.raises(ValueError, match="link must be"):
        sim.plan_buckets(_model(), torch.randn(2, 64), link="carrier-pigeon")
    with pytest.raises(ValueError, match="ranks"):
        sim.plan_buckets(_model(), torch.randn(2, 64), ranks=0)


def test_plan_benchmark_puts_prediction_beside_measurement(tmp_path):
    import json

    from commtune.bench import plan

    out = tmp_path / "plan.json"
    plan.main(["--ranks", "2", "--width", "256", "--depth", "3", "--caps", "0.1", "1", "--iters", "2",
               "--out", str(out)])
    data = json.loads(out.read_text())
    assert [r["bucket_cap_mb"] for r in data["results"]] == [0.1, 1]
    for r in data["results"]:
        assert r["predicted_buckets"] == r["measured_buckets"]  # DDP's rebuilt buckets, replayed
        assert r["measured_exposed_us"] >= 0 and r["predicted_exposed_us"] >= 0
    assert data["link"]["busbw_GBps"] > 0


def test_prediction_adds_the_exposed_tail_and_the_step():
    link = Link("l", alpha_us=0.0, busbw_GBps=1.0)
    t = BackwardTimeline([(MB, 1000.0)], backward_us=1000.0, forward_us=500.0)  # all ready at the end
    comm = link.allreduce_us(MB, 4)
    p = sim.predict(t, link, 4, sim.Config("plain"), optimizer_us=100.0)
    assert p["iteration_us"] == pytest.approx(1500 + comm + 100)
    assert p["speedup"] == pytest.approx(4 * 1600 / (1600 + comm)) and p["efficiency"] == pytest.approx(p["speedup"] / 4)
    bf16 = sim.predict(t, link, 4, sim.Config("bf16", wire_factor=0.5), optimizer_us=100.0)
    assert bf16["exposed_us"] == pytest.approx(comm / 2)
    accum = sim.predict(t, link, 4, sim.Config("accum", accumulation=4), optimizer_us=100.0)
    assert accum["iteration_us"] == pytest.approx(4 * 1500 + comm + 100)  # one send per 4 micro-steps
    one = sim.predict(t, link, 1, sim.Config("one"), optimizer_us=100.0)
    assert one["speedup"] == pytest.approx(1.0) and one["exposed_us"] == 0.0


def test_powersgd_wire_bytes_follow_torchs_compression_rule():
    from commtune.sim import powersgd_wire_bytes

    assert powersgd_wire_bytes(4 * 256 * 256, (256, 256), 4) == 4 * (256 + 256) * 4  # P and Q
    assert powersgd_wire_bytes(4 * 64 * 3 * 3 * 3, (64, 3, 3, 3), 4) == 4 * (64 + 27) * 4  # conv as 64 x 27
    assert powersgd_wire_bytes(4 * 10 * 12, (10, 12), 4) == 4 * 10 * 12  # (10+12)*4*2 >= 120: sent whole
    assert powersgd_wire_bytes(4 * 256, (256,), 4) == 4 * 256  # 1-D: never compressed
    link = Link("bw", alpha_us=0.0, busbw_GBps=1.0)
    t = BackwardTimeline([(4 * 256, 0.0, (256,)), (4 * 256 * 256, 10.0, (256, 256))], backward_us=10.0)
    pred = sim.predict(t, link, 2, sim.Config("powersgd", powersgd_rank=4, first_bucket_mb=None))
    assert pred["exposed_us"] == pytest.approx(link.allreduce_us(4 * 256 + 4 * 512 * 4, 2))


def test_a_hooks_gpu_work_delays_its_send_and_later_gradients():
    link = Link("bw", alpha_us=0.0, busbw_GBps=1.0)
    send = link.allreduce_us(MB, 2)
    t = BackwardTimeline([(MB, 100.0), (MB, 1000.0)], backward_us=1000.0)
    pred = replay(t, link, 2, bucket_cap_mb=1, first_bucket_mb=1, hook_us_per_mb=50.0)
    # bucket 1: ready at 100, encoded until 150, sent until 150 + send; bucket 2: ready at 1000 + 50
    # (bucket 1's work came first), encoded until 1100, sent after bucket 1's send
    # (flat: pytest.approx takes no nested sequences from pytest 9.2 on)
    assert [t for b in pred.buckets for t in b[1:]] == pytest.approx([100, 150, 150 + send, 1050, 150 + send, 150 + 2 * send])
    assert pred.hook_us == pytest.approx(100) and pred.exposed_us == pytest.approx(150 + 2 * send - 1100)
    p = sim.predict(t, link, 2, sim.Config("coded", first_bucket_mb=1, hook_us_per_mb=50.0))
    assert p["iteration_us"] == pytest.approx(150 + 2 * send)  # the last send's end
    one = sim.predict(t, link, 1, sim.Config("coded", first_bucket_mb=1, hook_us_per_mb=50.0))
    assert one["iteration_us"] == pytest.approx(1100) and one["speedup"] == pytest.approx(1000 / 1100)
