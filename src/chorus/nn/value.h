// Value: a tensor, or a nested list or string-keyed map of Values — the inputs
// and outputs of modules that take more than one tensor (Torch7's tables).
// Tuples are lists. DataParallel splits and gathers every tensor inside.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include "chorus/core/tensor.h"

namespace chorus::nn {

struct Value {
  using List = std::vector<Value>;
  using Map = std::map<std::string, Value>;
  std::variant<Tensor, List, Map> v;

  Value() = default;
  Value(Tensor t) : v(std::move(t)) {}
  Value(List l) : v(std::move(l)) {}
  Value(Map m) : v(std::move(m)) {}
  Value(std::initializer_list<Value> l) : v(List(l)) {}

  bool is_tensor() const { return std::holds_alternative<Tensor>(v); }
  bool is_list() const { return std::holds_alternative<List>(v); }
  bool is_map() const { return std::holds_alternative<Map>(v); }
  const Tensor& tensor() const;  // throws ValueError when not a tensor
  const List& list() const;
  const Map& map() const;
  const Value& operator[](size_t i) const { return list().at(i); }
  const Value& operator[](const std::string& k) const;
};

// Calls fn on every tensor inside v (lists in order, maps by key).
void for_each_tensor(const Value& v, const std::function<void(const Tensor&)>& fn);

}  // namespace chorus::nn
