// Dynamic batching of inference requests.
//
//   actor threads --compute(inputs)--> [ requests ] --next_batch--> inference thread
//        ^ blocked                                                   | get_inputs(): concatenated
//        +---------- own slice along batch_dim <---- set_outputs(outputs)
//
// Every caller of compute() blocks until the inference thread answers the
// Batch its request went into, then gets back its own rows of the outputs.
// A caller never hangs: a Batch destroyed without set_outputs (the inference
// thread raised), outputs whose batch size does not fit, and close() all turn
// into exceptions in the waiting callers.
#pragma once

#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "batching_queue.h"
#include "nest.h"

namespace beast {

class DynamicBatcher {
 private:
  struct Request {
    Nest inputs;
    int64_t rows = 0;  // size of inputs along batch_dim
    std::promise<Nest> outputs;
  };

 public:
  // The requests that went into one batch; answer them with set_outputs.
  class Batch {
   public:
    Batch(int64_t batch_dim, bool check_outputs, std::vector<std::unique_ptr<Request>> requests)
        : batch_dim_(batch_dim), check_outputs_(check_outputs), requests_(std::move(requests)) {
      std::vector<const Nest*> parts;
      for (const auto& request : requests_) parts.push_back(&request->inputs);
      try {
        inputs_ = concat(parts, batch_dim_);
      } catch (const std::exception& e) {
        fail_all(std::make_exception_ptr(std::runtime_error(e.what())));
        throw;
      }
    }

    // A Batch dropped unanswered fails its callers instead of leaving them blocked.
    ~Batch() {
      if (!answered_) {
        fail_all(std::make_exception_ptr(std::runtime_error(
            "DynamicBatcher: the batch was dropped without set_outputs (did the inference "
            "thread fail?)")));
      }
    }
    Batch(const Batch&) = delete;
    Batch& operator=(const Batch&) = delete;

    const Nest& inputs() const { return inputs_; }

    // Splits `outputs` along batch_dim and answers every caller. If they do
    // not fit, the callers get a RuntimeError, and with check_outputs this
    // also throws std::invalid_argument here.
    void set_outputs(const Nest& outputs) {
      if (answered_) throw std::runtime_error("set_outputs was already called on this batch");
      answered_ = true;
      std::vector<int64_t> sizes;
      for (const auto& request : requests_) sizes.push_back(request->rows);
      std::vector<Nest> parts;
      try {
        parts = split(outputs, sizes, batch_dim_);
      } catch (const std::invalid_argument& e) {
        fail_all(std::make_exception_ptr(std::runtime_error(
            std::string("DynamicBatcher: bad outputs from inference: ") + e.what())));
        if (check_outputs_) throw;
        return;
      }
      for (size_t i = 0; i < requests_.size(); ++i) {
        requests_[i]->outputs.set_value(std::move(parts[i]));
      }
    }

   private:
    void fail_all(std::exception_ptr error) {
      for (auto& request : requests_) request->outputs.set_exception(error);
    }

    const int64_t batch_dim_;
    const bool check_outputs_;
    std::vector<std::unique_ptr<Request>> requests_;
    Nest inputs_;
    bool answered_ = false;  // touched only by the thread holding the Batch (Python: GIL)
  };

  DynamicBatcher(int64_t batch_dim, BatchingOptions options, bool check_outputs)
      : batch_dim_(batch_dim), check_outputs_(check_outputs), requests_(std::move(options)) {
    if (batch_dim < 0) throw std::invalid_argument("batch_dim must be >= 0");
  }
  ~DynamicBatcher() { close(); }

  // Blocks until the inference thread answers. Throws std::invalid_argument
  // for inputs that do not fit the first ones, ClosedBatchingQueue if the
  // batcher closes first, std::runtime_error if the batch failed.
  Nest compute(Nest inputs) {
    layout_.check(inputs);
    auto request = std::make_unique<Request>();
    request->rows = batch_size(inputs, batch_dim_);
    if (request->rows < 0) throw std::invalid_argument("compute: the inputs hold no arrays");
    request->inputs = std::move(inputs);
    std::future<Nest> outputs = request->outputs.get_future();
    requests_.push(std::move(request));
    try {
      return outputs.get();
    } catch (const std::future_error&) {
      // The request was still queued when close() dropped it.
      throw ClosedBatchingQueue("DynamicBatcher was closed before answering");
    }
  }

  // The next batch; std::nullopt once closed.
  std::unique_ptr<Batch> next_batch() {
    std::optional<std::vector<std::unique_ptr<Request>>> requests = requests_.pop_batch();
    if (!requests) return nullptr;
    return std::make_unique<Batch>(batch_dim_, check_outputs_, std::move(*requests));
  }

  // Idempotent. Callers whose requests are still queued get ClosedBatchingQueue;
  // batches already handed out can still be answered.
  void close() { requests_.close(); }
  bool is_closed() const { return requests_.is_closed(); }
  int64_t size() const { return requests_.size(); }

 private:
  const int64_t batch_dim_;
  const bool check_outputs_;
  LayoutCheck layout_{batch_dim_};
  ItemQueue<std::unique_ptr<Request>> requests_;
};

}  // namespace beast
