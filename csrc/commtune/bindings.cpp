// The only file that includes pybind11: exposes hooks, handles and kernels as commtune._C.
#include <torch/extension.h>

#include <limits>

#include <commtune/hook.h>
#include <commtune/hooks/allreduce.h>
#include <commtune/hooks/cast.h>
#include <commtune/hooks/fused.h>
#include <commtune/hooks/powersgd.h>
#include <commtune/hooks/quantize.h>
#include <commtune/hooks/random_k.h>
#include <commtune/hooks/sign_sgd.h>
#include <commtune/hooks/top_k.h>
#include <commtune/hooks/with_optimizer.h>
#include <commtune/kernels/cast_scale.h>
#include <commtune/kernels/low_rank.h>
#include <commtune/kernels/orthogonalize.h>
#include <commtune/kernels/quantize.h>
#include <commtune/kernels/random_k.h>
#include <commtune/kernels/sign.h>
#include <commtune/kernels/top_k.h>

namespace py = pybind11;
using namespace commtune;

namespace {

py::dict totals_to_dict(const CounterTotals& t) {
  py::dict d;
  d["calls"] = t.calls;
  d["bytes_in"] = t.bytes_in;
  d["bytes_out"] = t.bytes_out;
  d["wire_bytes"] = t.wire_bytes;
  d["hook_host_us"] = t.hook_host_us;
  d["timed_calls"] = t.timed_calls;
  d["comm_us"] = t.comm_us;
  d["exposed_comm_us"] = t.exposed_comm_us;
  return d;
}

py::dict snapshot_to_dict(const CounterSnapshot& s) {
  py::dict d = totals_to_dict(s.total);
  d["iterations"] = s.iterations;
  d["timed_iterations"] = s.timed_iterations;
  py::list buckets;
  for (const CounterTotals& b : s.buckets) {
    buckets.append(totals_to_dict(b));
  }
  d["buckets"] = buckets;
  py::list spans;
  for (const BucketSpan& b : s.last_timed) {
    py::dict span;
    span["bucket"] = b.bucket;
    span["bytes_in"] = b.bytes_in;
    span["bytes_out"] = b.bytes_out;
    span["wire_bytes"] = b.wire_bytes;
    span["host_us"] = b.host_us;
    span["start_us"] = b.start_us;
    span["end_us"] = b.end_us;
    spans.append(span);
  }
  d["last_iteration"] = spans;
  return d;
}

// make_<hook>(process_group, options): the hook, built, for register_built or a wrapper.
template <typename H>
void def_make(py::module_& m, const char* name) {
  m.def(
      name,
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& process_group, const typename H::Options& options) {
        TORCH_CHECK(process_group, "commtune: the DDP module has no process group");
        return std::make_shared<BuiltHook>(BuiltHook{std::make_unique<H>(process_group, options)});
      },
      py::arg("process_group"), py::arg("options"));
}

// make_<wrapper>(process_group, inner, options): a wrapper hook around a built inner hook.
template <typename W>
void def_make_wrapper(py::module_& m, const char* name) {
  m.def(
      name,
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& process_group, BuiltHook& inner,
         const typename W::Options& options) {
        return std::make_shared<BuiltHook>(BuiltHook{std::make_unique<W>(process_group, inner.take(), options)});
      },
      py::arg("process_group"), py::arg("inner"), py::arg("options"));
}

OptimizerHook& optimizer_hook(const HookHandle& h) {
  auto* hook = dynamic_cast<OptimizerHook*>(h.hook);
  TORCH_CHECK(hook, "commtune: the hook is ", h.hook->name(), ", not WithOptimizer");
  return *hook;
}

} // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "commtune C++/CUDA core";
#ifdef COMMTUNE_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif

  m.def("allreduce_wire_bytes", &wire::allreduce, py::arg("bytes"), py::arg("ranks"),
        "bytes one rank sends in a ring allreduce of `bytes` on `ranks` ranks (nccl-tests' bus traffic)");

  py::class_<HookHandle>(m, "HookHandle")
      .def_property_readonly("name", [](const HookHandle& h) { return h.hook->name(); })
      .def_property_readonly("iteration", [](const HookHandle& h) { return h.hook->iteration(); })
      .def("counters",
           [](const HookHandle& h) {
             CounterSnapshot s;
             std::map<std::string, double> extra;
             {
               py::gil_scoped_release release;  // may wait on CUDA events
               s = h.hook->counters().snapshot();
               extra = h.hook->extra_stats();
             }
             py::dict d = snapshot_to_dict(s);
             for (const auto& [key, value] : extra) d[py::str(key)] = value;
             return d;
           })
      .def("reset_counters", [](const HookHandle& h) { h.hook->counters().reset(); })
      .def_property(
          "timing", [](const HookHandle& h) { return h.hook->counters().timing(); },
          [](const HookHandle& h, bool on) { h.hook->counters().set_timing(on); })
      .def_property(
          "timing_every", [](const HookHandle& h) { return h.hook->counters().timing_every(); },
          [](const HookHandle& h, int64_t every) { h.hook->counters().set_timing_every(every); })
      .def_property(
          "launch_thread", [](const HookHandle& h) { return h.hook->launch_thread(); },
          [](const HookHandle& h, bool on) {
            py::gil_scoped_release release;  // switching off waits for queued launches
            h.hook->set_launch_thread(on);
          })
      .def_property(
          "input_scale", [](const HookHandle& h) { return h.hook->input_scale(); },
          [](const HookHandle& h, double scale) { h.hook->set_input_scale(scale); })
      .def("set_parameters",
           [](const HookHandle& h, const std::vector<at::Tensor>& ps) { h.hook->set_parameters(ps); })
      .def("state_dict", [](const HookHandle& h) { return h.hook->state_dict(); })
      .def("load_state_dict",
           [](const HookHandle& h, const StateDict& state) { h.hook->load_state_dict(state); });

  py::class_<AllReduceHook::Options>(m, "AllReduceOptions").def(py::init<>());
  py::class_<CastHook::Options>(m, "CastOptions")
      .def(py::init<>())
      .def_readwrite("dtype", &CastHook::Options::dtype);

  using PowerSgdOptions = PowerSgdHook::Options;
  py::class_<PowerSgdOptions>(m, "PowerSgdOptions")
      .def(py::init<>())
      .def_readwrite("rank", &PowerSgdOptions::rank)
      .def_readwrite("start_iter", &PowerSgdOptions::start_iter)
      .def_readwrite("min_compression_rate", &PowerSgdOptions::min_compression_rate)
      .def_readwrite("error_feedback", &PowerSgdOptions::error_feedback)
      .def_readwrite("warm_start", &PowerSgdOptions::warm_start)
      .def_readwrite("orthogonalization_epsilon", &PowerSgdOptions::orthogonalization_epsilon)
      .def_readwrite("seed", &PowerSgdOptions::seed)
      .def_readwrite("batch_same_shape", &PowerSgdOptions::batch_same_shape)
      .def_readwrite("approx_error_every", &PowerSgdOptions::approx_error_every);

  def_make<AllReduceHook>(m, "make_allreduce");
  def_make<CastHook>(m, "make_cast");
  def_make<PowerSgdHook>(m, "make_powersgd");

  using QuantizeOptions = QuantizeHook::Options;
  py::class_<QuantizeOptions>(m, "QuantizeOptions")
      .def(py::init<>())
      .def_readwrite("codes", &QuantizeOptions::codes)
      .def_readwrite("chunk", &QuantizeOptions::chunk)
      .def_readwrite("stochastic", &QuantizeOptions::stochastic)
      .def_readwrite("error_feedback", &QuantizeOptions::error_feedback)
      .def_readwrite("seed", &QuantizeOptions::seed)
      .def_readwrite("min_size", &QuantizeOptions::min_size);
  def_make<QuantizeHook>(m, "make_quantize");

  using SignSgdOptions = SignSgdHook::Options;
  py::class_<SignSgdOptions>(m, "SignSgdOptions")
      .def(py::init<>())
      .def_readwrite("chunk", &SignSgdOptions::chunk)
      .def_readwrite("error_feedback", &SignSgdOptions::error_feedback)
      .def_readwrite("min_size", &SignSgdOptions::min_size);
  def_make<SignSgdHook>(m, "make_signsgd");

  using TopKOptions = TopKHook::Options;
  py::class_<TopKOptions>(m, "TopKOptions")
      .def(py::init<>())
      .def_readwrite("ratio", &TopKOptions::ratio)
      .def_readwrite("error_feedback", &TopKOptions::error_feedback)
      .def_readwrite("min_size", &TopKOptions::min_size)
      .def_property(
          "selection",
          [](const TopKOptions& o) { return o.selection == TopKHook::Selection::exact ? "exact" : "threshold"; },
          [](TopKOptions& o, const std::string& name) {
            TORCH_CHECK(name == "exact" || name == "threshold",
                        "commtune.TopK: selection must be 'exact' or 'threshold', got '", name, "'");
            o.selection = name == "exact" ? TopKHook::Selection::exact : TopKHook::Selection::threshold;
          });
  def_make<TopKHook>(m, "make_topk");
  using RandomKOptions = RandomKHook::Options;
  py::class_<RandomKOptions>(m, "RandomKOptions")
      .def(py::init<>())
      .def_readwrite("ratio", &RandomKOptions::ratio)
      .def_readwrite("seed", &RandomKOptions::seed)
      .def_readwrite("error_feedback", &RandomKOptions::error_feedback)
      .def_readwrite("min_size", &RandomKOptions::min_size);
  def_make<RandomKHook>(m, "make_randomk");
  // RandomK's passes on their own (kernel tests and benchmarks); see random_k.h.
  m.def("random_k_take_",
        [](const at::Tensor& x, uint64_t seed, const at::Tensor& values, bool clear, const std::optional<at::Tensor>& add) {
          random_k_take_(x, seed, values, clear, add.value_or(at::Tensor()));
        },
        py::arg("x"), py::arg("seed"), py::arg("values"), py::arg("clear"), py::arg("add") = py::none());
  m.def("random_k_place_", &random_k_place_, py::arg("summed"), py::arg("seed"), py::arg("out"), py::arg("ranks"));
  m.def("random_k_positions", &random_k_positions, py::arg("numel"), py::arg("k"), py::arg("seed"),
        "the k positions a draw takes (on the CPU)");
  // The sign compression's passes on their own (kernel tests); see sign.h.
  m.def("sign_piece_bytes", [](int64_t numel, int64_t chunk) { return SignLayout::of(numel, chunk).piece_bytes(); },
        py::arg("numel"), py::arg("chunk"));
  m.def("sign_encode_",
        [](const at::Tensor& src, const std::optional<at::Tensor>& error, const at::Tensor& piece, int64_t chunk,
           bool accumulate) {
          sign_encode_(src, error.value_or(at::Tensor()), piece, SignLayout::of(src.numel(), chunk), accumulate);
        },
        py::arg("src"), py::arg("error"), py::arg("piece"), py::arg("chunk"), py::arg("accumulate") = false);
  m.def("sign_decode_mean_",
        [](const at::Tensor& gathered, const at::Tensor& out, int64_t ranks, int64_t chunk) {
          sign_decode_mean_(gathered, out, ranks, SignLayout::of(out.numel(), chunk));
        },
        py::arg("gathered"), py::arg("out"), py::arg("ranks"), py::arg("chunk"));
  // The quantized allreduce's passes on their own (kernel tests and benchmarks); see quantize.h.
  m.def("threshold_top_k_",
        [](const at::Tensor& x, int64_t k, const at::Tensor& piece, const at::Tensor& qualifying, bool clear,
           const std::optional<at::Tensor>& add) {
          threshold_top_k_(x, k, piece, qualifying, clear, add.value_or(at::Tensor()));
        },
        py::arg("x"), py::arg("k"), py::arg("piece"), py::arg("qualifying"), py::arg("clear"), py::arg("add") = py::none(),
        "TopK's threshold selection (see kernels/top_k.h); returns nothing, fills piece and qualifying");
  m.def("top_k_place_", &top_k_place_, py::arg("gathered"), py::arg("out"), py::arg("ranks"),
        "TopK's decompression (see kernels/top_k.h): out = the mean of the ranks' all-gathered pieces");
  m.def("top_k_sample", [](int64_t numel, int64_t k) {
    const TopKSample s = TopKSample::of(numel, k);
    return py::make_tuple(s.size, s.stride, s.want);
  }, py::arg("numel"), py::arg("k"), "(sample size, stride between sampled entries, rank of the threshold in it)");
  m.def("quantize_layout", [](int64_t numel, int64_t ranks, int64_t chunk, const std::string& codes) {
    const QuantizeLayout l = QuantizeLayout::of(numel, ranks, chunk, codes_named(codes));
    return py::make_tuple(l.shard, l.piece_bytes());
  }, py::arg("numel"), py::arg("ranks"), py::arg("chunk"), py::arg("codes") = "int8",
  "(elements per shard, bytes per encoded shard)");
  m.def("quantize_shards_",
        [](const at::Tensor& src, const std::optional<at::Tensor>& error, const at::Tensor& packed, int64_t ranks,
           int64_t chunk, int64_t draws, const std::string& codes, bool accumulate) {
          quantize_shards_(src, error.value_or(at::Tensor()), packed,
                           QuantizeLayout::of(src.numel(), ranks, chunk, codes_named(codes)), draws, accumulate);
        },
        py::arg("src"), py::arg("error"), py::arg("packed"), py::arg("ranks"), py::arg("chunk"), py::arg("draws") = -1,
        py::arg("codes") = "int8", py::arg("accumulate") = false);
  m.def("reduce_shard_",
        [](const at::Tensor& received, const at::Tensor& piece, int64_t numel, int64_t ranks, int64_t chunk,
           int64_t divisor, int64_t draws, const std::string& codes) {
          reduce_shard_(received, piece, QuantizeLayout::of(numel, ranks, chunk, codes_named(codes)), divisor, draws);
        },
        py::arg("received"), py::arg("piece"), py::arg("numel"), py::arg("ranks"), py::arg("chunk"),
        py::arg("divisor"), py::arg("draws") = -1, py::arg("codes") = "int8");
  m.def("dequantize_shards_",
        [](const at::Tensor& packed, const at::Tensor& out, int64_t ranks, int64_t chunk, const std::string& codes) {
          dequantize_shards_(packed, out, QuantizeLayout::of(out.numel(), ranks, chunk, codes_named(codes)));
        },
        py::arg("packed"), py::arg("out"), py::arg("ranks"), py::arg("chunk"), py::arg("codes") = "int8");

  m.def("cast_scale", &cast_scale, py::arg("src"), py::arg("scale"), py::arg("dtype"),
        "(src * scale) cast to dtype in one pass");
  m.def("cast_scale_", &cast_scale_, py::arg("src"), py::arg("scale"), py::arg("out"));
  py::class_<BuiltHook, std::shared_ptr<BuiltHook>>(m, "BuiltHook");
  // The GIL is released so that a gloo/NCCL call inside registration cannot deadlock.
  m.def("register_built", &register_built, py::arg("reducer"), py::arg("built"),
        py::call_guard<py::gil_scoped_release>());

  using OptimizerOptions = OptimizerHook::Options;
  py::class_<OptimizerOptions>(m, "OptimizerOptions")
      .def(py::init<>())
      .def_readwrite("optimizer", &OptimizerOptions::optimizer)
      .def_readwrite("lr", &OptimizerOptions::lr)
      .def_readwrite("momentum", &OptimizerOptions::momentum)
      .def_readwrite("dampening", &OptimizerOptions::dampening)
      .def_readwrite("nesterov", &OptimizerOptions::nesterov)
      .def_readwrite("weight_decay", &OptimizerOptions::weight_decay)
      .def_readwrite("beta1", &OptimizerOptions::beta1)
      .def_readwrite("beta2", &OptimizerOptions::beta2)
      .def_readwrite("eps", &OptimizerOptions::eps)
      .def_readwrite("maximize", &OptimizerOptions::maximize);
  def_make_wrapper<OptimizerHook>(m, "make_with_optimizer");
  m.def("set_hyperparameters",
        [](const HookHandle& h, const OptimizerOptions& o) { optimizer_hook(h).set_hyperparameters(o); });
  m.def("hyperparameters", [](const HookHandle& h) { return optimizer_hook(h).hyperparameters(); });
  m.def("load_optimizer_state",
        [](const HookHandle& h, const StateDict& state) { optimizer_hook(h).load_optimizer_state(state); });

  py::class_<FusedHook::Options>(m, "FusedOptions")
      .def(py::init<>())
      .def_readwrite("min_bytes", &FusedHook::Options::min_bytes);
  def_make_wrapper<FusedHook>(m, "make_fused");

  m.def("orthogonalize_", &orthogonalize_, py::arg("matrices"), py::arg("epsilon") = 0.0);
  m.def("powersgd_steps",
        [](const at::Tensor& input, const at::Tensor& q_init, const std::vector<std::vector<int64_t>>& matrices,
           const std::vector<std::vector<int64_t>>& rest, double epsilon, const std::optional<at::Tensor>& addend,
           int64_t divisor) {
          // One PowerSGD round through the plan's batched steps (for kernel tests), the sums
          // taken as if `divisor` ranks had sent the same: matrices as [offset, rows, cols, rank,
          // p_offset, q_offset], rest as [offset, numel, rest_offset]. The error buffer starts as
          // input (+ addend) and ends as that minus the output.
          std::vector<LowRankMatrix> ms;
          for (const auto& m : matrices) {
            TORCH_CHECK(m.size() == 6, "powersgd_steps: a matrix is [offset, rows, cols, rank, p_offset, q_offset]");
            ms.push_back(LowRankMatrix{m[0], m[1], m[2], m[3], m[4], m[5]});
          }
          std::vector<RestSegment> rs;
          for (const auto& r : rest) {
            TORCH_CHECK(r.size() == 3, "powersgd_steps: a rest segment is [offset, numel, rest_offset]");
            rs.push_back(RestSegment{r[0], r[1], r[2]});
          }
          LowRankPlan plan(std::move(ms), std::move(rs), input.device());
          at::Tensor q = q_init.clone(), p = at::empty({plan.p_numel()}, input.options());
          at::Tensor rest_packed = at::empty({plan.rest_numel()}, input.options());
          at::Tensor out = at::full_like(input, std::numeric_limits<double>::quiet_NaN()), error = input.clone();
          at::Tensor norms = at::zeros({2}, input.options().dtype(at::kDouble));
          orthogonalize_factors_(q, Factor::Q, epsilon, plan);
          low_rank_compress_(error, addend.value_or(at::Tensor()), q, p, rest_packed, plan);
          orthogonalize_factors_(p, Factor::P, epsilon, plan);
          low_rank_project_back_(error, p, q, plan);
          low_rank_decompress_(p, q, rest_packed, divisor, out, error, norms, plan);
          return py::make_tuple(p, q, rest_packed, out, error, norms, plan.batched_kernels());
        },
        py::arg("input"), py::arg("q_init"), py::arg("matrices"), py::arg("rest"), py::arg("epsilon") = 0.0,
        py::arg("addend") = py::none(), py::arg("divisor") = 1);
  m.def("powersgd_torch_seeds", [](uint32_t seed, int64_t count) {
    std::mt19937 engine(seed);
    int64_t words = 0;
    std::vector<int64_t> out;
    for (int64_t i = 0; i < count; ++i) out.push_back(PowerSgdHook::draw_torch_seed(engine, words));
    return out;
  }, "the torch seeds PowerSGD draws, in order (numpy RandomState(seed).randint(1e9) each)");
}
