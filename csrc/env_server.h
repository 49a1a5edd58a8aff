// The environment server: serves Python environments over gRPC, or, at a
// "raw:PATH" address, over a unix socket without gRPC (raw_socket.h: the same
// messages and the same Session, for a learner on this machine).
//
//   actor (client) --Action--> gRPC thread --env.step(action) (GIL)--> Python adapter
//                  <--Step---             <-- dict(frame, reward, done, ...) --+
//
// One adapter per stream: a new stream calls env_factory() for a fresh
// adapter (with .initial(), .step(action) and optionally .close()), sends
// initial(), then answers every Action with step(action). A client that asks
// for N environments per stream (metadata "envs-per-stream: N", see
// stream_layout.h; our ActorPool does, TorchBeast's actors do not) gets
// env_factory(N) instead; a request outside [1, 4096] ends the stream with
// INVALID_ARGUMENT. An adapter that
// raises in step() is closed and replaced by a new one (from the same call),
// whose initial step goes out with done=True, so one bad episode does not end
// the stream.
// Every Step carries env_errors, the restarts on this stream so far.
//
// A single-environment adapter's dict fills Step's fixed fields (frame ->
// observation, reward, done, game_over, episode_return, episode_step; the
// actor knows last_action) and every other key travels in Step.extras under
// its own name, so a new environment-side rollout field needs no C++ change.
// A Dict observation's entries (keys "frame/<entry>") travel as the
// observation's map {entry: array}.
//
// An adapter with a `num_envs` attribute hosts a batch of environments (a
// beast.vector_envs VectorEnv): its dicts of [N, ...] arrays travel as
// Step.batch, whatever their names, and step() gets the int64 array of N
// actions (float [N, A] for a Box action space). Its own `restarts` attribute, if any (the environments it
// restarted itself), adds to env_errors.
//
// With a TlsConfig (tls.h) a gRPC address serves TLS: the server's certificate, and with
// root_certs only clients whose certificate that CA signed. Without one, plain gRPC.
//
// An address in use is refused: TCP ports are bound without SO_REUSEPORT
// (gRPC's default would let a second server share the port and split the
// connections), and a unix socket file that accepts connections is not
// replaced (gRPC would unlink it and take over); a stale one is.
//
// A client that dies or drops off the network mid-stream is noticed by HTTP/2
// keepalive: a client with open streams is pinged every keepalive_s, and one
// that does not answer within keepalive_s is dropped, ending its streams and
// closing their environments. A live client that is slow to send its next
// Action (a busy learner) answers pings, and is waited for. On a raw: address
// the client is on this machine: when it dies its socket closes, which ends
// the stream at once, so keepalive_s does not apply there.
//
// gRPC threads take the GIL only around Python calls and drop every Python
// object while holding it. Stop the server (stop() / leaving run()) before
// the interpreter exits: gRPC's handler threads end on a catch (...) of their
// own, which a thread that the exiting interpreter ends cannot pass.
#pragma once

#include <cxxabi.h>
#include <errno.h>
#include <grpcpp/grpcpp.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <pybind11/pybind11.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "nest.h"
#include "raw_socket.h"
#include "rpcenv.grpc.pb.h"
#include "stream_layout.h"
#include "tls.h"

namespace beast {

class EnvServer {
 public:
  EnvServer(py::object env_factory, std::string address, double keepalive_s = 10.0,
            TlsConfig tls = {})
      : env_factory_(std::move(env_factory)),
        address_(std::move(address)),
        keepalive_ms_(static_cast<int>(keepalive_s * 1000)),
        tls_(std::move(tls)) {
    if (!(keepalive_s >= 0.001 && keepalive_s <= 86400)) {
      throw std::invalid_argument("keepalive_s must be between 0.001 and 86400");
    }
    tls_.check_server();
    if (tls_.enabled() && is_raw_address(address_)) {
      throw std::invalid_argument("TLS is for gRPC addresses; " + address_ +
                                  " is a unix socket on this machine");
    }
  }
  // Called with the GIL held; run() cannot be active (it holds a reference).
  ~EnvServer() { stop(); }

  // Serves until stop(). Returns at once if stop() came first. Raises if the
  // address is in use or cannot be bound. Calls on_listening (if given) once
  // it listens, and check_interrupt (if given) every 100 ms; if either throws,
  // the server stops and its exception is rethrown.
  void run(const std::function<void()>& check_interrupt = nullptr,
           const std::function<void()>& on_listening = nullptr) {
    if (is_raw_address(address_)) {
      RawServing serving(this);  // listens now, or throws
      if (on_listening) on_listening();  // on a throw, ~RawServing stops serving
      wait_for_stop(check_interrupt, [&serving]() { serving.stop(); });
      return;
    }
    const std::string in_use = "EnvServer: address in use: " + address_ +
                               "; another env server listens there? stop it or pick another "
                               "address";
    if (address_.rfind("unix:", 0) == 0) {
      // gRPC unlinks an existing socket file before binding to its path.
      if (accepts_connections(address_)) throw std::runtime_error(in_use);
      // Said here, in one line: gRPC's own error for it is a page of its log.
      std::string problem = socket_directory_problem(address_);
      if (!problem.empty()) {
        throw std::runtime_error("EnvServer: could not listen on '" + address_ + "': " + problem);
      }
    }
    grpc::ServerBuilder builder;
    builder.AddListeningPort(address_, server_credentials(tls_));
    builder.RegisterService(&service_);
    builder.SetMaxReceiveMessageSize(-1);
    builder.SetMaxSendMessageSize(-1);
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, keepalive_ms_);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, keepalive_ms_);
    // Keep pinging while a stream waits for its client (no data either way).
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    if (!server) {
      if (accepts_connections(address_)) throw std::runtime_error(in_use);
      throw std::runtime_error(
          "EnvServer: could not listen on '" + address_ +
          (tls_.enabled() ? "' (address in use, bad address, or a TLS certificate and key "
                            "that gRPC cannot read or that do not match?)"
                          : "' (address in use, bad address, or directory not writable?)"));
    }
    // Streams wait on their clients; the deadline cancels them.
    auto shutdown = [&server]() {
      server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
      server->Wait();
    };
    if (on_listening) {
      try {
        on_listening();
      } catch (...) {
        shutdown();
        throw;
      }
    }
    wait_for_stop(check_interrupt, shutdown);
  }

  // Idempotent; run() returns soon after.
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_requested_ = true;
    }
    stop_cv_.notify_all();
  }

  const std::string& address() const { return address_; }

 private:
  // Waits for stop() or an exception from check_interrupt (called every 100
  // ms), then calls shutdown() and rethrows that exception, if any.
  void wait_for_stop(const std::function<void()>& check_interrupt,
                     const std::function<void()>& shutdown) {
    std::exception_ptr interrupt;
    {
      std::unique_lock<std::mutex> lock(mu_);
      while (!stop_requested_) {
        stop_cv_.wait_for(lock, std::chrono::milliseconds(100));
        if (check_interrupt && !stop_requested_) {
          lock.unlock();
          try {
            check_interrupt();
          } catch (const abi::__forced_unwind&) {
            // The interpreter is exiting and ends this thread as it takes the
            // GIL; ~Server would wait for the streams forever.
            shutdown();
            throw;
          } catch (...) {
            interrupt = std::current_exception();
          }
          lock.lock();
          if (interrupt) break;
        }
      }
    }
    shutdown();
    if (interrupt) std::rethrow_exception(interrupt);
  }

  // Why no socket file can be made at a "unix:PATH" address (its directory is
  // missing or not writable); empty when one can, or the address is not one.
  static std::string socket_directory_problem(const std::string& address) {
    std::string path = address.substr(5);
    if (path.rfind("//", 0) == 0) path = path.substr(2);
    size_t slash = path.rfind('/');
    std::string directory = slash == std::string::npos ? "." : path.substr(0, slash);
    if (directory.empty()) directory = "/";
    struct stat st;
    if (::stat(directory.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      return "the directory " + directory + " does not exist; create it or pick another path";
    }
    if (::access(directory.c_str(), W_OK | X_OK) != 0) {
      return "the directory " + directory + " is not writable; pick another path";
    }
    return "";
  }

  // Whether something accepts a connection at `address` ("unix:PATH",
  // "unix://PATH" or "HOST:PORT"); false for an address it cannot parse.
  static bool accepts_connections(const std::string& address) {
    if (address.rfind("unix:", 0) == 0) {
      std::string path = address.substr(5);
      if (path.rfind("//", 0) == 0) path = path.substr(2);
      sockaddr_un addr{};
      if (path.empty() || path.size() >= sizeof(addr.sun_path)) return false;
      addr.sun_family = AF_UNIX;
      std::memcpy(addr.sun_path, path.data(), path.size());
      int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      if (fd < 0) return false;
      int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
      int error = errno;
      ::close(fd);
      // EAGAIN: a listener whose backlog is full.
      return rc == 0 || error == EAGAIN;
    }
    size_t colon = address.rfind(':');
    if (colon == std::string::npos || colon == 0) return false;
    std::string host = address.substr(0, colon), port = address.substr(colon + 1);
    if (host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (getaddrinfo(host.c_str(), port.c_str(), &hints, &found) != 0) return false;
    bool accepted = false;
    for (addrinfo* a = found; a && !accepted; a = a->ai_next) {
      int fd =
          ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
      if (fd < 0) continue;
      if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
        accepted = true;
      } else if (errno == EINPROGRESS) {
        pollfd p{fd, POLLOUT, 0};
        int error = 0;
        socklen_t length = sizeof(error);
        accepted = ::poll(&p, 1, 1000) == 1 &&
                   getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) == 0 && error == 0;
      }
      ::close(fd);
    }
    freeaddrinfo(found);
    return accepted;
  }

  // One Python adapter; every method takes the GIL itself. A Session lives on
  // one thread, its stream's, from start to end.
  class Session {
    // This thread's Python thread state, kept for the whole stream (declared
    // first: made before and freed after everything else). Without it every
    // call would make and free one, and CPython 3.11 takes its runtime lock for
    // that without the GIL: a fork() at that moment in another thread (a
    // subprocess with preexec_fn, a forked actor) copies the lock held, and
    // the child blocks on it forever before it can exec.
    py::gil_scoped_acquire thread_state_;
    py::gil_scoped_release gil_released_;  // keeps the thread state

   public:
    // envs_per_stream: what the client asked for; nullopt if it did not ask.
    Session(EnvServer* server, std::optional<int64_t> envs_per_stream)
        : server_(server), envs_per_stream_(envs_per_stream) {
      py::gil_scoped_acquire gil;
      env_ = new_env();
      batched_ = py::hasattr(env_, "num_envs");
    }
    ~Session() {
      py::gil_scoped_acquire gil;
      close_env();
    }

    void initial(rpcenv::Step* step) {
      py::gil_scoped_acquire gil;
      fill(env_.attr("initial")(), step);
    }

    void step(rpcenv::Action* action, rpcenv::Step* step) {
      py::gil_scoped_acquire gil;
      try {
        // Our actors send a single environment's action twice: `action` (an
        // int for the adapter) and nest_action (for TorchBeast's servers); a
        // float action (a Box action space, [A]) as nest_action only.
        bool use_nest = action->has_nest_action() && (batched_ || !action->has_action());
        py::object a = use_nest ? nest_to_python(nest_from_proto(action->mutable_nest_action()))
                                : py::int_(action->action());
        fill(env_.attr("step")(a), step);
      } catch (const std::exception& e) {  // py::error_already_set included
        server_->log(std::string("the environment failed in step(), restarting it: ") + e.what());
        // The replacement counts its own restarts from 0; keep the old ones.
        restarts_ += 1 + adapter_restarts();
        close_env();
        env_ = new_env();
        step->Clear();
        fill(env_.attr("initial")(), step);
        if (!batched_) step->set_done(true);  // a batch's initial() says done itself
      }
    }

   private:
    py::object new_env() {  // GIL held
      return envs_per_stream_ ? server_->env_factory_(*envs_per_stream_) : server_->env_factory_();
    }

    void close_env() {  // GIL held
      try {
        if (env_ && py::hasattr(env_, "close")) env_.attr("close")();
      } catch (const std::exception& e) {
        server_->log(std::string("the environment failed in close(): ") + e.what());
      }
      env_ = py::object();
    }

    void fill(py::handle result, rpcenv::Step* step) {  // GIL held
      if (batched_) {
        nest_to_proto(nest_from_python(result, "batch"), step->mutable_batch());
      } else {
        fill_step(result, step);
      }
      step->set_env_errors(restarts_ + adapter_restarts());
    }

    // The environments a batched adapter restarted itself (GymnasiumVectorEnv
    // keeps `restarts`); 0 for an adapter without the attribute.
    int64_t adapter_restarts() const {  // GIL held
      if (!batched_ || !env_ || !py::hasattr(env_, "restarts")) return 0;
      try {
        return py::cast<int64_t>(env_.attr("restarts"));
      } catch (const py::cast_error&) {
        throw std::invalid_argument("the adapter's `restarts` attribute must be an int");
      }
    }

    // result: a dict with frame, reward, done, game_over and truncated (optional),
    // episode_return and episode_step for Step's fixed fields; every other key
    // but last_action goes into Step.extras, its value an array or a scalar.
    // A Dict observation comes as "frame/<entry>" keys instead of frame and
    // goes out as Step.observation's map {entry: array} (stream_layout.h).
    static void fill_step(py::handle result, rpcenv::Step* step) {
      if (!py::isinstance<py::dict>(result)) {
        std::string type_name = py::str(py::type::handle_of(result).attr("__name__"));
        throw std::invalid_argument("initial() and step() must return a dict, got a " + type_name);
      }
      py::dict d = py::reinterpret_borrow<py::dict>(result);
      auto get = [&d](const char* key) -> py::object {
        if (!d.contains(key)) {
          throw std::invalid_argument(std::string("the adapter's step dict lacks '") + key + "'");
        }
        return d[key];
      };
      const bool array_observation = d.contains("frame");
      if (array_observation) {
        nest_to_proto(nest_from_python(d["frame"], "['frame']"), step->mutable_observation());
      }
      step->set_reward(py::cast<float>(get("reward")));
      step->set_done(py::cast<bool>(get("done")));
      if (d.contains("game_over")) step->set_game_over(py::cast<bool>(d["game_over"]));
      if (d.contains("truncated")) step->set_truncated(py::cast<bool>(d["truncated"]));
      step->set_episode_return(py::cast<float>(get("episode_return")));
      step->set_episode_step(py::cast<int32_t>(get("episode_step")));
      static const std::vector<std::string> not_extras = {
          "frame",     "reward",         "done",         "game_over",
          "truncated", "episode_return", "episode_step", "last_action"};
      for (auto [key, value] : d) {
        if (!py::isinstance<py::str>(key)) {
          throw std::invalid_argument("the adapter's step dict has a key that is not a str");
        }
        std::string name = key.cast<std::string>();
        if (std::find(not_extras.begin(), not_extras.end(), name) != not_extras.end()) continue;
        Nest extra = nest_from_python(value, "['" + name + "']");
        if (extra.kind != Nest::Kind::kArray) {
          throw std::invalid_argument("the adapter's step dict entry '" + name +
                                      "' must be an array or a scalar, got " +
                                      kind_name(extra.kind));
        }
        if (name.compare(0, kObservationPrefix.size(), kObservationPrefix) != 0) {
          nest_to_proto(extra, &(*step->mutable_extras()->mutable_map())[name]);
          continue;
        }
        if (array_observation) {
          throw std::invalid_argument(
              "the adapter's step dict has both 'frame' and the "
              "observation entry '" +
              name + "'; send one or the other");
        }
        auto& entries = *step->mutable_observation()->mutable_map();
        nest_to_proto(extra, &entries[name.substr(kObservationPrefix.size())]);
      }
      if (!array_observation && step->observation().map_size() == 0) {
        throw std::invalid_argument("the adapter's step dict lacks 'frame' (or the entries '" +
                                    kObservationPrefix + "<key>' of a Dict observation)");
      }
    }

    EnvServer* server_;
    const std::optional<int64_t> envs_per_stream_;
    py::object env_;  // touched only with the GIL held
    bool batched_ = false;
    // Adapters replaced after errors, plus their own restarts. Only this
    // stream's gRPC thread touches it.
    int64_t restarts_ = 0;
  };

  // Serves one raw stream (raw_socket.h) on `socket`: the hello, then a Step
  // for every Action, as StreamingEnv does over gRPC. A refusal or an error
  // goes to the client as an error frame.
  void serve_raw(RawSocket* socket) {
    RawSocket::Kind kind;
    std::string in, out;
    if (!socket->receive(&kind, &in)) return;
    std::optional<int64_t> envs_per_stream;
    try {
      if (kind != RawSocket::kHello) {
        throw std::invalid_argument("a raw stream must open with a hello frame");
      }
      if (!in.empty()) envs_per_stream = parse_envs_per_stream(in);
    } catch (const std::invalid_argument& e) {
      log(std::string("refusing a stream: ") + e.what());
      socket->send(RawSocket::kError, e.what());
      return;
    }
    try {
      Session session(this, envs_per_stream);
      rpcenv::Step step;
      session.initial(&step);
      rpcenv::Action action;
      while (true) {
        step.SerializeToString(&out);
        if (!socket->send(RawSocket::kMessage, out) || !socket->receive(&kind, &in)) break;
        if (kind != RawSocket::kMessage || !action.ParseFromString(in)) {
          throw std::invalid_argument("the client sent a frame that is not an Action");
        }
        step.Clear();
        session.step(&action, &step);
      }
    } catch (const abi::__forced_unwind&) {
      throw;  // the interpreter is exiting and ends this thread
    } catch (const std::exception& e) {  // the factory, initial() or the client failed
      log(std::string("ending a stream: ") + e.what());
      socket->send(RawSocket::kError, e.what());
    }
  }

  // The raw transport's threads: one accepts connections, one serves each
  // (named "env-stream", where gRPC's are "grpcpp_sync_ser"). stop() cancels
  // every connection and joins every thread.
  class RawServing {
   public:
    explicit RawServing(EnvServer* server)
        : server_(server), listener_(server->address_), accepting_([this]() { accept_loop(); }) {}
    ~RawServing() { stop(); }

    void stop() {
      if (stopped_.exchange(true)) return;
      accepting_.join();  // no connection is added after this
      listener_.close();  // new clients are refused rather than left waiting
      std::lock_guard<std::mutex> lock(mu_);
      for (Connection& c : connections_) c.socket->cancel();
      for (Connection& c : connections_) c.thread.join();
      connections_.clear();
    }

   private:
    struct Connection {
      std::unique_ptr<RawSocket> socket;
      std::shared_ptr<std::atomic<bool>> done;
      std::thread thread;
    };

    void accept_loop() {
      pthread_setname_np(pthread_self(), "env-accept");
      while (!stopped_) {
        RawSocket accepted = listener_.accept(100);
        std::lock_guard<std::mutex> lock(mu_);
        join_finished();
        if (!accepted.valid() || stopped_) continue;
        Connection c{std::make_unique<RawSocket>(std::move(accepted)),
                     std::make_shared<std::atomic<bool>>(false), std::thread()};
        c.thread = std::thread([server = server_, socket = c.socket.get(), done = c.done]() {
          pthread_setname_np(pthread_self(), "env-stream");
          server->serve_raw(socket);
          *done = true;
        });
        connections_.push_back(std::move(c));
      }
    }

    void join_finished() {  // mu_ held
      for (auto it = connections_.begin(); it != connections_.end();) {
        if (*it->done) {
          it->thread.join();
          it = connections_.erase(it);
        } else {
          ++it;
        }
      }
    }

    EnvServer* server_;
    RawListener listener_;
    std::atomic<bool> stopped_{false};
    std::mutex mu_;
    std::vector<Connection> connections_;  // GUARDED_BY(mu_)
    std::thread accepting_;  // last: starts once the rest is ready
  };

  class Service final : public rpcenv::RPCEnvServer::Service {
   public:
    explicit Service(EnvServer* server) : server_(server) {}

    grpc::Status StreamingEnv(
        grpc::ServerContext* context,
        grpc::ServerReaderWriter<rpcenv::Step, rpcenv::Action>* stream) override {
      std::optional<int64_t> envs_per_stream;
      try {
        envs_per_stream = requested_envs_per_stream(*context);
      } catch (const std::invalid_argument& e) {
        server_->log(std::string("refusing a stream: ") + e.what());
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, e.what());
      }
      try {
        Session session(server_, envs_per_stream);
        rpcenv::Step step;
        session.initial(&step);
        rpcenv::Action action;
        while (stream->Write(step) && stream->Read(&action)) {
          step.Clear();
          session.step(&action, &step);
        }
        return grpc::Status::OK;
      } catch (const std::exception& e) {  // the factory or initial() failed
        server_->log(std::string("ending a stream: ") + e.what());
        return grpc::Status(grpc::StatusCode::INTERNAL, e.what());
      }
    }

   private:
    // The client's "envs-per-stream" metadata; nullopt when absent. Throws
    // std::invalid_argument for a bad value or more than one.
    static std::optional<int64_t> requested_envs_per_stream(const grpc::ServerContext& context) {
      const auto& metadata = context.client_metadata();
      auto [first, last] = metadata.equal_range(kEnvsPerStreamKey);
      if (first == last) return std::nullopt;
      if (std::next(first) != last) {
        throw std::invalid_argument(std::string("metadata '") + kEnvsPerStreamKey +
                                    "' given more than once");
      }
      return parse_envs_per_stream(std::string(first->second.data(), first->second.size()));
    }

    EnvServer* server_;
  };

  void log(const std::string& message) const {
    std::fprintf(stderr, "[EnvServer %s] %s\n", address_.c_str(), message.c_str());
  }

  py::object env_factory_;  // touched only with the GIL held
  const std::string address_;
  const int keepalive_ms_;
  const TlsConfig tls_;  // empty: plain gRPC
  Service service_{this};
  std::mutex mu_;
  std::condition_variable stop_cv_;
  bool stop_requested_ = false;  // GUARDED_BY(mu_)
};

}  // namespace beast
