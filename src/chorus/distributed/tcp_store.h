// TCPStore: the key-value store of a multi-process job over TCP.
//
// Note [Store wire protocol]: the server and the client speak PyTorch's
// TCPStore protocol (as of PyTorch 2.x), so a Chorus worker under torchrun
// (TORCHELASTIC_USE_AGENT_STORE=True) talks to the store torchrun's agent
// already serves on MASTER_ADDR:MASTER_PORT, and a Chorus server could serve
// PyTorch clients. Integers are little-endian; a string or byte string is a
// uint64 length and the bytes. A connection starts with VALIDATE (0x00) and
// the uint32 magic 0x3C85F7CE (no answer), then PING (0x0d) and a uint32 nonce
// that the server echoes. Queries are one type byte and arguments:
//   SET 0x01 key value (no answer)      COMPARE_SET 0x02 key expected desired -> value
//   GET 0x03 key -> value               ADD 0x04 key int64 -> int64
//   CHECK 0x05 n keys... -> uint8 (0 ready, 1 not ready)
//   WAIT 0x06 n keys... -> uint8 0 once all exist; the client may send
//     CANCEL_WAIT 0x0c instead, answered by 0x01
//   GETNUMKEYS 0x07 -> int64            DELETE_KEY 0x08 key -> int64 (0 or 1)
// (Recorded from PyTorch 2.11's own client and server on the GPU machine:
// docs/distributed.md.) A GET of a missing key is preceded by a WAIT, as
// PyTorch's client does, so the server never has to answer "absent".
// A store given a job secret also wants AUTH right after VALIDATE (Note
// [Store job secret] in distributed/store_auth.h); without one it speaks PyTorch's
// protocol unchanged.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "chorus/distributed/hash_store.h"
#include "chorus/distributed/socket.h"
#include "chorus/distributed/store.h"

namespace chorus::dist {

// The server: one thread accepting, one per connected client. Stops (and
// closes every connection) when destroyed.
//
// Note [Store connections are bounded] (issue 47, item 5): the store listens
// on the network, so whatever reaches its port may connect. A finished
// client's thread is joined at the next accept (it kept its stack mapped
// until the server ended: ~33,000 connect-and-close calls aborted the
// launcher); at most kMaxStoreClients connections are served at once (more
// are closed at once, as is one whose thread cannot be started); a client must identify itself as a store client
// within kStoreHelloTimeout and finish each message it starts within
// kStoreMessageTimeout; and a value is read as it arrives, so a length
// announced but never sent costs nothing.
inline constexpr size_t kMaxStoreClients = 16384;  // 2 mappings each: far below vm.max_map_count (65530)
inline constexpr std::chrono::seconds kStoreHelloTimeout{10}, kStoreMessageTimeout{60};

class TCPStoreServer {
 public:
  // Listens on bind_addr:port (port 0: a free port, see port()). Throws
  // DistError when the port is taken. With a `secret`, serves only clients
  // that prove it (Note [Store job secret]).
  explicit TCPStoreServer(int port, const std::string& bind_addr = "0.0.0.0", std::string secret = "");
  ~TCPStoreServer();
  TCPStoreServer(const TCPStoreServer&) = delete;
  TCPStoreServer& operator=(const TCPStoreServer&) = delete;
  int port() const { return port_; }
  // Connections dropped before they proved the secret (0 without one), and
  // the address of the first: what a launcher reports, once, instead of a
  // line per hostile connection.
  size_t refused() const { return refused_.load(); }
  std::string first_refused_peer();

 private:
  void accept_loop();
  void reap_finished();  // joins the threads of clients that left (clients_mu_ held)
  void serve(Socket client);
  void serve_client(Socket& client, bool* authed);  // until it leaves or is dropped
  struct Client {
    std::thread thread;
    int fd = -1;
    std::shared_ptr<std::atomic<bool>> done;
  };
  HashStore table_;
  const std::string secret_;
  std::atomic<size_t> refused_{0};
  std::string first_refused_;  // under clients_mu_
  Socket listener_;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread acceptor_;
  std::mutex clients_mu_;
  std::vector<Client> clients_;
};

class TCPStore final : public Store {
 public:
  // Connects to host:port, retrying until `timeout` (which is also the
  // default for every blocking call), and proves `secret` when not empty.
  // DistError when nothing answers; StoreAuthError (distributed/store_auth.h) when
  // the store wants another secret or none.
  TCPStore(const std::string& host, int port, std::chrono::milliseconds timeout = std::chrono::seconds(300),
           const std::string& secret = "");
  using Store::set;
  using Store::wait;
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  bool delete_key(const std::string& key) override;
  int64_t num_keys();
  const std::string& address() const { return address_; }

 private:
  // One query in flight per connection (the protocol has no request ids).
  void wait_locked(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  std::mutex mu_;
  Socket sock_;
  std::string address_;
};

}  // namespace chorus::dist
