// attn_test_common: GoogleTest-free helpers every engine suite (CPU and CUDA) shares. Link the
// `attn_test_common` target and include this header, or the one header you need:
//
//   common/host_tensor.h      HostTensor (any dtype, optional padded strides, random fill,
//                             poisoning and counting of unwritten elements / touched padding),
//                             AttentionTensors (all tensors of one problem), FreshSeed().
//   common/reference.h        RunReference(): the float64 CPU reference on exact float32 copies
//                             of the inputs (results not rounded to the problem's dtype).
//   common/naive_attention.h  NaiveForward/NaiveBackward: a plain same-precision
//                             implementation, the yardstick of the tolerance rule.
//   common/accuracy.h         Compare() error metrics, CheckAccuracy() (the 2x rule; float32
//                             rtol), CheckLse(), FractionCorrectlyRounded().
//   common/sweep.h            StandardSweep(): the named problems every suite iterates.
//   common/finite_difference.h  FiniteDifferenceCheck: a backward's gradients against central
//                             differences of a float64 loss, with no analytic reference.
//
// A typical engine test (a CUDA suite copies data() to and from the device around the call):
//
//   const uint64_t seed = FreshSeed();  // put it in the failure message; ATTN_TEST_SEED replays
//   AttentionTensors t = AttentionTensors::Make(c.problem, seed, c.padded);
//   auto ref = RunReference(c.problem, t, /*backward=*/false);
//   t.PoisonOutputs();
//   ASSERT_TRUE(engine->Forward(c.problem, t.forward_args()).ok());
//   EXPECT_EQ(t.o.CountPoisoned(), 0);
//   NaiveForwardResult naive = NaiveForward(c.problem, t.q, t.k, t.v);  // low precision only
//   EXPECT_TRUE(CheckAccuracy("O", c.problem.dtype, t.o.ToDouble(), ref->o, &naive.o).ok());
//   EXPECT_TRUE(CheckLse(t.lse, ref->lse).ok());
#pragma once

#include "common/accuracy.h"
#include "common/finite_difference.h"
#include "common/host_tensor.h"
#include "common/naive_attention.h"
#include "common/reference.h"
#include "common/sweep.h"
