// ProcessGroupNCCL: the CUDA backend of ProcessGroup (nccl_group.cpp).
#pragma once

#include "chorus/distributed/process_group.h"

namespace chorus::dist {

#if defined(CHORUS_WITH_CUDA) && defined(CHORUS_WITH_NCCL)
// One NCCL communicator on `device` (this process's GPU) and one
// communication stream. Note [NCCL process group] in nccl_group.cpp.
ProcessGroupPtr make_nccl_group(int rank, int size, StorePtr store, ProcessGroupOptions options, int device);
#endif

}  // namespace chorus::dist
