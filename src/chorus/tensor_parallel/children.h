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
  for (const auto& [n, c] : m.named_children()) {
    if (n == name) {
      auto typed = std::dynamic_pointer_cast<M>(c);
      CHORUS_ASSERT(typed != nullptr);
      return typed;
    }
  }
  CHORUS_THROW(ValueError, m.type_name(), ": has no child '", name, "'");
}

}  // namespace chorus::tp::detail
