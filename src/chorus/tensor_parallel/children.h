// A registered child of a module by name, as its concrete type: how the
// tensor-parallel GPT's modules reach one another (internal to this folder).
#pragma once

#include <memory>
#include <string>

#include "chorus/core/error.h"
#include "chorus/nn/module.h"

namespace chorus::tp::detail {

template <typename M = nn::Module>
std::shared_ptr<M> child(const nn::Module& m, const std::string& name) {
  return nn::child_as<M>(m, name);
}

}  // namespace chorus::tp::detail
