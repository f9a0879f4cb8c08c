// chorus_dist_probe: one rank of a multi-process test job, started by a
// launcher (tests/distributed/*.sh: chorus launch, mpirun, or the environment set by
// hand). Modes:
//   collectives  every collective of the process group on several sizes
//                (0, 1, not divisible by the world size, large) and dtypes,
//                checked against values computed by hand; prints one line.
//   hang RANK SIGNAL  all_reduce in a loop; rank RANK kills (SIGKILL) or stops
//                (SIGSTOP) itself at step 3. Survivors must fail with
//                DistError naming RANK; each prints how long that took.
//   hanggraph RANK SIGNAL  the same with the all-reduce inside a replayed CUDA
//                graph (nccl): the watch on each replay (Note [NCCL in a
//                CUDA graph]) must name RANK too, not wait forever.
//   sum          prints the sum over ranks of (rank+1) * [1, 2, 3] (two-node test).
//   threads      prints the CPU threads this rank's ops use after joining.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <chorus/chorus.h>
#include <chorus/distributed/init.h>
#include <chorus/parallel/graphed_step.h>

using namespace chorus;

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  }
}

// Element i of rank r's input: distinct per rank and element, exact in bf16.
double value(int r, int64_t i) { return static_cast<double>((r + 1) * 4 + (i % 7)) - 10.0; }

Device g_device = cpu_device(0);  // cuda:LOCAL_RANK under the nccl backend

Tensor make(const std::vector<double>& v, DType d) {
  return from_vector(v, {static_cast<int64_t>(v.size())}).to(d).to(g_device);
}

std::vector<double> read(const Tensor& t) {
  Tensor f = t.to(cpu_device(0)).to(kFloat64);
  return f.to_vector<double>();
}

void collectives(dist::ProcessGroup& pg) {
  const int R = pg.rank(), W = pg.size();
  for (DType d : {kFloat32, kBFloat16, kFloat64, kInt64}) {
    if (d == kFloat64 && g_device.is_cuda()) continue;  // Chorus keeps float64 on the CPU
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{W + 2}, int64_t{1000003}}) {
      const std::string tag = std::string(dtype_name(d)) + " n=" + std::to_string(n);
      std::vector<double> mine(n);
      for (int64_t i = 0; i < n; ++i) mine[i] = value(R, i);
      // all_reduce: sum, max, min, avg
      for (dist::ReduceOp op : {dist::ReduceOp::Sum, dist::ReduceOp::Max, dist::ReduceOp::Min, dist::ReduceOp::Avg}) {
        if (op == dist::ReduceOp::Avg && d == kInt64) continue;
        Tensor t = make(mine, d);
        pg.all_reduce(t, op)->wait();
        std::vector<double> got = read(t);
        bool ok = got.size() == static_cast<size_t>(n);
        for (int64_t i = 0; i < n && ok; ++i) {
          double want = op == dist::ReduceOp::Max ? -1e300 : op == dist::ReduceOp::Min ? 1e300 : 0;
          for (int r = 0; r < W; ++r) {
            const double v = value(r, i);
            if (op == dist::ReduceOp::Max) want = std::max(want, v);
            else if (op == dist::ReduceOp::Min) want = std::min(want, v);
            else want += v;
          }
          if (op == dist::ReduceOp::Avg) want /= W;
          const double tol = d == kBFloat16 ? 0.02 * std::max(1.0, std::abs(want)) : 1e-6;
          ok = std::abs(got[i] - want) <= tol;
        }
        expect(ok, "all_reduce " + std::string(dist::reduce_op_name(op)) + " " + tag);
      }
      // broadcast from the last rank
      {
        Tensor t = make(mine, d);
        pg.broadcast(t, W - 1)->wait();
        std::vector<double> got = read(t);
        bool ok = true;
        for (int64_t i = 0; i < n && ok; ++i) ok = got[i] == value(W - 1, i);
        expect(ok, "broadcast " + tag);
      }
      // all_gather
      {
        Tensor out = zeros({n * W}, TensorOptions(d, g_device));
        pg.all_gather(make(mine, d), out)->wait();
        std::vector<double> got = read(out);
        bool ok = true;
        for (int r = 0; r < W && ok; ++r)
          for (int64_t i = 0; i < n && ok; ++i) ok = got[r * n + i] == value(r, i);
        expect(ok, "all_gather " + tag);
      }
      // reduce_scatter: every rank contributes W chunks of n
      {
        std::vector<double> big(n * W);
        for (int64_t i = 0; i < n * W; ++i) big[i] = value(R, i);
        Tensor out = zeros({n}, TensorOptions(d, g_device));
        pg.reduce_scatter(make(big, d), out)->wait();
        std::vector<double> got = read(out);
        bool ok = true;
        for (int64_t i = 0; i < n && ok; ++i) {
          double want = 0;
          for (int r = 0; r < W; ++r) want += value(r, R * n + i);
          ok = std::abs(got[i] - want) <= (d == kBFloat16 ? 0.02 * std::max(1.0, std::abs(want)) : 1e-6);
        }
        expect(ok, "reduce_scatter " + tag);
      }
    }
  }
  // send/recv around the ring, and a barrier
  if (W > 1) {
    std::vector<double> v(17);
    for (int i = 0; i < 17; ++i) v[i] = value(R, i);
    Tensor out = make(v, kFloat32), in = zeros({17}, TensorOptions(kFloat32, g_device));
    // Even ranks send first, odd ranks receive first: NCCL runs a send only
    // when its receive is posted, in order on one stream.
    dist::WorkPtr s, r;
    if (R % 2 == 0) {
      s = pg.send(out, (R + 1) % W, 5);
      r = pg.recv(in, (R + W - 1) % W, 5);
    } else {
      r = pg.recv(in, (R + W - 1) % W, 5);
      s = pg.send(out, (R + 1) % W, 5);
    }
    s->wait();
    r->wait();
    std::vector<double> got = read(in);
    bool ok = true;
    for (int i = 0; i < 17 && ok; ++i) ok = got[i] == value((R + W - 1) % W, i);
    expect(ok, "send/recv ring");
  }
  // A subgroup of the first and last rank (new_group): an all_reduce inside
  // it sees only their values; the other ranks are not members.
  if (W > 1) {
    auto sub = pg.new_group({W - 1, 0});
    if (R == 0 || R == W - 1) {
      expect(sub != nullptr && sub->size() == 2 && sub->rank() == (R == 0 ? 1 : 0), "new_group ranks");
      Tensor t = make({static_cast<double>(R + 1)}, kFloat32);
      sub->all_reduce(t)->wait();
      expect(read(t)[0] == 1.0 + W, "all_reduce in a subgroup");
    } else {
      expect(sub == nullptr, "a rank outside new_group gets none");
    }
  }
  pg.barrier()->wait();
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "collectives";
  auto t0 = std::chrono::steady_clock::now();
  int rank = -1;
  try {
    dist::InitOptions o;
    if (const char* t = std::getenv("PROBE_TIMEOUT_MS")) o.timeout = std::chrono::milliseconds(std::atoi(t));
    if (const char* b = std::getenv("PROBE_BACKEND")) o.backend = b;  // nccl: CUDA tensors on cuda:LOCAL_RANK
    auto pg = dist::init_process_group(o);
    rank = pg->rank();
    if (pg->backend() == "nccl") g_device = current_device();
    if (mode == "collectives") {
      collectives(*pg);
      std::printf("rank %d of %d: %s\n", pg->rank(), pg->size(), failures ? "FAILED" : "all collectives ok");
      return failures ? 1 : 0;
    }
    if (mode == "sum") {
      Tensor t = from_vector(std::vector<float>{1, 2, 3}, {3}).to(g_device);
      t = t.mul(static_cast<double>(pg->rank() + 1));
      pg->all_reduce(t)->wait();
      auto v = t.to_vector<float>();
      std::printf("rank %d of %d: sum %.1f %.1f %.1f\n", pg->rank(), pg->size(), v[0], v[1], v[2]);
      return 0;
    }
    if (mode == "threads") {
      std::printf("rank %d: cpu threads %d\n", pg->rank(), cpu_threads());
      return 0;
    }
    if (mode == "hang") {
      const int victim = std::atoi(argv[2]);
      const int sig = std::string(argv[3]) == "STOP" ? SIGSTOP : SIGKILL;
      Tensor t = ones({1024}, TensorOptions(kFloat32, g_device));
      for (int step = 0;; ++step) {
        if (step == 3) {
          t0 = std::chrono::steady_clock::now();  // detection time counts from here
          if (pg->rank() == victim) ::kill(::getpid(), sig);
        }
        pg->all_reduce(t)->wait();
        if (pg->backend() == "nccl") (void)t.sum().item();  // a host wait per step, as a training loop has
      }
    }
    if (mode == "hanggraph") {
      const int victim = std::atoi(argv[2]);
      const int sig = std::string(argv[3]) == "STOP" ? SIGSTOP : SIGKILL;
      Tensor t = ones({1024}, TensorOptions(kFloat32, g_device));
      parallel::GraphedStepOptions go;
      go.on_fallback = [](const std::string& line) { std::printf("FAIL: not captured: %s\n", line.c_str()); };
      parallel::GraphedStep step(
          [&](const std::vector<Tensor>& in) {
            pg->all_reduce(t)->wait();
            t.mul_(0.5);  // stays finite however many steps run
            return std::vector<Tensor>{t.add(in[0])};
          },
          go);
      Tensor x = ones({1}, TensorOptions(kFloat32, g_device));
      for (int call = 0;; ++call) {
        if (call == 5) {  // calls 0-1 eager, 2 captured, 3 on replayed
          if (!step.captured()) std::printf("FAIL: rank %d: no graph by call 5\n", pg->rank());
          t0 = std::chrono::steady_clock::now();
          if (pg->rank() == victim) ::kill(::getpid(), sig);
        }
        (void)step({x})[0].sum().item();  // a host wait per step, as a training loop has
      }
    }
    std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
    return 2;
  } catch (const DistError& e) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("rank %d: DistError after %.2f s: %s\n", rank, s, e.message().c_str());
    std::fflush(stdout);
    return 3;
  } catch (const std::exception& e) {
    std::printf("rank %d: error: %s\n", rank, e.what());
    return 4;
  }
}
