#include "chorus/data_parallel/comm_hook.h"

#include "chorus/core/error.h"

namespace chorus::dist {

void CommHook::sum_each(std::vector<std::vector<Tensor>>&, const std::vector<Event>&) {
  CHORUS_THROW(ValueError, "this communication hook does not sum gradients in place");
}

std::vector<std::vector<Tensor>> CommHook::exchange_each(const std::vector<std::vector<Tensor>>&,
                                                         const std::vector<Event>&) {
  CHORUS_THROW(ValueError, "this communication hook does not exchange gradients");
}

}  // namespace chorus::dist
