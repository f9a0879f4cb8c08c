#include "chorus/nn/value.h"

#include "chorus/core/error.h"

namespace chorus::nn {

const Tensor& Value::tensor() const {
  CHORUS_CHECK(is_tensor(), "Value: expected a tensor, got a ", is_list() ? "list" : "map");
  return std::get<Tensor>(v);
}
const Value::List& Value::list() const {
  CHORUS_CHECK(is_list(), "Value: expected a list, got a ", is_tensor() ? "tensor" : "map");
  return std::get<List>(v);
}
const Value::Map& Value::map() const {
  CHORUS_CHECK(is_map(), "Value: expected a map, got a ", is_tensor() ? "tensor" : "list");
  return std::get<Map>(v);
}
const Value& Value::operator[](const std::string& k) const {
  auto it = map().find(k);
  CHORUS_CHECK(it != map().end(), "Value: no key '", k, "' in map");
  return it->second;
}

void for_each_tensor(const Value& v, const std::function<void(const Tensor&)>& fn) {
  if (v.is_tensor()) {
    fn(v.tensor());
  } else if (v.is_list()) {
    for (const Value& e : v.list()) for_each_tensor(e, fn);
  } else {
    for (const auto& [k, e] : v.map()) for_each_tensor(e, fn);
  }
}

}  // namespace chorus::nn
