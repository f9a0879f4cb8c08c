// The `chorus` command line: version, devices, train, bench, launch, checkpoint. Every
// error becomes one line on stderr and a non-zero exit code. main.cpp calls
// it; the command-line fuzz harness calls it with parse_only.
#include <CLI/CLI.hpp>

#include <csignal>
#include <cstdio>
#include <iostream>

#include "bench.h"
#include "bench_comm.h"
#include "chorus/core/error.h"
#include "checkpoint_commands.h"
#include "chorus/data/loader.h"
#include "cli_numbers.h"
#include "stop_signal.h"
#include "cli_options.h"
#include "commands.h"
#include "crash_report.h"
#include "launch.h"
#include "lm_commands.h"
#include "plan.h"
#include "plot.h"
#include "train.h"
#include "train_gpt.h"

using namespace chorus;

// The whole program; with parse_only it stops once the command line is
// parsed and checked (the command-line fuzz harness, tests/fuzz/fuzz_cli.cpp).
int chorus_main(int argc, char** argv, bool parse_only) {
  if (!parse_only) {
    app::install_crash_report();
    // Note [File size limit]: past `ulimit -f` a write fails with EFBIG, which
    // io:: turns into an IOError naming the file (the checkpoint before stays
    // as it was); SIGXFSZ's default action would kill the program with no word.
    ::signal(SIGXFSZ, SIG_IGN);
  }
  CLI::App app{"Chorus: train one neural network on many devices", "chorus"};
  app.require_subcommand(0, 1);
  bool show_version = false;
  app.add_flag("--version", show_version, "Print the version and build features");

  app::TrainConfig tc;
  CLI::App* train = app.add_subcommand("train", "Train and evaluate a model");
  train->add_option("--model", tc.model, "mlp|cnn|resnet20|wrn-16-4|wrn-28-10 | gpt2|gpt2-medium|gpt2-large|gpt2-xl|d6..d84")->capture_default_str();
  train->add_option("--data", tc.data, "fashion-mnist|mnist|cifar10|synthetic | GPT: tokens:GLOB|text:FILE")->capture_default_str();
  app::add_optional(train, "--data-dir", tc.data_dir, "Folder with the data set's files (default: /usr/share/datasets/<data>)");
  train->add_option("--devices", tc.devices, "cpu | cpu:0,cpu:1 | cuda:0,cuda:1 | all (default: cuda:0 if present, else cpu)")->check(app::non_empty_devices, "DEVICES");
  train->add_option("--strategy", tc.strategy, "single|dp|ddp|pipeline|zero (zero: sharded data parallelism, one process per device)")->capture_default_str();
  train->add_option("--zero-stage", tc.zero_stage, "zero: 1 optimizer state, 2 and gradients, 3 and weights sharded over the ranks (default 1)");
  train->add_flag("--reshard-after-forward,!--no-reshard-after-forward", tc.reshard_after_forward, "zero stage 3: free each unit's gathered weights after its forward and gather them again for its backward (default on)");
  train->add_flag("--zero-prefetch,!--no-zero-prefetch", tc.zero_prefetch, "zero: issue the weights' gathers ahead of use (stage 3: the next block's while this one computes; stages 1-2: every bucket's as the forward starts, each block waiting for its own) (default on)");
  train->add_flag("--hybrid", tc.hybrid, "zero: shard inside each node, replicate across nodes");
  app::add_optional(train, "--zero-param-dtype", tc.zero_param_dtype, "zero: the dtype the blocks' matrices are gathered in, bf16 or fp32 (default: bf16 under --precision bf16; the optimizer's shards stay float32)");
  train->add_option("--bucket-mb", tc.bucket_mb, "dp: sum gradients in buckets of this many MiB while the backward runs (0: one sum at the end)")->capture_default_str()->check(app::real_number(1e12));
  train->add_flag("--dp-gather-output", tc.dp_gather_output, "dp: gather the outputs on the first device and compute the loss there (PyTorch's DataParallel) instead of each replica computing its chunk's loss");
  app::add_optional(train, "--dp-all-reduce", tc.dp_all_reduce, "dp: how the replicas' gradients are summed: auto, nccl (NCCL's kernels), copy-engine (the GPUs' copy engines over peer access, and one small sum kernel) or in-update (two GPUs' copy engines exchange the gradients and the optimizer's update adds them: no SM held, no sum kernel); auto: in-update on two GPUs with peer access, else nccl (default: CHORUS_DP_ALLREDUCE, else auto)");
  train->add_flag("--dp-broadcast", tc.dp_broadcast, "dp: the first device steps the weights and broadcasts them to the replicas after each step (PyTorch's DataParallel) instead of every replica stepping its own copy");
  train->add_option("--epochs", tc.epochs, "Epochs")->capture_default_str()->transform(app::integer_up_to(app::kMaxEpochs));
  // Options without a natural default are std::optional (app::add_optional):
  // an explicit value is always checked, never mistaken for "unset".
  app::add_optional(train, "--steps", tc.steps, "Stop after this many steps of the global batch the run started with, kept on --resume at another world size (default: no limit besides --epochs)")->transform(app::integer_up_to(app::kMaxSteps));
  train->add_option("--batch-size", tc.batch_size, "Batch size per device (pipeline: the pipeline's batch)")->capture_default_str()->transform(app::integer_up_to(app::kMaxBatchSize));
  app::add_optional(train, "--lr", tc.lr, "Peak learning rate (default: 0.05 for SGD, 1e-3 for AdamW)")->check(app::real_number(1e6));
  train->add_option("--optimizer", tc.optimizer, "sgd|adamw")->capture_default_str();
  train->add_option("--momentum", tc.momentum, "SGD momentum (Nesterov)")->capture_default_str()->check(app::real_number(1, true));
  train->add_option("--weight-decay", tc.weight_decay, "Weight decay")->capture_default_str()->check(app::real_number(1e6));
  train->add_option("--label-smoothing", tc.label_smoothing, "Cross-entropy label smoothing")->capture_default_str()->check(app::real_number(1, true));
  train->add_option("--precision", tc.precision, "fp32|bf16")->capture_default_str();
  train->add_option("--seed", tc.seed, "Random seed")->capture_default_str()->transform(app::whole_number(0, UINT64_MAX));
  train->add_option("--workers", tc.workers, "Data loader worker threads")->capture_default_str()->transform(app::integer_up_to(data::kMaxWorkers));
  train->add_option("--synthetic-size", tc.synthetic_size, "Examples in --data synthetic")->capture_default_str()->transform(app::integer_up_to(app::kMaxSyntheticSize));
  app::add_optional(train, "--checkpoint-dir", tc.checkpoint_dir, "Write checkpoints here");
  train->add_option("--checkpoint-every", tc.checkpoint_every, "Also checkpoint every N steps (0: at epoch ends only)")
      ->capture_default_str()->transform(app::integer_up_to(app::kMaxSteps));
  train->add_flag("--resume", tc.resume, "Continue from the newest checkpoint in --checkpoint-dir");
  train->add_flag("--start-fresh", tc.start_fresh, "With --resume: when no checkpoint can be read, start over (they are kept, renamed *.unreadable)");
  train->add_option("--allow-change", tc.allow_change, "With --resume: let these saved settings change (epochs, steps, data_dir, devices, strategy)")->delimiter(',');
  app::add_optional(train, "--metrics", tc.metrics, "Write metrics as JSON lines (or CSV for a .csv file)");
  app::add_optional(train, "--tensorboard", tc.tensorboard, "Write TensorBoard event files (scalars) into a run directory under this folder");
  train->add_flag("--tensorboard-all-ranks", tc.tensorboard_all_ranks, "ddp: every rank writes event files (into rank<N> under the run directory), not rank 0 alone");
  app::add_optional(train, "--plot", tc.plot, "Draw the loss, accuracy, throughput and memory curves into this .svg or .png at each epoch end (as chorus plot does)");
  app::add_optional(train, "--trace", tc.trace, "Write a Chrome/Perfetto trace (JSON) of the --trace-steps steps: host phases and kernels, every rank in one file");
  train->add_option("--trace-steps", tc.trace_steps, "The steps --trace records, e.g. 5-7 (from 1)")->capture_default_str();
  train->add_option("--log-every", tc.log_every, "Read the loss every N steps")->capture_default_str()->transform(app::integer_up_to(app::kMaxSteps));
  train->add_flag("--sync-bn", tc.sync_bn, "ddp: batch-norm statistics over all ranks (SyncBatchNorm)");
  train->add_option("--comm-hook", tc.comm_hook, "ddp, zero: allreduce | bf16 (gradients travel as bfloat16)")->capture_default_str();
  train->add_option("--dist-timeout", tc.dist_timeout_s, "ddp: seconds the rendezvous and each collective may take")->capture_default_str()->check(app::real_number(1e7));
  train->add_option("--stats-every", tc.stats_every_s, "ddp: every this many seconds, one line with the ranks' median step time and the slowest rank (0: never)")->capture_default_str()->check(app::real_number(1e7));
  app::add_optional(train, "--micro-batches", tc.micro_batches, "pipeline: micro-batches per batch (default 4)")->transform(app::integer_up_to(app::kMaxBatchSize));
  app::add_optional(train, "--schedule", tc.schedule, "pipeline: gpipe | 1f1b (default) | interleaved");
  app::add_optional(train, "--balance", tc.balance, "pipeline: layers per stage, e.g. 14,15, or time | memory: split by measured time (default) or memory");
  app::add_optional(train, "--recompute", tc.recompute, "activation recomputation: never (default) | except_last | always (pipeline: per micro-batch); GPT models: never | always (every block) | N (the first N blocks) | auto (the fewest blocks the memory plan needs)");
  app::add_optional(train, "--virtual-stages", tc.virtual_stages, "pipeline, interleaved: stages per device (default 2)")->transform(app::integer_up_to(64));
  train->add_flag("--json", tc.json, "Print the final summary as one JSON object on stdout");
  train->add_flag("--quiet", tc.quiet, "No progress output");
  train->add_flag("--channels-last", tc.channels_last,
                  "Weights and batches in NHWC (channels-last) memory, the layout cuDNN's fastest convolutions want "
                  "(default where every device is a GPU)");
  train->add_flag("--no-channels-last", tc.no_channels_last, "Keep NCHW on GPUs too");
  train->add_flag("--no-cuda-graphs", tc.no_cuda_graphs,
                  "Run every step eagerly (default on CUDA devices: the step is captured as a CUDA graph and replayed; single, ddp and pipeline)");

  app::add_memory_plan_options(train, tc.memory);
  app::GptOptions gpt;
  app::add_gpt_train_options(train, gpt);
  app::TokenizeConfig tokc;
  CLI::App* tokenize = app::add_tokenize_command(app, tokc);
  app::GenerateConfig genc;
  CLI::App* generate = app::add_generate_command(app, genc);
  app::CheckpointConfig ckc;
  CLI::App* checkpoint = app::add_checkpoint_command(app, ckc);

  app::BenchConfig bc;
  CLI::App* bench = app.add_subcommand("bench", "Training throughput on synthetic data");
  app::add_bench_options(bench, bc);
  app::add_memory_plan_options(bench, bc.memory);

  CLI::App* devices = app.add_subcommand("devices", "List the devices and how GPUs are linked");

  app::BenchCommConfig cc;
  CLI::App* bench_comm = app.add_subcommand("bench-comm", "All-reduce bus bandwidth through the process group (run under a launcher)");
  app::add_bench_comm_options(bench_comm, cc);

  app::PlotConfig pc;
  CLI::App* plot = app.add_subcommand("plot", "Draw training curves from metrics files: chorus plot METRICS... --out curves.svg|.png");
  app::add_plot_options(plot, pc);

  app::PlanConfig plan_cfg;
  CLI::App* plan_cmd = app::add_plan_command(app, plan_cfg);

  app::LaunchConfig lc;
  CLI::App* launch = app.add_subcommand("launch", "Start the processes of a distributed job: chorus launch [options] -- PROGRAM ARGS...");
  app::add_launch_options(launch, lc);

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "chorus: error: %s (see chorus --help)\n", e.what());
    return 2;
  }
  try {
    const bool gpt_run = *train && app::is_gpt_model(tc.model);
    if (gpt_run) {
      gpt.batch_given = train->count("--batch-size") > 0;
      gpt.weight_decay_given = train->count("--weight-decay") > 0;
      gpt.optimizer_given = train->count("--optimizer") > 0;
      if (train->count("--data") == 0) tc.data = "";  // the image default means nothing here
    }
    if (parse_only) {
      if (*train) gpt_run ? app::validate_gpt(tc, gpt) : tc.validate();
      return 0;
    }
    if (show_version) {
      std::printf("%s", app::version_text().c_str());
      return 0;
    }
    if (*devices) return app::run_devices();
    if (*launch) return app::run_launch(lc);
    if (*bench_comm) return app::run_bench_comm(cc);
    if (*plan_cmd) return app::run_plan(plan_cfg);
    if (*bench) return app::run_bench(bc);
    if (*tokenize) return app::run_tokenize(tokc);
    if (*generate) return app::run_generate(genc);
    if (*checkpoint) return app::run_checkpoint(ckc);
    if (gpt_run) {
      CHORUS_CHECK(!tc.data.empty(), "--data is needed for ", tc.model, ": tokens:GLOB (llm.c token files) or text:FILE");
      auto summary = app::run_train_gpt(tc, gpt);
      if (summary.is_null()) return 0;
      if (tc.json) {
        std::printf("%s\n", summary.dump().c_str());
      } else {
        std::printf("%s: train loss %.4f, val loss %s, %lld steps in %.1f s (%.0f tok/s)\n", tc.model.c_str(),
                    summary["train_loss"].get<double>(),
                    summary["val_loss"].is_null() ? "-" : std::to_string(summary["val_loss"].get<double>()).c_str(),
                    (long long)summary["steps"].get<int64_t>(), summary["seconds"].get<double>(),
                    summary["tok_per_s"].get<double>());
      }
      return 0;
    }
    if (*plot) return app::run_plot(pc);
    if (*train) {
      auto summary = app::run_train(tc);
      if (summary.is_null()) return 0;  // a DDP rank other than 0: rank 0 reports
      if (tc.json) {
        std::printf("%s\n", summary.dump().c_str());
      } else {
        std::string where;
        for (const auto& d : summary["devices"]) where += (where.empty() ? "" : ",") + d.get<std::string>();
        std::printf("%s on %s: test accuracy %.4f, test loss %.4f, %lld steps in %.1f s (%.0f img/s)\n",
                    tc.model.c_str(), where.c_str(),
                    summary["test_accuracy"].get<double>(), summary["test_loss"].get<double>(),
                    (long long)summary["steps"].get<int64_t>(), summary["seconds"].get<double>(),
                    summary["img_per_s"].get<double>());
      }
      return 0;
    }
    std::printf("%s", app.help().c_str());
    return 0;
  } catch (const app::Interrupted& e) {
    return e.exit_code();  // Note [Stopping on a signal]: already said on stderr
  } catch (const Error& e) {
    std::fprintf(stderr, "chorus: error: %s\n", e.message().c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "chorus: error: %s\n", e.what());
    return 1;
  }
}
