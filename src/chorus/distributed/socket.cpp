#include "chorus/distributed/socket.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "chorus/core/error.h"

namespace chorus::dist {

std::string endpoint(const std::string& host, int port) {
  return (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

Socket::~Socket() {
  if (fd_ >= 0) ::close(fd_);
}

Socket::Socket(Socket&& o) noexcept : fd_(o.fd_), peer_(std::move(o.peer_)) { o.fd_ = -1; }

Socket& Socket::operator=(Socket&& o) noexcept {
  std::swap(fd_, o.fd_);
  std::swap(peer_, o.peer_);
  return *this;
}

namespace {
void set_nodelay(int fd) {
  int one = 1;
  (void)::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}
}  // namespace

Socket Socket::connect(const std::string& host, int port, std::chrono::milliseconds timeout) {
  const auto start = Clock::now(), deadline = start + timeout;
  std::string reason = "no attempt made";
  auto delay = std::chrono::milliseconds(10);
  for (;;) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
    if (rc != 0) {
      reason = std::string("cannot resolve the host name: ") + gai_strerror(rc);
    } else {
      for (addrinfo* a = res; a; a = a->ai_next) {
        int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) {
          reason = std::strerror(errno);
          continue;
        }
        if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
          ::freeaddrinfo(res);
          set_nodelay(fd);
          return Socket(fd, endpoint(host, port));
        }
        reason = std::strerror(errno);
        ::close(fd);
      }
      ::freeaddrinfo(res);
    }
    if (Clock::now() + delay >= deadline) break;
    std::this_thread::sleep_for(delay);
    delay = std::min(delay * 2, std::chrono::milliseconds(500));
  }
  const double secs = std::chrono::duration<double>(Clock::now() - start).count();
  CHORUS_THROW(DistError, "cannot reach the store at ", endpoint(host, port), " (tried for ",
               static_cast<int>(secs + 0.5), " s): ", reason,
               "; is rank 0 (or the launcher) running, and MASTER_ADDR / MASTER_PORT right?");
}

Socket Socket::listen(const std::string& bind_addr, int port, int backlog) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  CHORUS_CHECK_T(DistError, fd >= 0, "socket(): ", std::strerror(errno));
  Socket s(fd);
  int one = 1;
  (void)::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (bind_addr.empty() || bind_addr == "0.0.0.0") {
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
  } else {
    CHORUS_CHECK_T(DistError, ::inet_pton(AF_INET, bind_addr.c_str(), &addr.sin_addr) == 1,
                   "cannot listen on '", bind_addr, "': not an IPv4 address");
  }
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    CHORUS_THROW(DistError, "cannot listen on ", endpoint(bind_addr.empty() ? "0.0.0.0" : bind_addr, port), ": ",
                 err == EADDRINUSE     ? "the port is taken (another job, or an earlier run still going?); "
                                         "choose another --master-port / MASTER_PORT"
                 : err == EADDRNOTAVAIL ? "that is not an address of this machine; the store runs on node 0 / "
                                          "rank 0, whose own address --master-addr / MASTER_ADDR must be"
                                        : std::strerror(err));
  }
  CHORUS_CHECK_T(DistError, ::listen(fd, backlog) == 0, "listen(): ", std::strerror(errno));
  return s;
}

bool Socket::accept(Socket* out, std::chrono::milliseconds wait) {
  if (!readable(wait)) return false;
  sockaddr_storage peer{};
  socklen_t len = sizeof(peer);
  int fd = ::accept4(fd_, reinterpret_cast<sockaddr*>(&peer), &len, SOCK_CLOEXEC);
  if (fd < 0) return false;
  set_nodelay(fd);
  char host[NI_MAXHOST] = "?", serv[NI_MAXSERV] = "?";
  (void)::getnameinfo(reinterpret_cast<sockaddr*>(&peer), len, host, sizeof(host), serv, sizeof(serv),
                      NI_NUMERICHOST | NI_NUMERICSERV);
  *out = Socket(fd, std::string(host) + ":" + serv);
  return true;
}

void Socket::send_all(const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t k = ::send(fd_, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    CHORUS_CHECK_T(DistError, k > 0, "sending to ", peer_, " failed: ", std::strerror(errno));
    p += k;
    n -= static_cast<size_t>(k);
  }
}

void Socket::recv_all(void* data, size_t n, Clock::time_point deadline) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    CHORUS_CHECK_T(DistError, left.count() > 0 && readable(left), "no answer from ", peer_, " in time");
    const ssize_t k = ::recv(fd_, p, n, 0);
    if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    CHORUS_CHECK_T(DistError, k > 0, peer_, " closed the connection",
                   k < 0 ? std::string(": ") + std::strerror(errno) : std::string());
    p += k;
    n -= static_cast<size_t>(k);
  }
}

bool Socket::readable(std::chrono::milliseconds wait) const {
  pollfd pfd{fd_, POLLIN, 0};
  for (;;) {
    const int rc = ::poll(&pfd, 1, static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(wait.count(), INT32_MAX))));
    if (rc < 0 && errno == EINTR) continue;
    return rc > 0;
  }
}

void Socket::shutdown() {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

int Socket::local_port() const {
  sockaddr_in addr{};
  socklen_t len = sizeof(addr);
  if (::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return -1;
  return ntohs(addr.sin_port);
}

}  // namespace chorus::dist
