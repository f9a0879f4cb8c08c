// Blocking TCP sockets with deadlines, for the store and the launcher: every
// call that can wait takes a deadline and throws DistError naming the peer and
// how long it waited, never blocks forever.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace chorus::dist {

using Clock = std::chrono::steady_clock;

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd, std::string peer = "") : fd_(fd), peer_(std::move(peer)) {}
  ~Socket();
  Socket(Socket&& o) noexcept;
  Socket& operator=(Socket&& o) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  // Connects to host:port, retrying (the server may not be up yet) until
  // `timeout` has passed; then DistError "cannot reach HOST:PORT (tried for
  // Ns): <reason>".
  static Socket connect(const std::string& host, int port, std::chrono::milliseconds timeout);
  // Listens on `bind_addr`:port (port 0: any free port). DistError when the
  // port is taken, naming it.
  static Socket listen(const std::string& bind_addr, int port, int backlog = 512);
  // Accepts one connection; false when `wait` passes first (or the socket was shut down).
  bool accept(Socket* out, std::chrono::milliseconds wait);

  void send_all(const void* data, size_t n);
  // Reads exactly n bytes before `deadline` (DistError on timeout or a closed peer).
  void recv_all(void* data, size_t n, Clock::time_point deadline);
  // Waits until there is something to read (or the peer closed); false on timeout.
  bool readable(std::chrono::milliseconds wait) const;
  void shutdown();

  int fd() const { return fd_; }
  int local_port() const;
  const std::string& peer() const { return peer_; }
  bool valid() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
  std::string peer_;
};

// "host:port" for messages.
std::string endpoint(const std::string& host, int port);

}  // namespace chorus::dist
