// dist::DeviceMesh: the --mesh grammar, the layout checks, and a mesh over a
// world of one. The multi-rank meshes (sub-groups per axis, collectives on
// them) run over real processes in tests/distributed/tensor_parallel.sh.
#include <gtest/gtest.h>

#include "chorus/core/error.h"
#include "chorus/distributed/device_mesh.h"
#include "chorus/distributed/hash_store.h"

using namespace chorus;
using namespace chorus::dist;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ValueError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(DeviceMesh, ParsesAxesIntoCanonicalOrder) {
  auto axes = parse_mesh_spec("tp=4,dp=2");
  ASSERT_EQ(axes.size(), 3u);
  EXPECT_EQ(axes[0].name, "dp");
  EXPECT_EQ(axes[0].size, 2);
  EXPECT_EQ(axes[1].name, "pp");
  EXPECT_EQ(axes[1].size, 1);
  EXPECT_EQ(axes[2].name, "tp");
  EXPECT_EQ(axes[2].size, 4);
  EXPECT_EQ(mesh_spec_str(axes), "dp=2,pp=1,tp=4");
}

TEST(DeviceMesh, RefusesBadSpecsInOneLine) {
  EXPECT_NE(error_of([] { parse_mesh_spec("zz=2"); }).find("unknown axis 'zz'"), std::string::npos);
  EXPECT_NE(error_of([] { parse_mesh_spec("tp=2,tp=2"); }).find("given twice"), std::string::npos);
  EXPECT_NE(error_of([] { parse_mesh_spec("tp=0"); }).find("at least one rank"), std::string::npos);
  EXPECT_NE(error_of([] { parse_mesh_spec("tp=x"); }).find("whole number"), std::string::npos);
  EXPECT_NE(error_of([] { parse_mesh_spec("tp"); }).find("not AXIS=SIZE"), std::string::npos);
  EXPECT_NE(error_of([] { parse_mesh_spec(""); }).find("empty"), std::string::npos);
}

TEST(DeviceMesh, ChecksTheWorldSizeAndNodes) {
  const auto axes = parse_mesh_spec("dp=2,tp=2");
  EXPECT_NO_THROW(check_mesh_fits(axes, 4));
  EXPECT_NE(error_of([&] { check_mesh_fits(axes, 6); }).find("needs 4 processes, but the job has 6"),
            std::string::npos);
  // Two nodes of 2 ranks: tp=2 stays inside one; tp=4 would span both.
  MeshOptions two_nodes;
  two_nodes.local_world_size = 2;
  EXPECT_NO_THROW(check_mesh_fits(axes, 4, two_nodes));
  const auto wide = parse_mesh_spec("tp=4");
  EXPECT_NE(error_of([&] { check_mesh_fits(wide, 4, two_nodes); }).find("would span nodes"), std::string::npos);
  two_nodes.allow_tp_across_nodes = true;
  EXPECT_NO_THROW(check_mesh_fits(wide, 4, two_nodes));
}

TEST(DeviceMesh, WorldOfOne) {
  if (!gloo_available()) GTEST_SKIP() << "this build has no Gloo";
  auto world = make_process_group("gloo", 0, 1, std::make_shared<HashStore>());
  DeviceMesh mesh(world, parse_mesh_spec("tp=1"));
  EXPECT_EQ(mesh.size("tp"), 1);
  EXPECT_EQ(mesh.coord("dp"), 0);
  EXPECT_EQ(mesh.group("tp")->size(), 1);
  EXPECT_EQ(mesh.rank_at({0, 0, 0}), 0);
  EXPECT_NE(mesh.describe().find("rank 0"), std::string::npos);
  EXPECT_NE(error_of([&] { DeviceMesh(world, parse_mesh_spec("tp=2")); }).find("needs 2 processes"), std::string::npos);
  // Each axis's group has a track of its own in a step trace; other subgroups keep "sub".
  EXPECT_EQ(world->trace_track(), "gloo");
  EXPECT_EQ(mesh.group("tp")->trace_track(), "gloo tp");
  EXPECT_EQ(mesh.group("dp")->trace_track(), "gloo dp");
  EXPECT_EQ(world->new_group({0})->trace_track(), "gloo sub");
}

TEST(DeviceMesh, RowMajorWithTheLastAxisFastest) {
  const std::vector<MeshAxis> grid = {{"dp", 2}, {"pp", 3}, {"tp", 4}};
  EXPECT_EQ(mesh_coords(grid, 0), (std::vector<int>{0, 0, 0}));
  EXPECT_EQ(mesh_coords(grid, 1), (std::vector<int>{0, 0, 1}));  // tensor ranks are neighbours
  EXPECT_EQ(mesh_coords(grid, 4), (std::vector<int>{0, 1, 0}));
  EXPECT_EQ(mesh_coords(grid, 13), (std::vector<int>{1, 0, 1}));
  EXPECT_EQ(mesh_coords(grid, 23), (std::vector<int>{1, 2, 3}));
  for (int r = 0; r < 24; ++r) EXPECT_EQ(mesh_rank(grid, mesh_coords(grid, r)), r);
}
