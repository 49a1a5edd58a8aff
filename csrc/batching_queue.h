// Blocking queues that hand out batches.
//
//   producers --push/enqueue--> [ items (FIFO, at most maximum_queue_size) ] --pop_batch--> consumers
//                                                     between minimum_batch_size and
//                                                     maximum_batch_size items at a time
//
// ItemQueue<T> is the generic part, shared with the DynamicBatcher.
// BatchingQueue stores nests and concatenates each batch along batch_dim; it
// is the learner queue of PolyBeast (rollouts in, [T+1, B, ...] batches out).
//
// Batch sizes count *items* (calls to enqueue), not rows along batch_dim.
// close() is the one way to shut down: it wakes every waiter; producers then
// get ClosedBatchingQueue, consumers get "no more batches". Items still queued
// when the queue closes are dropped.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "nest.h"

namespace beast {

// Raised by enqueue()/compute() on a closed queue (Python:
// libpolybeast.ClosedBatchingQueue, a RuntimeError).
class ClosedBatchingQueue : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct BatchingOptions {
  int64_t minimum_batch_size = 1;
  int64_t maximum_batch_size = 1024;
  // After this long without minimum_batch_size items, a consumer takes
  // whatever is there (at least one item). None: wait for the minimum.
  std::optional<int64_t> timeout_ms;
  // enqueue blocks while this many items wait. None: unbounded.
  std::optional<int64_t> maximum_queue_size;

  void validate() const {
    if (minimum_batch_size < 1) throw std::invalid_argument("minimum_batch_size must be >= 1");
    if (maximum_batch_size < minimum_batch_size) {
      throw std::invalid_argument("maximum_batch_size must be >= minimum_batch_size");
    }
    if (timeout_ms && *timeout_ms < 0) throw std::invalid_argument("timeout_ms must be >= 0");
    if (maximum_queue_size && *maximum_queue_size < 1) {
      throw std::invalid_argument("maximum_queue_size must be >= 1");
    }
  }
};

template <typename T>
class ItemQueue {
 public:
  explicit ItemQueue(BatchingOptions options) : options_(std::move(options)) {
    options_.validate();
  }
  ~ItemQueue() { close(); }
  ItemQueue(const ItemQueue&) = delete;
  ItemQueue& operator=(const ItemQueue&) = delete;

  // Blocks while the queue is full. Throws ClosedBatchingQueue once closed.
  void push(T item) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      while (!closed_ && options_.maximum_queue_size &&
             static_cast<int64_t>(items_.size()) >= *options_.maximum_queue_size) {
        not_full_.wait(lock);
      }
      if (closed_) throw ClosedBatchingQueue("enqueue on a closed queue");
      items_.push_back(std::move(item));
    }
    // notify_all: consumers wait for different conditions (minimum reached,
    // or any item after their timeout), so one wakeup could go to the wrong one.
    not_empty_.notify_all();
  }

  // Blocks until a batch is ready; std::nullopt once the queue is closed.
  std::optional<std::vector<T>> pop_batch() {
    std::vector<T> batch;
    bool more_left = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      auto enough = [this] {
        return closed_ || static_cast<int64_t>(items_.size()) >= options_.minimum_batch_size;
      };
      if (options_.timeout_ms) {
        auto deadline =
            std::chrono::steady_clock::now() + std::chrono::milliseconds(*options_.timeout_ms);
        while (!enough()) {
          if (not_empty_.wait_until(lock, deadline) == std::cv_status::timeout) break;
        }
        while (!closed_ && items_.empty()) not_empty_.wait(lock);  // timed out: any item will do
      } else {
        while (!enough()) not_empty_.wait(lock);
      }
      if (closed_) return std::nullopt;
      int64_t n = std::min<int64_t>(items_.size(), options_.maximum_batch_size);
      for (int64_t i = 0; i < n; ++i) {
        batch.push_back(std::move(items_.front()));
        items_.pop_front();
      }
      more_left = !items_.empty();
    }
    not_full_.notify_all();
    if (more_left) not_empty_.notify_all();
    return batch;
  }

  // Idempotent. Wakes every waiter and drops the items still queued.
  void close() {
    std::deque<T> dropped;  // destroyed after the lock is released
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = true;
      dropped.swap(items_);
    }
    not_full_.notify_all();
    not_empty_.notify_all();
  }

  bool is_closed() const {
    std::lock_guard<std::mutex> lock(mu_);
    return closed_;
  }

  int64_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return items_.size();
  }

 private:
  BatchingOptions options_;  // constant after construction
  mutable std::mutex mu_;
  std::condition_variable not_full_;  // waited on by push
  std::condition_variable not_empty_;  // waited on by pop_batch
  std::deque<T> items_;  // GUARDED_BY(mu_)
  bool closed_ = false;  // GUARDED_BY(mu_)
};

class BatchingQueue {
 public:
  BatchingQueue(int64_t batch_dim, BatchingOptions options, bool check_inputs)
      : batch_dim_(batch_dim), check_inputs_(check_inputs), items_(std::move(options)) {
    if (batch_dim < 0) throw std::invalid_argument("batch_dim must be >= 0");
  }
  ~BatchingQueue() { close(); }

  // Blocks while full. With check_inputs, throws std::invalid_argument if the
  // nest lacks the batch dimension or does not fit the first nest enqueued.
  void enqueue(Nest nest) {
    if (check_inputs_) layout_.check(nest);
    items_.push(std::move(nest));
  }

  // The next batch, concatenated along batch_dim; std::nullopt once closed.
  std::optional<Nest> dequeue_many() {
    std::optional<std::vector<Nest>> batch = items_.pop_batch();
    if (!batch) return std::nullopt;
    return concat(*batch, batch_dim_);
  }

  void close() { items_.close(); }
  bool is_closed() const { return items_.is_closed(); }
  int64_t size() const { return items_.size(); }

 private:
  const int64_t batch_dim_;
  const bool check_inputs_;
  LayoutCheck layout_{batch_dim_};
  ItemQueue<Nest> items_;
};

}  // namespace beast
