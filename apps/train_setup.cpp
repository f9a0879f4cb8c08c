// `chorus train` for image models, its set-up (train_image.h): the data set,
// devices, model, optimizer and strategy (DataParallel, DDP, zero, pipeline,
// CUDA graphs), the loaders; the line announcing the run and its memory plan.
#include "train_image.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <optional>

#include "chorus/autograd/autocast.h"
#include "chorus/core/backend.h"
#include "chorus/core/error.h"
#include "chorus/core/warn.h"
#include "chorus/core/rng.h"
#include "chorus/data/cifar.h"
#include "chorus/data_parallel/sync_batch_norm.h"
#include "chorus/data/loader.h"
#include "chorus/data/mnist.h"
#include "chorus/data/sampler.h"
#include "chorus/data/synthetic.h"
#include "chorus/data/transforms.h"
#include "chorus/models/models.h"
#include "chorus/ops/copy.h"
#include "chorus/ops/factory.h"
#include "chorus/optim/adamw.h"
#include "chorus/optim/sgd.h"
#include "memory_check.h"
#include "train_dist.h"
#include "train_pipeline.h"
#include "train_step.h"
#include "train_zero.h"
#include "sharded_checkpoints.h"

namespace chorus::app::image_train {

namespace {

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
  j["zero_prefetch"] = cfg.zero_prefetch;
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

}  // namespace

Tensor in_layout(const Tensor& images, bool channels_last) {
  return channels_last && images.dim() == 4 ? ops::to_channels_last(images) : images;
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

}  // namespace chorus::app::image_train
