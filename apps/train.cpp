// The training driver, in the order run_train calls it: set_up (data, model,
// optimizer, schedule from the config), resume (from the newest checkpoint),
// train_loop (epochs of TrainStep with periodic, not per-step, reads of the
// loss; evaluation; checkpoints that make a killed run resumable to the same
// weights; metrics) and summarize (the closing summary).
#include "train.h"
#include "commands.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "chorus/autograd/grad_mode.h"
#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/core/rng.h"
#include "chorus/data/cifar.h"
#include "chorus/data/loader.h"
#include "chorus/data/mnist.h"
#include "chorus/data/sampler.h"
#include "chorus/data/synthetic.h"
#include "chorus/data/transforms.h"
#include "chorus/io/checkpoint.h"
#include "chorus/io/metrics.h"
#include "chorus/models/models.h"
#include "chorus/nn/functional.h"
#include "chorus/ops/elementwise.h"
#include "chorus/ops/reduce.h"
#include "chorus/optim/adamw.h"
#include "chorus/optim/lr_scheduler.h"
#include "chorus/optim/sgd.h"
#include "progress.h"
#include "resume_checks.h"
#include "stop_signal.h"
#include "train_step.h"

namespace chorus::app {

namespace fs = std::filesystem;

void TrainConfig::validate() const {
  auto names = models::model_names();
  bool wrn = model.rfind("wrn-", 0) == 0;
  CHORUS_CHECK(wrn || std::find(names.begin(), names.end(), model) != names.end(), "unknown model '", model,
               "' (expected mlp, cnn, resnet20, wrn-16-4 or wrn-28-10)");
  CHORUS_CHECK(data == "fashion-mnist" || data == "mnist" || data == "cifar10" || data == "synthetic",
               "unknown data set '", data, "' (expected fashion-mnist, mnist, cifar10 or synthetic)");
  CHORUS_CHECK(strategy == "single" || strategy == "dp" || strategy == "ddp" || strategy == "pipeline",
               "unknown strategy '", strategy, "' (expected single, dp, ddp or pipeline)");
  CHORUS_CHECK(strategy == "single" || strategy == "dp", "strategy '", strategy,
               "' is not available in this version of Chorus yet; use --strategy single or dp");
  CHORUS_CHECK(precision == "fp32" || precision == "bf16", "unknown precision '", precision, "' (expected fp32 or bf16)");
  CHORUS_CHECK(optimizer == "sgd" || optimizer == "adamw", "unknown optimizer '", optimizer, "' (expected sgd or adamw)");
  CHORUS_CHECK(batch_size > 0, "--batch-size must be positive, got ", batch_size);
  CHORUS_CHECK(std::isfinite(bucket_mb) && bucket_mb >= 0, "--bucket-mb must be a number >= 0, got ", bucket_mb);
  CHORUS_CHECK(epochs > 0, "--epochs must be positive, got ", epochs);
  CHORUS_CHECK(!steps || *steps > 0, "--steps must be positive, got ", steps.value_or(0));
  CHORUS_CHECK(!lr || (std::isfinite(*lr) && *lr >= 0), "--lr must be a non-negative number, got ", lr.value_or(0));
  CHORUS_CHECK(workers >= 0, "--workers must be >= 0, got ", workers);
  CHORUS_CHECK(synthetic_size > 0, "--synthetic-size must be positive, got ", synthetic_size);
  CHORUS_CHECK(checkpoint_every >= 0, "--checkpoint-every must be >= 0, got ", checkpoint_every);
  CHORUS_CHECK(!data_dir || !data_dir->empty(), "--data-dir is empty: name a folder, or leave --data-dir out for the default");
  CHORUS_CHECK(!checkpoint_dir || !checkpoint_dir->empty(),
               "--checkpoint-dir is empty: name a folder, or leave --checkpoint-dir out for no checkpoints");
  CHORUS_CHECK(!metrics || !metrics->empty(), "--metrics is empty: name a file, or leave --metrics out for no metrics");
  CHORUS_CHECK(!resume || checkpoint_dir, "--resume needs --checkpoint-dir");
  CHORUS_CHECK(!start_fresh || resume, "--start-fresh goes with --resume");
  CHORUS_CHECK(allow_change.empty() || resume, "--allow-change goes with --resume");
  for (const std::string& f : allow_change)
    CHORUS_CHECK(std::find(kResumeChangeable.begin(), kResumeChangeable.end(), f) != kResumeChangeable.end(),
                 "--allow-change ", f, ": only epochs, steps, data_dir and devices may change on --resume");
  CHORUS_CHECK(log_every > 0, "--log-every must be positive, got ", log_every);
  CHORUS_CHECK(label_smoothing >= 0 && label_smoothing < 1, "--label-smoothing must be in [0, 1), got ", label_smoothing);
}

nlohmann::json TrainConfig::to_json() const {
  return {{"model", model}, {"data", data}, {"data_dir", data_dir ? nlohmann::json(*data_dir) : nlohmann::json(nullptr)}, {"devices", devices}, {"strategy", strategy},
          {"epochs", epochs}, {"steps", steps ? nlohmann::json(*steps) : nlohmann::json(nullptr)}, {"batch_size", batch_size}, {"lr", lr ? nlohmann::json(*lr) : nlohmann::json(nullptr)}, {"momentum", momentum},
          {"weight_decay", weight_decay}, {"optimizer", optimizer}, {"label_smoothing", label_smoothing},
          {"precision", precision}, {"seed", seed}, {"synthetic_size", synthetic_size}};
}

namespace {

struct Datasets {
  std::shared_ptr<data::Dataset> train, test;
  std::vector<std::shared_ptr<const data::Transform>> augment;
};

Datasets load_data(const TrainConfig& c) {
  Datasets d;
  if (c.data == "fashion-mnist" || c.data == "mnist") {
    std::string dir = c.data_dir.value_or(c.data == "mnist" ? "/usr/share/datasets/mnist" : "/usr/share/datasets/fashion-mnist");
    data::Normalize norm = c.data == "mnist" ? data::Normalize::mnist() : data::Normalize::fashion_mnist();
    d.train = data::load_mnist(dir, true, norm);
    d.test = data::load_mnist(dir, false, norm);
  } else if (c.data == "cifar10") {
    CHORUS_CHECK(c.data_dir.has_value(), "--data cifar10 needs --data-dir (a folder with data_batch_1.bin .. test_batch.bin)");
    d.train = data::load_cifar10(*c.data_dir, true);
    d.test = data::load_cifar10(*c.data_dir, false);
    d.augment = {std::make_shared<data::RandomCrop>(32, 4), std::make_shared<data::RandomHorizontalFlip>(0.5)};
  } else {
    bool big = c.model.rfind("wrn", 0) == 0 || c.model == "resnet20";
    Shape shape = big ? Shape{3, 32, 32} : Shape{1, 28, 28};
    d.train = data::make_synthetic({c.synthetic_size, shape, 10, c.seed, true});
    d.test = data::make_synthetic({std::max<int64_t>(c.synthetic_size / 5, 1), shape, 10, c.seed, false});
  }
  // A model trained on one image shape cannot evaluate another.
  CHORUS_CHECK(d.test->image_shape() == d.train->image_shape(), d.test->name(), " has images of ",
               shape_str(d.test->image_shape()), " but the model trains on ", shape_str(d.train->image_shape()),
               " (", d.train->name(), ")");
  return d;
}

double default_lr(const TrainConfig& c) {
  return c.optimizer == "adamw" ? 1e-3 : 0.05;
}

std::vector<Device> pick_devices(const TrainConfig& c) {
  if (c.devices.empty()) {
    if (c.strategy == "dp") return parse_devices("all");
    return {cuda_is_available() ? cuda_device(0) : cpu_device(0)};
  }
  std::vector<Device> devs = parse_devices(c.devices);
  CHORUS_CHECK(c.strategy != "single" || devs.size() == 1, "--strategy single trains on one device, got --devices ",
               c.devices, " (use --strategy dp for several)");
  return devs;
}

struct EvalResult {
  double loss = 0, accuracy = 0;
};

EvalResult evaluate(nn::Module& model, data::DataLoader& loader) {
  NoGradGuard ng;
  model.eval();
  loader.start_epoch(0);
  data::Batch b;
  Tensor loss_sum, correct;
  int64_t n = 0;
  while (loader.next(&b)) {
    Tensor logits = model.forward(b.images);
    Tensor l = ops::unary(UnaryOp::MulScalar, nn::functional::cross_entropy(logits, b.labels), b.labels.size(0));
    Tensor c = ops::reduce(ReduceOp::Sum, ops::binary(BinaryOp::Eq, ops::reduce(ReduceOp::Argmax, logits, {1}, false), b.labels), {}, false);
    loss_sum = loss_sum.defined() ? ops::binary(BinaryOp::Add, loss_sum, l) : l;
    correct = correct.defined() ? ops::binary(BinaryOp::Add, correct, c) : c;
    n += b.labels.size(0);
  }
  model.train();
  if (n == 0) return {};
  return {loss_sum.item() / static_cast<double>(n), correct.item() / static_cast<double>(n)};
}

// Everything a run is made of, wired from the config.
struct Training {
  std::vector<Device> devices;
  Datasets data;
  nn::ModulePtr model;                     // what checkpoints and evaluation see
  std::unique_ptr<optim::Optimizer> opt;
  TrainStep step;                          // runs the model or its parallel wrapper
  std::unique_ptr<data::DataLoader> train_loader, test_loader;
  std::shared_ptr<optim::LRSchedule> schedule;
  int64_t per_epoch = 0, total_steps = 0;
};

Training set_up(const TrainConfig& cfg) {
  Training t;
  t.devices = pick_devices(cfg);
  const Device device = t.devices[0];
  CHORUS_CHECK(cfg.precision == "fp32" || device.is_cuda(), "--precision bf16 needs a CUDA device (got ", device.str(), ")");
  manual_seed(cfg.seed);
  t.data = load_data(cfg);
  models::ModelSpec spec{t.data.train->image_shape(), t.data.train->num_classes()};
  t.model = models::make_model(cfg.model, spec);
  t.model->to(device);
  const double lr = cfg.lr.value_or(default_lr(cfg));
  std::vector<Tensor> params = t.model->parameters();
  if (cfg.optimizer == "sgd")
    t.opt = std::make_unique<optim::SGD>(params, optim::SGDOptions{lr, cfg.momentum, 0.0, cfg.weight_decay, cfg.momentum > 0});
  else
    t.opt = std::make_unique<optim::AdamW>(params, optim::AdamWOptions{lr, 0.9, 0.999, 1e-8, cfg.weight_decay});
  t.step = {wrap_for_strategy(t.model, cfg.strategy, t.devices, cfg.bucket_mb), t.opt.get(), std::nullopt,
            cfg.label_smoothing};
  if (cfg.precision == "bf16") t.step.autocast = kBFloat16;

  data::DataLoaderOptions lo;
  lo.batch_size = cfg.batch_size * static_cast<int64_t>(t.devices.size());  // --batch-size is per device
  lo.num_workers = cfg.workers;
  lo.seed = cfg.seed;
  // DataParallel scatters each replica's chunk from where the batch is, so its
  // batches stay in host memory and every chunk goes to its device directly
  // (through pinned staging on GPUs), not to devices[0] first and on from there.
  if (cfg.strategy != "dp") lo.device = device;
  t.train_loader = std::make_unique<data::DataLoader>(
      t.data.train, std::make_shared<data::RandomSampler>(t.data.train->size(), cfg.seed), lo, t.data.augment);
  data::DataLoaderOptions eo = lo;
  eo.device = device;  // evaluation runs the model itself, on devices[0]
  eo.batch_size = std::max<int64_t>(cfg.batch_size, 500);
  t.test_loader = std::make_unique<data::DataLoader>(t.data.test, nullptr, eo);

  t.per_epoch = t.train_loader->num_batches();
  CHORUS_CHECK(!__builtin_mul_overflow(t.per_epoch, cfg.epochs, &t.total_steps), "--epochs ", cfg.epochs,
               " of ", t.per_epoch, " steps each is more steps than can be counted");
  if (cfg.steps) t.total_steps = std::min(t.total_steps, *cfg.steps);
  t.schedule = std::make_shared<optim::LinearWarmup>(
      std::min<int64_t>(100, t.total_steps / 10),
      std::make_shared<optim::CosineAnnealingLR>(lr, std::max<int64_t>(t.total_steps, 1)));
  return t;
}

// Where the loop is: a fresh run starts at zero, a resumed one where its
// checkpoint was written.
struct Position {
  int64_t step = 0, epoch = 0, batch_in_epoch = 0;
};

// --resume: weights, optimizer, RNG and position from the newest checkpoint
// that can be read (Note [Unreadable checkpoints]), once it is known to
// belong to this run (Note [Resume checks]).
Position resume(const TrainConfig& cfg, Training& t) {
  Position pos;
  if (!cfg.resume) return pos;
  auto check = [&](const io::TrainingState& st, const std::string& state_path) {
    check_resume_config(st.config, cfg.to_json(), cfg.allow_change, state_path);
    check_resume_position(st, t.per_epoch, cfg.epochs, t.total_steps, state_path);
  };
  io::Resumed r = io::resume_checkpoint(*cfg.checkpoint_dir, *t.model, *t.opt, cfg.start_fresh, check);
  // Said even with --quiet: work is being skipped.
  for (const io::SkippedCheckpoint& s : r.skipped)
    std::fprintf(stderr, "chorus: warning: skipped %s: %s; %s\n", s.path.c_str(), s.reason.c_str(),
                 s.kept_as.empty() ? "left in place" : ("kept as " + s.kept_as).c_str());
  if (!r.path) {
    if (!r.skipped.empty())
      std::fprintf(stderr, "chorus: no checkpoint in %s could be read; starting from scratch (--start-fresh)\n",
                   cfg.checkpoint_dir->c_str());
    else if (!cfg.quiet)
      std::fprintf(stderr, "no checkpoint in %s; starting from scratch\n", cfg.checkpoint_dir->c_str());
    return pos;
  }
  pos = {r.state.step, r.state.epoch, r.state.batch_in_epoch};
  default_generator().set_state(r.state.rng);
  if (!cfg.quiet || !r.skipped.empty())
    std::fprintf(stderr, "resuming from %s (epoch %lld, step %lld)\n", r.path->c_str(), (long long)pos.epoch + 1,
                 (long long)pos.step);
  return pos;
}

std::string save(const TrainConfig& cfg, const Training& t, const Position& pos) {
  if (!cfg.checkpoint_dir) return "";
  io::TrainingState st;
  st.epoch = pos.epoch;
  st.step = pos.step;
  st.batch_in_epoch = pos.batch_in_epoch;
  st.rng = default_generator().state();
  st.config = cfg.to_json();
  return io::save_checkpoint(*cfg.checkpoint_dir, *t.model, *t.opt, st);
}

// Note [Stopping on a signal]: after the step in flight, a checkpoint (when
// there is a directory for it), one line saying so, and Interrupted.
[[noreturn]] void stop_for_signal(const TrainConfig& cfg, const Training& t, const Position& pos, Progress& progress) {
  const int sig = StopSignal::pending();
  progress.finish();
  const std::string where = save(cfg, t, pos);
  if (where.empty())
    std::fprintf(stderr, "chorus: stopped by %s at step %lld; no --checkpoint-dir, so nothing was saved\n",
                 StopSignal::name(sig), (long long)pos.step);
  else
    std::fprintf(stderr, "chorus: stopped by %s at step %lld; checkpoint written to %s (continue with --resume)\n",
                 StopSignal::name(sig), (long long)pos.step, where.c_str());
  throw Interrupted(sig);
}

// Training loss and accuracy over a window of steps. They stay on the device;
// the host reads them only when the window closes (every --log-every steps),
// so no step waits for the GPU.
class StepStats {
 public:
  void add(const TrainStep::Result& r, const Tensor& labels) {
    NoGradGuard ng;
    Tensor l = ops::unary(UnaryOp::MulScalar, r.loss.detach(), labels.size(0));
    Tensor c = ops::reduce(ReduceOp::Sum,
                           ops::binary(BinaryOp::Eq, ops::reduce(ReduceOp::Argmax, r.logits.detach(), {1}, false), labels),
                           {}, false);
    loss_ = loss_.defined() ? ops::binary(BinaryOp::Add, loss_, l) : l;
    correct_ = correct_.defined() ? ops::binary(BinaryOp::Add, correct_, c) : c;
    count_ += labels.size(0);
  }
  struct Window {
    double loss, accuracy, img_per_s;
  };
  // Reads the window (one host wait) and starts the next one.
  Window close() {
    auto now = std::chrono::steady_clock::now();
    const double secs = std::chrono::duration<double>(now - start_).count();
    Window w{loss_.item() / static_cast<double>(count_), correct_.item() / static_cast<double>(count_),
             secs > 0 ? static_cast<double>(count_) / secs : 0};
    *this = StepStats();
    start_ = now;
    return w;
  }

 private:
  Tensor loss_, correct_;
  int64_t count_ = 0;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

struct LoopResult {
  double last_loss = std::nan(""), last_acc = 0;
  int64_t images = 0;
};

// End of an epoch: checkpoint, then test-set evaluation when anyone reads it.
void finish_epoch(const TrainConfig& cfg, Training& t, const Position& pos, io::MetricsWriter* metrics,
                  Progress& progress) {
  save(cfg, t, pos);
  if (!metrics && cfg.quiet) return;
  EvalResult ev = evaluate(*t.model, *t.test_loader);
  progress.finish();
  if (!cfg.quiet)
    std::fprintf(stderr, "epoch %lld/%lld: test loss %.4f, test accuracy %.4f\n", (long long)pos.epoch,
                 (long long)cfg.epochs, ev.loss, ev.accuracy);
  if (metrics) metrics->write({{"epoch", pos.epoch}, {"test_loss", ev.loss}, {"test_accuracy", ev.accuracy}});
}

// The epoch loop from `pos` on, until the epochs or --steps run out.
LoopResult train_loop(const TrainConfig& cfg, Training& t, Position& pos, io::MetricsWriter* metrics) {
  LoopResult out;
  Progress progress(!cfg.quiet);
  StepStats stats;
  const int64_t start_epoch = pos.epoch;
  t.model->train();
  for (int64_t epoch = start_epoch; epoch < cfg.epochs && pos.step < t.total_steps; ++epoch) {
    pos.epoch = epoch;
    if (epoch != start_epoch) pos.batch_in_epoch = 0;
    t.train_loader->start_epoch(epoch, pos.batch_in_epoch);
    data::Batch b;
    while (pos.step < t.total_steps && t.train_loader->next(&b)) {
      t.schedule->apply(*t.opt, pos.step);
      // Labels go where the loss is computed (the output device); the images
      // stay where the loader put them (host memory under DataParallel).
      if (b.labels.device() != t.devices[0]) b.labels = b.labels.to(t.devices[0]);
      stats.add(t.step.run(b.images, b.labels), b.labels);
      ++pos.step;
      ++pos.batch_in_epoch;
      out.images += b.labels.size(0);
      if (pos.step % cfg.log_every == 0 || pos.step == t.total_steps) {
        StepStats::Window w = stats.close();
        out.last_loss = w.loss;
        out.last_acc = w.accuracy;
        CHORUS_CHECK_T(Error, std::isfinite(w.loss), "training diverged: the loss is ", w.loss, " at step ", pos.step,
                       " (try a smaller --lr)");
        progress.update({pos.step, t.total_steps, epoch + 1, cfg.epochs, w.loss, w.accuracy, w.img_per_s});
        if (metrics)
          metrics->write({{"step", pos.step}, {"epoch", epoch + 1}, {"loss", w.loss}, {"accuracy", w.accuracy},
                          {"lr", t.opt->lr()}, {"img_per_s", w.img_per_s}});
      }
      if (cfg.checkpoint_every > 0 && pos.step % cfg.checkpoint_every == 0) save(cfg, t, pos);
      if (StopSignal::pending()) stop_for_signal(cfg, t, pos, progress);
    }
    if (pos.batch_in_epoch >= t.per_epoch) {
      finish_epoch(cfg, t, {pos.step, epoch + 1, 0}, metrics, progress);
    } else {
      save(cfg, t, pos);  // stopped inside the epoch (--steps): resumable from here
    }
  }
  progress.finish();
  return out;
}

nlohmann::ordered_json summarize(const TrainConfig& cfg, Training& t, const Position& start, const Position& end,
                                 const LoopResult& loop, double seconds) {
  EvalResult final_eval = evaluate(*t.model, *t.test_loader);
  std::vector<std::string> device_names;
  for (const Device& d : t.devices) device_names.push_back(d.str());
  const int64_t steps_run = std::max<int64_t>(end.step - start.epoch * t.per_epoch - start.batch_in_epoch, 1);
  using J = nlohmann::ordered_json;
  return {{"model", cfg.model},
          {"data", cfg.data},
          {"strategy", cfg.strategy},
          {"devices", device_names},
          {"precision", cfg.precision},
          {"epochs", cfg.epochs},
          {"steps", end.step},
          {"batch_size", cfg.batch_size},
          {"train_loss", std::isnan(loop.last_loss) ? J(nullptr) : J(loop.last_loss)},
          {"train_accuracy", loop.last_acc},
          {"test_loss", final_eval.loss},
          {"test_accuracy", final_eval.accuracy},
          {"img_per_s", seconds > 0 ? static_cast<double>(loop.images) / seconds : 0.0},
          {"seconds", seconds},
          {"seconds_per_epoch", seconds * static_cast<double>(t.per_epoch) / static_cast<double>(steps_run)}};
}

void announce(const TrainConfig& cfg, const Training& t) {
  if (cfg.quiet) return;
  std::fprintf(stderr, "training %s (%lld parameters) on %s%s, %s, %lld examples, batch %lld per device, %lld steps\n",
               cfg.model.c_str(), (long long)t.model->num_parameters(),
               cfg.devices.empty() ? t.devices[0].str().c_str() : cfg.devices.c_str(),
               cfg.strategy == "dp" ? " (DataParallel)" : "", t.data.train->name().c_str(),
               (long long)t.data.train->size(), (long long)cfg.batch_size, (long long)t.total_steps);
}

}  // namespace

nlohmann::ordered_json run_train(const TrainConfig& cfg) {
  cfg.validate();
  StopSignal stop_signal;
  Training t = set_up(cfg);
  const Position start = resume(cfg, t);
  std::unique_ptr<io::MetricsWriter> metrics;
  if (cfg.metrics) metrics = std::make_unique<io::MetricsWriter>(*cfg.metrics, cfg.resume);
  announce(cfg, t);
  const auto t0 = std::chrono::steady_clock::now();
  Position pos = start;
  LoopResult loop = train_loop(cfg, t, pos, metrics.get());
  synchronize();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  nlohmann::ordered_json summary = summarize(cfg, t, start, pos, loop, seconds);
  if (metrics) metrics->write({{"summary", summary}});
  return summary;
}

}  // namespace chorus::app
