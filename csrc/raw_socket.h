// The "raw:" transport: the same Step and Action messages as the gRPC
// service (rpcenv.proto), framed by hand over a unix socket, for env servers
// on the learner's own machine.
//
//   actor thread --[hello: envs-per-stream]--> env server
//                <--[Step]-- --[Action]--> <--[Step]-- ...
//                <--[error: why]-- (the server refused or ended the stream)
//
// A frame is an 8-byte header (uint32 payload length, uint8 kind, 3 bytes
// zero; host byte order, since both ends share a machine) and the payload: a
// serialized Step or Action, the envs-per-stream request as decimal text
// (empty: none), or an error message. One connection is one stream.
//
// Why: a gRPC round trip hands each message through gRPC's own threads and
// HTTP/2 framing at both ends. Here the actor thread and the server's stream
// thread read and write the socket themselves, one wake-up each way. Only our
// servers and actor pool speak it; TorchBeast's and remote servers use gRPC.
#pragma once

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>

namespace beast {

inline constexpr const char* kRawScheme = "raw:";

inline bool is_raw_address(const std::string& address) {
  return address.rfind(kRawScheme, 0) == 0;
}

// "raw:PATH" -> sockaddr_un for PATH; throws std::invalid_argument for a bad one.
inline sockaddr_un raw_socket_address(const std::string& address) {
  const std::string path = address.substr(std::strlen(kRawScheme));
  sockaddr_un addr{};
  if (!is_raw_address(address) || path.empty() || path.size() >= sizeof(addr.sun_path)) {
    throw std::invalid_argument("a raw address is raw:PATH, PATH a unix socket file of at most " +
                                std::to_string(sizeof(addr.sun_path) - 1) + " bytes; got '" +
                                address + "'");
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  return addr;
}

// One connected socket; the file descriptor is closed with it. cancel() may
// be called from any thread while another reads or writes: both then fail.
class RawSocket {
 public:
  enum Kind : uint8_t { kMessage = 0, kHello = 1, kError = 2 };
  // Bounds what a peer can make the other end allocate for one frame.
  static constexpr uint32_t kMaxPayload = 1u << 31;

  explicit RawSocket(int fd) : fd_(fd) {}
  RawSocket(RawSocket&& other) noexcept : fd_(other.fd_), errno_(other.errno_) { other.fd_ = -1; }
  RawSocket(const RawSocket&) = delete;
  RawSocket& operator=(const RawSocket&) = delete;
  ~RawSocket() {
    if (fd_ >= 0) ::close(fd_);
  }

  // A connection to the server at "raw:PATH"; an invalid socket (valid() false,
  // error() says why) when nothing accepts it there now.
  static RawSocket connect(const std::string& address) {
    sockaddr_un addr = raw_socket_address(address);
    int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return RawSocket(-1, errno);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      int error = errno;
      ::close(fd);
      return RawSocket(-1, error);
    }
    return RawSocket(fd);
  }

  bool valid() const { return fd_ >= 0; }
  // strerror of the last failure; "" after a clean end of stream.
  std::string error() const { return errno_ ? std::strerror(errno_) : ""; }

  // False once the peer is gone or the socket was cancelled.
  bool send(Kind kind, const std::string& payload) {
    if (fd_ < 0) return false;
    if (payload.size() > kMaxPayload) {
      throw std::invalid_argument("a message of " + std::to_string(payload.size()) +
                                  " bytes is more than the raw transport carries");
    }
    uint8_t header[8] = {};
    const uint32_t length = static_cast<uint32_t>(payload.size());
    std::memcpy(header, &length, sizeof(length));
    header[4] = kind;
    iovec parts[2] = {{header, sizeof(header)},
                      {const_cast<char*>(payload.data()), payload.size()}};
    msghdr message{};
    message.msg_iov = parts;
    message.msg_iovlen = 2;
    size_t left = sizeof(header) + payload.size();
    while (left > 0) {
      ssize_t sent = ::sendmsg(fd_, &message, MSG_NOSIGNAL);
      if (sent < 0) {
        if (errno == EINTR) continue;
        errno_ = errno;
        return false;
      }
      left -= static_cast<size_t>(sent);
      // Skip what went out; the loop ends before any iovec runs past its end.
      while (message.msg_iovlen > 0 && static_cast<size_t>(sent) >= message.msg_iov->iov_len) {
        sent -= static_cast<ssize_t>(message.msg_iov->iov_len);
        ++message.msg_iov;
        --message.msg_iovlen;
      }
      if (message.msg_iovlen > 0) {
        message.msg_iov->iov_base = static_cast<char*>(message.msg_iov->iov_base) + sent;
        message.msg_iov->iov_len -= static_cast<size_t>(sent);
      }
    }
    return true;
  }

  // The next frame; false at the end of the stream or on an error (error()).
  bool receive(Kind* kind, std::string* payload) {
    uint8_t header[8];
    if (!read_exactly(header, sizeof(header))) return false;
    uint32_t length;
    std::memcpy(&length, header, sizeof(length));
    if (length > kMaxPayload || header[4] > kError) {
      errno_ = EPROTO;
      return false;
    }
    *kind = static_cast<Kind>(header[4]);
    payload->resize(length);
    return read_exactly(payload->data(), length);
  }

  // Wakes a blocked send() or receive() in another thread; they fail from now on.
  void cancel() {
    if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
  }

 private:
  RawSocket(int fd, int error) : fd_(fd), errno_(error) {}

  bool read_exactly(void* data, size_t size) {
    if (fd_ < 0) return false;
    char* at = static_cast<char*>(data);
    while (size > 0) {
      ssize_t got = ::recv(fd_, at, size, 0);
      if (got == 0) return false;  // the peer closed the stream (or cancel())
      if (got < 0) {
        if (errno == EINTR) continue;
        errno_ = errno;
        return false;
      }
      at += got;
      size -= static_cast<size_t>(got);
    }
    return true;
  }

  int fd_;
  int errno_ = 0;
};

// A listening unix socket at "raw:PATH". A socket file that accepts
// connections is not replaced (another server listens there); a stale one is.
class RawListener {
 public:
  explicit RawListener(const std::string& address)
      : path_(address.substr(std::strlen(kRawScheme))) {
    sockaddr_un addr = raw_socket_address(address);
    if (RawSocket::connect(address).valid()) {
      throw std::runtime_error("EnvServer: address in use: " + address +
                               "; another env server listens there? stop it or pick another "
                               "address");
    }
    struct stat st;
    if (::lstat(path_.c_str(), &st) == 0 && S_ISSOCK(st.st_mode)) ::unlink(path_.c_str());
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd_ < 0 || ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        ::listen(fd_, 128) != 0) {
      const std::string why = std::strerror(errno);
      if (fd_ >= 0) ::close(fd_);
      throw std::runtime_error("EnvServer: could not listen on '" + address + "': " + why +
                               " (a file in the way, or a directory that is not writable?)");
    }
  }
  RawListener(const RawListener&) = delete;
  RawListener& operator=(const RawListener&) = delete;
  ~RawListener() { close(); }

  // Stops listening and removes the socket file: connections not yet
  // accepted are refused. Idempotent.
  void close() {
    if (fd_ < 0) return;
    ::close(fd_);
    ::unlink(path_.c_str());
    fd_ = -1;
  }

  // A new connection, or an invalid socket after timeout_ms without one.
  // Not concurrently with close().
  RawSocket accept(int timeout_ms) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, timeout_ms) != 1) return RawSocket(-1);
    int fd = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0 && errno != EINTR && errno != ECONNABORTED) {
      // Out of file descriptors or memory: the connection stays pending and
      // poll() says so at once; wait rather than spin.
      std::this_thread::sleep_for(std::chrono::milliseconds(timeout_ms));
    }
    return RawSocket(fd);
  }

 private:
  std::string path_;
  int fd_ = -1;
};

}  // namespace beast
