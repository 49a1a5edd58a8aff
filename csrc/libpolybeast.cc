// Python bindings of the PolyBeast C++ pieces. The logic lives in the headers:
// nest.h, batching_queue.h, dynamic_batcher.h, actor_pool.h, env_server.h.
//
// Every binding that can block releases the GIL. Nests are converted from
// Python (a copy) while holding it, and back to numpy arrays that own the C++
// buffer (no copy).
#include <cxxabi.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "actor_pool.h"
#include "batching_queue.h"
#include "dynamic_batcher.h"
#include "env_server.h"
#include "nest.h"
#include "stream_layout.h"
#include "tls.h"

namespace py = pybind11;
using beast::ActorPool;
using beast::BatchingOptions;
using beast::BatchingQueue;
using beast::DynamicBatcher;
using beast::EnvServer;
using beast::Nest;
using beast::TlsConfig;

namespace {

using release_gil = py::call_guard<py::gil_scoped_release>;

// Lets Ctrl-C (and other Python signal handlers) interrupt a long C++ wait in
// the main thread; elsewhere PyErr_CheckSignals does nothing.
void check_signals() {
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() != 0) throw py::error_already_set();
}

// Runs a long C++ wait that calls check_signals, without the GIL. At
// interpreter exit, taking the GIL ends the thread with a forced unwind
// (abi::__forced_unwind), which must go on without the guard taking the GIL
// once more: its destructor would, and the process would abort.
template <typename Wait>
void wait_without_gil(Wait&& wait) {
  py::gil_scoped_release release;
  try {
    wait();
  } catch (const abi::__forced_unwind&) {
    release.disarm();
    throw;
  }
}

BatchingOptions batching_options(int64_t minimum_batch_size, int64_t maximum_batch_size,
                                 std::optional<int64_t> timeout_ms,
                                 std::optional<int64_t> maximum_queue_size) {
  BatchingOptions options;
  options.minimum_batch_size = minimum_batch_size;
  options.maximum_batch_size = maximum_batch_size;
  options.timeout_ms = timeout_ms;
  options.maximum_queue_size = maximum_queue_size;
  return options;
}

}  // namespace

PYBIND11_MODULE(libpolybeast, m) {
  m.doc() =
      "C++ pieces of PolyBeast: BatchingQueue, DynamicBatcher, ActorPool, EnvServer.\n\n"
      "A nest is a dict (str keys) / list / tuple of nests, or a numpy array (Python\n"
      "scalars become 0-d arrays). Nests are copied on the way in; arrays coming out\n"
      "are numpy arrays that own their C++ buffer.";

  py::register_exception<beast::ClosedBatchingQueue>(m, "ClosedBatchingQueue", PyExc_RuntimeError);
  py::register_exception<beast::BadStep>(m, "BadStep", PyExc_RuntimeError);

  py::class_<BatchingQueue, std::shared_ptr<BatchingQueue>>(
      m, "BatchingQueue",
      "FIFO queue of nests that hands out batches concatenated along batch_dim.\n\n"
      "Batch sizes count enqueued nests. Iterating blocks until minimum_batch_size\n"
      "nests wait (or, after timeout_ms, at least one) and yields up to\n"
      "maximum_batch_size of them; it stops once the queue is closed. Nests still\n"
      "queued at close() are dropped.")
      .def(py::init([](int64_t batch_dim, int64_t minimum_batch_size, int64_t maximum_batch_size,
                       std::optional<int64_t> timeout_ms, bool check_inputs,
                       std::optional<int64_t> maximum_queue_size) {
             return std::make_shared<BatchingQueue>(
                 batch_dim,
                 batching_options(minimum_batch_size, maximum_batch_size, timeout_ms,
                                  maximum_queue_size),
                 check_inputs);
           }),
           py::arg("batch_dim") = 1, py::arg("minimum_batch_size") = 1,
           py::arg("maximum_batch_size") = 1024, py::arg("timeout_ms") = py::none(),
           py::arg("check_inputs") = true, py::arg("maximum_queue_size") = py::none())
      .def(
          "enqueue",
          [](BatchingQueue& queue, py::handle nest) {
            Nest copy = beast::nest_from_python(nest);
            py::gil_scoped_release release;
            queue.enqueue(std::move(copy));
          },
          py::arg("nest"),
          "Adds a nest whose arrays all have the batch dimension. Blocks while the queue\n"
          "is full. Raises ValueError for a nest that does not fit the first one (with\n"
          "check_inputs) and ClosedBatchingQueue once closed.")
      .def("__iter__", [](py::object self) { return self; })
      .def("__next__",
           [](BatchingQueue& queue) {
             std::optional<Nest> batch;
             {
               py::gil_scoped_release release;
               batch = queue.dequeue_many();
             }
             if (!batch) throw py::stop_iteration();
             return beast::nest_to_python(*batch);
           })
      .def("close", &BatchingQueue::close, release_gil(),
           "Wakes every waiter; idempotent. Queued nests are dropped.")
      .def("is_closed", &BatchingQueue::is_closed)
      .def("size", &BatchingQueue::size, "Number of nests waiting.");

  py::class_<DynamicBatcher::Batch>(
      m, "Batch", "A batch of compute() requests, handed out by iterating a DynamicBatcher.")
      .def(
          "get_inputs",
          [](const DynamicBatcher::Batch& batch) { return beast::nest_to_python(batch.inputs()); },
          "The callers' inputs concatenated along batch_dim.")
      .def(
          "set_outputs",
          [](DynamicBatcher::Batch& batch, py::handle outputs) {
            batch.set_outputs(beast::nest_from_python(outputs));
          },
          py::arg("outputs"),
          "Answers the callers: each gets its own rows of outputs along batch_dim. Raises\n"
          "ValueError (and fails the callers) if the batch size does not match.");

  py::class_<DynamicBatcher, std::shared_ptr<DynamicBatcher>>(
      m, "DynamicBatcher",
      "Batches concurrent compute() calls for one inference thread.\n\n"
      "Callers block in compute(inputs) while the inference thread iterates over the\n"
      "batcher, gets Batch objects and answers them with set_outputs. A Batch dropped\n"
      "without outputs, or outputs of the wrong batch size, raise RuntimeError in\n"
      "its callers; close() makes waiting callers raise ClosedBatchingQueue.")
      .def(py::init([](int64_t batch_dim, int64_t minimum_batch_size, int64_t maximum_batch_size,
                       std::optional<int64_t> timeout_ms, bool check_outputs) {
             return std::make_shared<DynamicBatcher>(
                 batch_dim,
                 batching_options(minimum_batch_size, maximum_batch_size, timeout_ms, std::nullopt),
                 check_outputs);
           }),
           py::arg("batch_dim") = 1, py::arg("minimum_batch_size") = 1,
           py::arg("maximum_batch_size") = 1024, py::arg("timeout_ms") = 100,
           py::arg("check_outputs") = true)
      .def(
          "compute",
          [](DynamicBatcher& batcher, py::handle inputs) {
            Nest copy = beast::nest_from_python(inputs);
            Nest outputs;
            {
              py::gil_scoped_release release;
              outputs = batcher.compute(std::move(copy));
            }
            return beast::nest_to_python(outputs);
          },
          py::arg("inputs"),
          "Blocks until the inference thread answers; returns this caller's rows.")
      .def("__iter__", [](py::object self) { return self; })
      .def("__next__",
           [](DynamicBatcher& batcher) {
             std::unique_ptr<DynamicBatcher::Batch> batch;
             {
               py::gil_scoped_release release;
               batch = batcher.next_batch();
             }
             if (!batch) throw py::stop_iteration();
             return batch;
           })
      .def("close", &DynamicBatcher::close, release_gil(),
           "Wakes everyone; idempotent. Queued callers raise ClosedBatchingQueue.")
      .def("is_closed", &DynamicBatcher::is_closed)
      .def("size", &DynamicBatcher::size, "Number of requests waiting for a batch.");

  py::class_<ActorPool>(
      m, "ActorPool",
      "One actor thread per env server address: steps the environment through the\n"
      "inference batcher and puts (rollout, initial_agent_state) on the learner queue.\n\n"
      "The batcher is called with (env_outputs, agent_state) and must answer\n"
      "(agent_outputs, agent_state), agent_outputs a dict with an 'action' array.\n"
      "env_outputs holds every named array the server sends (the fixed Step fields\n"
      "with 'frame' (a dict observation: 'frame/<key>' per entry) and 'last_action',\n"
      "plus any extra key of the environment's dict),\n"
      "so an environment-side rollout field needs no C++ change; a step that lacks\n"
      "one of env_keys (list of str) fails the run naming the key and the server; a\n"
      "batched step may leave out truncated (false) and game_over (== done), as a\n"
      "single-environment Step may.\n"
      "Every array of a step is [1, 1, ...]; a rollout is a dict of [T+1, 1, ...]\n"
      "arrays (T = unroll_length) whose last step is step 0 of the next one.\n"
      "A single environment's action goes out as Action.action (int32) and as\n"
      "Action.nest_action (a 0-d int64 array, what TorchBeast's servers read). A float\n"
      "'action' (a Box action space, [1, 1, A] per step) goes out as nest_action only,\n"
      "the array [A] ([N, A] for a batched stream); initial_last_action (a numpy array,\n"
      "default a 0-d int64 zero) is a single-environment stream's first last_action,\n"
      "after which it is the action sent last.\n\n"
      "envs_per_stream N > 0 asks every server for N environments per stream (gRPC\n"
      "metadata 'envs-per-stream: N' when the stream opens), which a server started\n"
      "without its own --envs_per_stream follows; 0 (the default) asks for nothing, as\n"
      "TorchBeast's actors do. At most MAX_ENVS_PER_STREAM.\n\n"
      "tls (a dict of PEM texts, default None: plain gRPC) makes the gRPC streams TLS:\n"
      "root_certs, the CA that signed the servers' certificates (required);\n"
      "cert_chain and private_key, this learner's own, for servers that require one;\n"
      "target_name, the name the servers' certificate carries when it is not the host\n"
      "of the address. raw: addresses (local unix sockets) cannot use it.\n\n"
      "A server that ends the stream, or sends no Step for stream_timeout_s (only the\n"
      "wait for the server counts, not inference or the learner queue), is reconnected\n"
      "to with a fresh agent state; 'lost the env server' is logged at most once per\n"
      "actor per 5 s. The run fails (see run()) when an actor gets no Step for\n"
      "connect_timeout_s from a server that has not yet completed one of its rollouts, or\n"
      "for reconnect_timeout_s (0: connect_timeout_s) from one that has, or when its\n"
      "streams keep reaching the server but ending before a rollout is complete for\n"
      "connect_timeout_s.")
      .def(py::init([](int64_t unroll_length, std::shared_ptr<BatchingQueue> learner_queue,
                       std::shared_ptr<DynamicBatcher> inference_batcher,
                       std::vector<std::string> env_server_addresses,
                       py::handle initial_agent_state, std::vector<std::string> env_keys,
                       double connect_timeout_s, double stream_timeout_s, int64_t envs_per_stream,
                       py::handle initial_last_action,
                       std::optional<std::map<std::string, std::string>> tls,
                       double reconnect_timeout_s) {
             beast::Array last = beast::filled_array<int64_t>(beast::dtypes::kInt64, 0, {});
             if (!initial_last_action.is_none()) {
               Nest nest = beast::nest_from_python(initial_last_action, "initial_last_action");
               if (nest.kind != Nest::Kind::kArray) {
                 throw std::invalid_argument("initial_last_action must be a numpy array");
               }
               last = std::move(nest.array);
             }
             return std::make_unique<ActorPool>(
                 unroll_length, std::move(learner_queue), std::move(inference_batcher),
                 std::move(env_server_addresses), beast::nest_from_python(initial_agent_state),
                 std::move(env_keys), connect_timeout_s, stream_timeout_s, envs_per_stream,
                 std::move(last), tls ? TlsConfig::from_map(*tls) : TlsConfig{},
                 reconnect_timeout_s);
           }),
           py::arg("unroll_length"), py::arg("learner_queue"), py::arg("inference_batcher"),
           py::arg("env_server_addresses"), py::arg("initial_agent_state"), py::arg("env_keys"),
           py::arg("connect_timeout_s") = 60.0, py::arg("stream_timeout_s") = 30.0,
           py::arg("envs_per_stream") = 0, py::arg("initial_last_action") = py::none(),
           py::arg("tls") = py::none(), py::arg("reconnect_timeout_s") = 0.0)
      .def(
          "run", [](ActorPool& pool) { wait_without_gil([&] { pool.run(check_signals); }); },
          "Runs the actors until the queues (or the pool) are closed. Raises RuntimeError\n"
          "naming the address for the first actor that failed: an env server that sent\n"
          "no Step for connect_timeout_s (reconnect_timeout_s once it had served); streams\n"
          "that kept reaching it but ending before a rollout was complete for\n"
          "connect_timeout_s (the message counts them and gives the last\n"
          "reason). BadStep (a RuntimeError) for a step the learner cannot take: one\n"
          "without one of env_keys, or with NaN or inf in a float array the server sent;\n"
          "or a bad inference answer. That also closes both queues.")
      .def("count", &ActorPool::count, "Environment steps taken so far.")
      .def("env_errors", &ActorPool::env_errors,
           "Environment restarts after errors so far, as the env servers report them\n"
           "(Step.env_errors), summed over all streams; 0 for servers that do not report.")
      .def("close", &ActorPool::close, release_gil(),
           "Stops the actors without closing the queues; idempotent.");

  py::class_<EnvServer>(
      m, "EnvServer",
      "Serves environments over gRPC (csrc/rpcenv.proto) at 'unix:/path' or 'host:port'.\n\n"
      "Each stream gets its own adapter from env_factory(), or env_factory(N) when the\n"
      "client asked for N environments per stream (gRPC metadata 'envs-per-stream: N',\n"
      "as an ActorPool with envs_per_stream=N sends; TorchBeast's actors send none). A\n"
      "request that is not an integer in [1, MAX_ENVS_PER_STREAM] ends the stream with\n"
      "INVALID_ARGUMENT. The adapter must offer\n"
      ".initial() and .step(action) returning dict(frame, reward, done, game_over,\n"
      "episode_return, episode_step, ...), and optionally .close(). Every other key of\n"
      "the dict (but last_action, which the actor knows) travels as a named array\n"
      "(Step.extras), an array or a scalar each. An adapter with `num_envs` hosts that\n"
      "many environments: its dicts of [num_envs, ...] arrays travel whole as\n"
      "Step.batch, and step() gets the array of actions the actor sent (int64 [N], or\n"
      "float32 [N, A] for a Box action space). An adapter that raises\n"
      "in step() is replaced; each Step reports the restarts so far (Step.env_errors,\n"
      "plus a batched adapter's own `restarts` attribute if it has one). A single\n"
      "environment's step() gets Action.action (an int) if the client sent it, else\n"
      "nest_action as a numpy array.\n\n"
      "Clients with open streams are pinged every keepalive_s seconds; one that does\n"
      "not answer within keepalive_s is dropped and its environments closed.\n\n"
      "tls (a dict of PEM texts, default None: plain gRPC) serves over TLS:\n"
      "cert_chain and private_key, the server's certificate and key (required);\n"
      "root_certs, a CA: given, only clients with a certificate signed by it connect.\n"
      "Not for raw: addresses.")
      .def(py::init([](py::object env_factory, std::string server_address, double keepalive_s,
                       std::optional<std::map<std::string, std::string>> tls) {
             return std::make_unique<EnvServer>(std::move(env_factory), std::move(server_address),
                                                keepalive_s,
                                                tls ? TlsConfig::from_map(*tls) : TlsConfig{});
           }),
           py::arg("env_factory"), py::arg("server_address"), py::arg("keepalive_s") = 10.0,
           py::arg("tls") = py::none())
      .def(
          "run",
          [](EnvServer& server, py::object on_listening) {
            std::function<void()> listening;
            if (!on_listening.is_none()) {
              listening = [&on_listening]() {
                py::gil_scoped_acquire gil;
                on_listening();
              };
            }
            wait_without_gil([&] { server.run(check_signals, listening); });
          },
          py::arg("on_listening") = py::none(),
          "Serves until stop(). Calls on_listening() (if given) once it listens.\n"
          "Raises RuntimeError if the address cannot be bound (a unix socket's\n"
          "directory that does not exist, say), or 'address in use: <address>; ...'\n"
          "if another server listens there (a TCP port is never shared; a unix socket\n"
          "file is replaced only if nobody listens).")
      .def("stop", &EnvServer::stop, release_gil(), "Makes run() return; idempotent.")
      .def_property_readonly("address", &EnvServer::address);

  m.attr("MAX_ENVS_PER_STREAM") = beast::kMaxEnvsPerStream;
}
