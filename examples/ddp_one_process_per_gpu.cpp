// ddp_one_process_per_gpu: PyTorch's "Distributed Data Parallel" program in
// Chorus -- one process per GPU, each training the same model on its own
// share of the data, gradients averaged while the backward runs.
//
// In PyTorch:
//   dist.init_process_group("nccl", rank=rank, world_size=world_size)
//   model = ToyModel().to(rank)
//   ddp_model = DDP(model, device_ids=[rank])
//   loss_fn(ddp_model(inputs), labels).backward(); optimizer.step()
//
// Run it with any launcher (each process takes cuda:LOCAL_RANK, or a logical
// CPU device and Gloo when there is no GPU):
//   chorus launch --nproc-per-node 2 -- ./example_ddp_one_process_per_gpu
//   torchrun --nproc-per-node 2 --no-python ./example_ddp_one_process_per_gpu
//   mpirun -np 2 ./example_ddp_one_process_per_gpu
#include <chorus/chorus.h>
#include <chorus/optim/sgd.h>

#include <cstdio>

using namespace chorus;
namespace F = chorus::nn::functional;

int main() {
  const dist::LaunchEnv env = *dist::read_launch_env();  // nullopt when not launched: init_process_group says how
  const bool gpus = cuda_device_count() > env.local_rank;
  const Device device = gpus ? cuda_device(env.local_rank) : cpu_device(0);
  if (gpus) set_device(device);
  auto pg = dist::init_process_group({.backend = gpus ? "nccl" : "gloo"});

  // The same model on every rank; DDP broadcasts rank 0's weights anyway.
  manual_seed(0);
  auto model = std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
      std::make_shared<nn::Linear>(10, 10), std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(10, 5)});
  model->to(device);
  auto ddp_model = std::make_shared<dist::DistributedDataParallel>(model, pg);
  optim::SGD optimizer(model->parameters(), {.lr = 0.01});

  // Each rank draws its own batch (a real job would use data::DistributedSampler).
  manual_seed(100 + pg->rank());
  const Tensor w_true = randn({10, 5}, device);
  double loss_first = 0, loss_last = 0;
  for (int step = 0; step < 50; ++step) {
    Tensor inputs = randn({20, 10}, device);
    Tensor labels = inputs.matmul(w_true);
    optimizer.zero_grad();
    Tensor loss = F::mse_loss(ddp_model->forward(inputs), labels);
    loss.backward();  // gradients averaged over the ranks here
    optimizer.step();
    (step == 0 ? loss_first : loss_last) = loss.item();
  }
  // Every rank holds the same weights after training.
  Tensor w = model->parameters()[0].detach().to(cpu_device(0)).sum().reshape({1}).to(kFloat64);
  Tensor w_all = empty({pg->size()}, {kFloat64, cpu_device(0)});
  if (gpus) {
    Tensor wd = w.to(device), all = empty({pg->size()}, {kFloat64, device});
    pg->all_gather(wd, all)->wait();
    w_all = all.to(cpu_device(0));
  } else {
    pg->all_gather(w, w_all)->wait();
  }
  const std::vector<double> sums = w_all.to_vector<double>();
  bool same = true;
  for (double s : sums) same = same && s == sums[0];
  std::printf("rank %d of %d on %s: loss %.4f -> %.4f, weights %s on every rank\n", pg->rank(), pg->size(),
              device.str().c_str(), loss_first, loss_last, same ? "identical" : "DIFFERENT");
  return same && loss_last < loss_first ? 0 : 1;
}
