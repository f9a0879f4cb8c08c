#include "chorus/data/mnist.h"

#include "chorus/core/error.h"
#include "chorus/data/file_reader.h"

namespace chorus::data {

IdxArray read_idx_ubyte(const std::string& path, int ndim) {
  // Header first, then exactly the payload it promises (Note [Bounded reads]).
  detail::FileReader f(path);
  std::vector<uint8_t> head;
  const uint32_t expected_magic = 0x0800u + static_cast<uint32_t>(ndim);
  const size_t header = 4 + 4 * static_cast<size_t>(ndim);
  f.read(4, &head);
  if (head.size() < 4)
    CHORUS_THROW(IOError, path, ": file is ", head.size(),
                 " bytes long, too short for an IDX magic number (expected ", expected_magic, ")");
  const uint32_t magic = detail::read_be32(head.data());
  if (magic != expected_magic)
    CHORUS_THROW(IOError, path, ": bad magic number: expected ", expected_magic,
                 " (unsigned-byte IDX, ", ndim, "-d), got ", magic,
                 magic == 0x0801u || magic == 0x0803u ? " (images and labels files swapped?)" : "");
  f.read(header - 4, &head);
  if (head.size() < header)
    CHORUS_THROW(IOError, path, ": truncated header: expected ", header, " bytes, got ", head.size());

  IdxArray out;
  uint64_t need = 1;
  bool too_big = false;
  for (int d = 0; d < ndim; ++d) {
    const uint32_t n = detail::read_be32(head.data() + 4 + 4 * d);
    out.dims.push_back(n);
    if (n != 0 && need > (uint64_t{1} << 40) / n) too_big = true;
    need *= n;
  }
  const std::string what = ndim == 1 ? "label" : "image";
  if (too_big)
    CHORUS_THROW(IOError, path, ": the header says ", shape_str(out.dims), ", more than 2^40 bytes of ", what,
                 " data: not a data set this reader loads");
  // Trailing bytes past the payload are tolerated, as every MNIST reader does,
  // and never read.
  const uint64_t got = f.read(need, &out.bytes);
  if (got < need)
    CHORUS_THROW(IOError, path, ": truncated file: the header says ", shape_str(out.dims), " so expected ", need,
                 " bytes of ", what, " data after the ", header, "-byte header, got ", got,
                 " (the file ends at byte offset ", header + got, ")");
  return out;
}

namespace {

std::string find_idx_file(const std::string& dir, const std::string& base) {
  for (const std::string& p : {dir + "/" + base, dir + "/" + base + ".gz"})
    if (detail::file_exists(p)) return p;
  CHORUS_THROW(IOError, dir, "/", base, "[.gz] not found; install Debian's dataset-fashion-mnist (",
               kFashionMnistDir, ") or pass --data-dir");
}

}  // namespace

MnistDataset::MnistDataset(const std::string& dir, bool train, Normalize normalize)
    : table_(normalize, 1, "IDX data set in " + dir) {
  const std::string split = train ? "train" : "t10k";
  const std::string image_path = find_idx_file(dir, split + "-images-idx3-ubyte");
  const std::string label_path = find_idx_file(dir, split + "-labels-idx1-ubyte");
  name_ = image_path;  // errors about the split (its image shape, its size) name the file

  IdxArray images = read_idx_ubyte(image_path, 3);
  IdxArray labels = read_idx_ubyte(label_path, 1);
  if (images.dims[0] != labels.dims[0])
    CHORUS_THROW(IOError, "image/label count mismatch: ", image_path, " has ", images.dims[0],
                 " images but ", label_path, " has ", labels.dims[0], " labels");
  for (size_t i = 0; i < labels.bytes.size(); ++i)
    if (labels.bytes[i] >= 10)
      CHORUS_THROW(IOError, label_path, ": label ", int{labels.bytes[i]}, " of example ", i,
                   " (byte offset ", 8 + i, ") is outside [0, 10)");
  if (images.dims[0] == 0)
    CHORUS_THROW(IOError, image_path, ": holds 0 images; a data set needs at least one");
  count_ = images.dims[0];
  rows_ = images.dims[1];
  cols_ = images.dims[2];
  images_ = std::move(images.bytes);
  labels_ = std::move(labels.bytes);
}

const uint8_t* MnistDataset::pixels(int64_t index) const {
  check_index(index);
  return images_.data() + index * rows_ * cols_;
}

int64_t MnistDataset::label(int64_t index) const {
  check_index(index);
  return labels_[index];
}

void MnistDataset::get(int64_t index, float* image_out, int64_t* label_out) const {
  table_.convert(pixels(index), rows_ * cols_, image_out);
  *label_out = labels_[index];
}

std::shared_ptr<Dataset> load_mnist(const std::string& dir, bool train, Normalize normalize) {
  return std::make_shared<MnistDataset>(dir, train, std::move(normalize));
}

}  // namespace chorus::data
