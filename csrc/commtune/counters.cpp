#include <commtune/counters.h>

#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>

namespace commtune {

TimePoint TimePoint::now(const c10::Device& device) {
  TimePoint t;
  if (device.is_cpu()) {
    t.host_ = std::chrono::steady_clock::now();
    return t;
  }
  c10::impl::VirtualGuardImpl impl(device.type());
  // BACKEND_DEFAULT keeps timing enabled (cudaEventDefault on CUDA).
  t.event_ = std::make_shared<c10::Event>(device.type(), c10::EventFlag::BACKEND_DEFAULT);
  t.event_->record(impl.getStream(device));
  return t;
}

bool TimePoint::ready() const {
  return !event_ || event_->query();
}

void TimePoint::wait() const {
  if (event_) {
    event_->synchronize();
  }
}

double TimePoint::us_until(const TimePoint& later) const {
  TORCH_INTERNAL_ASSERT(static_cast<bool>(event_) == static_cast<bool>(later.event_));
  if (event_) {
    return event_->elapsedTime(*later.event_) * 1000.0;
  }
  return std::chrono::duration<double, std::micro>(later.host_ - host_).count();
}

void Counters::set_timing_every(int64_t every) {
  TORCH_CHECK(every >= 1, "timing_every must be >= 1, got ", std::to_string(every));
  timing_every_ = every;
}

CounterTicket Counters::open(size_t bucket_index, bool is_last, const at::Tensor& buffer) {
  std::lock_guard<std::mutex> lock(mutex_);
  fold(/*wait=*/false);
  if (pending_.empty() || pending_.back().saw_last) {
    const int64_t serial = next_serial_++;
    Iteration fresh{serial, {}};
    fresh.timed = timing_ && (buffer.is_cpu() || serial % timing_every_ == 0);
    pending_.push_back(std::move(fresh));
  }
  Iteration& it = pending_.back();
  std::optional<TimePoint> start;
  if (it.timed) {
    start = TimePoint::now(buffer.device());
  }
  it.records.push_back(Record{bucket_index, buffer.device(),
                              static_cast<int64_t>(buffer.nbytes()), 0, 0.0, 0, std::move(start)});
  const size_t slot = it.records.size() - 1;
  if (is_last) {
    it.saw_last = true;
    it.last_slot = slot;
  }
  ++it.open;
  return CounterTicket{it.serial, slot};
}

Counters::Record& Counters::record(const CounterTicket& ticket) {
  TORCH_INTERNAL_ASSERT(!pending_.empty() && ticket.iteration >= pending_.front().serial);
  Iteration& it = pending_.at(ticket.iteration - pending_.front().serial);
  return it.records.at(ticket.slot);
}

void Counters::launched(const CounterTicket& ticket, double host_us, int64_t bytes_out, double wire_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  Record& r = record(ticket);
  r.host_us = host_us;
  r.bytes_out = bytes_out;
  r.wire_bytes = wire_bytes;
}

void Counters::close(const CounterTicket& ticket) {
  std::lock_guard<std::mutex> lock(mutex_);
  Record& r = record(ticket);
  if (r.start) {
    r.end = TimePoint::now(r.device);
  }
  --pending_.at(ticket.iteration - pending_.front().serial).open;
}

void Counters::drop(const CounterTicket& ticket) {
  std::lock_guard<std::mutex> lock(mutex_);
  record(ticket).failed = true;
  --pending_.at(ticket.iteration - pending_.front().serial).open;
}

void Counters::fold(bool wait) {
  while (!pending_.empty()) {
    Iteration& it = pending_.front();
    if (!it.saw_last || it.open > 0) {
      return;  // still in flight
    }
    for (const Record& r : it.records) {
      if (!r.end) {
        continue;  // failed or untimed: nothing to wait for
      }
      if (wait) {
        r.end->wait();
      } else if (!r.end->ready()) {
        return;
      }
    }
    if (!it.discard) {
      add(it);
    }
    pending_.pop_front();
  }
}

void Counters::add(const Iteration& it) {
  const std::optional<TimePoint>& handover = it.records[it.last_slot].start;
  double exposed_iteration = 0;
  bool timed = false;
  for (const Record& r : it.records) {
    if (totals_.buckets.size() <= r.bucket) {
      totals_.buckets.resize(r.bucket + 1);  // buckets are rebuilt after iteration 1
    }
    CounterTotals& b = totals_.buckets[r.bucket];
    b.calls += 1;
    b.bytes_in += r.bytes_in;
    b.bytes_out += r.bytes_out;
    b.wire_bytes += r.wire_bytes;
    b.hook_host_us += r.host_us;
    totals_.total.calls += 1;
    totals_.total.bytes_in += r.bytes_in;
    totals_.total.bytes_out += r.bytes_out;
    totals_.total.wire_bytes += r.wire_bytes;
    totals_.total.hook_host_us += r.host_us;
    if (!r.end) {
      continue;
    }
    timed = true;
    b.timed_calls += 1;
    totals_.total.timed_calls += 1;
    const double comm = r.start->us_until(*r.end);
    const double exposed = handover ? std::max(0.0, handover->us_until(*r.end)) : 0.0;
    b.comm_us += comm;
    b.exposed_comm_us += exposed;
    totals_.total.comm_us += comm;
    exposed_iteration = std::max(exposed_iteration, exposed);
  }
  totals_.total.exposed_comm_us += exposed_iteration;
  const std::optional<TimePoint>& first = it.records.front().start;
  if (timed && first) {
    totals_.last_timed.clear();
    for (const Record& r : it.records) {
      if (!r.end) continue;
      totals_.last_timed.push_back(BucketSpan{static_cast<int64_t>(r.bucket), r.bytes_in, r.bytes_out, r.wire_bytes,
                                              r.host_us, first->us_until(*r.start), first->us_until(*r.end)});
    }
  }
  totals_.iterations += 1;
  totals_.timed_iterations += timed ? 1 : 0;
}

CounterSnapshot Counters::snapshot() {
  std::lock_guard<std::mutex> lock(mutex_);
  fold(/*wait=*/true);
  return totals_;
}

void Counters::reset() {
  std::lock_guard<std::mutex> lock(mutex_);
  totals_ = CounterSnapshot{};
  for (Iteration& it : pending_) {
    it.discard = true;
  }
}

} // namespace commtune
