// train_dp: a program outside Chorus's tree that trains a small convolutional
// network with DataParallel over two logical CPU devices (cpu:0, cpu:1), built
// against an installed Chorus (see CMakeLists.txt). Exits non-zero unless the
// loss falls, so CI can run it as a check.
#include <chorus/chorus.h>

#include <cstdio>
#include <vector>

using namespace chorus;
namespace F = chorus::nn::functional;

int main() {
  try {
    const std::vector<Device> devices = parse_devices("cpu:0,cpu:1");
    manual_seed(0);
    auto net = models::make_model("cnn", {{1, 12, 12}, 4});
    net->to(devices[0]);
    auto model = std::make_shared<parallel::DataParallel>(net, devices);  // batch split along dim 0
    optim::SGD optimizer(model->parameters(), {.lr = 0.05, .momentum = 0.9});

    // Something to learn: the label is the quadrant with the largest pixel sum.
    const int64_t batch = 32;
    auto make_batch = [&] {
      Tensor x = randn({batch, 1, 12, 12}, devices[0]);
      Tensor quadrants = x.reshape({batch, 2, 6, 2, 6}).sum({2, 4}).reshape({batch, 4});
      return std::make_pair(x, quadrants.argmax(1));
    };

    std::printf("chorus out-of-tree: DataParallel over %s, %s; %lld parameters\n", devices[0].str().c_str(),
                devices[1].str().c_str(), static_cast<long long>(model->num_parameters()));
    double first = 0, last = 0;
    const int steps = 40;
    for (int step = 0; step < steps; ++step) {
      auto [x, y] = make_batch();
      optimizer.zero_grad();
      Tensor loss = F::cross_entropy(model->forward(x), y);
      loss.backward();
      optimizer.step();
      last = loss.item();
      if (step == 0) first = last;
      if (step % 10 == 0 || step == steps - 1) std::printf("step %2d  loss %.4f\n", step, last);
    }
    std::printf("loss %.4f -> %.4f: %s\n", first, last, last < first ? "ok" : "NOT LEARNING");
    return last < first ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_dp: error: %s\n", e.what());
    return 1;
  }
}
