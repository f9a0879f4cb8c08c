// `chorus launch` (DESIGN.md, "Command line"; docs/distributed.md).
//
// Note [Launcher]: node 0's launcher hosts the job's TCP store (as torchrun's
// agent does) and tells the workers so (TORCHELASTIC_USE_AGENT_STORE=True):
// a worker that dies, rank 0 included, does not take the store with it, so
// the others can still find out who is missing. Each worker runs in its own
// process group with PR_SET_PDEATHSIG, so nothing outlives the launcher:
// stopping the job signals every worker's whole process group. Output: rank
// 0's stdout is passed through byte for byte (so `--json` can be piped), every
// other line is prefixed "[rank N] "; with --log-dir each rank's output also
// goes to rank_N.log. The last lines of each rank are kept for the failure
// report. On several nodes the launchers watch a key in the store, so a
// failure on one node ends the job on all. The store serves only processes
// that prove the job's secret, which the launcher hands its workers in their
// environment (Note [Store job secret] in distributed/store_auth.h).
#include "launch.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <thread>

#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/distributed/job_secret.h"
#include "chorus/distributed/launch_env.h"
#include "chorus/distributed/store_address.h"
#include "chorus/distributed/store_auth.h"
#include "chorus/distributed/tcp_store.h"
#include "cli_numbers.h"

namespace chorus::app {

namespace {

volatile sig_atomic_t g_signal = 0;
int g_wake[2] = {-1, -1};  // self-pipe: a signal wakes the poll loop

void on_signal(int sig) {
  if (!g_signal) g_signal = sig;
  const char b = 1;
  (void)!::write(g_wake[1], &b, 1);
}

struct Stream {
  int fd = -1;
  std::string partial;  // an unfinished line
};

struct Worker {
  int rank = 0, local_rank = 0;
  pid_t pid = -1;
  Stream out, err;
  std::deque<std::string> tail;  // last lines, for the failure report
  FILE* log = nullptr;
  bool exited = false;
  bool stopped = false;  // by SIGSTOP/SIGTSTP: alive but will never answer
  bool was_stopped = false;  // stopped at some point (named in the report)
  int status = 0;
};

constexpr size_t kTailLines = 12;
constexpr std::chrono::seconds kStoreWait{300};  // for node 0's store, from another node
constexpr size_t kTailLineBytes = 4096;
constexpr size_t kMaxLine = size_t{1} << 20;  // longer output lines are passed on in pieces

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("was killed by signal ") + std::to_string(WTERMSIG(status)) + " (" +
                                  strsignal(WTERMSIG(status)) + ")";
  return "ended";
}

class Launcher {
 public:
  explicit Launcher(const LaunchConfig& c) : c_(c) {}

  int run() {
    nproc_ = resolve_nproc();
    world_ = nproc_ * c_.nnodes;
    if (!c_.log_dir.empty()) std::filesystem::create_directories(c_.log_dir);
    secret_ = job_secret();
    if (c_.node_rank == 0) {
      // On the master address alone (Note [Store listen address]), for
      // clients that prove the secret (Note [Store job secret]).
      const std::string listen = dist::store_listen_address(c_.master_addr, c_.nnodes > 1);
      server_ = std::make_unique<dist::TCPStoreServer>(c_.master_port, listen, secret_);
      store_host_ = dist::store_connect_address(listen);
    } else {
      store_host_ = c_.master_addr;
    }
    if (c_.nnodes == 1 && dist::job_id_of_environment("chorus").empty()) {
      std::random_device rd;
      char buf[40];
      std::snprintf(buf, sizeof buf, "%d-%08x%08x", static_cast<int>(::getpid()), rd(), rd());
      run_id_ = buf;
    }
    if (c_.nnodes > 1) {
      store_ = connect_to_store();
      if (!store_) {
        std::fprintf(stderr, "chorus launch: got signal %d (%s) while waiting for node 0's store; no worker was started\n",
                     static_cast<int>(g_signal), strsignal(g_signal));
        return 128 + g_signal;
      }
    }
    double backoff = c_.restart_backoff_s;
    for (int attempt = 0;; ++attempt) {
      const int rc = run_once(attempt);
      if (rc == 0 || g_signal || attempt >= c_.max_restarts) {
        report_refused(true);
        return rc;
      }
      // A failure that repeats at once (a port still taken, a file system
      // still full) gets a growing pause rather than a tight loop of restarts.
      std::fprintf(stderr, "chorus launch: restarting the job in %.1f s (%d of %d restarts)\n", backoff, attempt + 1,
                   c_.max_restarts);
      if (!pause_unless_signalled(backoff)) {
        std::fprintf(stderr, "chorus launch: got signal %d (%s) while waiting to restart; not restarting\n",
                     static_cast<int>(g_signal), strsignal(g_signal));
        return 128 + g_signal;
      }
      backoff = std::min(backoff * 2, kMaxRestartBackoff);
    }
  }

 private:
  // Note [Store job secret] (distributed/store_auth.h): --job-secret-file, else
  // CHORUS_JOB_SECRET, else on one node a fresh one. Nodes cannot agree on a
  // random secret by themselves: a job of several nodes must be given one.
  std::string job_secret() const {
    if (!c_.job_secret_file.empty()) return dist::read_job_secret_file(c_.job_secret_file);
    std::string s = dist::job_secret_from_environment();
    if (!s.empty()) return s;
    CHORUS_CHECK(c_.nnodes == 1, "chorus launch --nnodes ", c_.nnodes, ": every node of the job must be given the same "
                 "secret: export ", dist::kJobSecretVariable, " or pass --job-secret-file FILE (mode 600) on every node "
                 "(make one with: od -An -tx1 -N32 /dev/urandom | tr -d ' \\n')");
    return dist::make_job_secret();
  }

  // Connections the store dropped because they did not prove the secret: the
  // first is named when it is noticed, the total at the end; never a line
  // per connection (a flood of them would flood the log).
  void report_refused(bool at_end) {
    if (!server_) return;
    const size_t n = server_->refused();
    if (n > 0 && !refused_named_) {
      refused_named_ = true;
      std::fprintf(stderr, "chorus launch: the job's store dropped a connection from %s that did not prove the job "
                   "secret (a process not of this job, or given another secret); more are counted, not shown\n",
                   server_->first_refused_peer().c_str());
    }
    if (at_end && n > 1)
      std::fprintf(stderr, "chorus launch: the job's store dropped %zu connections that did not prove the job secret\n", n);
  }

  // The job's store on node 0, which may start after this node: tried for
  // kStoreWait, a short try at a time, so that SIGINT or SIGTERM ends the wait
  // within a try (a node-rank >= 1 launcher ignored them for up to 300 s while
  // node 0 was unreachable). Null when a signal came.
  std::unique_ptr<dist::TCPStore> connect_to_store() {
    const std::string& host = store_host_;
    const auto deadline = std::chrono::steady_clock::now() + kStoreWait;
    for (;;) {
      try {
        auto store = std::make_unique<dist::TCPStore>(host, c_.master_port, std::chrono::seconds(1), secret_);
        store->set_timeout(kStoreWait);
        return store;
      } catch (const StoreAuthError&) {
        throw;  // another secret: trying again will not help
      } catch (const Error& e) {
        if (g_signal) return nullptr;
        if (std::chrono::steady_clock::now() >= deadline)
          CHORUS_THROW(DistError, "node 0's store at ", host, ":", c_.master_port, " did not answer for ",
                       kStoreWait.count(), " s (last try: ", e.message(), ")");
      }
      if (!pause_unless_signalled(0.2)) return nullptr;
    }
  }

  // Sleeps `seconds`; false as soon as a signal arrives (the self-pipe wakes the poll).
  static bool pause_unless_signalled(double seconds) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (!g_signal) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
      if (left.count() <= 0) return true;
      pollfd p{g_wake[0], POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count(), 1000))) > 0) {
        char b[64];
        (void)!::read(g_wake[0], b, sizeof(b));
      }
    }
    return false;
  }

  int resolve_nproc() const {
    if (c_.nproc_per_node == "gpu") {
      const int n = cuda_device_count();
      CHORUS_CHECK(n > 0, "--nproc-per-node gpu: this machine has no visible GPU");
      return n;
    }
    try {
      size_t used = 0;
      const int n = std::stoi(c_.nproc_per_node, &used);
      if (used == c_.nproc_per_node.size() && n >= 1 && n <= 4096) return n;
    } catch (const std::exception&) {
    }
    CHORUS_THROW(ValueError, "--nproc-per-node must be a number from 1 to 4096 or 'gpu', got '", c_.nproc_per_node,
                 "'");
  }

  void start(Worker& w, int attempt) {
    int out[2], err[2];
    CHORUS_CHECK_T(Error, ::pipe2(out, O_CLOEXEC) == 0 && ::pipe2(err, O_CLOEXEC) == 0, "pipe: ", std::strerror(errno));
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    CHORUS_CHECK_T(Error, pid >= 0, "fork: ", std::strerror(errno));
    if (pid == 0) {
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(127);  // the launcher died before prctl
      ::dup2(out[1], 1);
      ::dup2(err[1], 2);
      ::signal(SIGXFSZ, SIG_DFL);  // chorus ignores it (Note [File size limit]); the program decides for itself
      auto set = [](const char* k, const std::string& v) { ::setenv(k, v.c_str(), 1); };
      set("RANK", std::to_string(w.rank));
      set("WORLD_SIZE", std::to_string(world_));
      set("LOCAL_RANK", std::to_string(w.local_rank));
      set("LOCAL_WORLD_SIZE", std::to_string(nproc_));
      set("GROUP_RANK", std::to_string(c_.node_rank));
      set("MASTER_ADDR", c_.master_addr);
      set("MASTER_PORT", std::to_string(c_.master_port));
      set("TORCHELASTIC_USE_AGENT_STORE", "True");
      set("CHORUS_LAUNCHER", "1");
      set("CHORUS_RESTART_COUNT", std::to_string(attempt));
      if (!run_id_.empty()) set("CHORUS_RUN_ID", run_id_);
      // In the environment, never on a command line: /proc/PID/environ is
      // readable by the same user only, /proc/PID/cmdline by everyone.
      set(dist::kJobSecretVariable, secret_);
      std::vector<char*> argv;
      for (const auto& a : c_.command) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execvp(argv[0], argv.data());
      std::fprintf(stderr, "chorus launch: cannot run '%s': %s\n", argv[0], std::strerror(errno));
      ::_exit(127);
    }
    ::setpgid(pid, pid);  // also here: no race with the child's own call
    ::close(out[1]);
    ::close(err[1]);
    w.pid = pid;
    w.out = {out[0], ""};
    w.err = {err[0], ""};
    w.exited = false;
    w.tail.clear();
    if (!c_.log_dir.empty()) {
      const std::string path = c_.log_dir + "/rank_" + std::to_string(w.rank) + ".log";
      w.log = std::fopen(path.c_str(), attempt == 0 ? "w" : "a");
    }
  }

  // Forwards what arrived on one of a worker's pipes; false at end of file.
  bool pump(Worker& w, Stream& s, bool is_stdout) {
    char buf[65536];
    const ssize_t n = ::read(s.fd, buf, sizeof(buf));
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return true;
    if (n <= 0) {
      if (!s.partial.empty()) emit(w, s.partial + "\n", is_stdout);
      s.partial.clear();
      ::close(s.fd);
      s.fd = -1;
      return false;
    }
    if (w.log) std::fwrite(buf, 1, static_cast<size_t>(n), w.log), std::fflush(w.log);
    if (w.rank == 0 && is_stdout) (void)!::write(1, buf, static_cast<size_t>(n));  // untouched, byte for byte
    split_lines(s, buf, static_cast<size_t>(n), [&](const std::string& line) { emit(w, line, is_stdout); });
    return true;
  }

  // Appends what arrived to the stream's unfinished line and hands on every
  // line it completes (with its '\n'). Linear in what arrives: the search for
  // '\n' starts where the last one stopped, and the lines are cut out in one
  // erase (a search from the start on every read made one long line cost
  // quadratic time). A line longer than kMaxLine goes on in pieces of that
  // size, so a worker that prints without newlines cannot fill our memory.
  template <typename OnLine>
  static void split_lines(Stream& s, const char* buf, size_t n, OnLine&& on_line) {
    size_t from = s.partial.size();  // nothing before this holds a '\n'
    s.partial.append(buf, n);
    size_t start = 0, pos;
    while ((pos = s.partial.find('\n', from)) != std::string::npos) {
      on_line(s.partial.substr(start, pos + 1 - start));
      start = from = pos + 1;
    }
    s.partial.erase(0, start);
    while (s.partial.size() >= kMaxLine) {
      on_line(s.partial.substr(0, kMaxLine) + "\n");
      s.partial.erase(0, kMaxLine);
    }
  }

  void keep(Worker& w, const std::string& line) {
    // The failure report shows a line's start; a megabyte of it helps nobody.
    w.tail.push_back(line.size() > kTailLineBytes ? line.substr(0, kTailLineBytes) + " [...]" : line);
    if (w.tail.size() > kTailLines) w.tail.pop_front();
  }

  void emit(Worker& w, const std::string& line, bool is_stdout) {
    keep(w, line.substr(0, line.size() - 1));
    if (w.rank == 0 && is_stdout) return;
    const std::string text = "[rank " + std::to_string(w.rank) + "] " + line;
    (void)!::write(is_stdout ? 1 : 2, text.data(), text.size());
  }

  void signal_all(std::vector<Worker>& ws, int sig) {
    for (auto& w : ws)
      if (!w.exited && w.pid > 0) {
        ::kill(-w.pid, sig);
        ::kill(-w.pid, SIGCONT);  // a stopped process acts on nothing until continued
        // Continued now: drain waits for it to act on `sig` (before, it
        // returned at once while a stopped worker was still being killed,
        // and the launcher could exit before reaping it).
        w.stopped = false;
      }
  }

  // Waits (pumping output) until every worker has exited or `deadline`.
  void drain(std::vector<Worker>& ws, std::chrono::steady_clock::time_point deadline) {
    // Stopped workers will not end by themselves: no point waiting for them.
    while (std::any_of(ws.begin(), ws.end(), [](const Worker& w) { return !w.exited && !w.stopped; }) &&
           std::chrono::steady_clock::now() < deadline)
      step(ws, 50);
  }

  // One round: output, exits. Returns the first worker that failed this round, or null.
  Worker* step(std::vector<Worker>& ws, int wait_ms) {
    std::vector<pollfd> fds;
    std::vector<std::pair<Worker*, Stream*>> who;
    fds.push_back({g_wake[0], POLLIN, 0});
    who.push_back({nullptr, nullptr});
    for (auto& w : ws)
      for (Stream* s : {&w.out, &w.err})
        if (s->fd >= 0) {
          fds.push_back({s->fd, POLLIN, 0});
          who.push_back({&w, s});
        }
    if (::poll(fds.data(), fds.size(), wait_ms) > 0) {
      for (size_t i = 0; i < fds.size(); ++i) {
        if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        if (i == 0) {
          char b[64];
          (void)!::read(g_wake[0], b, sizeof(b));
          continue;
        }
        pump(*who[i].first, *who[i].second, who[i].second == &who[i].first->out);
      }
    }
    Worker* failed = nullptr;
    for (auto& w : ws) {
      if (w.exited) continue;
      int status = 0;
      const pid_t r = ::waitpid(w.pid, &status, WNOHANG | WUNTRACED | WCONTINUED);
      if (r != w.pid) continue;
      if (WIFSTOPPED(status) || WIFCONTINUED(status)) {
        w.stopped = WIFSTOPPED(status);
        w.was_stopped = w.was_stopped || w.stopped;
        continue;
      }
      // Collect what it wrote last before judging it.
      for (Stream* s : {&w.out, &w.err})
        while (s->fd >= 0 && pump(w, *s, s == &w.out)) {
        }
      w.exited = true;
      w.status = status;
      if (w.log) std::fclose(w.log), w.log = nullptr;
      if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0) && !failed) failed = &w;
    }
    return failed;
  }

  int run_once(int attempt) {
    std::vector<Worker> ws(static_cast<size_t>(nproc_));
    for (int i = 0; i < nproc_; ++i) {
      ws[i].rank = c_.node_rank * nproc_ + i;
      ws[i].local_rank = i;
      start(ws[i], attempt);
    }
    Worker* failed = nullptr;
    std::string remote_failure;
    auto last_check = std::chrono::steady_clock::now();
    while (std::any_of(ws.begin(), ws.end(), [](const Worker& w) { return !w.exited; })) {
      if (g_signal) break;
      report_refused(false);
      if (Worker* f = step(ws, 200)) {
        failed = f;
        break;
      }
      if (store_ && std::chrono::steady_clock::now() - last_check > std::chrono::milliseconds(500)) {
        last_check = std::chrono::steady_clock::now();
        const std::string key = "chorus/launch/" + std::to_string(attempt) + "/failed";
        try {
          if (store_->check({key})) {
            remote_failure = store_->get_string(key);
            break;
          }
        } catch (const Error&) {
          // Node 0's launcher (the store) is gone: our workers' own timeouts
          // end them if their job is broken; nothing more to watch.
          store_.reset();
        }
      }
    }
    if (g_signal) {
      // Note [Stopping on a signal] (apps/stop_signal.h): the workers finish
      // a step and write their stop checkpoint; they get --stop-timeout for
      // it (it was a fixed 10 s, and the exit said nothing of a checkpoint).
      const int sig = g_signal;
      std::fprintf(stderr, "chorus launch: got signal %d (%s); stopping the workers (--stop-timeout %g s)\n", sig,
                   strsignal(sig), c_.stop_timeout_s);
      signal_all(ws, sig);
      drain(ws, std::chrono::steady_clock::now() +
                    std::chrono::milliseconds(static_cast<int64_t>(c_.stop_timeout_s * 1000)));
      std::string killed;
      for (const auto& w : ws)
        if (!w.exited) killed += (killed.empty() ? "" : ", ") + std::to_string(w.rank);
      signal_all(ws, SIGKILL);
      drain(ws, std::chrono::steady_clock::now() + std::chrono::seconds(5));
      if (!killed.empty()) {
        std::fprintf(stderr, "chorus launch: rank %s did not stop within %g s (--stop-timeout) and was killed: a stop "
                     "checkpoint it was writing is lost\n", killed.c_str(), c_.stop_timeout_s);
      } else {
        // What the workers said of their checkpoint (chorus train's last line), or nothing.
        std::string said;
        for (const auto& w : ws)
          for (const auto& l : w.tail)
            if (said.empty() && (l.find("checkpoint written to") != std::string::npos ||
                                 l.find("nothing was saved") != std::string::npos))
              said = "; rank " + std::to_string(w.rank) + ": " + l;
        std::fprintf(stderr, "chorus launch: every worker stopped by itself%s\n", said.c_str());
      }
      return 128 + sig;
    }
    if (!failed && remote_failure.empty()) {
      finish_nodes(attempt);
      return 0;
    }
    std::string report;
    if (failed) {
      report = "rank " + std::to_string(failed->rank) + " (pid " + std::to_string(failed->pid) + ") " +
               describe_status(failed->status);
      if (store_) store_->set("chorus/launch/" + std::to_string(attempt) + "/failed", report + " on node " +
                                                                                    std::to_string(c_.node_rank));
    } else {
      report = remote_failure;
    }
    // The others get a moment to end by themselves (and report what they
    // saw: DistError naming the missing rank), then are stopped.
    drain(ws, std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(c_.grace_s * 1000)));
    signal_all(ws, SIGTERM);
    drain(ws, std::chrono::steady_clock::now() + std::chrono::seconds(5));
    signal_all(ws, SIGKILL);
    drain(ws, std::chrono::steady_clock::now() + std::chrono::seconds(5));
    std::string stopped;
    for (const auto& w : ws)
      if (w.was_stopped) stopped += (stopped.empty() ? "" : ", ") + std::to_string(w.rank);
    if (!stopped.empty()) report += " (rank " + stopped + " had been stopped by a signal)";
    std::fprintf(stderr, "chorus launch: %s; the job is stopped\n", report.c_str());
    if (failed && !failed->tail.empty()) {
      std::fprintf(stderr, "chorus launch: last lines of rank %d:\n", failed->rank);
      for (const auto& l : failed->tail) std::fprintf(stderr, "  | %s\n", l.c_str());
    }
    return 1;
  }

  // Every node's launcher checks out; node 0 (which serves the store) waits
  // for the others (60 s at most) so that none loses the store mid-exit.
  void finish_nodes(int attempt) {
    if (!store_) return;
    try {
      const std::string key = "chorus/launch/" + std::to_string(attempt) + "/done";
      store_->add(key, 1);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (c_.node_rank == 0 && store_->add(key, 0) < c_.nnodes && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    } catch (const Error&) {
    }
  }

  const LaunchConfig& c_;
  int nproc_ = 1, world_ = 1;
  std::unique_ptr<dist::TCPStoreServer> server_;
  // Note [Job ids] in distributed/launch_env.h: on one node, a fresh id per launch
  // unless the environment has one (across nodes the launchers could not
  // agree on a random one: CHORUS_RUN_ID, or the scheduler's, is used).
  std::string run_id_;
  std::unique_ptr<dist::TCPStore> store_;
  std::string secret_;      // Note [Store job secret]; never printed
  std::string store_host_;  // where this node reaches the store
  bool refused_named_ = false;
};

}  // namespace

void add_launch_options(CLI::App* cmd, LaunchConfig& c) {
  cmd->add_option("--nproc-per-node", c.nproc_per_node, "Processes on this node: N, or 'gpu' (one per visible GPU)")
      ->capture_default_str();
  cmd->add_option("--nnodes", c.nnodes, "Nodes (machines) in the job")->capture_default_str()->check(CLI::Range(1, 65536));
  cmd->add_option("--node-rank", c.node_rank, "This node's index, 0 .. nnodes-1")->capture_default_str()->check(CLI::NonNegativeNumber);
  cmd->add_option("--master-addr", c.master_addr, "Address of node 0 (serves the job's store)")->capture_default_str();
  cmd->add_option("--master-port", c.master_port, "Port of the job's store on node 0")->capture_default_str()->check(CLI::Range(1, 65535));
  cmd->add_option("--max-restarts", c.max_restarts, "Restart the whole job up to K times when a process fails")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  cmd->add_option("--log-dir", c.log_dir, "Also write each rank's output to DIR/rank_N.log");
  cmd->add_option("--grace-period", c.grace_s, "Seconds a failed job's other processes get to end by themselves")
      ->capture_default_str()->check(real_number(kMaxGracePeriod, false, 0));
  cmd->add_option("--stop-timeout", c.stop_timeout_s,
                  "Seconds the workers get to stop (and write a stop checkpoint) after a forwarded signal")
      ->capture_default_str()->check(real_number(kMaxGracePeriod, false, 0));
  cmd->add_option("--restart-backoff", c.restart_backoff_s,
                  "Seconds before the first --max-restarts restart, doubled for each next one (at most 60)")
      ->capture_default_str()->check(real_number(kMaxRestartBackoff, false, 0));
  cmd->add_option("--job-secret-file", c.job_secret_file,
                  "File (mode 600) with the job's secret, the same on every node; default: $CHORUS_JOB_SECRET, "
                  "or on one node a random one");
  cmd->add_option("command", c.command, "PROGRAM ARGS... (after --)")->required();
}

int run_launch(const LaunchConfig& c) {
  CHORUS_CHECK(c.node_rank < c.nnodes, "--node-rank ", c.node_rank, " is out of range for --nnodes ", c.nnodes);
  CHORUS_CHECK(!c.command.empty(), "chorus launch: no program to run (chorus launch [options] -- PROGRAM ARGS...)");
  CHORUS_CHECK_T(Error, ::pipe2(g_wake, O_CLOEXEC | O_NONBLOCK) == 0, "pipe: ", std::strerror(errno));
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::sigaction(sig, &sa, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
  return Launcher(c).run();
}

}  // namespace chorus::app
