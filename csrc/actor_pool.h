// The actor pool: one C++ thread per environment server, over gRPC or, for a
// "raw:" address, a unix socket without gRPC (env_stream.h).
//
//   env server --Step--> actor thread --compute((env_outputs, agent_state))--> DynamicBatcher
//       ^                  |     <------- (agent_outputs, agent_state) -------- (inference thread)
//       +----Action--------+
//                          +--every unroll_length steps: (rollout, initial_agent_state)--> learner queue
//
// Each step is the dict env_outputs + agent_outputs with arrays of shape
// [1, N, ...] ([T=1, B=N, ...]) for a stream of N environments (N=1 unless
// the server sends Step.batch). env_outputs holds whatever named arrays the
// server sends, without knowing their names (Step.batch's entries, or Step's
// fixed fields + Step.extras + last_action), and must include every name in
// env_keys. A rollout stacks unroll_length + 1 steps along dim 0 into
// [T+1, N, ...] and goes to the learner queue as N rollouts [T+1, 1, ...].
// Its last step is step 0 of the next rollout (the overlap that the
// bootstrap needs), and initial_agent_state is the agent state before step 0.
//
// A server that goes away is not an error: the actor logs a line, drops the
// rollout in progress, reconnects (gRPC backoff, 100 ms doubling up to 2 s;
// a raw: address, env_stream.h, is tried every 100 ms)
// and starts over with a fresh agent state. A server that goes silent counts
// as gone: run() cancels a stream that has waited stream_timeout_s for its
// next Step (the wait covers Action write + Step read only, not inference or
// the learner queue, so a slow but live environment is not cut off). The
// "lost the env server" line is logged at most once per actor per 5 s
// (LostLines::kInterval), with the count of lines suppressed since the last.
//
// Progress is a complete rollout, not contact. Fatal errors:
// - no Step for connect_timeout_s from a server that has not yet completed a
//   rollout of this actor (unreachable, or accepts streams but never answers);
// - no Step for reconnect_timeout_s from one that has: a link that went down,
//   a host that reboots. Until then the actor retries (the backoff above)
//   while the other actors go on with their servers;
// - streams that reach the server but keep ending before a rollout is
//   complete for connect_timeout_s since the first contact or the end of the
//   last stream that completed one (such streams reconnect with the backoff,
//   not at once; streams that never reach it are the two cases above);
// - a step without one of env_keys, one with NaN or inf in a float array the
//   server sent (check_finite), or a bad answer from inference: these raise
//   BadStep.
// The first such error closes both queues (so every other thread ends) and
// run() rethrows it, naming the server.
//
// A batched step (Step.batch) may leave out truncated (false) and game_over
// (== done), as a single-environment Step may: servers from before those
// fields still serve.
//
// On a single-environment stream, Action carries the action twice, as
// `action` (int32, for our older servers) and as `nest_action`, a 0-d int64
// array, which is all that TorchBeast's servers read. Batched streams send
// nest_action only, int64 [N]. A float action (a Box action space, [A] per
// environment) travels as nest_action only, the float array itself: [A] for
// one environment, [N, A] for a batch. A single-environment stream's
// last_action is the action the actor sent last (initial_last_action, zeros
// of the right dtype and shape, at the start of a stream): its server does not
// send it.
//
// With envs_per_stream N > 0, every stream asks its server for N environments
// (gRPC metadata "envs-per-stream: N", stream_layout.h), so that servers
// started by hand get the learner's layout; a server started with its own
// --envs_per_stream, or TorchBeast's, may answer with another number. 0 asks
// for nothing (what TorchBeast's actors do).
//
// Servers report their environment restarts in Step.env_errors (cumulative
// per stream); env_errors() sums the increases over all streams.
#pragma once

#include <cxxabi.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "batching_queue.h"
#include "dynamic_batcher.h"
#include "env_stream.h"
#include "nest.h"
#include "stream_layout.h"

namespace beast {

// A step the learner cannot take (a missing env key, a NaN, an array that does
// not fit) or a bad inference answer: run() raises it as libpolybeast.BadStep,
// a RuntimeError, so that Python tells it from a server it cannot reach.
class BadStep : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class ActorPool {
 public:
  ActorPool(int64_t unroll_length, std::shared_ptr<BatchingQueue> learner_queue,
            std::shared_ptr<DynamicBatcher> inference_batcher,
            std::vector<std::string> env_server_addresses, Nest initial_agent_state,
            std::vector<std::string> env_keys, double connect_timeout_s, double stream_timeout_s,
            int64_t envs_per_stream = 0,
            Array initial_last_action = filled_array<int64_t>(dtypes::kInt64, 0, {}),
            TlsConfig tls = {}, double reconnect_timeout_s = 0)
      : unroll_length_(unroll_length),
        learner_queue_(std::move(learner_queue)),
        inference_batcher_(std::move(inference_batcher)),
        addresses_(std::move(env_server_addresses)),
        initial_agent_state_(std::move(initial_agent_state)),
        env_keys_(std::move(env_keys)),
        connect_timeout_(std::chrono::duration<double>(connect_timeout_s)),
        reconnect_timeout_(std::chrono::duration<double>(
            reconnect_timeout_s > 0 ? reconnect_timeout_s : connect_timeout_s)),
        stream_timeout_(std::chrono::duration<double>(stream_timeout_s)),
        envs_per_stream_(envs_per_stream),
        initial_last_action_(std::move(initial_last_action)),
        tls_(std::move(tls)) {
    if (unroll_length_ < 1) throw std::invalid_argument("unroll_length must be >= 1");
    if (!learner_queue_ || !inference_batcher_) {
      throw std::invalid_argument("learner_queue and inference_batcher are required");
    }
    if (!(connect_timeout_s > 0)) throw std::invalid_argument("connect_timeout_s must be > 0");
    if (!(stream_timeout_s > 0)) throw std::invalid_argument("stream_timeout_s must be > 0");
    if (!(reconnect_timeout_s >= 0)) {
      throw std::invalid_argument("reconnect_timeout_s must be >= 0 (0: connect_timeout_s)");
    }
    if (envs_per_stream_ < 0 || envs_per_stream_ > kMaxEnvsPerStream) {
      throw std::invalid_argument("envs_per_stream must be between 0 (ask for nothing) and " +
                                  std::to_string(kMaxEnvsPerStream));
    }
    for (const std::string& key : env_keys_) {
      if (key.empty()) throw std::invalid_argument("env_keys must not contain an empty name");
    }
    tls_.check_client();
    for (const std::string& address : addresses_) {
      if (!is_raw_address(address)) continue;
      raw_socket_address(address);  // throws for a bad one
      if (tls_.enabled()) {
        throw std::invalid_argument("TLS is for gRPC addresses; " + address +
                                    " is a unix socket on this machine");
      }
    }
  }
  // run() has joined every thread before the pool can be destroyed.
  ~ActorPool() { close(); }

  // Runs one actor thread per address and joins them. Returns when the queues
  // or the pool are closed; rethrows the first fatal actor error. Every 100 ms
  // it cancels the streams that have waited stream_timeout_s for a Step, and
  // calls check_interrupt (if given); if that throws, everything is closed and
  // its exception is rethrown after the join.
  void run(const std::function<void()>& check_interrupt = nullptr) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (started_) throw std::runtime_error("ActorPool.run() can only be called once");
      started_ = true;
      running_ = addresses_.size();
    }
    std::vector<std::thread> threads;
    for (size_t i = 0; i < addresses_.size(); ++i) {
      threads.emplace_back(&ActorPool::actor_loop, this, i);
    }
    std::exception_ptr interrupt;
    std::unique_lock<std::mutex> lock(mu_);
    while (running_ > 0) {
      all_done_.wait_for(lock, std::chrono::milliseconds(100));
      cancel_silent_streams();
      lock.unlock();
      // Queues closed from outside: also cancel streams to servers that hang.
      if (stopping()) close();
      if (check_interrupt && !interrupt) {
        try {
          check_interrupt();
        } catch (const abi::__forced_unwind&) {
          // The interpreter is exiting and ends this thread as it takes the
          // GIL. The unwind must go on, but not past joinable threads.
          close_all();
          for (std::thread& thread : threads) thread.join();
          throw;
        } catch (...) {
          interrupt = std::current_exception();
          close_all();
        }
      }
      lock.lock();
    }
    lock.unlock();
    for (std::thread& thread : threads) thread.join();
    if (interrupt) std::rethrow_exception(interrupt);
    lock.lock();
    if (first_error_) std::rethrow_exception(first_error_);
  }

  // Idempotent. Stops the actor threads without closing the queues: streams
  // are cancelled at once; an actor waiting on a queue stops when it returns.
  void close() {
    closed_ = true;
    std::lock_guard<std::mutex> lock(mu_);
    for (StreamWatch& watch : watches_) {
      if (watch.stream) watch.stream->cancel();
    }
  }

  // Environment steps taken by all actors so far.
  int64_t count() const { return count_.load(); }

  // Environment restarts after errors that the env servers reported so far.
  int64_t env_errors() const { return env_errors_.load(); }

 private:
  using Clock = std::chrono::steady_clock;

  // What run() knows of an actor's stream. GUARDED_BY(mu_)
  struct StreamWatch {
    EnvStream* stream = nullptr;  // nullptr between streams
    std::optional<Clock::time_point> waiting_since;  // set while waiting for a Step
    double cancelled_after_s = 0;  // > 0: run() cancelled it after waiting this long
  };

  // Registers the stream of actor `index` so that close() can cancel it, and
  // run() too when a wait for a Step (between waiting(true) and
  // waiting(false)) lasts longer than stream_timeout_s.
  class LiveStream {
   public:
    LiveStream(ActorPool* pool, size_t index, EnvStream* stream) : pool_(pool), index_(index) {
      std::lock_guard<std::mutex> lock(pool_->mu_);
      pool_->watches_[index_] = StreamWatch{stream};
      if (pool_->closed_) stream->cancel();
    }
    ~LiveStream() {
      std::lock_guard<std::mutex> lock(pool_->mu_);
      pool_->watches_[index_] = StreamWatch{};
    }

    void waiting(bool on) {
      std::lock_guard<std::mutex> lock(pool_->mu_);
      pool_->watches_[index_].waiting_since =
          on ? std::optional<Clock::time_point>(Clock::now()) : std::nullopt;
    }

    double cancelled_after_s() const {
      std::lock_guard<std::mutex> lock(pool_->mu_);
      return pool_->watches_[index_].cancelled_after_s;
    }

   private:
    ActorPool* pool_;
    size_t index_;
  };

  // The stream watchdog; run() calls it with mu_ held.
  void cancel_silent_streams() {
    const Clock::time_point now = Clock::now();
    for (StreamWatch& watch : watches_) {
      if (watch.stream && watch.waiting_since && watch.cancelled_after_s == 0 &&
          now - *watch.waiting_since > stream_timeout_) {
        watch.cancelled_after_s = seconds(now - *watch.waiting_since);
        watch.stream->cancel();
      }
    }
  }

  static double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

  static std::string seconds_str(double s) {
    std::ostringstream out;
    out.precision(3);
    out << s << " s";
    return out.str();
  }

  bool stopping() const {
    return closed_ || learner_queue_->is_closed() || inference_batcher_->is_closed();
  }

  void close_all() {
    learner_queue_->close();
    inference_batcher_->close();
    close();
  }

  void log(size_t index, const std::string& message) const {
    std::fprintf(stderr, "[ActorPool] actor %zu (%s): %s\n", index, addresses_[index].c_str(),
                 message.c_str());
  }

  void sleep_unless_stopping(Clock::duration duration) const {
    auto until = Clock::now() + duration;
    while (!stopping() && Clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  // How a stream ended.
  struct StreamEnd {
    std::string why;  // what the transport or the server said, or the stream timeout
    bool timed_out = false;
    int64_t steps = 0;  // Steps received
    int64_t rollouts = 0;  // rollouts completed
    Clock::time_point last_step;  // when the last Step arrived
  };

  // One actor's "lost the env server" lines: at most one per kInterval.
  struct LostLines {
    static constexpr std::chrono::seconds kInterval{5};
    std::optional<Clock::time_point> last_logged;
    int64_t suppressed = 0;
  };

  // Logs `line` unless the last one was less than kInterval ago; says whether it did.
  bool log_lost(size_t index, LostLines* lines, const std::string& line) const {
    const Clock::time_point now = Clock::now();
    if (lines->last_logged && now - *lines->last_logged < LostLines::kInterval) {
      ++lines->suppressed;
      return false;
    }
    std::string text = line;
    if (lines->suppressed > 0) {
      text += " (" + std::to_string(lines->suppressed) + " such line(s) suppressed in the last " +
              seconds_str(seconds(now - *lines->last_logged)) + ")";
    }
    log(index, text);
    lines->last_logged = now;
    lines->suppressed = 0;
    return true;
  }

  // Throws once the actor has gone too long without progress (see the top).
  // progress: the first contact, or the end of the last stream that completed
  // a rollout; early_streams: the streams since then that reached the server
  // but did not; served: whether any stream of this actor completed a rollout.
  void check_progress(Clock::time_point last_contact,
                      const std::optional<Clock::time_point>& progress, int64_t early_streams,
                      const std::string& trouble, bool served) const {
    const Clock::time_point now = Clock::now();
    if (progress && early_streams > 0 && now - *progress > connect_timeout_) {
      throw std::runtime_error("no complete rollout for " + seconds_str(seconds(now - *progress)) +
                               " (connect_timeout_s " + seconds_str(connect_timeout_.count()) +
                               "): " + std::to_string(early_streams) +
                               " stream(s) ended before a rollout of unroll_length " +
                               std::to_string(unroll_length_) +
                               " was complete; the last one: " + trouble);
    }
    const Clock::duration limit =
        std::chrono::duration_cast<Clock::duration>(served ? reconnect_timeout_ : connect_timeout_);
    if (now - last_contact > limit) {
      std::ostringstream message;
      message << "could not reach the env server for " << seconds(limit) << " s";
      if (served) message << " since its last Step (reconnect_timeout_s)";
      if (!trouble.empty()) message << " (last problem: " << trouble << ")";
      throw std::runtime_error(message.str());
    }
  }

  void actor_loop(size_t index) {
    // Counts this thread out however it ends, forced unwinds included.
    struct Ended {
      ActorPool* pool;
      ~Ended() {
        {
          std::lock_guard<std::mutex> lock(pool->mu_);
          --pool->running_;
        }
        pool->all_done_.notify_all();
      }
    } ended{this};
    // "actor-<index>" in top -H, py-spy and bench.cpushare, which split the cores by thread name.
    pthread_setname_np(pthread_self(), ("actor-" + std::to_string(index)).substr(0, 15).c_str());
    try {
      std::unique_ptr<EnvConnection> connection = EnvConnection::create(addresses_[index], tls_);

      Clock::time_point last_contact = Clock::now();  // the last Step received
      std::optional<Clock::time_point> progress;  // see check_progress
      int64_t early_streams = 0;
      Clock::duration backoff = std::chrono::milliseconds(100);
      std::string trouble;  // why the last stream ended; empty before the first
      LostLines lost_lines;
      bool announce = false;  // log "reconnected" when the next stream answers
      bool served = false;  // a stream of this actor has completed a rollout
      while (!stopping()) {
        check_progress(last_contact, progress, early_streams, trouble, served);
        const Clock::time_point started = Clock::now();
        std::unique_ptr<EnvStream> stream = connection->open(envs_per_stream_);
        if (!stream) continue;  // not reachable now; open() waited a little
        StreamEnd end = run_stream(index, stream.get(), announce);
        if (stopping()) break;
        trouble = end.why;
        if (end.steps > 0) {
          last_contact = end.last_step;
          if (!progress) progress = started;
          announce = false;  // run_stream logged "reconnected", if it was to
        }
        if ((end.steps > 0 || end.timed_out) &&
            log_lost(index, &lost_lines, "lost the env server (" + trouble + "); reconnecting")) {
          announce = true;
        }
        if (end.rollouts > 0) {
          progress = Clock::now();
          early_streams = 0;
          served = true;
          backoff = std::chrono::milliseconds(100);
        } else {
          // No rollout is no progress: retry, but not at once. A stream that never got a
          // Step (a link that is down) is no early stream: last_contact covers it.
          if (end.steps > 0) ++early_streams;
          sleep_unless_stopping(backoff);
          backoff = std::min<Clock::duration>(2 * backoff, std::chrono::seconds(2));
        }
      }
    } catch (const abi::__forced_unwind&) {
      close_all();
      throw;
    } catch (const ClosedBatchingQueue&) {
      // The queues were closed: a normal shutdown.
    } catch (const std::invalid_argument& e) {  // what the server sent, or inference
      fail(index, e.what(), /*bad_step=*/true);
    } catch (const std::exception& e) {
      fail(index, e.what());
    } catch (...) {
      fail(index, "unknown error");
    }
  }

  // The first error is the one run() raises; the others are only logged.
  void fail(size_t index, const std::string& what, bool bad_step = false) {
    bool first = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!first_error_) {
        first = true;
        const std::string message = "ActorPool: actor " + std::to_string(index) +
                                    " for env server '" + addresses_[index] + "' failed: " + what;
        first_error_ = bad_step ? std::make_exception_ptr(BadStep(message))
                                : std::make_exception_ptr(std::runtime_error(message));
      }
    }
    if (!first) log(index, "failed too: " + what);
    close_all();
  }

  // Steps one environment (or a batch) over one stream until the stream
  // breaks, and says how it ended. Throws ClosedBatchingQueue on shutdown;
  // other exceptions are fatal.
  StreamEnd run_stream(size_t index, EnvStream* stream, bool announce) {
    StreamEnd end;
    LiveStream live(this, index, stream);
    live.waiting(true);  // the wait for the first Step starts with the stream
    auto finish = [&]() {
      std::string why = stream->finish();
      double waited_s = live.cancelled_after_s();
      if (waited_s > 0) {
        end.timed_out = true;
        end.why = "no Step for " + seconds_str(waited_s) + ", more than stream_timeout_s " +
                  seconds_str(stream_timeout_.count()) + "; cancelled the stream";
      } else {
        end.why = why;
      }
      return end;
    };
    // The wait for a Step, the only time the stream timeout counts.
    auto next_step = [&](const rpcenv::Action* action, rpcenv::Step* step) {
      if (action) live.waiting(true);
      bool ok = (!action || stream->write(*action)) && stream->read(step);
      live.waiting(false);
      if (ok) {
        ++end.steps;
        end.last_step = Clock::now();
      }
      return ok;
    };
    try {
      rpcenv::Step step;
      if (!next_step(nullptr, &step)) return finish();
      if (announce) log(index, "reconnected");

      Nest agent_state;
      int64_t num_envs = 0;  // environments on this stream, known from the first step
      Array last_action = initial_last_action_;  // single-environment streams only
      int64_t env_errors_seen = 0;  // this stream's Step.env_errors at the previous step
      std::vector<Nest> rollout;  // rollout[0] is the last step of the previous rollout
      Nest rollout_state;  // the agent state before rollout[0]
      while (true) {
        // A new stream starts from 0, so its first value counts too.
        if (step.env_errors() > env_errors_seen) {
          env_errors_.fetch_add(step.env_errors() - env_errors_seen);
        }
        env_errors_seen = step.env_errors();
        const bool batched = step.has_batch();
        Nest env_outputs = batched ? batch_env_outputs(&step) : env_outputs_of(&step, last_action);
        check_env_keys(env_outputs);
        check_finite(env_outputs, /*last_action_is_ours=*/!batched);
        int64_t n = batch_size(env_outputs, 1);
        if (num_envs == 0) {
          num_envs = n;
          agent_state = repeated(initial_agent_state_, num_envs);
          // The server's own layout wins over the ask; say so once, so that the learner's
          // --envs_per_stream is not taken silently for the one in use.
          if (envs_per_stream_ > 0 && n != envs_per_stream_ && !told_layout_.exchange(true)) {
            log(index, "the server hosts " + std::to_string(n) +
                           " environment(s) a stream, where " + std::to_string(envs_per_stream_) +
                           " were asked for (a server's own --envs_per_stream wins; said once)");
          }
        } else if (n != num_envs) {
          throw std::runtime_error(
              "the env server changed the number of environments on a "
              "stream from " +
              std::to_string(num_envs) + " to " + std::to_string(n));
        }
        Nest answer = inference_batcher_->compute(Nest::tuple({env_outputs, agent_state}));
        const Nest* agent_outputs = check_answer(answer);
        if (rollout.empty()) rollout_state = agent_state;
        rollout.push_back(merged(env_outputs, *agent_outputs));
        if (static_cast<int64_t>(rollout.size()) == unroll_length_ + 1) {
          enqueue_rollouts(concat(rollout, 0), rollout_state, num_envs);
          ++end.rollouts;
          rollout.erase(rollout.begin(), rollout.end() - 1);
          rollout_state = agent_state;  // still the state before the overlapping step
        }
        rpcenv::Action action;
        const Array& actions = agent_outputs->fields.at("action").array;
        if (batched) {
          Array flat = actions;  // [T=1, N, ...] -> [N, ...]; shares the bytes
          if (flat.shape.empty()) throw std::invalid_argument("agent output 'action' is 0-d");
          flat.shape.erase(flat.shape.begin());
          nest_to_proto(Nest::of(std::move(flat)), action.mutable_nest_action());
        } else if (is_integer_dtype(actions.dtype)) {
          // TorchBeast's servers read only nest_action (and call int() on it);
          // ours, and older clients', read `action`.
          int64_t value = to_int64(actions, "agent output 'action'");
          action.set_action(static_cast<int32_t>(value));
          last_action = filled_array<int64_t>(dtypes::kInt64, value, {});
          nest_to_proto(Nest::of(last_action), action.mutable_nest_action());
        } else {
          // A continuous action: [T=1, B=1, A] -> [A], sent as it is.
          last_action = actions;
          if (last_action.shape.size() < 2) {
            throw std::invalid_argument("agent output 'action' must be [T=1, B=1, ...], got " +
                                        shape_str(actions.shape));
          }
          last_action.shape.erase(last_action.shape.begin(), last_action.shape.begin() + 2);
          nest_to_proto(Nest::of(last_action), action.mutable_nest_action());
        }
        agent_state = std::move(answer.items[1]);

        if (!next_step(&action, &step)) return finish();
        count_.fetch_add(num_envs);
      }
    } catch (...) {  // rethrows everything, forced unwinds included
      stream->cancel();
      stream->finish();
      throw;
    }
  }

  // NumPy's integer type numbers (int8 to uint64): a discrete action.
  static bool is_integer_dtype(int dtype) { return dtype >= 1 && dtype <= 10; }

  // The learner queue takes one rollout [T+1, 1, ...] per environment, so
  // that --batch_size counts rollouts whatever the servers' batch sizes.
  void enqueue_rollouts(const Nest& rollouts, const Nest& initial_states, int64_t num_envs) {
    if (num_envs == 1) {
      learner_queue_->enqueue(Nest::tuple({rollouts, initial_states}));
      return;
    }
    std::vector<int64_t> ones(num_envs, 1);
    std::vector<Nest> parts = split(rollouts, ones, 1);
    std::vector<Nest> states = split(initial_states, ones, 1);
    for (int64_t j = 0; j < num_envs; ++j) {
      learner_queue_->enqueue(Nest::tuple({std::move(parts[j]), std::move(states[j])}));
    }
  }

  // The agent state of one environment ([layers, 1, ...]) repeated for n.
  static Nest repeated(const Nest& state, int64_t n) {
    if (n == 1) return state;
    return concat(std::vector<const Nest*>(n, &state), 1);
  }

  // The inference thread must answer (agent_outputs, agent_state) with an
  // "action" among the agent outputs.
  static const Nest* check_answer(const Nest& answer) {
    bool ok = (answer.kind == Nest::Kind::kTuple || answer.kind == Nest::Kind::kList) &&
              answer.items.size() == 2 && answer.items[0].kind == Nest::Kind::kDict &&
              answer.items[0].fields.count("action") &&
              answer.items[0].fields.at("action").kind == Nest::Kind::kArray;
    if (!ok) {
      throw std::invalid_argument(
          "inference must answer (agent_outputs, agent_state) where agent_outputs is a dict "
          "with an 'action' array");
    }
    return &answer.items[0];
  }

  static Nest merged(const Nest& env_outputs, const Nest& agent_outputs) {
    Nest step = env_outputs;
    for (const auto& [key, value] : agent_outputs.fields) {
      if (!step.fields.emplace(key, value).second) {
        throw std::invalid_argument("agent output '" + key + "' has the name of an env output");
      }
    }
    return step;
  }

  // The inference inputs of a stream of N environments: Step.batch's arrays,
  // [N, ...] each, become [1, N, ...] ([T=1, B=N]). As in the single-
  // environment format, a server that sends no truncated (one from before the
  // field) cuts no episode short, and one without game_over ends its games at
  // every done.
  static Nest batch_env_outputs(rpcenv::Step* step) {
    Nest batch = nest_from_proto(step->mutable_batch(), "batch");
    if (batch.kind != Nest::Kind::kDict) {
      throw std::invalid_argument("Step.batch must be a dict of arrays");
    }
    for (auto& [key, value] : batch.fields) {
      if (value.kind != Nest::Kind::kArray || value.array.shape.empty()) {
        throw std::invalid_argument("Step.batch entry '" + key +
                                    "' must be an array with a leading batch dimension");
      }
      value.array.shape.insert(value.array.shape.begin(), 1);
    }
    auto done = batch.fields.find("done");
    if (done != batch.fields.end()) {
      const std::vector<int64_t> shape = {1, done->second.array.shape[1]};
      batch.fields.emplace("truncated", Nest::of(filled_array<bool>(dtypes::kBool, false, shape)));
      batch.fields.emplace("game_over", done->second);  // shares the bytes
    }
    return batch;
  }

  // Every float array the server sent must be finite: a NaN reward makes NaN
  // logits (the model takes the reward) and a NaN episode_return logs NaN.
  // A single-environment stream's last_action is not the server's but ours.
  // The reward first: a NaN there makes the episode_return NaN too.
  static void check_finite(const Nest& env_outputs, bool last_action_is_ours) {
    auto reward = env_outputs.fields.find("reward");
    if (reward != env_outputs.fields.end()) check_finite(reward->first, reward->second);
    for (const auto& [key, value] : env_outputs.fields) {
      if (!(last_action_is_ours && key == "last_action")) check_finite(key, value);
    }
  }

  static void check_finite(const std::string& key, const Nest& value) {
    if (value.kind != Nest::Kind::kArray) return;
    const Array& a = value.array;
    std::optional<int64_t> bad = first_not_finite(a);
    if (!bad) return;
    // Arrays are [T=1, N, ...]: the element's environment is its index along N.
    const int64_t n = a.shape.size() > 1 ? a.shape[1] : 1;
    const int64_t per_env = n > 0 ? a.numel() / n : 1;
    const int64_t env = per_env > 0 ? *bad / per_env : 0;
    throw std::invalid_argument(
        "the env server sent a '" + key + "' with NaN or inf in it (environment " +
        std::to_string(env) + " of " + std::to_string(n) + " on the stream: " +
        element_str(a, *bad) + "); the environment, or a wrapper of it, made it. The learner " +
        "takes finite values only: fix the environment so that its rewards and observations " +
        "stay finite");
  }

  // The flat index of the first NaN or inf of a float array; nullopt if none
  // (or not a float array). Elements are copied out: the bytes of a proto need
  // not be aligned.
  static std::optional<int64_t> first_not_finite(const Array& a) {
    const int64_t count = a.numel();
    const char* bytes = a.bytes();
    if (a.dtype == 11) {  // float32
      for (int64_t i = 0; i < count; ++i) {
        float x;
        std::memcpy(&x, bytes + i * sizeof(x), sizeof(x));
        if (!std::isfinite(x)) return i;
      }
    } else if (a.dtype == 12) {  // float64
      for (int64_t i = 0; i < count; ++i) {
        double x;
        std::memcpy(&x, bytes + i * sizeof(x), sizeof(x));
        if (!std::isfinite(x)) return i;
      }
    } else if (a.dtype == 23) {  // float16: all exponent bits set is inf or NaN
      for (int64_t i = 0; i < count; ++i) {
        uint16_t x;
        std::memcpy(&x, bytes + i * sizeof(x), sizeof(x));
        if ((x & 0x7C00) == 0x7C00) return i;
      }
    }
    return std::nullopt;
  }

  // Element i of a float array that first_not_finite found: "nan", "inf" or "-inf".
  static std::string element_str(const Array& a, int64_t i) {
    double x;
    if (a.dtype == 11) {
      float f;
      std::memcpy(&f, a.bytes() + i * sizeof(f), sizeof(f));
      x = f;
    } else if (a.dtype == 12) {
      std::memcpy(&x, a.bytes() + i * sizeof(x), sizeof(x));
    } else {
      uint16_t h;
      std::memcpy(&h, a.bytes() + i * sizeof(h), sizeof(h));
      x = (h & 0x03FF) ? NAN : ((h & 0x8000) ? -INFINITY : INFINITY);
    }
    return std::isnan(x) ? "nan" : (x > 0 ? "inf" : "-inf");
  }

  // Every step must carry the env keys of the run, and may carry more.
  void check_env_keys(const Nest& env_outputs) const {
    std::string missing;
    for (const std::string& key : env_keys_) {
      if (!env_outputs.fields.count(key)) missing += (missing.empty() ? "'" : ", '") + key + "'";
    }
    if (missing.empty()) return;
    std::string sent;
    for (const auto& [key, value] : env_outputs.fields) sent += (sent.empty() ? "" : ", ") + key;
    throw std::invalid_argument("the env server sent a step without the env key(s) " + missing +
                                " (it sent: " + sent +
                                "); the environment side must return "
                                "every one of env_keys");
  }

  // The inference inputs for one step, each array [1, 1, ...] ([T=1, B=1]).
  // An array observation becomes "frame"; a dict observation (a Gymnasium
  // Dict, as a map) one array "frame/<key>" per entry (beast/rollout.py
  // OBSERVATION_PREFIX); Step.extras' entries keep their names.
  static Nest env_outputs_of(rpcenv::Step* step, const Array& last_action) {
    auto leading_ones = [](Nest n, const std::string& what) {
      if (n.kind != Nest::Kind::kArray) throw std::invalid_argument(what + " must be an array");
      n.array.shape.insert(n.array.shape.begin(), {1, 1});
      return n;
    };
    const std::vector<int64_t> one{1, 1};
    Nest out = Nest::dict({});
    auto& f = out.fields;
    Nest observation = nest_from_proto(step->mutable_observation(), "observation");
    if (observation.kind == Nest::Kind::kArray) {
      f["frame"] = leading_ones(std::move(observation), "the observation");
    } else if (observation.kind == Nest::Kind::kDict) {
      for (auto& [key, value] : observation.fields) {
        f[kObservationPrefix + key] =
            leading_ones(std::move(value), "observation entry '" + key + "'");
      }
    } else {
      throw std::invalid_argument("the observation must be an array or a dict of arrays");
    }
    auto put = [&f](const std::string& key, Array a) {
      if (!f.emplace(key, Nest::of(std::move(a))).second) {
        throw std::invalid_argument("observation entry '" + key + "' clashes with a step field");
      }
    };
    bool game_over = step->has_game_over() ? step->game_over() : step->done();
    put("reward", filled_array<float>(dtypes::kFloat32, step->reward(), one));
    put("done", filled_array<bool>(dtypes::kBool, step->done(), one));
    put("game_over", filled_array<bool>(dtypes::kBool, game_over, one));
    put("truncated", filled_array<bool>(dtypes::kBool, step->truncated(), one));
    put("episode_return", filled_array<float>(dtypes::kFloat32, step->episode_return(), one));
    put("episode_step", filled_array<int32_t>(dtypes::kInt32, step->episode_step(), one));
    Array last = last_action;  // shares the bytes
    last.shape.insert(last.shape.begin(), {1, 1});
    put("last_action", std::move(last));
    if (step->has_extras()) {
      rpcenv::ArrayNest* extras = step->mutable_extras();
      if (extras->has_array() || extras->vector_size() > 0) {
        throw std::invalid_argument("Step.extras must be a map of name -> array");
      }
      for (auto& [key, value] : *extras->mutable_map()) {
        const std::string where = "Step.extras entry '" + key + "'";
        if (f.count(key)) {
          throw std::invalid_argument(where +
                                      " clashes with the step field of that name (a "
                                      "fixed Step field or an observation entry)");
        }
        f[key] = leading_ones(nest_from_proto(&value, "extras['" + key + "']"), where);
      }
    }
    return out;
  }

  const int64_t unroll_length_;
  const std::shared_ptr<BatchingQueue> learner_queue_;
  const std::shared_ptr<DynamicBatcher> inference_batcher_;
  const std::vector<std::string> addresses_;
  const Nest initial_agent_state_;
  const std::vector<std::string> env_keys_;  // names every env step must carry
  const std::chrono::duration<double> connect_timeout_;
  const std::chrono::duration<double> reconnect_timeout_;
  const std::chrono::duration<double> stream_timeout_;
  const int64_t envs_per_stream_;  // asked of every server; 0: ask for nothing
  const Array initial_last_action_;  // a single-environment stream's first last_action
  const TlsConfig tls_;  // for gRPC addresses; empty: plain gRPC

  std::atomic<int64_t> count_{0};
  std::atomic<int64_t> env_errors_{0};  // sum over streams of Step.env_errors' increases
  std::atomic<bool> closed_{false};
  std::atomic<bool> told_layout_{false};  // a stream's size other than envs_per_stream_ was logged
  mutable std::mutex mu_;
  std::condition_variable all_done_;  // signalled when an actor thread ends
  bool started_ = false;  // GUARDED_BY(mu_)
  size_t running_ = 0;  // GUARDED_BY(mu_); actor threads not yet ended
  std::exception_ptr first_error_;  // GUARDED_BY(mu_)
  std::vector<StreamWatch> watches_ =
      std::vector<StreamWatch>(addresses_.size());  // GUARDED_BY(mu_); one per actor
};

}  // namespace beast
