// The training driver: data, model, optimizer and schedule from the config;
// an epoch loop with periodic (not per-step) reads of the loss, evaluation,
// checkpoints that make a killed run resumable to the same weights, metrics
// and a closing summary.
#include "train.h"
#include "commands.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>

#include "chorus/autograd/autocast.h"
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
#include "chorus/ops/factory.h"
#include "chorus/ops/reduce.h"
#include "chorus/optim/adamw.h"
#include "chorus/optim/lr_scheduler.h"
#include "chorus/optim/sgd.h"
#include "chorus/parallel/data_parallel.h"
#include "progress.h"

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
  CHORUS_CHECK(!resume || !checkpoint_dir.empty(), "--resume needs --checkpoint-dir");
  CHORUS_CHECK(log_every > 0, "--log-every must be positive, got ", log_every);
  CHORUS_CHECK(label_smoothing >= 0 && label_smoothing < 1, "--label-smoothing must be in [0, 1), got ", label_smoothing);
}

nlohmann::json TrainConfig::to_json() const {
  return {{"model", model}, {"data", data}, {"data_dir", data_dir}, {"devices", devices}, {"strategy", strategy},
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
    std::string dir = c.data_dir.empty() ? (c.data == "mnist" ? "/usr/share/datasets/mnist" : "/usr/share/datasets/fashion-mnist")
                                         : c.data_dir;
    data::Normalize norm = c.data == "mnist" ? data::Normalize::mnist() : data::Normalize::fashion_mnist();
    d.train = data::load_mnist(dir, true, norm);
    d.test = data::load_mnist(dir, false, norm);
  } else if (c.data == "cifar10") {
    CHORUS_CHECK(!c.data_dir.empty(), "--data cifar10 needs --data-dir (a folder with data_batch_1.bin .. test_batch.bin)");
    d.train = data::load_cifar10(c.data_dir, true);
    d.test = data::load_cifar10(c.data_dir, false);
    d.augment = {std::make_shared<data::RandomCrop>(32, 4), std::make_shared<data::RandomHorizontalFlip>(0.5)};
  } else {
    bool big = c.model.rfind("wrn", 0) == 0 || c.model == "resnet20";
    Shape shape = big ? Shape{3, 32, 32} : Shape{1, 28, 28};
    d.train = data::make_synthetic({c.synthetic_size, shape, 10, c.seed, true});
    d.test = data::make_synthetic({std::max<int64_t>(c.synthetic_size / 5, 1), shape, 10, c.seed, false});
  }
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

}  // namespace

nlohmann::ordered_json run_train(const TrainConfig& cfg) {
  cfg.validate();
  std::vector<Device> devices = pick_devices(cfg);
  Device device = devices[0];
  CHORUS_CHECK(cfg.precision == "fp32" || device.is_cuda(), "--precision bf16 needs a CUDA device (got ", device.str(), ")");
  manual_seed(cfg.seed);
  Datasets ds = load_data(cfg);

  models::ModelSpec spec{ds.train->image_shape(), ds.train->num_classes()};
  nn::ModulePtr model = models::make_model(cfg.model, spec);
  model->to(device);
  nn::ModulePtr net = model;  // what the step runs: the model, or its DataParallel wrapper
  if (cfg.strategy == "dp")
    net = std::make_shared<parallel::DataParallel>(model, devices, dp_options(cfg.bucket_mb));
  std::vector<Tensor> params = model->parameters();
  double lr = cfg.lr.value_or(default_lr(cfg));
  std::unique_ptr<optim::Optimizer> opt;
  if (cfg.optimizer == "sgd") {
    opt = std::make_unique<optim::SGD>(params, optim::SGDOptions{lr, cfg.momentum, 0.0, cfg.weight_decay, cfg.momentum > 0});
  } else {
    opt = std::make_unique<optim::AdamW>(params, optim::AdamWOptions{lr, 0.9, 0.999, 1e-8, cfg.weight_decay});
  }

  data::DataLoaderOptions lo;
  lo.batch_size = cfg.batch_size * static_cast<int64_t>(devices.size());  // --batch-size is per device
  lo.num_workers = cfg.workers;
  lo.seed = cfg.seed;
  lo.device = device;
  data::DataLoader train_loader(ds.train, std::make_shared<data::RandomSampler>(ds.train->size(), cfg.seed), lo, ds.augment);
  data::DataLoaderOptions eo = lo;
  eo.batch_size = std::max<int64_t>(cfg.batch_size, 500);
  data::DataLoader test_loader(ds.test, nullptr, eo);

  const int64_t per_epoch = train_loader.num_batches();
  int64_t total_steps = per_epoch * cfg.epochs;
  if (cfg.steps) total_steps = std::min(total_steps, *cfg.steps);
  auto schedule = std::make_shared<optim::LinearWarmup>(
      std::min<int64_t>(100, total_steps / 10), std::make_shared<optim::CosineAnnealingLR>(lr, std::max<int64_t>(total_steps, 1)));

  // Resume: weights, optimizer, RNG, position.
  int64_t step = 0, start_epoch = 0, start_batch = 0;
  if (cfg.resume) {
    auto latest = io::find_latest_checkpoint(cfg.checkpoint_dir);
    if (latest) {
      io::TrainingState st = io::load_checkpoint(*latest, *model, *opt);
      step = st.step;
      start_epoch = st.epoch;
      start_batch = st.batch_in_epoch;
      default_generator().set_state(st.rng);
      if (!cfg.quiet) std::fprintf(stderr, "resuming from %s (epoch %lld, step %lld)\n", latest->c_str(),
                                   (long long)start_epoch + 1, (long long)step);
    } else if (!cfg.quiet) {
      std::fprintf(stderr, "no checkpoint in %s; starting from scratch\n", cfg.checkpoint_dir.c_str());
    }
  }

  std::unique_ptr<io::MetricsWriter> metrics;
  if (!cfg.metrics.empty()) metrics = std::make_unique<io::MetricsWriter>(cfg.metrics, cfg.resume);
  if (!cfg.quiet)
    std::fprintf(stderr, "training %s (%lld parameters) on %s%s, %s, %lld examples, batch %lld per device, %lld steps\n",
                 cfg.model.c_str(), (long long)model->num_parameters(), cfg.devices.empty() ? device.str().c_str() : cfg.devices.c_str(),
                 cfg.strategy == "dp" ? " (DataParallel)" : "", ds.train->name().c_str(),
                 (long long)ds.train->size(), (long long)cfg.batch_size, (long long)total_steps);

  auto save = [&](int64_t epoch, int64_t batch_in_epoch) {
    if (cfg.checkpoint_dir.empty()) return;
    io::TrainingState st;
    st.epoch = epoch;
    st.step = step;
    st.batch_in_epoch = batch_in_epoch;
    st.rng = default_generator().state();
    st.config = cfg.to_json();
    io::save_checkpoint(cfg.checkpoint_dir, *model, *opt, st);
  };

  std::optional<DType> amp;
  if (cfg.precision == "bf16") amp = kBFloat16;
  Progress progress(!cfg.quiet);
  auto t0 = std::chrono::steady_clock::now();
  auto window_start = t0;
  int64_t window_images = 0, images_total = 0;
  Tensor window_loss, window_correct;
  int64_t window_count = 0;
  double last_loss = std::nan(""), last_acc = 0;
  model->train();
  for (int64_t epoch = start_epoch; epoch < cfg.epochs && step < total_steps; ++epoch) {
    train_loader.start_epoch(epoch, epoch == start_epoch ? start_batch : 0);
    int64_t batch_in_epoch = epoch == start_epoch ? start_batch : 0;
    data::Batch b;
    while (step < total_steps && train_loader.next(&b)) {
      schedule->apply(*opt, step);
      Tensor logits, loss;
      {
        AutocastGuard autocast(amp);  // --precision bf16: bf16 compute, fp32 weights and loss
        logits = net->forward(b.images);
        loss = nn::functional::cross_entropy(logits, b.labels, cfg.label_smoothing);
      }
      opt->zero_grad();
      loss.backward();
      opt->step();
      ++step;
      ++batch_in_epoch;
      // Statistics stay on the device; the host reads them every log_every steps.
      {
        NoGradGuard ng;
        Tensor l = ops::unary(UnaryOp::MulScalar, loss.detach(), b.labels.size(0));
        Tensor c = ops::reduce(ReduceOp::Sum, ops::binary(BinaryOp::Eq, ops::reduce(ReduceOp::Argmax, logits.detach(), {1}, false), b.labels), {}, false);
        window_loss = window_loss.defined() ? ops::binary(BinaryOp::Add, window_loss, l) : l;
        window_correct = window_correct.defined() ? ops::binary(BinaryOp::Add, window_correct, c) : c;
      }
      window_count += b.labels.size(0);
      window_images += b.labels.size(0);
      images_total += b.labels.size(0);
      if (step % cfg.log_every == 0 || step == total_steps) {
        last_loss = window_loss.item() / static_cast<double>(window_count);
        last_acc = window_correct.item() / static_cast<double>(window_count);
        auto now = std::chrono::steady_clock::now();
        double secs = std::chrono::duration<double>(now - window_start).count();
        double ips = secs > 0 ? static_cast<double>(window_images) / secs : 0;
        CHORUS_CHECK_T(Error, std::isfinite(last_loss), "training diverged: the loss is ", last_loss, " at step ", step,
                       " (try a smaller --lr)");
        progress.update({step, total_steps, epoch + 1, cfg.epochs, last_loss, last_acc, ips});
        if (metrics)
          metrics->write({{"step", step}, {"epoch", epoch + 1}, {"loss", last_loss}, {"accuracy", last_acc},
                          {"lr", opt->lr()}, {"img_per_s", ips}});
        window_loss = Tensor();
        window_correct = Tensor();
        window_count = 0;
        window_images = 0;
        window_start = now;
      }
      if (cfg.checkpoint_every > 0 && step % cfg.checkpoint_every == 0) save(epoch, batch_in_epoch);
    }
    bool epoch_done = batch_in_epoch >= per_epoch;
    if (epoch_done) {
      save(epoch + 1, 0);
      if (metrics || !cfg.quiet) {
        EvalResult ev = evaluate(*model, test_loader);
        progress.finish();
        if (!cfg.quiet)
          std::fprintf(stderr, "epoch %lld/%lld: test loss %.4f, test accuracy %.4f\n", (long long)epoch + 1,
                       (long long)cfg.epochs, ev.loss, ev.accuracy);
        if (metrics) metrics->write({{"epoch", epoch + 1}, {"test_loss", ev.loss}, {"test_accuracy", ev.accuracy}});
      }
    } else if (!cfg.checkpoint_dir.empty()) {
      save(epoch, batch_in_epoch);
    }
  }
  synchronize();
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  progress.finish();
  EvalResult final_eval = evaluate(*model, test_loader);
  std::vector<std::string> device_names;
  for (const Device& d : devices) device_names.push_back(d.str());
  nlohmann::ordered_json summary = {{"model", cfg.model},
                            {"data", cfg.data},
                            {"strategy", cfg.strategy},
                            {"devices", device_names},
                            {"precision", cfg.precision},
                            {"epochs", cfg.epochs},
                            {"steps", step},
                            {"batch_size", cfg.batch_size},
                            {"train_loss", std::isnan(last_loss) ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(last_loss)},
                            {"train_accuracy", last_acc},
                            {"test_loss", final_eval.loss},
                            {"test_accuracy", final_eval.accuracy},
                            {"img_per_s", seconds > 0 ? static_cast<double>(images_total) / seconds : 0.0},
                            {"seconds", seconds},
                            {"seconds_per_epoch", seconds * static_cast<double>(per_epoch) /
                                                      static_cast<double>(std::max<int64_t>(step - start_epoch * per_epoch - start_batch, 1))}};
  if (metrics) metrics->write({{"summary", summary}});
  return summary;
}

}  // namespace chorus::app
