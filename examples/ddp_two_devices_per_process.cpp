// ddp_two_devices_per_process: PyTorch's "Distributed Model and Data Parallel"
// seed in Chorus -- one process per "machine", each driving two devices, the
// gradients summed inside the process and then averaged across processes.
//
// The seed wrote, per machine rank,
//   gpus = {0: [0, 1], 1: [2, 3]}[machine_rank]
//   model = DDP(DataParallel(net, device_ids=gpus))     # PyTorch has since dropped this
// Chorus keeps it: a DataParallel over this process's devices, wrapped in
// DistributedDataParallel over the processes.
//
//   chorus launch --nproc-per-node 2 -- ./example_ddp_two_devices_per_process
// With 2k GPUs process r takes cuda:2r and cuda:2r+1; otherwise two logical
// CPU devices each (cpu:0, cpu:1) and Gloo.
#include <chorus/chorus.h>
#include <chorus/models/models.h>
#include <chorus/optim/sgd.h>

#include <cstdio>
#include <vector>

using namespace chorus;
namespace F = chorus::nn::functional;

int main() {
  const dist::LaunchEnv env = *dist::read_launch_env();
  const int machine = env.local_rank;
  std::vector<Device> devices;
  if (cuda_device_count() >= 2 * env.local_world_size)
    devices = {cuda_device(2 * machine), cuda_device(2 * machine + 1)};  // {0: [0, 1], 1: [2, 3]}[machine_rank]
  else
    devices = {Device("cpu:0"), Device("cpu:1")};
  if (devices[0].is_cuda()) set_device(devices[0]);
  auto pg = dist::init_process_group({.backend = devices[0].is_cuda() ? "nccl" : "gloo"});

  manual_seed(0);
  auto net = std::make_shared<models::SmallCNN>(models::ModelSpec{{1, 28, 28}, 10});
  net->to(devices[0]);
  auto model = std::make_shared<dist::DistributedDataParallel>(
      std::make_shared<parallel::DataParallel>(net, devices), pg);
  optim::SGD optimizer(net->parameters(), {.lr = 0.05, .momentum = 0.9});

  // A learnable synthetic task: the label is the brightest of ten stripes.
  manual_seed(7 + pg->rank());
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    Tensor x = randn({32, 1, 28, 28}, devices[0]);  // this process's batch, split over its two devices
    Tensor y = x.narrow(2, 0, 20).reshape({32, 10, 56}).sum({2}).argmax(1);
    optimizer.zero_grad();
    Tensor loss = F::cross_entropy(model->forward(x), y);
    loss.backward();
    optimizer.step();
    (step == 0 ? first : last) = loss.item();
  }
  std::printf("machine %d of %d, devices %s + %s: loss %.4f -> %.4f\n", pg->rank(), pg->size(),
              devices[0].str().c_str(), devices[1].str().c_str(), first, last);
  return last < first ? 0 : 1;
}
