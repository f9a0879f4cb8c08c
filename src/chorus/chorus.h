// The public API of Chorus in one include.
#pragma once

#include "chorus/autograd/functions.h"
#include "chorus/autograd/grad_mode.h"
#include "chorus/core/backend.h"
#include "chorus/core/device.h"
#include "chorus/core/dtype.h"
#include "chorus/core/error.h"
#include "chorus/core/rng.h"
#include "chorus/core/stream.h"
#include "chorus/core/tensor.h"
#include "chorus/nn/functional.h"
#include "chorus/nn/init.h"
#include "chorus/nn/layers.h"
#include "chorus/nn/module.h"
#include "chorus/ops/factory.h"
