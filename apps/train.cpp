// The training driver, in the order run_train calls it: set_up (data, model,
// optimizer, schedule from the config), resume (from the newest checkpoint),
// train_loop (epochs of TrainStep with periodic, not per-step, reads of the
// loss; evaluation; checkpoints that make a killed run resumable to the same
// weights; metrics) and summarize (the closing summary).
#include "train.h"
#include "commands.h"

#include <algorithm>
#include <csignal>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>

#include "chorus/autograd/autocast.h"
#include "chorus/autograd/grad_mode.h"
#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/core/warn.h"
#include "chorus/core/rng.h"
#include "chorus/data/cifar.h"
#include "chorus/dist/replica_sync.h"
#include "chorus/dist/sync_batch_norm.h"
#include "chorus/data/loader.h"
#include "chorus/data/mnist.h"
#include "chorus/data/sampler.h"
#include "chorus/data/synthetic.h"
#include "chorus/data/transforms.h"
#include "chorus/io/checkpoint.h"
#include "chorus/io/dir_lock.h"
#include "chorus/io/json_util.h"
#include "chorus/io/metrics.h"
#include "chorus/models/models.h"
#include "chorus/nn/functional.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/elementwise.h"
#include "chorus/ops/factory.h"
#include "chorus/ops/reduce.h"
#include "chorus/ops/profile.h"
#include "chorus/optim/adamw.h"
#include "chorus/optim/lr_scheduler.h"
#include "chorus/optim/sgd.h"
#include "memory_check.h"
#include "progress.h"
#include "resume_checks.h"
#include "run_position.h"
#include "run_log.h"
#include "step_trace.h"
#include "stop_signal.h"
#include "train_dist.h"
#include "train_pipeline.h"
#include "train_step.h"
#include "train_zero.h"
#include "sharded_checkpoints.h"

namespace chorus::app {

namespace fs = std::filesystem;

void TrainConfig::validate() const {
  auto names = models::model_names();
  bool wrn = model.rfind("wrn-", 0) == 0;
  CHORUS_CHECK(wrn || std::find(names.begin(), names.end(), model) != names.end(), "unknown model '", model,
               "' (expected mlp, cnn, resnet20, wrn-16-4 or wrn-28-10)");
  CHORUS_CHECK(data == "fashion-mnist" || data == "mnist" || data == "cifar10" || data == "synthetic",
               "unknown data set '", data, "' (expected fashion-mnist, mnist, cifar10 or synthetic)");
  CHORUS_CHECK(strategy == "single" || strategy == "dp" || strategy == "ddp" || strategy == "pipeline" || strategy == "zero",
               "unknown strategy '", strategy, "' (expected single, dp, ddp, zero or pipeline)");
  validate_zero_options(*this);
  // An image model's convolutions take float32 weights under autocast's
  // per-use casts: no 16-bit gathered parameters (--zero-param-dtype is GPTs').
  CHORUS_CHECK(!zero_param_dtype, "--zero-param-dtype is offered for GPT models; ", model,
               " gathers its weights in float32");
  CHORUS_CHECK(!channels_last || strategy != "zero", "--channels-last is not offered with --strategy zero yet (a shard is a "
               "range of a parameter's row-major elements); zero runs train NCHW");
  if (strategy == "pipeline") {
    CHORUS_CHECK(!micro_batches || (*micro_batches >= 1 && *micro_batches <= batch_size), "--micro-batches must be from 1 to the batch size (",
                 batch_size, "), got ", micro_batches.value_or(0));
    if (schedule) (void)parallel::parse_schedule(*schedule);
    if (recompute) (void)parallel::parse_checkpoint(*recompute);
    if (balance) (void)parse_balance(*balance);
    CHORUS_CHECK(!virtual_stages || (*virtual_stages >= 1 && *virtual_stages <= 64),
                 "--virtual-stages must be from 1 to 64, got ", virtual_stages.value_or(0));
    CHORUS_CHECK(!virtual_stages || schedule.value_or("") == "interleaved", "--virtual-stages goes with --schedule interleaved");
  } else {
    const char* given = micro_batches ? "--micro-batches" : schedule ? "--schedule" : balance ? "--balance"
                        : recompute ? "--recompute" : virtual_stages ? "--virtual-stages" : nullptr;
    CHORUS_CHECK(given == nullptr, given ? given : "", " goes with --strategy pipeline");
  }
  if (strategy == "ddp" || strategy == "zero") ddp_launch_env(strategy);  // says how to launch when nothing did
  CHORUS_CHECK(!sync_bn || strategy == "ddp" || strategy == "zero", "--sync-bn goes with --strategy ddp or zero");
  CHORUS_CHECK(!dp_broadcast || strategy == "dp", "--dp-broadcast goes with --strategy dp");
  CHORUS_CHECK(!dp_gather_output || strategy == "dp", "--dp-gather-output goes with --strategy dp");
  check_dp_all_reduce(dp_all_reduce, strategy, dp_broadcast);
  CHORUS_CHECK(comm_hook != "noop",
               "--comm-hook noop communicates nothing (the ranks would train apart): it is for chorus bench's headroom "
               "analysis, not for training");
  CHORUS_CHECK(comm_hook == "allreduce" || comm_hook == "bf16", "--comm-hook must be allreduce or bf16, got '",
               comm_hook, "'");
  CHORUS_CHECK(dist_timeout_s > 0, "--dist-timeout must be positive, got ", dist_timeout_s);
  CHORUS_CHECK(std::isfinite(stats_every_s) && stats_every_s >= 0, "--stats-every must be a number of seconds >= 0, got ", stats_every_s);
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
  CHORUS_CHECK(!tensorboard || !tensorboard->empty(),
               "--tensorboard is empty: name a folder, or leave --tensorboard out for no event files");
  CHORUS_CHECK(!tensorboard_all_ranks || tensorboard, "--tensorboard-all-ranks goes with --tensorboard DIR");
  CHORUS_CHECK(!plot || (plot->size() > 4 && (plot->substr(plot->size() - 4) == ".svg" || plot->substr(plot->size() - 4) == ".png")),
               "--plot must name a .svg or .png file, got '", plot.value_or(""), "'");
  CHORUS_CHECK(!trace || !trace->empty(), "--trace is empty: name a .json file, or leave --trace out");
  (void)parse_trace_steps(trace_steps);
  CHORUS_CHECK(!resume || checkpoint_dir, "--resume needs --checkpoint-dir");
  CHORUS_CHECK(!start_fresh || resume, "--start-fresh goes with --resume");
  CHORUS_CHECK(allow_change.empty() || resume, "--allow-change goes with --resume");
  for (const std::string& f : allow_change)
    CHORUS_CHECK(std::find(kResumeChangeable.begin(), kResumeChangeable.end(), f) != kResumeChangeable.end(),
                 "--allow-change ", f, ": only epochs, steps, data_dir, devices and strategy may change on --resume");
  CHORUS_CHECK(log_every > 0, "--log-every must be positive, got ", log_every);
  CHORUS_CHECK(label_smoothing >= 0 && label_smoothing < 1, "--label-smoothing must be in [0, 1), got ", label_smoothing);
}

nlohmann::json TrainConfig::to_json() const {
  nlohmann::json j = {{"model", model}, {"data", data}, {"data_dir", data_dir ? nlohmann::json(*data_dir) : nlohmann::json(nullptr)}, {"devices", devices}, {"strategy", strategy},
          {"epochs", epochs}, {"steps", steps ? nlohmann::json(*steps) : nlohmann::json(nullptr)}, {"batch_size", batch_size}, {"lr", lr ? nlohmann::json(*lr) : nlohmann::json(nullptr)}, {"momentum", momentum},
          {"weight_decay", weight_decay}, {"optimizer", optimizer}, {"label_smoothing", label_smoothing},
          {"precision", precision}, {"seed", seed}, {"synthetic_size", synthetic_size}};
  if (sync_bn) j["sync_bn"] = true;  // only when set: checkpoints from before it existed still compare
  return j;
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
  if (c.strategy == "ddp") return ddp_devices(c.devices, ddp_launch_env());
  if (c.strategy == "zero") {
    // A shard per process: a DataParallel inside a rank would hold whole replicas.
    std::vector<Device> devs = ddp_devices(c.devices, ddp_launch_env(c.strategy));
    CHORUS_CHECK(devs.size() == 1, "--strategy zero takes one device per process, got --devices ", c.devices,
                 " (launch one process per device)");
    return devs;
  }
  if (c.devices.empty()) {
    if (c.strategy == "dp") return parse_devices("all");
    if (c.strategy == "pipeline") return parse_devices(cuda_device_count() >= 2 ? "all" : "cpu:0,cpu:1");
    return {cuda_is_available() ? cuda_device(0) : cpu_device(0)};
  }
  std::vector<Device> devs = parse_devices(c.devices);
  CHORUS_CHECK(c.strategy != "single" || devs.size() == 1, "--strategy single trains on one device, got --devices ",
               c.devices, " (use --strategy dp for several)");
  return devs;
}

// --channels-last: a batch of images in the model's layout (converted where
// the loader put it; a DataParallel chunk keeps the layout on its way).
Tensor in_layout(const Tensor& images, bool channels_last) {
  return channels_last && images.dim() == 4 ? ops::to_channels_last(images) : images;
}

struct EvalResult {
  double loss = 0, accuracy = 0;
};

// Under DDP each rank evaluates its share of the test set and the sums are
// added over the ranks (Note [Training ranks]).
EvalResult evaluate(nn::Module& model, data::DataLoader& loader, bool channels_last,
                    const RankContext* ranks = nullptr) {
  NoGradGuard ng;
  model.eval();
  loader.start_epoch(0);
  data::Batch b;
  Tensor loss_sum, correct;
  int64_t n = 0;
  while (loader.next(&b)) {
    Tensor logits = model.forward(in_layout(b.images, channels_last));
    Tensor l = ops::unary(UnaryOp::MulScalar, nn::functional::cross_entropy(logits, b.labels), b.labels.size(0));
    Tensor c = ops::reduce(ReduceOp::Sum, ops::binary(BinaryOp::Eq, ops::reduce(ReduceOp::Argmax, logits, {1}, false), b.labels), {}, false);
    loss_sum = loss_sum.defined() ? ops::binary(BinaryOp::Add, loss_sum, l) : l;
    correct = correct.defined() ? ops::binary(BinaryOp::Add, correct, c) : c;
    n += b.labels.size(0);
  }
  model.train();
  std::vector<double> sums = {loss_sum.defined() ? loss_sum.item() : 0.0, correct.defined() ? correct.item() : 0.0,
                              static_cast<double>(n)};
  if (ranks) sums = sum_over_ranks(*ranks, sums);
  if (sums[2] == 0) return {};
  return {sums[0] / sums[2], sums[1] / sums[2]};
}

// Everything a run is made of, wired from the config.
struct Training {
  std::vector<Device> devices;
  Datasets data;
  nn::ModulePtr model;                     // what checkpoints and evaluation see
  std::unique_ptr<optim::Optimizer> opt;
  TrainStep step;                          // runs the model or its parallel wrapper
  std::unique_ptr<data::DataLoader> train_loader, test_loader;
  std::shared_ptr<optim::LRSchedule> schedule;  // over reference steps (Note [Progress in samples])
  double lr = 0;                           // the schedule's peak
  int64_t per_epoch = 0;                   // steps of this run's global batch in an epoch
  int64_t total_steps = 0;                 // this run's own steps from 0 to its end (set by plan_run)
  int64_t global_batch = 0;                // examples per step, over all devices and ranks
  int64_t step_samples = 0;                // the run's reference step: its first global batch
  int64_t budget = 0;                      // examples to consume in all: --steps x step_samples (or no limit)
  int64_t schedule_steps = 0;              // the schedule's length in reference steps
  std::optional<RankContext> ranks;        // --strategy ddp or zero
  std::shared_ptr<dist::DistributedDataParallel> ddp;
  // --strategy zero: the optimizer updates this rank's pieces (sdp->shard_parameters());
  // every rank writes its part of each checkpoint (apps/sharded_checkpoints.h).
  std::shared_ptr<dist::ShardedDataParallel> sdp;
  std::unique_ptr<ShardedCheckpointer> sharded_ckpt;
  int64_t saved_samples = -1;              // the position of the last checkpoint this run wrote
  std::shared_ptr<parallel::Pipeline> pipeline;   // --strategy pipeline
  std::string pipeline_line;                     // how the model was split
  bool evaluate_epochs = false;            // the test set after each epoch (decided by rank 0's settings)
  bool channels_last = false;              // NHWC weights and batches (default where every device is a GPU)
  // The memory plan's static part, when printed: the first step's measured
  // peak names the activations (apps/memory_check.h).
  std::optional<dist::MemoryPlan> memory_plan;
  const RankContext* rank_context() const { return ranks ? &*ranks : nullptr; }
  int world() const { return ranks ? ranks->group->size() : 1; }
};

// What every rank of a job must agree on (Note [Options every rank shares] in
// train_dist.h): the options that shape training, by their names in the
// config, this rank's number of devices, and each split's size with a
// checksum of its first and last examples (FNV-1a over their bytes).
nlohmann::json rank_fingerprint(const TrainConfig& cfg, const Datasets& data, size_t devices) {
  nlohmann::json j = cfg.to_json();
  j.erase("data_dir");  // a path may differ between nodes; the contents may not
  j.erase("devices");   // device names are per rank (cuda:LOCAL_RANK); their number is not
  j["sync_bn"] = cfg.sync_bn;
  j["lr"] = cfg.lr.value_or(default_lr(cfg));
  j["log_every"] = cfg.log_every;  // where the ranks meet to sum the figures
  j["bucket_mb"] = cfg.bucket_mb;
  j["comm_hook"] = cfg.comm_hook;
  j["zero_stage"] = cfg.zero_stage.value_or(0);
  j["reshard_after_forward"] = cfg.reshard_after_forward;
  j["hybrid"] = cfg.hybrid;
  j["devices_per_rank"] = devices;
  auto checksum = [](const data::Dataset& d) {
    uint64_t h = 1469598103934665603ull;
    auto mix = [&h](const void* p, size_t n) {
      for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<const unsigned char*>(p)[i]) * 1099511628211ull;
    };
    std::vector<float> image(static_cast<size_t>(numel_of(d.image_shape())));
    std::vector<int64_t> picks;
    for (int64_t i = 0; i < std::min<int64_t>(d.size(), 4); ++i) picks.push_back(i);
    if (d.size() > 4) picks.push_back(d.size() - 1);
    for (int64_t i : picks) {
      int64_t label = 0;
      d.get(i, image.data(), &label);
      mix(image.data(), image.size() * sizeof(float));
      mix(&label, sizeof(label));
    }
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
    return nlohmann::json{{"size", d.size()}, {"checksum", hex}};
  };
  j["train_data"] = checksum(*data.train);
  j["test_data"] = checksum(*data.test);
  return j;
}

// --strategy zero: the model in ShardedDataParallel over the job. Stage 3
// names a ResNet's residual blocks as its units (sharded from the start, as
// a GPT's blocks); other models' units are found (Note [Sharded units]) and
// trusted only after a first, fully gathered step.
std::shared_ptr<dist::ShardedDataParallel> shard_model(const TrainConfig& cfg, Training& t) {
  if (cfg.sync_bn) nn::convert_sync_batchnorm(t.model, t.ranks->group);
  dist::ShardOptions so = zero_flag_options(cfg);
  if (so.stage == 3) so.units = models::residual_blocks(t.model);
  // As under DDP: rank 0's buffers (the ones its checkpoints hold) reach
  // the others before each evaluation (ready_to_evaluate), not before every
  // forward: one meeting point less per step.
  so.broadcast_buffers = false;
  return make_sharded(cfg, t.model, *t.ranks, so);
}

Training set_up(const TrainConfig& cfg) {
  Training t;
  t.devices = pick_devices(cfg);
  const Device device = t.devices[0];
  CHORUS_CHECK(!(cfg.channels_last && cfg.no_channels_last), "--channels-last and --no-channels-last contradict each other");
  bool all_cuda = true;
  for (const Device& d : t.devices) {
    CHORUS_CHECK(!cfg.channels_last || d.is_cuda(), "--channels-last needs CUDA devices (got ", d.str(), ")");
    all_cuda = all_cuda && d.is_cuda();
  }
  // Channels-last by default on GPUs: cuDNN's fastest convolutions read NHWC
  // (chorus train WRN-16-4 bf16 faster in both runs on an H100; the small
  // Fashion-MNIST CNN, bound by its data, within noise; benchmarks journal,
  // session 11). The numbers do not depend on the layout.
  // Not under zero: its shards are ranges of row-major (NCHW) parameters.
  t.channels_last = cfg.channels_last || (all_cuda && !cfg.no_channels_last && cfg.strategy != "zero");
  CHORUS_CHECK(cfg.precision == "fp32" || device.is_cuda(), "--precision bf16 needs a CUDA device (got ", device.str(), ")");
  if (cfg.strategy == "ddp" || cfg.strategy == "zero") t.ranks = join_job(ddp_launch_env(cfg.strategy), device, cfg.dist_timeout_s);
  manual_seed(cfg.seed);
  t.data = load_data(cfg);
  if (t.ranks) check_same_options(*t.ranks, rank_fingerprint(cfg, t.data, t.devices.size()));
  models::ModelSpec spec{t.data.train->image_shape(), t.data.train->num_classes()};
  t.model = models::make_model(cfg.model, spec);
  t.model->to(device);
  // Every later move (DataParallel's replicas, a pipeline's stages) keeps the
  // layout (ops::to_device), and each batch is converted as it arrives.
  if (t.channels_last) t.model->to_channels_last();
  const double lr = cfg.lr.value_or(default_lr(cfg));
  if (cfg.strategy == "zero") t.sdp = shard_model(cfg, t);  // before the optimizer: it updates the pieces
  // One weight decay for every parameter, so each piece decays as its parameter would.
  std::vector<Tensor> params = t.sdp ? t.sdp->shard_parameters() : t.model->parameters();
  if (cfg.optimizer == "sgd")
    t.opt = std::make_unique<optim::SGD>(params, optim::SGDOptions{lr, cfg.momentum, 0.0, cfg.weight_decay, cfg.momentum > 0});
  else
    t.opt = std::make_unique<optim::AdamW>(params, optim::AdamWOptions{lr, 0.9, 0.999, 1e-8, cfg.weight_decay});
  nn::ModulePtr net;
  if (t.sdp) {
    net = t.sdp;
    if (cfg.checkpoint_dir) t.sharded_ckpt = std::make_unique<ShardedCheckpointer>(*cfg.checkpoint_dir, t.sdp, *t.opt, *t.ranks);
  } else if (t.ranks) {
    if (cfg.sync_bn) nn::convert_sync_batchnorm(t.model, t.ranks->group);
    nn::ModulePtr inner = t.devices.size() > 1 ? wrap_for_strategy(t.model, "dp", t.devices, cfg.bucket_mb) : t.model;
    dist::DDPOptions o;
    o.bucket_bytes = static_cast<int64_t>(cfg.bucket_mb * (1 << 20));
    o.comm_hook = dist::parse_comm_hook(cfg.comm_hook);
    // Rank 0's buffers are its own either way, and only rank 0's are saved;
    // the others receive them before each evaluation (finish_epoch, summarize)
    // instead of before every forward: one meeting point less per step.
    o.broadcast_buffers = false;
    t.ddp = std::make_shared<dist::DistributedDataParallel>(inner, t.ranks->group, o);
    net = t.ddp;
  } else if (cfg.strategy == "pipeline") {
    PipelineChoice pc;
    pc.micro_batches = cfg.micro_batches.value_or(std::min<int64_t>(4, cfg.batch_size));
    pc.schedule = cfg.schedule.value_or("1f1b");
    pc.balance = cfg.balance;
    pc.recompute = cfg.recompute.value_or("never");
    pc.virtual_stages = cfg.virtual_stages.value_or(0);
    // Balanced by time on one micro-batch of the training data's shape.
    const int64_t micro = std::max<int64_t>(1, cfg.batch_size / pc.micro_batches);
    Shape in{micro};
    in.insert(in.end(), spec.input.begin(), spec.input.end());
    AutocastGuard cast(cfg.precision == "bf16" ? std::optional<DType>(kBFloat16) : std::nullopt);
    const RngState rng = default_generator().state();  // timing draws nothing the run would see
    t.pipeline = make_pipeline(t.model, t.devices, pc, in_layout(randn(in, {kFloat32, device}), t.channels_last),
                               &t.pipeline_line);
    default_generator().set_state(rng);
    net = t.pipeline;
  } else {
    check_dp_all_reduce(cfg.dp_all_reduce, cfg.strategy, cfg.dp_broadcast);
    net = wrap_for_strategy(t.model, cfg.strategy, t.devices, cfg.bucket_mb, std::nullopt,
                            cfg.dp_broadcast ? nullptr : t.opt.get(), cfg.dp_all_reduce);
  }
  t.step = {net, t.opt.get(), std::nullopt, cfg.label_smoothing};
  t.step.pipeline = t.pipeline.get();
  t.step.dp_gather_output = cfg.dp_gather_output;
  if (cfg.precision == "bf16") t.step.autocast = kBFloat16;
  // Note [Graphed step]: captured after two eager steps, replayed from then on.
  // (DataParallel keeps the batch in host memory, so its steps stay eager;
  // DDP's collectives go into the graph: Note [DDP in a CUDA graph];
  // a pipeline is one graph over its devices: Note [Pipelines and CUDA graphs].)
  if (!cfg.no_cuda_graphs && cfg.strategy != "dp" && cuda_graphs_apply(cfg.strategy, t.devices)) {
    parallel::GraphedStepOptions go;
    if (t.pipeline) go.devices = t.pipeline->devices();
    // One line from rank 0 (every rank has the same last, smaller batch); a
    // failed capture is said by whichever rank it happens on.
    const bool leader = !t.ranks || t.ranks->leader();
    go.on_fallback = [leader](const std::string& line) {
      if (leader || line.find("cannot be captured") != std::string::npos) warn(line);
    };
    t.step.enable_cuda_graphs(go);
  }

  data::DataLoaderOptions lo;
  // --batch-size is per device; a pipeline's batch goes through every device (in micro-batches).
  lo.batch_size = cfg.batch_size * (t.pipeline ? 1 : static_cast<int64_t>(t.devices.size()));
  lo.num_workers = cfg.workers;
  lo.seed = cfg.seed;
  // DataParallel scatters each replica's chunk from where the batch is, so its
  // batches stay in host memory and every chunk goes to its device directly
  // (through pinned staging on GPUs), not to devices[0] first and on from there.
  if (t.devices.size() == 1 || t.pipeline) lo.device = device;
  std::shared_ptr<data::Sampler> sampler;
  if (t.ranks)  // Note [Training ranks]: this rank's share, reshuffled every epoch
    sampler = std::make_shared<data::DistributedSampler>(t.data.train->size(), t.world(), t.ranks->env.rank, true, cfg.seed);
  else
    sampler = std::make_shared<data::RandomSampler>(t.data.train->size(), cfg.seed);
  t.train_loader = std::make_unique<data::DataLoader>(t.data.train, sampler, lo, t.data.augment);
  t.global_batch = lo.batch_size * t.world();
  data::DataLoaderOptions eo = lo;
  eo.device = device;  // evaluation runs the model itself, on devices[0]
  eo.batch_size = std::max<int64_t>(cfg.batch_size, 500);
  std::shared_ptr<data::Sampler> eval_sampler;
  if (t.ranks) eval_sampler = std::make_shared<data::ShardSampler>(t.data.test->size(), t.world(), t.ranks->env.rank);
  t.test_loader = std::make_unique<data::DataLoader>(t.data.test, eval_sampler, eo);

  t.per_epoch = t.train_loader->num_batches();
  int64_t epoch_examples = 0;
  CHORUS_CHECK(!__builtin_mul_overflow(t.per_epoch, cfg.epochs, &t.total_steps) &&
                   !__builtin_mul_overflow(t.total_steps, t.global_batch, &epoch_examples),
               "--epochs ", cfg.epochs, " of ", t.per_epoch, " steps each is more steps than can be counted");
  t.lr = lr;
  t.step_samples = t.global_batch;  // a fresh run's; a resumed run takes its checkpoint's (plan_run)
  return t;
}

// Where the loop is: a fresh run starts at zero, a resumed one where its
// checkpoint was written. Steps and batches are this run's own (its global
// batch); `samples` is the position of record (Note [Progress in samples]).
struct Position {
  int64_t step = 0, epoch = 0, batch_in_epoch = 0;
  int64_t samples = 0;  // examples consumed, over all devices and ranks
};

// What a resumed run takes from its checkpoint beyond the weights.
struct Continued {
  Position pos;
  int64_t step_samples = 0;                   // the run's reference step
  std::optional<int64_t> schedule_steps;      // the schedule's length, when the run's length is unchanged
};

// A checkpoint's position in this run's terms, once it is known to be
// reachable (Note [Resume checks]). Its batches were of the writer's global
// batch: the position within the epoch is the examples already seen,
// rounded down to this run's batches (Note [Progress in samples]).
Continued continue_from(const TrainConfig& cfg, const Training& t, const io::TrainingState& st,
                        const std::string& state_path) {
  int64_t writer = t.global_batch;
  if (auto it = st.extra.find("global_batch"); it != st.extra.end()) {
    if (!it->is_number_integer() || it->get<int64_t>() <= 0)
      CHORUS_THROW(IOError, state_path, ": \"global_batch\" is ", io::detail::json_excerpt(*it),
                   ", not an integer >= 1");
    writer = it->get<int64_t>();
  }
  const SavedPosition at = read_position(st.extra, kSampleKeys, st.step, writer, state_path);
  check_resume_position(st, at, writer, t.global_batch, t.per_epoch, cfg.epochs, cfg.steps, state_path);
  Continued c;
  c.step_samples = at.per_step;
  c.pos.epoch = st.epoch;
  c.pos.samples = at.consumed;
  int64_t seen = 0;  // examples of the epoch already seen
  if (__builtin_mul_overflow(st.batch_in_epoch, writer, &seen))
    CHORUS_THROW(IOError, state_path, ": batch_in_epoch ", st.batch_in_epoch, " is past the end of an epoch");
  c.pos.batch_in_epoch = std::min(seen / t.global_batch, t.per_epoch);
  c.pos.step = c.pos.epoch * t.per_epoch + c.pos.batch_in_epoch;
  // The schedule the checkpoint was on, as long as the run's length is the same.
  const nlohmann::json now = cfg.to_json();
  auto it = st.extra.find("schedule_steps");
  if (it != st.extra.end() && it->is_number_integer() && it->get<int64_t>() >= 0 && st.config.is_object() &&
      st.config.value("epochs", nlohmann::json()) == now["epochs"] && st.config.value("steps", nlohmann::json()) == now["steps"])
    c.schedule_steps = it->get<int64_t>();
  return c;
}

// --resume: weights, optimizer, RNG and position from the newest checkpoint
// that can be read (Note [Unreadable checkpoints]), once it is known to
// belong to this run (Note [Resume checks]).
std::optional<Continued> resume(const TrainConfig& cfg, Training& t) {
  if (!cfg.resume) return std::nullopt;
  auto check = [&](const io::TrainingState& st, const std::string& state_path) {
    check_resume_config(st.config, cfg.to_json(), cfg.allow_change, state_path);
    (void)continue_from(cfg, t, st, state_path);
  };
  // Note [Checkpoints at any layout] (apps/sharded_checkpoints.h): either
  // kind, whichever is newest. A zero rank reads its own ranges of it.
  io::Resumed r;
  if (t.sdp) {
    r = resume_at_any_layout(*cfg.checkpoint_dir, *t.model, *t.opt, t.sdp.get(), cfg.start_fresh, check);
  } else {
    if (!t.ranks || t.ranks->leader())
      r = resume_at_any_layout(*cfg.checkpoint_dir, *t.model, *t.opt, nullptr, cfg.start_fresh, check);
    if (t.ranks) {  // Note [Training ranks]: rank 0 picks, every rank loads that one
      const std::string chosen = agree_on_checkpoint(*t.ranks, r.path);
      if (!t.ranks->leader() && !chosen.empty()) {
        r.state = load_at_any_layout(chosen, *t.model, *t.opt, check);
        r.path = chosen;
      }
    }
  }
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
    return std::nullopt;
  }
  Continued c = continue_from(cfg, t, r.state, state_file_of(*r.path));
  default_generator().set_state(r.state.rng);
  if (!cfg.quiet || !r.skipped.empty())
    std::fprintf(stderr, "resuming from %s (epoch %lld, step %lld, %lld examples seen)\n", r.path->c_str(),
                 (long long)c.pos.epoch + 1, (long long)c.pos.step, (long long)c.pos.samples);
  return c;
}

// Note [Progress in samples]: the budget, the schedule and this run's own
// steps, from the reference step (the checkpoint's when resuming).
Position plan_run(const TrainConfig& cfg, Training& t, const std::optional<Continued>& from) {
  const Position pos = from ? from->pos : Position{};
  if (from) t.step_samples = from->step_samples;
  t.budget = std::numeric_limits<int64_t>::max();
  if (cfg.steps)
    CHORUS_CHECK(!__builtin_mul_overflow(*cfg.steps, t.step_samples, &t.budget), "--steps ", *cfg.steps, " of ",
                 t.step_samples, " examples each is more examples than can be counted");
  // The epochs in reference steps (set_up checked that per_epoch * epochs * global_batch fits).
  const int64_t epoch_steps = t.per_epoch * cfg.epochs * t.global_batch / t.step_samples;
  t.schedule_steps = cfg.steps ? std::min(epoch_steps, *cfg.steps) : epoch_steps;
  if (from && from->schedule_steps) t.schedule_steps = *from->schedule_steps;
  t.schedule = std::make_shared<optim::LinearWarmup>(
      std::min<int64_t>(100, t.schedule_steps / 10),
      std::make_shared<optim::CosineAnnealingLR>(t.lr, std::max<int64_t>(t.schedule_steps, 1)));
  t.total_steps = t.per_epoch * cfg.epochs;
  if (cfg.steps) t.total_steps = std::min(t.total_steps, pos.step + steps_left(pos.samples, t.budget, t.global_batch));
  return pos;
}

std::string save(const TrainConfig& cfg, Training& t, const Position& pos) {
  if (!cfg.checkpoint_dir) return "";
  io::TrainingState st;
  st.epoch = pos.epoch;
  // Named by reference steps (Note [Progress in samples]): pruning and the
  // fallback to an older checkpoint follow the position on any world size.
  st.step = reference_step(pos.samples, t.step_samples);
  st.batch_in_epoch = pos.batch_in_epoch;  // of this run's batches (global_batch)
  st.rng = default_generator().state();
  st.config = cfg.to_json();
  st.extra["global_batch"] = t.global_batch;
  st.extra["world_size"] = t.world();
  st.extra[kSampleKeys.consumed] = pos.samples;
  st.extra[kSampleKeys.per_step] = t.step_samples;
  st.extra["schedule_steps"] = t.schedule_steps;
  // Written already (--checkpoint-every at the step --steps or a signal stops
  // at): once is enough, and a sharded save of one step cannot be committed twice.
  const std::string path = *cfg.checkpoint_dir + "/" + io::checkpoint_name(st.step);
  if (t.saved_samples == pos.samples) return path;
  t.saved_samples = pos.samples;
  if (!t.ranks) return io::save_checkpoint(*cfg.checkpoint_dir, *t.model, *t.opt, st);
  if (t.sharded_ckpt) {
    // Every rank its pieces, written in the background; committed through
    // the job's store (apps/sharded_checkpoints.h).
    const double stall = t.sharded_ckpt->save(st);
    if (t.ranks->leader() && !cfg.quiet)
      std::fprintf(stderr, "checkpoint %s: training stalled %.1f ms (%s)\n", path.c_str(), stall,
                   snapshot_where(t.sharded_ckpt->writer().last_snapshot_devices()).c_str());
    return path;
  }
  // Note [Training ranks]: rank 0 writes; nobody goes on before it is complete.
  const std::string written = t.ranks->leader() ? io::save_checkpoint(*cfg.checkpoint_dir, *t.model, *t.opt, st) : path;
  t.ranks->group->barrier()->wait();
  return written;
}

// Note [Stopping on a signal]: after the step in flight, a checkpoint (when
// there is a directory for it), one line saying so, and Interrupted.
[[noreturn]] void stop_for_signal(const TrainConfig& cfg, Training& t, const Position& pos, Progress& progress) {
  // Under DDP a rank may stop because another one was signalled.
  const int sig = StopSignal::pending() ? StopSignal::pending() : SIGTERM;
  progress.finish();
  const std::string where = save(cfg, t, pos);
  if (t.sharded_ckpt) t.sharded_ckpt->wait();  // whole on disk before the run stops
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
    ++steps_;
  }
  // Time inside the window that was not training (an epoch's evaluation and
  // checkpoint): left out of its img/s and step time.
  void exclude(double seconds) { excluded_s_ += seconds; }
  struct Window {
    double loss, accuracy, img_per_s, step_ms;
    bool report = false;  // rank 0 asked for the ranks' step times (Note [Slow ranks named])
  };
  // Rank 0: ask every rank, through this window's all-reduce, for a RankTimes report.
  void ask_for_report() { report_due_ = true; }
  // Reads the window (one host wait) and starts the next one. Under DDP the
  // figures are over all ranks (Note [Training ranks]).
  Window close(const RankContext* ranks = nullptr) {
    auto now = std::chrono::steady_clock::now();
    const double secs = std::chrono::duration<double>(now - start_).count() - excluded_s_;
    std::vector<double> sums = {loss_.item(), correct_.item(), static_cast<double>(count_), report_due_ ? 1.0 : 0.0};
    if (ranks) sums = sum_over_ranks(*ranks, sums);
    Window w{sums[0] / sums[2], sums[1] / sums[2], secs > 0 ? sums[2] / secs : 0,
             steps_ > 0 ? 1000.0 * secs / static_cast<double>(steps_) : 0, sums[3] > 0};
    *this = StepStats();
    start_ = now;
    return w;
  }

 private:
  Tensor loss_, correct_;
  int64_t count_ = 0, steps_ = 0;
  double excluded_s_ = 0;
  bool report_due_ = false;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

struct LoopResult {
  double last_loss = std::nan(""), last_acc = 0;
  int64_t images = 0;
};

// Before evaluating through the model itself (a collective under ddp and
// zero): rank 0's batch-norm statistics everywhere, as its checkpoint has
// them; under zero the full weights in the module too.
void ready_to_evaluate(Training& t) {
  if (t.ddp) t.ddp->broadcast_buffers();
  if (!t.sdp) return;
  t.sdp->gather_parameters();
  NoGradGuard ng;
  std::vector<Tensor> buffers;
  for (auto& [name, b] : t.model->named_buffers()) buffers.push_back(b);
  dist::broadcast_in_place(*t.ranks->group, buffers);
}

// End of an epoch: checkpoint, then test-set evaluation when anyone reads it.
void finish_epoch(const TrainConfig& cfg, Training& t, const Position& pos, RunLog* log, Progress& progress) {
  save(cfg, t, pos);
  if (!t.evaluate_epochs) return;
  ready_to_evaluate(t);
  EvalResult ev = evaluate(*t.model, *t.test_loader, t.channels_last, t.rank_context());
  progress.finish();
  if (!cfg.quiet)
    std::fprintf(stderr, "epoch %lld/%lld: test loss %.4f, test accuracy %.4f\n", (long long)pos.epoch,
                 (long long)cfg.epochs, ev.loss, ev.accuracy);
  // Memory at the epoch's end and its peak during the epoch (the largest over
  // this process's devices): a steady run shows the same peak epoch after epoch.
  size_t in_use = 0, peak = 0;
  nlohmann::ordered_json per_device = nlohmann::ordered_json::object();
  for (const Device& d : t.devices) {
    in_use = std::max(in_use, backend(d).bytes_in_use(d));
    peak = std::max(peak, backend(d).peak_bytes(d));
    per_device[d.str()] = backend(d).peak_bytes(d);
    backend(d).reset_peak_bytes(d);
  }
  if (log)
    log->epoch({{"step", pos.step}, {"epoch", pos.epoch}, {"test_loss", ev.loss}, {"test_accuracy", ev.accuracy},
                {"mem_in_use_bytes", in_use}, {"peak_mem_bytes", peak}, {"peak_mem_bytes_per_device", per_device}});
}

// Whether to stop after this step: at once on a signal for one process; under
// DDP after the step the ranks agreed on (Note [Stopping ranks together]).
bool should_stop(const Training& t, StopAgreement* agreement, int64_t step) {
  return agreement ? agreement->stop_after(step, StopSignal::pending() != 0) : StopSignal::pending() != 0;
}

// The L2 norm of the model's gradients after the last step (what its update
// used: averaged over the ranks under DDP, summed over the replicas under
// DataParallel); unset when no parameter has one. Read at log windows only:
// one host wait.
std::optional<double> grad_norm(const Training& t) {
  NoGradGuard ng;
  Tensor sum;
  for (const Tensor& p : t.model->parameters()) {
    if (!p.grad().defined()) continue;
    Tensor g = p.grad();
    Tensor s = ops::reduce(ReduceOp::Sum, ops::binary(BinaryOp::Mul, g, g), {}, false);
    if (s.dtype() != kFloat32) s = s.to(kFloat32);
    sum = sum.defined() ? ops::binary(BinaryOp::Add, sum, s) : s;  // cross-device operands move to `sum`'s device
  }
  if (!sum.defined()) return std::nullopt;
  return std::sqrt(sum.item());
}

// The largest peak of this process's devices since the epoch began.
size_t peak_bytes(const std::vector<Device>& devices) {
  size_t peak = 0;
  for (const Device& d : devices) peak = std::max(peak, backend(d).peak_bytes(d));
  return peak;
}

// The epoch loop from `pos` on, until the epochs or --steps run out.
LoopResult train_loop(const TrainConfig& cfg, Training& t, Position& pos, RunLog* log, StepTracer& tracer) {
  LoopResult out;
  Progress progress(!cfg.quiet);
  StepStats stats;
  RankTimes rank_times;  // Note [Slow ranks named]
  auto last_report = std::chrono::steady_clock::now();
  std::optional<StopAgreement> agreement;
  if (t.ranks) agreement.emplace(*t.ranks);
  const int64_t start_epoch = pos.epoch;
  const int64_t first_step = pos.step;
  t.model->train();
  for (int64_t epoch = start_epoch; epoch < cfg.epochs && pos.step < t.total_steps; ++epoch) {
    pos.epoch = epoch;
    if (epoch != start_epoch) pos.batch_in_epoch = 0;
    t.train_loader->start_epoch(epoch, pos.batch_in_epoch);
    data::Batch b;
    while (pos.step < t.total_steps) {
      tracer.begin_step(pos.step + 1);  // --trace: the chosen steps, their data loading included
      const auto step_begin = std::chrono::steady_clock::now();
      bool got = false;
      {
        ops::TraceScope data("data");
        got = t.train_loader->next(&b);
      }
      const auto data_end = std::chrono::steady_clock::now();
      if (!got) break;
      // Note [Progress in samples]: the schedule at the examples consumed.
      t.opt->set_lr(lr_at_position([&](int64_t k) { return t.schedule->lr_at(k); }, pos.samples, t.step_samples));
      // Labels go where the loss is computed (the output device); the images
      // stay where the loader put them (host memory under DataParallel).
      if (b.labels.device() != t.devices[0]) b.labels = b.labels.to(t.devices[0]);
      stats.add(t.step.run(in_layout(b.images, t.channels_last), b.labels), b.labels);
      ++pos.step;
      ++pos.batch_in_epoch;
      pos.samples += t.global_batch;  // a last, partial batch of an epoch counts whole, on every rank alike
      out.images += b.labels.size(0);
      tracer.end_step(pos.step);
      // Note [Measured beside the plan] (apps/memory_check.h).
      if (t.memory_plan && (pos.step == first_step + 2 || (pos.step == first_step + 1 && pos.step == t.total_steps))) {
        progress.finish();
        std::fprintf(stderr, "%s\n", dist::measured_line(*t.memory_plan, static_cast<int64_t>(peak_bytes(t.devices))).c_str());
      }
      if (t.ranks) {
        const auto now = std::chrono::steady_clock::now();
        rank_times.add_step(std::chrono::duration<double>(now - step_begin).count(),
                            std::chrono::duration<double>(data_end - step_begin).count());
      }
      if (pos.step % cfg.log_every == 0 || pos.step == t.total_steps) {
        const auto now = std::chrono::steady_clock::now();
        if (t.ranks) rank_times.arrive();  // Note [Late arrivals]
        if (t.ranks && t.ranks->leader() && cfg.stats_every_s > 0 &&
            std::chrono::duration<double>(now - last_report).count() >= cfg.stats_every_s)
          stats.ask_for_report();
        StepStats::Window w = stats.close(t.rank_context());
        if (w.report) {  // every rank, at the same step
          const std::string line = rank_times.report(*t.ranks, pos.step, t.ddp ? t.ddp->gradient_wait_seconds() : 0.0);
          last_report = now;
          if (!line.empty() && !cfg.quiet) {
            progress.finish();
            std::fprintf(stderr, "%s\n", line.c_str());
          }
        }
        out.last_loss = w.loss;
        out.last_acc = w.accuracy;
        CHORUS_CHECK_T(Error, std::isfinite(w.loss), "training diverged: the loss is ", w.loss, " at step ", pos.step,
                       " (try a smaller --lr)");
        progress.update({pos.step, t.total_steps, epoch + 1, cfg.epochs, w.loss, w.accuracy, w.img_per_s});
        if (log) {
          nlohmann::ordered_json rec = {{"step", pos.step}, {"samples", pos.samples}, {"epoch", epoch + 1}, {"loss", w.loss},
                                        {"accuracy", w.accuracy}, {"lr", t.opt->lr()}, {"img_per_s", w.img_per_s},
                                        {"step_ms", w.step_ms}, {"world_size", t.world()}};
          if (auto norm = grad_norm(t)) rec["grad_norm"] = *norm;
          rec["peak_mem_bytes"] = peak_bytes(t.devices);
          log->step(rec);
        }
      }
      // The epoch's last step is saved by finish_epoch, as the next epoch's start.
      if (cfg.checkpoint_every > 0 && pos.step % cfg.checkpoint_every == 0 && pos.batch_in_epoch < t.per_epoch)
        save(cfg, t, pos);
      if (should_stop(t, agreement ? &*agreement : nullptr, pos.step)) stop_for_signal(cfg, t, pos, progress);
    }
    if (pos.batch_in_epoch >= t.per_epoch) {
      const auto eval_start = std::chrono::steady_clock::now();
      finish_epoch(cfg, t, {pos.step, epoch + 1, 0, pos.samples}, log, progress);
      stats.exclude(std::chrono::duration<double>(std::chrono::steady_clock::now() - eval_start).count());
    } else {
      save(cfg, t, pos);  // stopped inside the epoch (--steps): resumable from here
    }
  }
  progress.finish();
  return out;
}

nlohmann::ordered_json summarize(const TrainConfig& cfg, Training& t, const Position& start, const Position& end,
                                 const LoopResult& loop, double seconds) {
  ready_to_evaluate(t);
  EvalResult final_eval = evaluate(*t.model, *t.test_loader, t.channels_last, t.rank_context());
  std::vector<std::string> device_names;
  for (const Device& d : t.devices) device_names.push_back(d.str());
  const int64_t steps_run = std::max<int64_t>(end.step - start.epoch * t.per_epoch - start.batch_in_epoch, 1);
  using J = nlohmann::ordered_json;
  return {{"model", cfg.model},
          {"data", cfg.data},
          {"strategy", cfg.strategy},
          {"devices", device_names},
          {"world_size", t.world()},
          {"precision", cfg.precision},
          {"channels_last", t.channels_last},
          {"epochs", cfg.epochs},
          {"steps", end.step},
          {"samples", end.samples},
          {"batch_size", cfg.batch_size},
          {"train_loss", std::isnan(loop.last_loss) ? J(nullptr) : J(loop.last_loss)},
          {"train_accuracy", loop.last_acc},
          {"test_loss", final_eval.loss},
          {"test_accuracy", final_eval.accuracy},
          {"img_per_s", seconds > 0 ? static_cast<double>(loop.images * t.world()) / seconds : 0.0},
          {"seconds", seconds},
          {"seconds_per_epoch", seconds * static_cast<double>(t.per_epoch) / static_cast<double>(steps_run)},
          // Note [Graphed step]: steps replayed from the captured graph (null: graphs off or not applicable).
          {"cuda_graph_replays", t.step.graph ? J(t.step.graph->replays()) : J(nullptr)}};
}

void announce(const TrainConfig& cfg, const Training& t) {
  if (cfg.quiet) return;
  std::string where;
  for (const Device& d : t.devices) where += (where.empty() ? "" : ",") + d.str();
  std::fprintf(stderr, "training %s (%lld parameters) on %s%s%s, %s, %lld examples, batch %lld%s, %lld steps\n",
               cfg.model.c_str(), (long long)t.model->num_parameters(), where.c_str(),
               t.ranks ? (" x " + std::to_string(t.world()) + " processes (" + (t.sdp ? "zero" : "DDP") + " over " +
                          t.ranks->group->backend() + ")").c_str()
               : cfg.strategy == "dp" ? " (DataParallel)" : t.pipeline ? " (pipeline)" : t.step.graph ? " (CUDA graph)" : "",
               t.channels_last ? ", channels-last" : "",
               t.data.train->name().c_str(),
               (long long)t.data.train->size(), (long long)cfg.batch_size, t.pipeline ? "" : " per device",
               (long long)t.total_steps);
  if (t.pipeline) std::fprintf(stderr, "%s\n", t.pipeline_line.c_str());
  if (t.sdp) std::fprintf(stderr, "%s\n", describe_sharding(*t.sdp, t.world()).c_str());
}

// The plan's static part (weights, gradients, optimizer, communication)
// before step 1, its activations measured on the first (apps/memory_check.h);
// pipelines, whose stages hold unequal parts, have none.
void plan_memory(const TrainConfig& cfg, Training& t) {
  if (t.pipeline || cfg.quiet || !(t.devices[0].is_cuda() || cfg.memory.show)) return;
  const int64_t opt_bytes = cfg.optimizer == "adamw" ? 8 : cfg.momentum > 0 ? 4 : 0;
  dist::MemoryPlanInputs in = module_plan_inputs(*t.model, cfg.precision == "bf16", opt_bytes, cfg.bucket_mb);
  const int stage = t.sdp ? t.sdp->options().stage : 0;
  // Zero 3 with units it finds itself: the first step holds the whole model
  // gathered (Note [Sharded units]), and that step is the peak.
  if (stage == 3) in.root_unit_params = in.params;
  dist::MemoryPlan plan =
      dist::plan_for(plan_strategy(cfg.strategy, static_cast<int64_t>(t.devices.size()), t.world(), stage), in);
  if (!check_memory_plan(cfg.model, plan, in, t.devices[0], cfg.memory)) return;
  t.memory_plan = plan;
  for (const Device& d : t.devices) backend(d).reset_peak_bytes(d);
}

}  // namespace

nlohmann::ordered_json run_train(const TrainConfig& given) {
  given.validate();
  StopSignal stop_signal;
  Training t = set_up(given);
  // Note [Training ranks]: only rank 0 speaks and writes metrics.
  TrainConfig cfg = given;
  t.evaluate_epochs = given.metrics || given.tensorboard || given.plot || !given.quiet;
  const bool leader = !t.ranks || t.ranks->leader();
  if (!leader) {
    cfg.quiet = true;
    cfg.metrics.reset();
    if (!cfg.tensorboard_all_ranks) cfg.tensorboard.reset();
    cfg.plot.reset();
  }
  // Note [Checkpoint directory lock]: the writer holds its directory until it ends.
  std::optional<io::CheckpointDirLock> dir_lock;
  if (leader && cfg.checkpoint_dir) dir_lock.emplace(*cfg.checkpoint_dir);
  const Position start = plan_run(cfg, t, resume(cfg, t));
  RunLogOptions lo;
  lo.metrics = cfg.metrics;
  lo.append = cfg.resume;
  lo.tensorboard = tensorboard_run_dir(cfg.tensorboard, cfg.model, cfg.strategy, t.ranks ? &*t.ranks : nullptr,
                                      cfg.tensorboard_all_ranks);
  lo.plot = cfg.plot;
  lo.run_name = cfg.metrics ? fs::path(*cfg.metrics).stem().string() : cfg.model + " " + cfg.strategy;
  RunLog log(lo);
  announce(cfg, t);
  plan_memory(cfg, t);
  if (log.tensorboard() && !cfg.quiet) std::fprintf(stderr, "tensorboard: %s\n", log.tensorboard()->path().c_str());
  const auto t0 = std::chrono::steady_clock::now();
  Position pos = start;
  // Note [Traces of several ranks]: every rank records; rank 0 writes the file.
  StepTracer tracer(cfg.trace, cfg.trace_steps, t.ranks ? t.ranks->group->store() : nullptr,
                    t.ranks ? t.ranks->env.rank : 0, t.world(), !cfg.quiet);
  LoopResult loop = train_loop(cfg, t, pos, log.any() ? &log : nullptr, tracer);
  tracer.finish();
  if (t.sharded_ckpt) t.sharded_ckpt->wait();  // the last checkpoint is whole on disk before the run reports
  synchronize();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  nlohmann::ordered_json summary = summarize(cfg, t, start, pos, loop, seconds);
  log.summary(summary);
  return leader ? summary : nlohmann::ordered_json();
}

}  // namespace chorus::app
