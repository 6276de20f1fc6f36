#pragma once
// Per-bucket and per-iteration counters for a communication hook.
//
// The hook opens a record when DDP hands it a bucket and closes it in the
// collective's continuation. On CUDA both ends are events on the stream that is
// current at that moment, so nothing synchronizes inside the hook; events are
// read later, once they have completed (or, from snapshot(), by waiting).

#include <ATen/ATen.h>
#include <c10/core/Event.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

namespace commtune {

// Sums over calls; times in microseconds.
struct CounterTotals {
  int64_t calls = 0;
  int64_t bytes_in = 0;   // bucket bytes handed to the hook
  int64_t bytes_out = 0;  // bytes this rank handed to collectives
  double wire_bytes = 0;  // bytes this rank sent, each collective counted as wire.h does
  double hook_host_us = 0;  // host time spent inside the hook
  int64_t timed_calls = 0;  // calls whose times are in comm_us and exposed_comm_us
  double comm_us = 0;  // hand-over until the reduced bucket is ready
  double exposed_comm_us = 0;  // part of comm_us after the last bucket's hand-over
};

// One bucket of the latest timed iteration, in microseconds from that iteration's first hand-over.
struct BucketSpan {
  int64_t bucket = 0;
  int64_t bytes_in = 0;
  int64_t bytes_out = 0;
  double wire_bytes = 0;
  double host_us = 0;
  double start_us = 0;  // handed to the hook
  double end_us = 0;  // reduced bucket ready
};

struct CounterSnapshot {
  int64_t iterations = 0;
  int64_t timed_iterations = 0;  // iterations whose times are in the totals
  CounterTotals total;
  std::vector<CounterTotals> buckets;  // by bucket index
  std::vector<BucketSpan> last_timed;  // the latest timed iteration, bucket by bucket (for traces)
};

// A moment on a device: a timing event on its current stream, or the host clock.
class TimePoint {
 public:
  static TimePoint now(const c10::Device& device);
  bool ready() const;
  void wait() const;
  // Microseconds from this moment to `later`; negative when `later` came first.
  double us_until(const TimePoint& later) const;

 private:
  std::shared_ptr<c10::Event> event_;  // set for accelerator devices
  std::chrono::steady_clock::time_point host_;
};

struct CounterTicket {
  int64_t iteration;  // serial number of the iteration the record belongs to
  size_t slot;  // position of the record in that iteration
};

class Counters {
 public:
  // A bucket was handed over. The first bucket after an `is_last` one starts a new iteration.
  CounterTicket open(size_t bucket_index, bool is_last, const at::Tensor& buffer);
  // The hook returned: what it spent on the host, handed to collectives and put on the wire.
  void launched(const CounterTicket& ticket, double host_us, int64_t bytes_out, double wire_bytes);
  // The reduced bucket is ready (call from the continuation, on its stream).
  void close(const CounterTicket& ticket);
  // The collective failed: the record counts its call and bytes but no time.
  void drop(const CounterTicket& ticket);

  // Totals of every finished iteration; waits for their outstanding events.
  CounterSnapshot snapshot();
  // Forgets the totals; iterations in flight are not counted when they finish.
  void reset();
  // Off: no events are recorded and comm/exposed times stay zero; bytes and calls still count.
  void set_timing(bool on) { timing_ = on; }
  bool timing() const { return timing_; }
  // On accelerators, time one iteration in `every` (the first, then each every-th): each event
  // costs driver calls on every bucket (about 1 ms per ResNet-50 iteration on the GPU machine,
  // 1.9% of it, with every iteration timed). Host-clock timing (CPU) times every iteration.
  void set_timing_every(int64_t every);
  int64_t timing_every() const { return timing_every_; }

 private:
  struct Record {
    size_t bucket;
    c10::Device device;
    int64_t bytes_in;
    int64_t bytes_out = 0;
    double wire_bytes = 0;
    double host_us = 0;
    std::optional<TimePoint> start;  // empty when timing is off
    std::optional<TimePoint> end;  // empty until closed, and when failed or untimed
    bool failed = false;
  };
  struct Iteration {
    int64_t serial;
    std::vector<Record> records;
    size_t last_slot = 0;  // the record of the is_last bucket, once seen
    bool saw_last = false;
    int open = 0;
    bool discard = false;
    bool timed = false;
  };

  Record& record(const CounterTicket& ticket);
  // Folds finished iterations, oldest first, into the totals. Without `wait`
  // it stops at the first one whose events have not completed yet.
  void fold(bool wait);
  void add(const Iteration& it);

  std::atomic<bool> timing_{true};
  std::atomic<int64_t> timing_every_{10};
  std::mutex mutex_;
  std::deque<Iteration> pending_;
  int64_t next_serial_ = 0;
  CounterSnapshot totals_;
};

} // namespace commtune
