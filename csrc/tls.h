// TLS for gRPC between actors and env servers on other machines.
//
//   learner (ActorPool) --TLS: is the server's certificate signed by root_certs and made out
//                              to the host of its address (or target_name)?-->  EnvServer
//                       <--with client_ca: is the learner's certificate signed by it?--
//
// The PEM texts come from Python (beast/tls.py reads the files and reports a missing or
// unreadable one by its flag). An empty TlsConfig is plain gRPC, as TorchBeast speaks.
// raw: addresses are unix sockets on one machine and never use TLS.
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>

#include <map>
#include <memory>
#include <stdexcept>
#include <string>

namespace beast {

struct TlsConfig {
  // Client: the CA that signed the servers' certificates. Server: the CA that signed the
  // learners' certificates; given, a learner without one signed by it is refused.
  std::string root_certs;
  // The certificate (chain) and private key this side shows: the server's own; a
  // learner's, for servers that ask for one.
  std::string cert_chain;
  std::string private_key;
  // Client only: the name the servers' certificate must carry, instead of the host of
  // each address (say, when the learner reaches them by IP and the certificate names a
  // hostname).
  std::string target_name;

  bool enabled() const { return !root_certs.empty() || !cert_chain.empty(); }

  // From Python's dict of the same names; an unknown key is a typo, not an option.
  static TlsConfig from_map(const std::map<std::string, std::string>& fields) {
    TlsConfig config;
    for (const auto& [key, value] : fields) {
      if (key == "root_certs") {
        config.root_certs = value;
      } else if (key == "cert_chain") {
        config.cert_chain = value;
      } else if (key == "private_key") {
        config.private_key = value;
      } else if (key == "target_name") {
        config.target_name = value;
      } else {
        throw std::invalid_argument("tls: unknown key '" + key +
                                    "' (root_certs, cert_chain, private_key, target_name)");
      }
    }
    if (config.cert_chain.empty() != config.private_key.empty()) {
      throw std::invalid_argument("tls: cert_chain and private_key go together");
    }
    return config;
  }

  void check_client() const {
    if (enabled() && root_certs.empty()) {
      throw std::invalid_argument("tls: a client needs root_certs, the CA of its servers");
    }
  }

  void check_server() const {
    if (enabled() && cert_chain.empty()) {
      throw std::invalid_argument("tls: a server needs cert_chain and private_key");
    }
    if (!target_name.empty()) throw std::invalid_argument("tls: target_name is a client's");
  }
};

inline std::shared_ptr<grpc::ChannelCredentials> channel_credentials(const TlsConfig& tls) {
  if (!tls.enabled()) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = tls.root_certs;
  options.pem_private_key = tls.private_key;
  options.pem_cert_chain = tls.cert_chain;
  return grpc::SslCredentials(options);
}

inline std::shared_ptr<grpc::ServerCredentials> server_credentials(const TlsConfig& tls) {
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options(
      tls.root_certs.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                             : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_root_certs = tls.root_certs;
  options.pem_key_cert_pairs.push_back({tls.private_key, tls.cert_chain});
  return grpc::SslServerCredentials(options);
}

}  // namespace beast
