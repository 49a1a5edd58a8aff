// How many environments a stream carries: the request that travels from an
// actor (actor_pool.h) to an env server (env_server.h) when a stream opens.
//
//   ActorPool(envs_per_stream=N) --gRPC metadata "envs-per-stream: N"--> EnvServer
//                                                  --> env_factory(N) (no header: env_factory())
//
// (On the raw transport, raw_socket.h, the request is the hello frame's text
// "N", empty for none.)
//
// Metadata, not a message: TorchBeast's servers ignore it, and TorchBeast's
// actors send none, so they keep getting one environment per stream and
// TorchBeast's single-environment wire format. Also: the names of a Dict
// observation's entries on both ends (kObservationPrefix).
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

namespace beast {

// gRPC metadata keys are lowercase ASCII.
inline constexpr const char* kEnvsPerStreamKey = "envs-per-stream";
// Bounds what one client can make a server allocate per stream.
inline constexpr int64_t kMaxEnvsPerStream = 4096;

// A Gymnasium Dict observation of a single-environment stream travels as
// Step.observation's map {entry: array}, the nest it is (a TorchBeast server
// sends one so too). The server reads the entries from its adapter's keys
// "frame/<entry>", and the actor names them so again: one rollout field per
// entry, as in beast/rollout.py OBSERVATION_PREFIX. A batched stream's
// Step.batch carries the "frame/<entry>" arrays like any other field.
inline const std::string kObservationPrefix = "frame/";

// The number in a request's value: decimal digits only, in [1, kMaxEnvsPerStream].
// Throws std::invalid_argument, with a message for the client, otherwise.
inline int64_t parse_envs_per_stream(const std::string& value) {
  const std::string problem = "metadata '" + std::string(kEnvsPerStreamKey) + "' must be an " +
                              "integer in [1, " + std::to_string(kMaxEnvsPerStream) + "], got '" +
                              value.substr(0, 32) + "'";
  if (value.empty() || value.size() > 9 ||
      value.find_first_not_of("0123456789") != std::string::npos) {
    throw std::invalid_argument(problem);
  }
  int64_t n = std::stoll(value);
  if (n < 1 || n > kMaxEnvsPerStream) throw std::invalid_argument(problem);
  return n;
}

}  // namespace beast
