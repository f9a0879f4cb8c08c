// data_parallel_table: Torch7's nn.DataParallelTable training loop, in Chorus.
//
// In Torch7 you wrote
//
//   model = nn.DataParallelTable(1):add(net, {1, 2})   -- split dim 1 over GPUs 1, 2
//   ... forward, backward, optim.sgd(feval, params) ...
//   model:syncParameters()                            -- before using the replicas again
//
// Here the wrapper is one module as the optimizer sees it: its parameters()
// are the master weights on the first device, the gradients of all replicas
// are summed into them by backward, and each forward copies the weights the
// optimizer changed out to the replicas. There is no syncParameters.
#include <chorus/chorus.h>
#include <chorus/models/models.h>
#include <chorus/optim/sgd.h>
#include <chorus/parallel/data_parallel.h>

#include <cstdio>
#include <vector>

using namespace chorus;
namespace F = chorus::nn::functional;

int main() {
  // All GPUs if there are two or more, else two logical CPU devices.
  std::vector<Device> devices;
  for (int i = 0; i < cuda_device_count(); ++i) devices.push_back(cuda_device(i));
  if (devices.size() < 2) devices = {Device("cpu:0"), Device("cpu:1")};
  const Device first = devices[0];

  // A small MLP on 1x8x8 "images", 4 classes; built on the first device.
  manual_seed(1);
  const models::ModelSpec spec{{1, 8, 8}, 4};
  auto net = std::make_shared<models::MLP>(models::MLPOptions{spec, {64}});
  net->to(first);

  // Split the batch (dim 0) over the devices; outputs gathered on devices[0].
  auto model = std::make_shared<parallel::DataParallel>(net, devices);
  optim::SGD optimizer(model->parameters(), {.lr = 0.1, .momentum = 0.9});

  // Synthetic data with something to learn: the label is the quadrant (of four)
  // whose pixels have the largest sum.
  const int64_t batch = 32;  // global batch: 16 per device on two devices
  auto make_batch = [&] {
    Tensor x = randn({batch, 1, 8, 8}, first);
    Tensor quadrants = x.reshape({batch, 2, 4, 2, 4}).sum({2, 4}).reshape({batch, 4});
    return std::make_pair(x, quadrants.argmax(1));
  };

  std::printf("DataParallel over %zu devices:", devices.size());
  for (const Device& d : devices) std::printf(" %s", d.str().c_str());
  std::printf("; %lld parameters, batch %lld\n", static_cast<long long>(model->num_parameters()),
              static_cast<long long>(batch));

  double first_loss = 0, last_loss = 0;
  const int steps = 30;
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = make_batch();
    optimizer.zero_grad();
    Tensor loss = F::cross_entropy(model->forward(x), y);
    loss.backward();   // each replica's backward runs on its own device
    optimizer.step();  // updates the master weights only; replicas follow at the next forward
    last_loss = loss.item();
    if (step == 0) first_loss = last_loss;
    if (step % 5 == 0 || step == steps - 1) std::printf("step %2d  loss %.4f\n", step, last_loss);
  }
  synchronize();
  std::printf("loss %.4f -> %.4f\n", first_loss, last_loss);
  return 0;
}
