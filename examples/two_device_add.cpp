// two_device_add: tensors on two devices combined with no manual copy, as
// cutorch let you write it in Torch7:
//
//   cutorch.setDevice(1); a = torch.CudaTensor(4):fill(1)
//   cutorch.setDevice(2); b = torch.CudaTensor(4):fill(2)
//   b:add(a)            -- runs on GPU 2, `a` is copied over for you
//
// Chorus's rule (DESIGN.md, "Devices and execution"): an op runs on the device
// of its first tensor argument (in-place ops: of self), and the other operands
// are copied there asynchronously, ordered by events rather than host waits.
// With fewer than two GPUs the same program runs on logical CPU devices.
#include <chorus/chorus.h>

#include <iostream>

using namespace chorus;

int main() {
  const bool gpus = cuda_device_count() >= 2;
  const Device dev0 = gpus ? Device("cuda:0") : Device("cpu:0");
  const Device dev1 = gpus ? Device("cuda:1") : Device("cpu:1");
  std::cout << "devices: " << dev0 << " and " << dev1 << (gpus ? "" : " (logical CPU devices: no two GPUs here)")
            << "\n";

  Tensor a = arange(0, 4, 1, {kFloat32, dev0});  // [0, 1, 2, 3] on dev0
  Tensor b = full({4}, 10.0, {kFloat32, dev1});  // [10, 10, 10, 10] on dev1

  // In place on b's device: a is brought over to dev1 first.
  b.add_(a);
  // A new tensor on the first operand's device (dev0): b is copied to dev0.
  Tensor c = a + b;

  // Everything above was only enqueued; wait for both devices before timing or
  // reading raw memory. (Printing copies to the host, which waits anyway.)
  synchronize();

  std::cout << "b.add_(a) = " << b << "  lives on " << b.device() << "\n";
  std::cout << "c = a + b = " << c << "  lives on " << c.device() << "\n";

  const std::vector<float> want{10, 12, 14, 16};
  if (c.to_vector<float>() != want || c.device() != dev0 || b.device() != dev1) {
    std::cout << "unexpected result\n";
    return 1;
  }
  std::cout << "ok\n";
  return 0;
}
