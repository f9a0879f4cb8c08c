// PersistentAllocations: marks the allocations a training run makes in the
// middle of a step but keeps for good.
//
// Note [Persistent allocations]: autocast's kept weight copies are made at
// the first forward, between that step's activations, and the optimizer's
// state at the first update, after the backward freed them. In one pool,
// they then pin the memory around them: the activations' space cannot go
// back to the driver when a CUDA graph's capture trims the pool (Note [Graph
// pools]), and gpt2-xl kept 4.65 GiB idle beside its graph. Inside this
// scope an allocator that can (CUDA: Note [Allocator front cache]) serves
// the calling thread from a pool of their own, exact sizes, never cached, so
// they sit together. Only where the tensor outlives the step; a transient
// made inside the scope is harmless (it goes back to that pool when freed).
// CHORUS_CUDA_PERSISTENT_POOL=0 turns it off, for comparisons.
#pragma once

namespace chorus {

class PersistentAllocations {
 public:
  PersistentAllocations();
  ~PersistentAllocations();
  PersistentAllocations(const PersistentAllocations&) = delete;
  PersistentAllocations& operator=(const PersistentAllocations&) = delete;
  // Whether the calling thread is inside a scope.
  static bool active() noexcept;

 private:
  bool prev_;
};

}  // namespace chorus
