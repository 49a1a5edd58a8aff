// An actor's stream to its env server, whatever carries it:
//
//   EnvConnection::create(address, tls) --open(envs_per_stream)--> EnvStream: read(Step) / write(Action)
//
// "raw:PATH" is a unix socket of raw_socket.h (servers on this machine, no
// gRPC in between); every other address is gRPC's (unix:PATH, HOST:PORT),
// which TorchBeast's servers and servers on other machines speak. The actor
// pool (actor_pool.h) sees only this interface, so a new transport is a new
// pair of classes here.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "raw_socket.h"
#include "rpcenv.grpc.pb.h"
#include "stream_layout.h"
#include "tls.h"

namespace beast {

class EnvStream {
 public:
  virtual ~EnvStream() = default;
  // False once the stream has ended: the server ended it, it broke, or cancel().
  virtual bool read(rpcenv::Step* step) = 0;
  virtual bool write(const rpcenv::Action& action) = 0;
  // From any thread, at any time: read() and write() fail from now on.
  virtual void cancel() = 0;
  // Once read() or write() has failed: why the stream ended. Call it once.
  virtual std::string finish() = 0;
};

class EnvConnection {
 public:
  virtual ~EnvConnection() = default;
  // A new stream that asks for envs_per_stream environments (0: asks for
  // nothing), or nullptr when the server cannot be reached now; the call then
  // took about 100 ms, so a loop around it does not spin.
  virtual std::unique_ptr<EnvStream> open(int64_t envs_per_stream) = 0;

  // tls applies to gRPC addresses (raw: ones are local unix sockets).
  static std::unique_ptr<EnvConnection> create(const std::string& address, const TlsConfig& tls);
};

class GrpcEnvStream final : public EnvStream {
 public:
  GrpcEnvStream(rpcenv::RPCEnvServer::Stub* stub, int64_t envs_per_stream) {
    if (envs_per_stream > 0) {
      context_.AddMetadata(kEnvsPerStreamKey, std::to_string(envs_per_stream));
    }
    stream_ = stub->StreamingEnv(&context_);
  }
  bool read(rpcenv::Step* step) override { return stream_->Read(step); }
  bool write(const rpcenv::Action& action) override { return stream_->Write(action); }
  void cancel() override { context_.TryCancel(); }
  std::string finish() override {
    grpc::Status status = stream_->Finish();
    if (status.ok()) return "the server ended the stream";
    return status.error_message() + ", gRPC code " + std::to_string(status.error_code());
  }

 private:
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<rpcenv::Action, rpcenv::Step>> stream_;
};

class GrpcEnvConnection final : public EnvConnection {
 public:
  GrpcEnvConnection(const std::string& address, const TlsConfig& tls) {
    grpc::ChannelArguments args;
    // A local subchannel pool keeps this channel's reconnect backoff its own.
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
    args.SetMaxReceiveMessageSize(-1);  // large observations
    args.SetInt(GRPC_ARG_ENABLE_HTTP_PROXY, 0);  // env servers are never behind an HTTP proxy
    if (!tls.target_name.empty()) args.SetSslTargetNameOverride(tls.target_name);
    channel_ = grpc::CreateCustomChannel(address, channel_credentials(tls), args);
    stub_ = rpcenv::RPCEnvServer::NewStub(channel_);
  }
  std::unique_ptr<EnvStream> open(int64_t envs_per_stream) override {
    auto deadline = std::chrono::system_clock::now() + std::chrono::milliseconds(100);
    if (!channel_->WaitForConnected(deadline)) return nullptr;
    return std::make_unique<GrpcEnvStream>(stub_.get(), envs_per_stream);
  }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<rpcenv::RPCEnvServer::Stub> stub_;
};

class RawEnvStream final : public EnvStream {
 public:
  RawEnvStream(RawSocket socket, int64_t envs_per_stream) : socket_(std::move(socket)) {
    hello_sent_ =
        socket_.send(RawSocket::kHello, envs_per_stream > 0 ? std::to_string(envs_per_stream) : "");
  }
  bool read(rpcenv::Step* step) override {
    RawSocket::Kind kind;
    if (!hello_sent_ || !socket_.receive(&kind, &in_)) return false;
    if (kind == RawSocket::kError) {
      server_error_ = in_;
      return false;
    }
    if (kind != RawSocket::kMessage || !step->ParseFromString(in_)) {
      server_error_ = "the server sent a frame that is not a Step";
      return false;
    }
    return true;
  }
  bool write(const rpcenv::Action& action) override {
    action.SerializeToString(&out_);
    return socket_.send(RawSocket::kMessage, out_);
  }
  void cancel() override { socket_.cancel(); }
  std::string finish() override {
    if (!server_error_.empty()) return server_error_;
    std::string error = socket_.error();
    return error.empty() ? "the server ended the stream" : "raw socket: " + error;
  }

 private:
  RawSocket socket_;
  bool hello_sent_ = false;
  std::string server_error_;  // what the server said when it ended the stream
  std::string in_, out_;  // reused, to spare an allocation per message
};

class RawEnvConnection final : public EnvConnection {
 public:
  explicit RawEnvConnection(std::string address) : address_(std::move(address)) {
    raw_socket_address(address_);  // a bad address fails here, at once
  }
  std::unique_ptr<EnvStream> open(int64_t envs_per_stream) override {
    RawSocket socket = RawSocket::connect(address_);
    if (!socket.valid()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      return nullptr;
    }
    return std::make_unique<RawEnvStream>(std::move(socket), envs_per_stream);
  }

 private:
  const std::string address_;
};

inline std::unique_ptr<EnvConnection> EnvConnection::create(const std::string& address,
                                                            const TlsConfig& tls) {
  if (is_raw_address(address)) return std::make_unique<RawEnvConnection>(address);
  return std::make_unique<GrpcEnvConnection>(address, tls);
}

}  // namespace beast
