#pragma once
// A thread that runs a hook's launches in the order they were posted.
//
// DDP calls a hook on autograd's thread, between the launches of backward's kernels; a hook's
// host work (kernel launches, the collective's bookkeeping: 0.1-0.4 ms per bucket on the GPU
// machine) delays backward whenever the host, not the GPU, sets the pace. Posting that work
// here lets autograd's thread go on. One thread keeps collectives in bucket order on every rank.
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

namespace commtune {

class LaunchThread {
 public:
  LaunchThread();
  // Runs what is still queued, then joins.
  ~LaunchThread();
  LaunchThread(const LaunchThread&) = delete;
  LaunchThread& operator=(const LaunchThread&) = delete;

  // Queues a task. A task must not throw: it reports errors through its own future.
  void post(std::function<void()> task);
  // Returns once every task posted so far has run.
  void drain();

 private:
  void loop();

  std::mutex mutex_;
  std::condition_variable wake_, idle_;
  std::deque<std::function<void()>> tasks_;
  bool busy_ = false;
  bool stop_ = false;
  std::thread thread_;
};

} // namespace commtune
