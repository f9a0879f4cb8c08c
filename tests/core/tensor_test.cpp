// Tensor metadata: views share storage, view() vs reshape(), broadcasting
// errors, and printing.
#include <gtest/gtest.h>

#include <string>

#include <chorus/chorus.h>
#include <chorus/ops/copy.h>

#include "testing/expect_error.h"

namespace chorus {
namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]] as float32.
Tensor iota34() { return arange(0, 12, 1, {kFloat32}).view({3, 4}); }

TEST(TensorViews, MetadataOfAContiguousTensor) {
  Tensor t = zeros({2, 3, 4});
  EXPECT_EQ(t.sizes(), (Shape{2, 3, 4}));
  EXPECT_EQ(t.strides(), (Shape{12, 4, 1}));
  EXPECT_EQ(t.dim(), 3);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.size(-1), 4);
  EXPECT_EQ(t.stride(0), 12);
  EXPECT_EQ(t.nbytes(), 96u);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.describe(), "float32[2, 3, 4] on cpu:0");
  EXPECT_THROW(t.size(3), ValueError);
}

TEST(TensorViews, ViewsShareStorage) {
  Tensor base = iota34();
  Tensor row = base.select(0, 1);
  Tensor col = base.select(1, 2);
  Tensor tr = base.t();
  Tensor stepped = base.slice(1, 0, 4, 2);
  Tensor flat = base.view({12});
  Tensor perm = base.unsqueeze(0).permute({2, 0, 1});
  for (const Tensor* v : {&row, &col, &tr, &stepped, &flat, &perm}) EXPECT_EQ(v->storage(), base.storage());
  EXPECT_EQ(row.storage_offset(), 4);
  EXPECT_EQ(col.stride(0), 4);
  EXPECT_EQ(tr.strides(), (Shape{1, 4}));
  EXPECT_FALSE(tr.is_contiguous());
  EXPECT_EQ(stepped.to_vector<float>(), (std::vector<float>{0, 2, 4, 6, 8, 10}));
  EXPECT_EQ(col.to_vector<float>(), (std::vector<float>{2, 6, 10}));
  EXPECT_EQ(tr.to_vector<float>(), (std::vector<float>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}));
}

TEST(TensorViews, WritingThroughAViewChangesTheBase) {
  Tensor base = iota34();
  base.select(0, 1).fill_(-1);
  base.slice(1, 1, 4, 2).select(0, 2).fill_(100);  // base[2, 1] and base[2, 3]
  base.t().select(0, 0).copy_(from_vector(std::vector<float>{7, 8, 9}, {3}));  // column 0
  EXPECT_EQ(base.to_vector<float>(),
            (std::vector<float>{7, 1, 2, 3, 8, -1, -1, -1, 9, 100, 10, 100}));
  // And through a reshape that is a view.
  Tensor flat = base.reshape({12});
  flat.narrow(0, 0, 2).zero_();
  EXPECT_EQ(base.to_vector<float>()[0], 0);
  EXPECT_EQ(base.to_vector<float>()[1], 0);
  // In-place math through a view.
  base.select(1, 3).mul_(2.0);
  EXPECT_EQ(base.to_vector<float>()[3], 6);
  EXPECT_EQ(base.to_vector<float>()[11], 200);
}

TEST(TensorViews, ViewsShareTheVersionCounter) {
  Tensor base = iota34();
  Tensor v = base.t();
  uint32_t before = base.version();
  v.fill_(1.0);
  EXPECT_GT(base.version(), before);
  EXPECT_EQ(v.version(), base.version());
}

TEST(TensorViews, ExpandedViewsReadTheSameElement) {
  Tensor col = from_vector(std::vector<float>{1, 2, 3}, {3, 1});
  Tensor e = col.expand({3, 4});
  EXPECT_EQ(e.strides(), (Shape{1, 0}));
  EXPECT_EQ(e.storage(), col.storage());
  EXPECT_EQ(e.to_vector<float>(), (std::vector<float>{1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3}));
  Tensor lead = from_vector(std::vector<float>{5, 6}, {2}).expand({3, 2});
  EXPECT_EQ(lead.strides(), (Shape{0, 1}));
  EXPECT_EQ(lead.to_vector<float>(), (std::vector<float>{5, 6, 5, 6, 5, 6}));
  EXPECT_THROW(col.expand({3, 4, 2}), ValueError);  // [3, 1] -> [.., 4, 2]: 3 vs 4
  EXPECT_THROW(col.expand({4}), ValueError);
}

TEST(TensorViews, ViewOnANonViewableTensorThrowsWhileReshapeCopies) {
  Tensor base = iota34();
  Tensor tr = base.t();  // [4, 3], strides [1, 4]
  // The message says what to do instead.
  EXPECT_TRUE(test::throws_naming([&] { tr.view({12}); }, {"view", "[12]", "reshape"}));
  Tensor r = tr.reshape({12});
  EXPECT_NE(r.storage(), base.storage());  // a copy
  EXPECT_TRUE(r.is_contiguous());
  EXPECT_EQ(r.to_vector<float>(), (std::vector<float>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}));
  // A reshape that is possible without a copy is a view.
  Tensor v = base.reshape({2, 6});
  EXPECT_EQ(v.storage(), base.storage());
  // Viewable although not contiguous: splitting a dim of a transposed tensor.
  Tensor split = tr.view({2, 2, 3});
  EXPECT_EQ(split.storage(), base.storage());
  EXPECT_EQ(split.to_vector<float>(), tr.to_vector<float>());
  // Merging a column slice's rows is impossible; merging within a row is fine.
  Tensor cols = base.narrow(1, 0, 2);  // [3, 2], strides [4, 1]
  EXPECT_THROW(cols.view({6}), ValueError);
  EXPECT_EQ(cols.view({3, 2, 1}).storage(), base.storage());
  EXPECT_EQ(cols.reshape({6}).to_vector<float>(), (std::vector<float>{0, 1, 4, 5, 8, 9}));
}

TEST(TensorViews, ShapeArithmeticErrors) {
  Tensor t = zeros({2, 6});
  EXPECT_EQ(t.view({-1, 3}).sizes(), (Shape{4, 3}));
  EXPECT_EQ(t.reshape({3, -1}).sizes(), (Shape{3, 4}));
  EXPECT_THROW(t.view({5, -1}), ValueError);
  EXPECT_THROW(t.view({-1, -1}), ValueError);
  EXPECT_THROW(t.reshape({7}), ValueError);
  EXPECT_THROW(t.permute({0, 0}), ValueError);
  EXPECT_THROW(t.permute({0}), ValueError);
  EXPECT_THROW(t.select(0, 2), ValueError);
  EXPECT_THROW(t.narrow(1, 4, 3), ValueError);
  EXPECT_THROW(t.transpose(0, 2), ValueError);
  EXPECT_EQ(t.squeeze(0).sizes(), (Shape{2, 6}));  // not size 1: unchanged
  EXPECT_EQ(t.unsqueeze(2).sizes(), (Shape{2, 6, 1}));
  EXPECT_EQ(t.unsqueeze(-1).sizes(), (Shape{2, 6, 1}));
  EXPECT_EQ(t.unsqueeze(0).squeeze(0).sizes(), (Shape{2, 6}));
  EXPECT_EQ(zeros({2, 3, 4}).flatten(1).sizes(), (Shape{2, 12}));
  EXPECT_EQ(zeros({2, 3, 4}).flatten(0, 1).sizes(), (Shape{6, 4}));
  EXPECT_EQ(zeros({2, 3, 4}).flatten().sizes(), (Shape{24}));
}

TEST(TensorBroadcast, ShapesCombine) {
  EXPECT_EQ(broadcast_shapes({3, 1, 4}, {5, 4}, "test"), (Shape{3, 5, 4}));
  EXPECT_EQ(broadcast_shapes({}, {2, 3}, "test"), (Shape{2, 3}));
  EXPECT_EQ(broadcast_shapes({2, 1}, {1, 3}, "test"), (Shape{2, 3}));
  EXPECT_EQ(broadcast_shapes({0, 1}, {1, 3}, "test"), (Shape{0, 3}));
  Tensor s = add(zeros({3, 1, 4}), ones({5, 4}));
  EXPECT_EQ(s.sizes(), (Shape{3, 5, 4}));
}

TEST(TensorBroadcast, ErrorsNameBothShapes) {
  using test::throws_naming;
  EXPECT_TRUE(throws_naming([] { broadcast_shapes({2, 3}, {4}, "myop"); }, {"myop", "[2, 3]", "[4]"}));
  Tensor a = zeros({2, 3}), b = zeros({3, 2});
  EXPECT_TRUE(throws_naming([&] { a + b; }, {"add", "[2, 3]", "[3, 2]"}));
  EXPECT_TRUE(throws_naming([&] { a * b; }, {"mul", "[2, 3]", "[3, 2]"}));
  EXPECT_TRUE(throws_naming([&] { a.lt(b); }, {"lt", "[2, 3]", "[3, 2]"}));
  EXPECT_TRUE(throws_naming([&] { a.copy_(zeros({4})); }, {"copy_", "[2, 3]", "[4]"}));
}

TEST(TensorPrinting, StrShowsValuesDtypeShapeAndDevice) {
  Tensor t = from_vector(std::vector<float>{1.5f, -2.25f, 3.0f, 0.125f}, {2, 2});
  std::string s = t.str();
  EXPECT_TRUE(contains(s, "tensor(")) << s;
  for (const char* v : {"1.5000", "-2.2500", "3.0000", "0.1250"}) EXPECT_TRUE(contains(s, v)) << s;
  EXPECT_TRUE(contains(s, "float32[2, 2] on cpu:0")) << s;
  EXPECT_LT(s.find("1.5000"), s.find("-2.2500"));  // row-major order
  EXPECT_LT(s.find("-2.2500"), s.find("3.0000"));
  std::ostringstream os;
  os << t;
  EXPECT_EQ(os.str(), s);
}

TEST(TensorPrinting, ViewsIntegersBoolsScalarsAndLongTensors) {
  // A transposed view prints in its own logical order.
  Tensor t = from_vector(std::vector<float>{1, 2, 3, 4}, {2, 2}).t();
  std::string s = t.str();
  EXPECT_LT(s.find("3.0000"), s.find("2.0000")) << s;
  std::string i = from_vector(std::vector<int64_t>{7, -3, 42}, {3}).str();
  EXPECT_TRUE(contains(i, "[7, -3, 42]")) << i;
  EXPECT_TRUE(contains(i, "int64[3]")) << i;
  std::string b = from_vector(std::vector<float>{0, 1}, {2}).to(kBool).str();
  EXPECT_TRUE(contains(b, "false")) << b;
  EXPECT_TRUE(contains(b, "true")) << b;
  std::string sc = full({}, 2.5).str();
  EXPECT_TRUE(contains(sc, "2.5000")) << sc;
  std::string e = zeros({0, 3}).str();
  EXPECT_TRUE(contains(e, "[]")) << e;
  std::string lng = arange(1000).str();
  EXPECT_TRUE(contains(lng, "...")) << lng;
  EXPECT_TRUE(contains(lng, "999")) << lng;
  EXPECT_LT(lng.size(), 200u) << lng;
  EXPECT_EQ(Tensor().str(), "tensor(undefined)");
  std::string on1 = ones({2}, {kFloat32, Device("cpu:1")}).str();
  EXPECT_TRUE(contains(on1, "cpu:1")) << on1;
  std::string bf = from_vector(std::vector<float>{0.5f}, {1}, {kBFloat16}).str();
  EXPECT_TRUE(contains(bf, "0.5000")) << bf;
  EXPECT_TRUE(contains(bf, "bfloat16")) << bf;
}

// Moving a channels-last batch (or a batch-dim chunk of one, as DataParallel
// scatters it) to another device keeps it channels-last; a channels-last
// tensor sliced along H is not dense and arrives contiguous.
TEST(TensorCopies, CrossDeviceCopyKeepsChannelsLast) {
  manual_seed(4);
  Tensor x = ops::to_channels_last(randn({6, 3, 4, 5}));
  for (const Tensor& t : {x, x.narrow(0, 2, 3)}) {
    Tensor moved = t.to(Device("cpu:1"));
    EXPECT_TRUE(ops::is_channels_last(moved)) << shape_str(moved.strides());
    EXPECT_EQ(moved.to_vector<float>(), t.to_vector<float>());
  }
  Tensor sliced = x.narrow(2, 1, 2);
  Tensor moved = sliced.to(Device("cpu:1"));
  EXPECT_TRUE(moved.is_contiguous());
  EXPECT_EQ(moved.to_vector<float>(), sliced.to_vector<float>());
}

TEST(TensorCopies, CloneContiguousAndCrossDevice) {
  Tensor base = iota34();
  Tensor c = base.clone();
  EXPECT_NE(c.storage(), base.storage());
  c.fill_(0);
  EXPECT_EQ(base.to_vector<float>()[5], 5);
  EXPECT_TRUE(base.contiguous().is_same(base));  // already contiguous: itself
  Tensor tc = base.t().contiguous();
  EXPECT_TRUE(tc.is_contiguous());
  EXPECT_EQ(tc.to_vector<float>(), base.t().to_vector<float>());
  Tensor moved = base.to(Device("cpu:1"));
  EXPECT_EQ(moved.device(), cpu_device(1));
  EXPECT_NE(moved.storage(), base.storage());
  EXPECT_EQ(moved.to_vector<float>(), base.to_vector<float>());
  EXPECT_TRUE(base.to(Device("cpu:0")).is_same(base));
  // Binary op across logical devices: runs on the first operand's device.
  Tensor sum = moved + base;
  EXPECT_EQ(sum.device(), cpu_device(1));
  EXPECT_EQ(sum.to_vector<float>()[11], 22);
  EXPECT_EQ((base + moved).device(), cpu_device(0));
  EXPECT_DOUBLE_EQ(base.select(0, 2).select(0, 3).item(), 11.0);
  EXPECT_THROW(base.item(), ValueError);
}

}  // namespace
}  // namespace chorus
