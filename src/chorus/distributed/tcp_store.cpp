#include "chorus/distributed/tcp_store.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <system_error>

#include "chorus/core/error.h"
#include "chorus/distributed/store_auth.h"

namespace chorus::dist {

namespace {

// Note [Store wire protocol] (tcp_store.h).
constexpr uint32_t kMagic = 0x3C85F7CE;
enum Query : uint8_t {
  kValidate = 0, kSet = 1, kCompareSet = 2, kGet = 3, kAdd = 4, kCheck = 5, kWait = 6,
  kNumKeys = 7, kDeleteKey = 8, kCancelWait = 12, kPing = 13,
};
constexpr uint8_t kReady = 0, kNotReady = 1;            // CHECK
constexpr uint8_t kStopWaiting = 0, kWaitCanceled = 1;  // WAIT
// Caps on what a peer may announce: a corrupt or hostile length must be an
// error, not a 2^64-byte allocation.
constexpr uint64_t kMaxKeyBytes = uint64_t{1} << 20, kMaxValueBytes = uint64_t{1} << 30, kMaxKeys = 1 << 20;

// Builds one message, sent with a single write.
struct Message {
  std::vector<uint8_t> buf;
  explicit Message(uint8_t type) { buf.push_back(type); }
  template <typename T>
  Message& value(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    buf.insert(buf.end(), p, p + sizeof(T));
    return *this;
  }
  Message& bytes(const void* data, size_t n) {
    value<uint64_t>(n);
    const auto* p = static_cast<const uint8_t*>(data);
    buf.insert(buf.end(), p, p + n);
    return *this;
  }
  Message& str(const std::string& s) { return bytes(s.data(), s.size()); }
  Message& bytes(const Bytes& b) { return bytes(b.data(), b.size()); }
  void send(Socket& s) { s.send_all(buf.data(), buf.size()); }
};

// Reads values off a socket, each before the deadline.
struct Reader {
  Socket& s;
  Clock::time_point deadline;
  template <typename T>
  T value() {
    T v{};
    s.recv_all(&v, sizeof(T), deadline);
    return v;
  }
  Bytes bytes(uint64_t cap = kMaxValueBytes) {
    const uint64_t n = value<uint64_t>();
    CHORUS_CHECK_T(DistError, n <= cap, "store: ", s.peer(), " announced ", n, " bytes (more than ", cap, ")");
    // Read as it arrives, a MiB at a time: an announced length costs memory
    // only once the bytes come (Note [Store connections are bounded]).
    constexpr uint64_t kChunk = uint64_t{1} << 20;
    Bytes b;
    while (b.size() < n) {
      const size_t old = b.size(), k = static_cast<size_t>(std::min<uint64_t>(n - old, kChunk));
      b.resize(old + k);
      s.recv_all(b.data() + old, k, deadline);
    }
    return b;
  }
  std::string str() {
    Bytes b = bytes(kMaxKeyBytes);
    return std::string(b.begin(), b.end());
  }
  std::vector<std::string> keys() {
    const uint64_t n = value<uint64_t>();
    CHORUS_CHECK_T(DistError, n <= kMaxKeys, "store: ", s.peer(), " asked for ", n, " keys");
    std::vector<std::string> ks;
    for (uint64_t i = 0; i < n; ++i) ks.push_back(str());
    return ks;
  }
};

void send_bytes(Socket& s, const Bytes& b) {
  std::vector<uint8_t> buf(sizeof(uint64_t) + b.size());
  const uint64_t n = b.size();
  std::memcpy(buf.data(), &n, sizeof(n));
  if (!b.empty()) std::memcpy(buf.data() + sizeof(n), b.data(), b.size());
  s.send_all(buf.data(), buf.size());
}

// The server reads without a deadline of its own: a client may stay idle
// for the whole job.
constexpr auto kForever = std::chrono::hours(24 * 365);

}  // namespace

// ---- server ---------------------------------------------------------------------

TCPStoreServer::TCPStoreServer(int port, const std::string& bind_addr, std::string secret)
    : secret_(std::move(secret)), listener_(Socket::listen(bind_addr, port)) {
  port_ = listener_.local_port();
  acceptor_ = std::thread([this] { accept_loop(); });
}

TCPStoreServer::~TCPStoreServer() {
  stop_.store(true);
  listener_.shutdown();
  if (acceptor_.joinable()) acceptor_.join();
  std::vector<Client> clients;
  {
    std::lock_guard<std::mutex> lk(clients_mu_);
    for (const Client& c : clients_)
      if (!c.done->load()) ::shutdown(c.fd, SHUT_RDWR);
    clients.swap(clients_);
  }
  for (auto& c : clients) c.thread.join();
}

std::string TCPStoreServer::first_refused_peer() {
  std::lock_guard<std::mutex> lk(clients_mu_);
  return first_refused_;
}

void TCPStoreServer::reap_finished() {
  for (size_t i = 0; i < clients_.size();) {
    if (clients_[i].done->load()) {
      clients_[i].thread.join();
      clients_[i] = std::move(clients_.back());
      clients_.pop_back();
    } else {
      ++i;
    }
  }
}

void TCPStoreServer::accept_loop() {
  while (!stop_.load()) {
    Socket c;
    const bool got = listener_.accept(&c, std::chrono::milliseconds(100));
    std::lock_guard<std::mutex> lk(clients_mu_);
    reap_finished();
    if (!got) continue;
    if (stop_.load()) return;
    if (clients_.size() >= kMaxStoreClients) continue;  // full: this one is closed (Socket's destructor)
    auto done = std::make_shared<std::atomic<bool>>(false);
    const int fd = c.fd();
    try {
      std::thread t([this, done, s = std::move(c)]() mutable {
        serve(std::move(s));  // closes the socket when it returns
        done->store(true);
      });
      clients_.push_back({std::move(t), fd, done});
    } catch (const std::system_error&) {
      // No thread to be had (a process limit): this connection is closed, the
      // store goes on (an uncaught exception here ended the launcher).
    }
  }
}

void TCPStoreServer::serve(Socket c) {
  bool authed = secret_.empty();  // Note [Store job secret]
  try {
    serve_client(c, &authed);
  } catch (const std::exception&) {
    // The client went away (or sent garbage): its thread ends, the store stays.
  }
  if (!authed && !stop_.load() && refused_.fetch_add(1) == 0) {
    std::lock_guard<std::mutex> lk(clients_mu_);
    first_refused_ = c.peer();
  }
}

void TCPStoreServer::serve_client(Socket& c, bool* authed) {
  Reader in{c, Clock::now() + kForever};
  bool hello = false;  // a store client says who it is first (and proves the secret)
  const auto hello_by = Clock::now() + kStoreHelloTimeout;
  for (;;) {
    uint8_t type = 0;
    if (!c.readable(std::chrono::milliseconds(200))) {
      if (stop_.load()) return;
      if (!(hello && *authed) && Clock::now() > hello_by) return;  // a silent connection: drop it
      continue;
    }
    // A message begun is finished in time: a half-sent one does not hold
    // its thread forever (Note [Store connections are bounded]).
    in.deadline = Clock::now() + kStoreMessageTimeout;
    c.recv_all(&type, 1, in.deadline);
    if (!hello && type != kValidate) return;  // not a store client: drop it
    if (!*authed && type != kValidate && type != kAuthQuery) {
      // Not a word to a client without the secret, but what it lacks.
      if (type == kPing) {
        in.value<uint32_t>();
        c.send_all(&kAuthRequiredEcho, sizeof(kAuthRequiredEcho));
      }
      return;
    }
    switch (type) {
      case kValidate:
        if (in.value<uint32_t>() != kMagic) return;  // not a store client: drop it
        hello = true;
        break;
      case kAuthQuery:
        if (secret_.empty()) {
          in.value<Nonce>();
          c.send_all(&kAuthUnneeded, 1);  // the client decides (Note [Store job secret])
        } else if (*authed || !accept_job_secret(c, secret_, in.deadline)) {
          return;
        } else {
          *authed = true;
        }
        break;
      case kPing:
        { const uint32_t nonce = in.value<uint32_t>(); c.send_all(&nonce, sizeof(nonce)); }
        break;
      case kSet: {
        std::string k = in.str();
        table_.set(k, in.bytes());
        break;
      }
      case kCompareSet: {
        std::string k = in.str();
        Bytes expected = in.bytes(), desired = in.bytes();
        Bytes now = table_.compare_set(k, expected, desired);
        send_bytes(c, now);
        break;
      }
      case kGet: {
        Bytes v;
        table_.try_get(in.str(), &v);
        send_bytes(c, v);
        break;
      }
      case kAdd: {
        std::string k = in.str();
        const int64_t v = table_.add(k, in.value<int64_t>());
        c.send_all(&v, sizeof(v));
        break;
      }
      case kCheck: {
        const uint8_t r = table_.check(in.keys()) ? kReady : kNotReady;
        c.send_all(&r, 1);
        break;
      }
      case kWait: {
        std::vector<std::string> ks = in.keys();
        // Waits here (this thread serves only this client) until the keys
        // exist, the client cancels, or the server stops.
        bool cancelled = false;
        const bool ok = table_.wait_until(ks, kForever, [&] {
          if (stop_.load()) return true;
          if (c.readable(std::chrono::milliseconds(0))) {
            uint8_t t = 0;
            c.recv_all(&t, 1, Clock::now() + std::chrono::seconds(5));
            cancelled = t == kCancelWait;
            return true;
          }
          return false;
        });
        if (ok) {
          const uint8_t r = kStopWaiting;
          c.send_all(&r, 1);
        } else if (cancelled) {
          const uint8_t r = kWaitCanceled;
          c.send_all(&r, 1);
        } else {
          return;  // stopping, or a protocol error: drop the client
        }
        break;
      }
      case kNumKeys: {
        const int64_t n = table_.num_keys();
        c.send_all(&n, sizeof(n));
        break;
      }
      case kDeleteKey: {
        const int64_t n = table_.delete_key(in.str()) ? 1 : 0;
        c.send_all(&n, sizeof(n));
        break;
      }
      default:
        return;  // unknown query: drop the client rather than guess
    }
  }
}

// ---- client ---------------------------------------------------------------------

TCPStore::TCPStore(const std::string& host, int port, std::chrono::milliseconds timeout, const std::string& secret)
    : Store(timeout), sock_(Socket::connect(host, port, timeout)), address_(endpoint(host, port)) {
  Message(kValidate).value<uint32_t>(kMagic).send(sock_);
  if (!secret.empty()) prove_job_secret(sock_, secret, address_, Clock::now() + timeout);
  const uint32_t nonce = static_cast<uint32_t>(::getpid());
  Message(kPing).value<uint32_t>(nonce).send(sock_);
  Reader in{sock_, Clock::now() + timeout};
  const uint32_t echo = in.value<uint32_t>();
  if (echo == kAuthRequiredEcho && secret.empty()) throw_secret_required(address_);
  CHORUS_CHECK_T(DistError, echo == nonce, "the service at ", address_, " is not a TCPStore (wrong answer to a ping)");
}

void TCPStore::set(const std::string& key, const Bytes& value) {
  std::lock_guard<std::mutex> lk(mu_);
  Message(kSet).str(key).bytes(value).send(sock_);
}

void TCPStore::wait_locked(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  Message m(kWait);
  m.value<uint64_t>(keys.size());
  for (const auto& k : keys) m.str(k);
  m.send(sock_);
  if (sock_.readable(timeout)) {
    Reader in{sock_, Clock::now() + timeout_};
    CHORUS_CHECK_T(DistError, in.value<uint8_t>() == kStopWaiting, "store at ", address_, ": unexpected answer to WAIT");
    return;
  }
  // Cancel; the server may have answered just before seeing it.
  Message(kCancelWait).send(sock_);
  Reader in{sock_, Clock::now() + std::chrono::seconds(30)};
  uint8_t r = in.value<uint8_t>();
  if (r == kStopWaiting) r = in.value<uint8_t>();
  CHORUS_CHECK_T(DistError, r == kWaitCanceled, "store at ", address_, ": unexpected answer to CANCEL_WAIT");
  throw_store_timeout(keys, timeout, address_);
}

void TCPStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lk(mu_);
  wait_locked(keys, timeout);
}

Bytes TCPStore::get(const std::string& key) {
  std::lock_guard<std::mutex> lk(mu_);
  wait_locked({key}, timeout_);
  Message(kGet).str(key).send(sock_);
  return Reader{sock_, Clock::now() + timeout_}.bytes();
}

int64_t TCPStore::add(const std::string& key, int64_t delta) {
  std::lock_guard<std::mutex> lk(mu_);
  Message(kAdd).str(key).value<int64_t>(delta).send(sock_);
  return Reader{sock_, Clock::now() + timeout_}.value<int64_t>();
}

Bytes TCPStore::compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  std::lock_guard<std::mutex> lk(mu_);
  Message(kCompareSet).str(key).bytes(expected).bytes(desired).send(sock_);
  return Reader{sock_, Clock::now() + timeout_}.bytes();
}

bool TCPStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lk(mu_);
  Message m(kCheck);
  m.value<uint64_t>(keys.size());
  for (const auto& k : keys) m.str(k);
  m.send(sock_);
  return Reader{sock_, Clock::now() + timeout_}.value<uint8_t>() == kReady;
}

bool TCPStore::delete_key(const std::string& key) {
  std::lock_guard<std::mutex> lk(mu_);
  Message(kDeleteKey).str(key).send(sock_);
  return Reader{sock_, Clock::now() + timeout_}.value<int64_t>() == 1;
}

int64_t TCPStore::num_keys() {
  std::lock_guard<std::mutex> lk(mu_);
  Message(kNumKeys).send(sock_);
  return Reader{sock_, Clock::now() + timeout_}.value<int64_t>();
}

}  // namespace chorus::dist
