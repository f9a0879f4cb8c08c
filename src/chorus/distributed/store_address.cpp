#include "chorus/distributed/store_address.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

namespace chorus::dist {

std::string store_listen_address(const std::string& master_addr, bool other_machines) {
  if (master_addr.empty()) return "0.0.0.0";
  if (master_addr == "localhost") return "127.0.0.1";
  in_addr numeric{};
  if (::inet_pton(AF_INET, master_addr.c_str(), &numeric) == 1) return master_addr;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(master_addr.c_str(), nullptr, &hints, &res) != 0 || !res) return "0.0.0.0";  // IPv6, or unknown
  const in_addr a = reinterpret_cast<const sockaddr_in*>(res->ai_addr)->sin_addr;
  ::freeaddrinfo(res);
  const bool loopback = (ntohl(a.s_addr) >> 24) == 127;
  if (loopback && other_machines) return "0.0.0.0";  // Note [Store listen address]
  char buf[INET_ADDRSTRLEN];
  return ::inet_ntop(AF_INET, &a, buf, sizeof(buf)) ? std::string(buf) : "0.0.0.0";
}

std::string store_connect_address(const std::string& listen_addr) {
  return listen_addr == "0.0.0.0" ? "127.0.0.1" : listen_addr;
}

}  // namespace chorus::dist
