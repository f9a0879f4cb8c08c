// The job secret (Note [Store job secret] in distributed/store_auth.h): SHA-256 and
// HMAC-SHA256 against the published vectors, the store's handshake over real
// sockets on 127.0.0.x, secret files, and the listen address.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <chorus/distributed/hmac_sha256.h>
#include <chorus/distributed/job_secret.h>
#include <chorus/distributed/rendezvous.h>
#include <chorus/distributed/store_address.h>
#include <chorus/distributed/store_auth.h>
#include <chorus/distributed/tcp_store.h>

#include "testing/expect_error.h"

namespace chorus::dist {
namespace store_auth_tests {

using namespace std::chrono_literals;

std::string hex_of(const Digest& d) {
  static const char* h = "0123456789abcdef";
  std::string s;
  for (uint8_t c : d) s += h[c >> 4], s += h[c & 15];
  return s;
}
std::string sha(const std::string& m) { return hex_of(sha256(m.data(), m.size())); }
std::string mac(const std::string& k, const std::string& m) { return hex_of(hmac_sha256(k, m.data(), m.size())); }
Bytes bytes_of(const std::string& x) { return Bytes(x.begin(), x.end()); }

const std::string kSecret = "0123456789abcdef-the-job", kOther = "fedcba9876543210-another";

// FIPS 180-2 appendix B (one block, two blocks, a million bytes) and the empty message.
TEST(StoreAuth, Sha256Vectors) {
  EXPECT_EQ(sha("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha(std::string(1000000, 'a')), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

// RFC 4231 test cases 1-4, 6 and 7 (5 truncates the output).
TEST(StoreAuth, HmacSha256Rfc4231) {
  std::string k4;
  for (int i = 1; i <= 25; ++i) k4 += static_cast<char>(i);
  const std::string big_key(131, '\xaa');
  EXPECT_EQ(mac(std::string(20, '\x0b'), "Hi There"), "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  EXPECT_EQ(mac("Jefe", "what do ya want for nothing?"),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  EXPECT_EQ(mac(std::string(20, '\xaa'), std::string(50, '\xdd')),
            "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe");
  EXPECT_EQ(mac(k4, std::string(50, '\xcd')), "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b");
  EXPECT_EQ(mac(big_key, "Test Using Larger Than Block-Size Key - Hash Key First"),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  EXPECT_EQ(mac(big_key, "This is a test using a larger than block-size key and a larger than block-size data. The "
                         "key needs to be hashed before being used by the HMAC algorithm."),
            "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2");
}

TEST(StoreAuth, TheRightSecretIsServed) {
  TCPStoreServer server(0, "127.0.0.1", kSecret);
  TCPStore st("127.0.0.1", server.port(), 10s, kSecret);
  st.set("world_size", bytes_of("2"));
  EXPECT_EQ(st.get("world_size"), bytes_of("2"));
  EXPECT_EQ(st.add("n", 3), 3);
  EXPECT_EQ(server.refused(), 0u);
}

// Each refusal is one line naming what is wrong, and is not retried as a
// store that is not up yet would be (StoreAuthError).
TEST(StoreAuth, WrongMissingOrUnwantedSecretsAreNamed) {
  TCPStoreServer server(0, "127.0.0.1", kSecret);
  const std::string at = "the store at 127.0.0.1:" + std::to_string(server.port());
  EXPECT_TRUE(test::throws_naming<StoreAuthError>([&] { TCPStore("127.0.0.1", server.port(), 5s, kOther); },
                                                  {at + " was given another job secret than this process"}));
  EXPECT_TRUE(test::throws_naming<StoreAuthError>([&] { TCPStore("127.0.0.1", server.port(), 5s); },
                                                  {at + " requires the job's secret and this process has none"}));
  // No message shows a secret.
  try {
    TCPStore("127.0.0.1", server.port(), 5s, kOther);
  } catch (const StoreAuthError& e) {
    EXPECT_EQ(std::string(e.what()).find(kOther), std::string::npos);
    EXPECT_EQ(std::string(e.what()).find(kSecret), std::string::npos);
  }
  TCPStoreServer open(0, "127.0.0.1");
  EXPECT_TRUE(test::throws_naming<StoreAuthError>([&] { TCPStore("127.0.0.1", open.port(), 5s, kSecret); },
                                                  {"has no job secret but this process was given one"}));
  EXPECT_EQ(open.refused(), 0u);
  for (int i = 0; i < 200 && server.refused() < 3; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(server.refused(), 3u);  // the one without a secret is the first store's
  EXPECT_EQ(server.first_refused_peer().rfind("127.0.0.1:", 0), 0u);
}

// A client that speaks PyTorch's protocol without the secret (VALIDATE, then
// SET), or fakes a proof, is dropped before it writes a key.
TEST(StoreAuth, AnOutsiderCannotWriteAKey) {
  TCPStoreServer server(0, "127.0.0.1", kSecret);
  auto raw = [&] {
    Socket s = Socket::connect("127.0.0.1", server.port(), 5s);
    std::vector<uint8_t> validate{0x00, 0xCE, 0xF7, 0x85, 0x3C};
    s.send_all(validate.data(), validate.size());
    return s;
  };
  auto set_msg = [](const std::string& k, const std::string& v) {
    std::vector<uint8_t> m{0x01};
    for (const std::string* x : {&k, &v}) {
      const uint64_t n = x->size();
      m.insert(m.end(), reinterpret_cast<const uint8_t*>(&n), reinterpret_cast<const uint8_t*>(&n) + 8);
      m.insert(m.end(), x->begin(), x->end());
    }
    return m;
  };
  // Closed: end of file, or a reset (the server left the SET unread).
  auto closed = [](Socket& s) {
    char c;
    return s.readable(5s) && ::recv(s.fd(), &c, 1, 0) <= 0;
  };
  {  // SET without AUTH
    Socket s = raw();
    auto m = set_msg("world_size", "7");
    s.send_all(m.data(), m.size());
    EXPECT_TRUE(closed(s));
  }
  {  // AUTH with a made-up proof, then SET
    Socket s = raw();
    std::vector<uint8_t> hello(33, 0x5a);
    hello[0] = kAuthQuery;
    s.send_all(hello.data(), hello.size());
    std::vector<uint8_t> challenge(65);
    s.recv_all(challenge.data(), challenge.size(), Clock::now() + 5s);
    EXPECT_EQ(challenge[0], kAuthChallenge);
    std::vector<uint8_t> proof(32, 0);
    auto m = set_msg("job", "outsider");
    proof.insert(proof.end(), m.begin(), m.end());
    (void)::send(s.fd(), proof.data(), proof.size(), MSG_NOSIGNAL);
    EXPECT_TRUE(closed(s));
  }
  TCPStore st("127.0.0.1", server.port(), 10s, kSecret);
  EXPECT_FALSE(st.check({"world_size"}));
  EXPECT_FALSE(st.check({"job"}));
  EXPECT_EQ(st.num_keys(), 0);
}

// Each connection gets its own challenge: the same client nonce twice gets
// two different server nonces, so a recorded proof is worth nothing.
TEST(StoreAuth, ChallengesAreFresh) {
  TCPStoreServer server(0, "127.0.0.1", kSecret);
  std::vector<std::vector<uint8_t>> seen;
  for (int i = 0; i < 2; ++i) {
    Socket s = Socket::connect("127.0.0.1", server.port(), 5s);
    std::vector<uint8_t> m{0x00, 0xCE, 0xF7, 0x85, 0x3C, kAuthQuery};
    m.resize(m.size() + 32, 0x11);
    s.send_all(m.data(), m.size());
    std::vector<uint8_t> challenge(65);
    s.recv_all(challenge.data(), challenge.size(), Clock::now() + 5s);
    seen.push_back(challenge);
  }
  EXPECT_NE(seen[0], seen[1]);
}

TEST(StoreAuth, RendezvousWithTheSecret) {
  TCPStoreServer server(0, "127.0.0.1", kSecret);
  auto env = [&](int rank, const std::string& secret) {
    LaunchEnv e;
    e.launcher = "chorus";
    e.rank = rank;
    e.world_size = 2;
    e.master_addr = "127.0.0.1";
    e.master_port = server.port();
    e.use_agent_store = true;
    e.job_secret = secret;
    return e;
  };
  EXPECT_TRUE(test::throws_naming<StoreAuthError>([&] { rendezvous(env(1, kOther), 5s); }, {"another job secret"}));
  std::thread first([&] { EXPECT_NO_THROW(rendezvous(env(0, kSecret), 20s)); });
  EXPECT_NO_THROW(rendezvous(env(1, kSecret), 20s));
  first.join();
}

// Under torchrun its agent serves the store (PyTorch's, which knows no
// secret and would drop an AUTH): a secret in the environment is not sent.
// A store without one plays it here; it would refuse a client that sent one.
TEST(StoreAuth, TorchrunsStoreGetsNoAuth) {
  TCPStoreServer server(0, "127.0.0.1");
  LaunchEnv e;
  e.launcher = "torchrun";
  e.master_addr = "127.0.0.1";
  e.master_port = server.port();
  e.use_agent_store = true;
  e.job_secret = kSecret;
  EXPECT_NO_THROW(rendezvous(e, 20s));
  e.launcher = "env";  // RANK etc. by hand: the secret given is meant for a Chorus store
  EXPECT_TRUE(test::throws_naming<StoreAuthError>([&] { rendezvous(e, 5s); }, {"has no job secret"}));
}

TEST(StoreAuth, SecretFiles) {
  char dir[] = "/tmp/chorus_secret_XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  const std::string path = std::string(dir) + "/secret";
  std::ofstream(path) << kSecret << "\n";
  ::chmod(path.c_str(), 0644);
  EXPECT_TRUE(test::throws_naming<ValueError>([&] { read_job_secret_file(path); },
                                              {"--job-secret-file " + path + " has mode 0644", "chmod 600"}));
  ::chmod(path.c_str(), 0600);
  EXPECT_EQ(read_job_secret_file(path), kSecret);
  std::ofstream(path) << "short\n";
  EXPECT_TRUE(test::throws_naming<ValueError>([&] { read_job_secret_file(path); }, {"needs at least 16"}));
  EXPECT_TRUE(test::throws_naming<ValueError>([&] { read_job_secret_file(path + ".none"); }, {"No such file"}));
  ::unlink(path.c_str());
  ::rmdir(dir);
  const std::string a = make_job_secret(), b = make_job_secret();
  EXPECT_EQ(a.size(), 64u);
  EXPECT_NE(a, b);
}

// Note [Store listen address]: the master address itself; a store bound to
// 127.0.0.2 is not reachable on 127.0.0.1.
TEST(StoreAuth, ListensOnTheMasterAddress) {
  EXPECT_EQ(store_listen_address("127.0.0.2", true), "127.0.0.2");
  EXPECT_EQ(store_listen_address("localhost", false), "127.0.0.1");
  EXPECT_EQ(store_listen_address("", false), "0.0.0.0");
  EXPECT_EQ(store_listen_address("::1", false), "0.0.0.0");
  EXPECT_EQ(store_connect_address("0.0.0.0"), "127.0.0.1");
  TCPStoreServer server(0, store_listen_address("127.0.0.2", false), kSecret);
  EXPECT_NO_THROW(TCPStore("127.0.0.2", server.port(), 5s, kSecret));
  EXPECT_TRUE(test::throws_naming<DistError>([&] { TCPStore("127.0.0.1", server.port(), 300ms, kSecret); },
                                             {"cannot reach the store at 127.0.0.1"}));
  EXPECT_TRUE(test::throws_naming<DistError>([&] { TCPStoreServer(0, "192.0.2.77"); },
                                             {"not an address of this machine"}));
}

}  // namespace store_auth_tests
}  // namespace chorus::dist
