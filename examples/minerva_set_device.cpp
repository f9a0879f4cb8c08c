// minerva_set_device: Minerva's multi-device example, in Chorus.
//
// Minerva (Wang et al., 2014) treated every compute resource as a device and
// let you write
//
//   ms.set_device(gpu0); x = ms.ones([8, 4])
//   ms.set_device(gpu1); y = ms.randn([8, 4], 0, 1)
//   z = x + y          # no copy written: the engine moves the data
//
// Here the current device (set_device / DeviceGuard) decides where factory
// functions put their tensors, and a binary op with operands on two devices
// runs on the first operand's device after an implicit, asynchronous copy.
// Work on different devices runs at the same time: nothing above waits on the
// host until the result is read.
#include <chorus/chorus.h>

#include <cmath>
#include <iostream>

using namespace chorus;

int main() {
  const bool gpus = cuda_device_count() >= 2;
  const Device dev0 = gpus ? Device("cuda:0") : Device("cpu:0");
  const Device dev1 = gpus ? Device("cuda:1") : Device("cpu:1");
  manual_seed(2014);

  set_device(dev0);
  Tensor x = ones({2, 4});  // on dev0: the current device
  set_device(dev1);
  Tensor y = rand({2, 4});  // on dev1
  set_device(dev0);

  Tensor z = x + y;  // on dev0 (x's device); y copied over for us

  std::cout << "x on " << x.device() << ", y on " << y.device() << (gpus ? "" : " (logical CPU devices)") << "\n";
  std::cout << "y = " << y << "\n";
  std::cout << "z = x + y on " << z.device() << ":\n" << z << "\n";

  // z - 1 gives y back, up to float rounding of 1 + y.
  bool ok = z.device() == dev0 && y.device() == dev1;
  auto zv = z.to_vector<float>(), yv = y.to_vector<float>();
  for (size_t i = 0; i < zv.size(); ++i) ok = ok && std::abs((zv[i] - 1.0f) - yv[i]) < 1e-6f;
  std::cout << (ok ? "ok" : "unexpected result") << "\n";
  return ok ? 0 : 1;
}
