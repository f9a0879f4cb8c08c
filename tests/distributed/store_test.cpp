// The stores (HashStore, PrefixStore, TCPStore over real sockets on
// 127.0.0.1), the launcher environments and the rendezvous failures.
#include <gtest/gtest.h>

#include <optional>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>

#include <atomic>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <chorus/distributed/hash_store.h>
#include <chorus/distributed/launch_env.h>
#include <chorus/distributed/process_group.h>
#include <chorus/chorus.h>
#include <chorus/distributed/prefix_store.h>
#include <chorus/distributed/rendezvous.h>
#include <chorus/distributed/tcp_store.h>

#include "testing/expect_error.h"

namespace chorus::dist {
namespace {

using namespace std::chrono_literals;

std::string s(const Bytes& b) { return std::string(b.begin(), b.end()); }
Bytes b(const std::string& x) { return Bytes(x.begin(), x.end()); }

// The same semantics from every implementation. `other` is a second handle on
// the same store (a TCPStore connection carries one query at a time, so a
// second thread needs its own, as a second rank has).
void exercise(Store& st, Store& other) {
  st.set("a", b("1"));
  EXPECT_EQ(s(st.get("a")), "1");
  EXPECT_EQ(st.add("n", 5), 5);
  EXPECT_EQ(st.add("n", -2), 3);
  EXPECT_EQ(s(st.get("n")), "3");
  EXPECT_TRUE(st.check({"a", "n"}));
  EXPECT_FALSE(st.check({"a", "missing"}));
  // compare_set: absent + empty expected sets; a match swaps; a mismatch leaves it.
  EXPECT_EQ(s(st.compare_set("c", {}, b("x"))), "x");
  EXPECT_EQ(s(st.compare_set("c", b("x"), b("y"))), "y");
  EXPECT_EQ(s(st.compare_set("c", b("nope"), b("z"))), "y");
  // Binary values with zeros, and a large one.
  Bytes big(3 << 20);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<uint8_t>(i * 7);
  st.set("big", big);
  EXPECT_EQ(st.get("big"), big);
  EXPECT_TRUE(st.delete_key("a"));
  EXPECT_FALSE(st.delete_key("a"));
  EXPECT_FALSE(st.check({"a"}));
  // wait: returns once another thread sets the key; times out naming it.
  std::thread later([&] {
    std::this_thread::sleep_for(50ms);
    other.set("late", b("!"));
  });
  st.wait({"late"}, 5s);
  later.join();
  EXPECT_TRUE(test::throws_naming<DistError>([&] { st.wait({"never"}, 200ms); }, {"never'"}));
}

TEST(Store, HashStore) {
  HashStore st;
  exercise(st, st);
}

TEST(Store, TCPStoreAgainstItsServer) {
  TCPStoreServer server(0, "127.0.0.1");
  TCPStore st("127.0.0.1", server.port(), 10s), other("127.0.0.1", server.port(), 10s);
  exercise(st, other);
}

TEST(Store, PrefixStoreKeepsNamespacesApart) {
  auto inner = std::make_shared<HashStore>();
  PrefixStore a("job/a", inner), c("job/c", inner);
  a.set("k", b("from a"));
  c.set("k", b("from c"));
  EXPECT_EQ(s(a.get("k")), "from a");
  EXPECT_EQ(s(c.get("k")), "from c");
  EXPECT_TRUE(inner->check({"job/a/k", "job/c/k"}));
  PrefixStore p("x", inner);
  exercise(p, p);
}

TEST(Store, ManyClientsAddConcurrently) {
  TCPStoreServer server(0, "127.0.0.1");
  std::vector<std::thread> ts;
  for (int c = 0; c < 8; ++c)
    ts.emplace_back([&] {
      TCPStore st("127.0.0.1", server.port(), 10s);
      for (int i = 0; i < 200; ++i) st.add("counter", 1);
    });
  for (auto& t : ts) t.join();
  TCPStore st("127.0.0.1", server.port(), 10s);
  EXPECT_EQ(st.add("counter", 0), 1600);
  // A GET of a key set later by another client waits for it.
  std::thread setter([&] {
    std::this_thread::sleep_for(100ms);
    TCPStore other("127.0.0.1", server.port(), 10s);
    other.set("x", b("ready"));
  });
  EXPECT_EQ(s(st.get("x")), "ready");
  setter.join();
}

// Issue 47, item 5 (Note [Store connections are bounded]): 2,000
// connect-and-close calls (each finished thread's stack stayed mapped until the
// server ended: ~33,000 aborted the launcher; dist.store_flood sends 100,000
// to a launcher), clients that announce a 1 GiB value and send 10 bytes of it,
// and clients that connect and say nothing. The server's mappings stay
// bounded, and a real client is served throughout.
size_t mappings() {
  std::ifstream maps("/proc/self/maps");
  return static_cast<size_t>(std::count(std::istreambuf_iterator<char>(maps), std::istreambuf_iterator<char>(), '\n'));
}
int raw_connect(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0) << std::strerror(errno);
  return fd;
}
// The server reaps finished clients' threads every accept-loop tick (100 ms);
// waits up to 5 s for the mappings to come back under `bound`.
bool mappings_settle_below(size_t bound) {
  for (int i = 0; i < 50; ++i) {
    if (mappings() < bound) return true;
    std::this_thread::sleep_for(100ms);
  }
  return mappings() < bound;
}
TEST(Store, ServerSurvivesHostileConnections) {
  TCPStoreServer server(0, "127.0.0.1");
  TCPStore client("127.0.0.1", server.port(), 30s);
  client.set("k", b("before"));
  const size_t before = mappings();
  for (int i = 0; i < 2000; ++i) {
    const int fd = raw_connect(server.port());
    linger l{1, 0};  // closed with a reset: no TIME_WAIT pile-up on this side
    ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
    ::close(fd);
    if (i % 500 == 0) EXPECT_EQ(s(client.get("k")), "before") << "after " << i << " connections";
  }
  // 2,000 finished clients left 2 mappings each before the fix; now none. (The
  // bound is measured with no client open: a live thread's own mappings vary
  // with the build, ~2 plain, ~9 under ThreadSanitizer.)
  EXPECT_TRUE(mappings_settle_below(before + 100)) << "mappings grew from " << before << " to " << mappings() << " after 2000 finished clients";
  // Half-sent SETs: the magic, then a SET of a 1 GiB value of which 10 bytes come.
  std::vector<int> stalled;
  for (int i = 0; i < 64; ++i) {
    const int fd = raw_connect(server.port());
    std::vector<uint8_t> m{0};
    const uint32_t magic = 0x3C85F7CE;
    m.insert(m.end(), reinterpret_cast<const uint8_t*>(&magic), reinterpret_cast<const uint8_t*>(&magic) + 4);
    m.push_back(1);  // SET
    const uint64_t klen = 1, vlen = uint64_t{1} << 30;
    m.insert(m.end(), reinterpret_cast<const uint8_t*>(&klen), reinterpret_cast<const uint8_t*>(&klen) + 8);
    m.push_back('x');
    m.insert(m.end(), reinterpret_cast<const uint8_t*>(&vlen), reinterpret_cast<const uint8_t*>(&vlen) + 8);
    m.insert(m.end(), 10, 0xAB);
    ASSERT_EQ(::send(fd, m.data(), m.size(), MSG_NOSIGNAL), static_cast<ssize_t>(m.size()));
    stalled.push_back(fd);
  }
  for (int i = 0; i < 64; ++i) stalled.push_back(raw_connect(server.port()));  // and say nothing
  // A real client is served while the 128 hold their threads.
  client.set("k", b("after"));
  EXPECT_EQ(s(client.get("k")), "after");
  for (int fd : stalled) ::close(fd);
  // Their threads end and are reaped too: nothing stays behind.
  EXPECT_TRUE(mappings_settle_below(before + 100)) << "mappings grew from " << before << " to " << mappings() << " after 128 stalled clients left";
}

TEST(Store, UnreachableMasterAndTakenPort) {
  // A port nobody listens on: the error names the address and the time tried.
  int port = 0;
  {
    TCPStoreServer probe(0, "127.0.0.1");
    port = probe.port();
  }
  EXPECT_TRUE(test::throws_naming<DistError>([&] { TCPStore("127.0.0.1", port, 300ms); }, {"cannot reach the store at 127.0.0.1:" + std::to_string(port)}));
  TCPStoreServer server(0, "127.0.0.1");
  EXPECT_TRUE(test::throws_naming<DistError>([&] { TCPStoreServer again(server.port(), "127.0.0.1"); }, {"the port is taken"}));
}

// ---- launcher environments --------------------------------------------------------

// Sets variables for one test and puts back what the process had before.
struct EnvGuard {
  std::vector<std::pair<std::string, std::optional<std::string>>> saved;
  void remember(const std::string& k) {
    for (const auto& [name, value] : saved)
      if (name == k) return;
    const char* v = std::getenv(k.c_str());
    saved.emplace_back(k, v ? std::optional<std::string>(v) : std::nullopt);
  }
  void set(const std::string& k, const std::string& v) {
    remember(k);
    ::setenv(k.c_str(), v.c_str(), 1);
  }
  void unset(const std::string& k) {
    remember(k);
    ::unsetenv(k.c_str());
  }
  ~EnvGuard() {
    for (auto it = saved.rbegin(); it != saved.rend(); ++it) {
      if (it->second) ::setenv(it->first.c_str(), it->second->c_str(), 1);
      else ::unsetenv(it->first.c_str());
    }
  }
};

TEST(LaunchEnv, NoneWhenNotLaunched) {
  for (const char* v : {"RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID",
                        "SLURM_NTASKS"})
    ::unsetenv(v);
  EXPECT_FALSE(read_launch_env().has_value());
}

TEST(LaunchEnv, TorchrunStyle) {
  EnvGuard g;
  g.set("RANK", "3"), g.set("WORLD_SIZE", "8"), g.set("LOCAL_RANK", "1"), g.set("LOCAL_WORLD_SIZE", "4");
  g.set("MASTER_ADDR", "node7"), g.set("MASTER_PORT", "1234"), g.set("TORCHELASTIC_USE_AGENT_STORE", "True");
  g.set("TORCHELASTIC_RUN_ID", "x");
  auto e = read_launch_env();
  ASSERT_TRUE(e);
  EXPECT_EQ(e->launcher, "torchrun");
  EXPECT_EQ(e->rank, 3);
  EXPECT_EQ(e->world_size, 8);
  EXPECT_EQ(e->local_rank, 1);
  EXPECT_EQ(e->local_world_size, 4);
  EXPECT_EQ(e->master_addr, "node7");
  EXPECT_EQ(e->master_port, 1234);
  EXPECT_TRUE(e->use_agent_store);
}

TEST(LaunchEnv, OpenMPIAndSlurm) {
  {
    EnvGuard g;
    g.set("OMPI_COMM_WORLD_RANK", "2"), g.set("OMPI_COMM_WORLD_SIZE", "3");
    g.set("OMPI_COMM_WORLD_LOCAL_RANK", "2"), g.set("OMPI_COMM_WORLD_LOCAL_SIZE", "3");
    auto e = read_launch_env();
    ASSERT_TRUE(e);
    EXPECT_EQ(e->launcher, "mpirun");
    EXPECT_EQ(e->rank, 2);
    EXPECT_EQ(e->master_addr, "127.0.0.1");  // one machine: this one
  }
  {
    EnvGuard g;
    g.set("OMPI_COMM_WORLD_RANK", "2"), g.set("OMPI_COMM_WORLD_SIZE", "8");
    g.set("OMPI_COMM_WORLD_LOCAL_RANK", "2"), g.set("OMPI_COMM_WORLD_LOCAL_SIZE", "4");
    EXPECT_TRUE(test::throws_naming<ValueError>([] { read_launch_env(); }, {"MASTER_ADDR is not set"}));
  }
  {
    EnvGuard g;
    g.set("SLURM_PROCID", "5"), g.set("SLURM_NTASKS", "8"), g.set("SLURM_LOCALID", "1");
    g.set("SLURM_NODELIST", "gpu[07-09,12],login1"), g.set("SLURM_NTASKS_PER_NODE", "4(x2)");
    auto e = read_launch_env();
    ASSERT_TRUE(e);
    EXPECT_EQ(e->launcher, "slurm");
    EXPECT_EQ(e->rank, 5);
    EXPECT_EQ(e->local_world_size, 4);
    EXPECT_EQ(e->master_addr, "gpu07");
  }
  EXPECT_EQ(first_slurm_host("node1,node2"), "node1");
  EXPECT_EQ(first_slurm_host("a[3-5]"), "a3");
}

TEST(LaunchEnv, BadValuesNameTheVariable) {
  EnvGuard g;
  g.set("RANK", "4"), g.set("WORLD_SIZE", "4"), g.set("MASTER_ADDR", "h");
  EXPECT_TRUE(test::throws_naming<ValueError>([] { read_launch_env(); }, {"RANK=4 is out of range [0, 3]"}));
  g.set("RANK", "x1");
  EXPECT_TRUE(test::throws_naming<ValueError>([] { read_launch_env(); }, {"RANK='x1' is not an integer"}));
  g.set("RANK", "0"), g.set("MASTER_PORT", "70000");
  EXPECT_TRUE(test::throws_naming<ValueError>([] { read_launch_env(); }, {"MASTER_PORT=70000 is out of range"}));
}

// ---- rendezvous failures ----------------------------------------------------------

LaunchEnv env_of(int rank, int world, int port) {
  LaunchEnv e;
  e.rank = rank;
  e.world_size = world;
  e.master_addr = "127.0.0.1";
  e.master_port = port;
  e.use_agent_store = true;  // the test's server plays the launcher
  return e;
}

TEST(Rendezvous, WorldSizesThatDisagree) {
  TCPStoreServer server(0, "127.0.0.1");
  std::thread first([&] {
    try {
      rendezvous(env_of(0, 2, server.port()), 2s);
    } catch (const DistError&) {
    }
  });
  std::this_thread::sleep_for(100ms);
  EXPECT_TRUE(test::throws_naming<DistError>([&] { rendezvous(env_of(1, 3, server.port()), 2s); }, {"was started with world size 3 but another rank of this job with 2"}));
  first.join();
}

TEST(Rendezvous, RankThatJoinsTwiceAndRanksThatNeverCome) {
  TCPStoreServer server(0, "127.0.0.1");
  std::thread first([&] {
    try {
      rendezvous(env_of(1, 3, server.port()), 1s);
    } catch (const DistError&) {
    }
  });
  std::this_thread::sleep_for(100ms);
  EXPECT_TRUE(test::throws_naming<DistError>([&] { rendezvous(env_of(1, 3, server.port()), 1s); }, {"rank 1 joined twice"}));
  first.join();
  TCPStoreServer other(0, "127.0.0.1");
  EXPECT_TRUE(test::throws_naming<DistError>([&] { rendezvous(env_of(0, 3, other.port()), 500ms); },
                                             {"rank(s) 1, 2 of 3 had not joined"}));
}

// Note [Job ids]: a process of another job given the same port is stopped at
// once with one line, and the job whose store it is goes on unharmed.
TEST(Rendezvous, AProcessOfAnotherJobOnTheSamePortIsNamed) {
  TCPStoreServer server(0, "127.0.0.1");
  auto of_job = [&](int rank, const std::string& id) {
    LaunchEnv e = env_of(rank, 2, server.port());
    e.job_id = id;
    return e;
  };
  std::string first_error = "did not finish";
  std::thread first([&] {
    try {
      rendezvous(of_job(0, "chorus:A"), 20s);
      first_error.clear();
    } catch (const std::exception& e) {
      first_error = e.what();
    }
  });
  // Job A's id is in the store before job B's process comes.
  TCPStore look("127.0.0.1", server.port(), 20s);
  look.wait({"chorus/0/job"});
  EXPECT_TRUE(test::throws_naming<DistError>([&] { rendezvous(of_job(1, "chorus:B"), 20s); },
                                             {"another job's (job id 'chorus:A', this process's 'chorus:B')",
                                              "two jobs were given MASTER_PORT=" + std::to_string(server.port())}));
  EXPECT_NO_THROW(rendezvous(of_job(1, "chorus:A"), 20s));  // job A's own rank 1: not "joined twice"
  first.join();
  EXPECT_EQ(first_error, "");
}

TEST(LaunchEnv, JobIdsFromEachLauncher) {
  EnvGuard g;
  for (const char* v : {"CHORUS_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_STEP_ID", "PMIX_NAMESPACE",
                        "OMPI_MCA_ess_base_jobid", "CHORUS_LAUNCHER", "RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                        "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"})
    g.unset(v);
  for (const char* l : {"env", "chorus", "torchrun", "mpirun", "slurm"}) EXPECT_EQ(job_id_of_environment(l), "") << l;
  // Each launcher's own variable, and only its own: mpirun inside a Slurm job
  // sees Slurm's too, which may differ between its ranks.
  g.set("OMPI_MCA_ess_base_jobid", "771");
  g.set("SLURM_JOB_ID", "42");
  g.set("TORCHELASTIC_RUN_ID", "none");
  EXPECT_EQ(job_id_of_environment("mpirun"), "ompi:771");
  g.set("PMIX_NAMESPACE", "prterun-h-5@1");
  EXPECT_EQ(job_id_of_environment("mpirun"), "pmix:prterun-h-5@1");
  EXPECT_EQ(job_id_of_environment("slurm"), "slurm:42");
  g.set("SLURM_STEP_ID", "3");
  EXPECT_EQ(job_id_of_environment("slurm"), "slurm:42.3");
  EXPECT_EQ(job_id_of_environment("torchrun"), "");  // torchrun's default, "none", says nothing
  EXPECT_EQ(job_id_of_environment("env"), "");
  g.set("TORCHELASTIC_RUN_ID", "exp7");
  EXPECT_EQ(job_id_of_environment("torchrun"), "torchrun:exp7");
  g.set("CHORUS_RUN_ID", "r1");  // set by hand or by chorus launch: every launcher's
  for (const char* l : {"env", "chorus", "torchrun", "mpirun", "slurm"}) EXPECT_EQ(job_id_of_environment(l), "chorus:r1") << l;
  g.set("RANK", "0"), g.set("WORLD_SIZE", "1"), g.set("MASTER_ADDR", "127.0.0.1");
  EXPECT_EQ(read_launch_env()->job_id, "chorus:r1");
  g.unset("CHORUS_RUN_ID");
  EXPECT_EQ(read_launch_env()->job_id, "torchrun:exp7");  // TORCHELASTIC_RUN_ID set: torchrun
}

}  // namespace
}  // namespace chorus::dist

namespace chorus::dist {
namespace {

// A backend this build or machine lacks is refused with one clear error.
TEST(ProcessGroupBackends, RefusedWithAClearError) {
  auto store = std::make_shared<HashStore>();
  EXPECT_TRUE(test::throws_naming<ValueError>([&] { make_process_group("mpi", 0, 1, store); },
                                              {"unknown process-group backend 'mpi'"}));
  if (!nccl_backend_available()) {
    EXPECT_TRUE(test::throws_naming<DistError>([&] { make_process_group("nccl", 0, 1, store); }, {"has no NCCL"}));
  } else if (cuda_device_count() == 0) {
    EXPECT_TRUE(test::throws_naming<ValueError>([&] { make_process_group("nccl", 0, 1, store); },
                                                {"the nccl backend needs a CUDA GPU"}));
  }
  if (!gloo_available()) {
    EXPECT_TRUE(test::throws_naming<DistError>([&] { make_process_group("gloo", 0, 1, store); }, {"has no Gloo"}));
  } else {
    // A world of one: every collective works (and is the identity).
    auto pg = make_process_group("gloo", 0, 1, store);
    Tensor t = from_vector(std::vector<float>{1.5f, -2.f}, {2});
    pg->all_reduce(t, ReduceOp::Avg)->wait();
    EXPECT_EQ(t.to_vector<float>(), (std::vector<float>{1.5f, -2.f}));
    EXPECT_TRUE(test::throws_naming<ValueError>([&] { pg->send(t, 0); }, {"is not another rank"}));
  }
}

}  // namespace
}  // namespace chorus::dist
