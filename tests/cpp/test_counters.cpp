#include <commtune/counters.h>

#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace {

using commtune::Counters;

// One iteration of `sizes.size()` buckets, handed over and closed in order.
void iteration(Counters& c, const std::vector<int64_t>& sizes, int64_t out_divisor = 1) {
  for (size_t b = 0; b < sizes.size(); ++b) {
    at::Tensor buffer = at::empty({sizes[b]});
    auto ticket = c.open(b, b + 1 == sizes.size(), buffer);
    c.launched(ticket, 1.0, buffer.nbytes() / out_divisor, 1.5 * buffer.nbytes() / out_divisor);
    c.close(ticket);
  }
}

TEST(Counters, SumsPerBucketAndPerIteration) {
  Counters c;
  iteration(c, {10, 20, 30});
  iteration(c, {10, 20, 30}, 2);
  auto s = c.snapshot();
  EXPECT_EQ(s.iterations, 2);
  EXPECT_EQ(s.total.calls, 6);
  EXPECT_EQ(s.total.bytes_in, 2 * 60 * 4);
  EXPECT_EQ(s.total.bytes_out, 60 * 4 + 30 * 4);
  EXPECT_DOUBLE_EQ(s.total.wire_bytes, 1.5 * (60 * 4 + 30 * 4));
  EXPECT_DOUBLE_EQ(s.buckets[2].wire_bytes, 1.5 * (30 * 4 + 15 * 4));
  ASSERT_EQ(s.buckets.size(), 3u);
  EXPECT_EQ(s.buckets[1].calls, 2);
  EXPECT_EQ(s.buckets[1].bytes_in, 2 * 20 * 4);
  EXPECT_DOUBLE_EQ(s.total.hook_host_us, 6.0);
  EXPECT_GE(s.total.comm_us, 0.0);
  EXPECT_LE(s.total.exposed_comm_us, s.total.comm_us);
}

TEST(Counters, FollowsABucketRebuild) {
  Counters c;
  iteration(c, {60});  // DDP's first iteration: one bucket
  iteration(c, {10, 20, 30});  // rebuilt: three
  auto s = c.snapshot();
  EXPECT_EQ(s.iterations, 2);
  ASSERT_EQ(s.buckets.size(), 3u);
  EXPECT_EQ(s.buckets[0].bytes_in, (60 + 10) * 4);
  EXPECT_EQ(s.buckets[2].calls, 1);
}

TEST(Counters, IterationInFlightIsNotCountedUntilItsLastBucketCloses) {
  Counters c;
  at::Tensor buffer = at::empty({8});
  auto first = c.open(0, false, buffer);
  auto last = c.open(1, true, buffer);
  c.close(last);
  EXPECT_EQ(c.snapshot().iterations, 0);  // bucket 0 is still communicating
  c.close(first);
  EXPECT_EQ(c.snapshot().iterations, 1);
}

TEST(Counters, ExposedTimeIsMeasuredFromTheLastHandOver) {
  Counters c;
  at::Tensor buffer = at::empty({8});
  auto early = c.open(0, false, buffer);
  c.close(early);  // finished long before the last bucket arrives: nothing exposed
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  auto last = c.open(1, true, buffer);
  c.close(last);
  auto s = c.snapshot();
  EXPECT_DOUBLE_EQ(s.buckets[0].exposed_comm_us, 0.0);
  EXPECT_GT(s.buckets[0].comm_us, 0.0);
  EXPECT_DOUBLE_EQ(s.total.exposed_comm_us, s.buckets[1].exposed_comm_us);
}

TEST(Counters, KeepsTheLatestTimedIterationBucketByBucket) {
  Counters c;
  iteration(c, {60});
  at::Tensor buffer = at::empty({8});
  auto first = c.open(0, false, buffer);
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  auto last = c.open(1, true, buffer);
  c.launched(last, 2.5, 16, 24.0);
  c.close(last);
  c.close(first);
  auto s = c.snapshot();
  ASSERT_EQ(s.last_timed.size(), 2u);  // the second iteration's, not the first's
  EXPECT_EQ(s.last_timed[0].bucket, 0);
  EXPECT_DOUBLE_EQ(s.last_timed[0].start_us, 0.0);  // times count from the first hand-over
  EXPECT_GE(s.last_timed[1].start_us, 5000.0);
  EXPECT_GE(s.last_timed[0].end_us, s.last_timed[1].end_us);  // bucket 0 closed last
  EXPECT_EQ(s.last_timed[1].bytes_out, 16);
  EXPECT_DOUBLE_EQ(s.last_timed[1].wire_bytes, 24.0);
  EXPECT_DOUBLE_EQ(s.last_timed[1].host_us, 2.5);
}

TEST(Counters, DroppedRecordsCountBytesButNoTime) {
  Counters c;
  at::Tensor buffer = at::empty({8});
  auto t = c.open(0, true, buffer);
  c.launched(t, 2.0, 32, 48.0);
  c.drop(t);
  auto s = c.snapshot();
  EXPECT_EQ(s.iterations, 1);
  EXPECT_EQ(s.total.calls, 1);
  EXPECT_EQ(s.total.bytes_out, 32);
  EXPECT_DOUBLE_EQ(s.total.wire_bytes, 48.0);
  EXPECT_DOUBLE_EQ(s.total.comm_us, 0.0);
}

TEST(Counters, ResetForgetsTotalsAndIterationsInFlight) {
  Counters c;
  iteration(c, {4, 4});
  at::Tensor buffer = at::empty({4});
  auto in_flight = c.open(0, false, buffer);
  c.reset();
  auto last = c.open(1, true, buffer);
  c.close(in_flight);
  c.close(last);
  EXPECT_EQ(c.snapshot().iterations, 0);
  iteration(c, {4, 4});
  EXPECT_EQ(c.snapshot().iterations, 1);
}

TEST(Counters, ThreadSafeUnderConcurrentCloses) {
  Counters c;
  constexpr int kIterations = 200;
  constexpr int kBuckets = 4;
  at::Tensor buffer = at::empty({16});
  for (int i = 0; i < kIterations; ++i) {
    std::vector<commtune::CounterTicket> tickets;
    for (int b = 0; b < kBuckets; ++b) {
      tickets.push_back(c.open(b, b == kBuckets - 1, buffer));
    }
    std::vector<std::thread> closers;
    for (auto& t : tickets) {
      closers.emplace_back([&c, t] { c.close(t); });
    }
    for (auto& th : closers) th.join();
  }
  auto s = c.snapshot();
  EXPECT_EQ(s.iterations, kIterations);
  EXPECT_EQ(s.total.calls, kIterations * kBuckets);
}

} // namespace

namespace {

TEST(Counters, TimingOffCountsBytesButNoTime) {
  Counters c;
  c.set_timing(false);
  iteration(c, {10, 20});
  auto s = c.snapshot();
  EXPECT_EQ(s.iterations, 1);
  EXPECT_EQ(s.total.bytes_in, 30 * 4);
  EXPECT_DOUBLE_EQ(s.total.comm_us, 0.0);
  EXPECT_DOUBLE_EQ(s.total.exposed_comm_us, 0.0);
  c.set_timing(true);
  iteration(c, {10, 20});
  EXPECT_GT(c.snapshot().total.comm_us, 0.0);
}

} // namespace
