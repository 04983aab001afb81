// SyncBN (internal to worker/engine): BatchNorm in training whose batch statistics are those of
// every device of a group, summed with an engine::CrossDeviceSum. The statistics and the
// gradient's correction terms are computed on the host in double: each device contributes its
// per-channel count, sum and sum of squares (forward), and the sums of dy and dy * xhat
// (backward), 2c + 1 values per pass. dy must be the gradient of the group's loss (the trainer
// scales each device's loss gradient by its share of the batch), so the correction is the one
// the whole batch on one device would make:
//   dx = gamma / sigma * (dy - sum(dy) / N - xhat * sum(dy * xhat) / N)   (sums over the group)
// dgamma and dbeta are this device's own sums, which the trainer's reduce adds up.
#ifndef TESSERA_WORKER_ENGINE_INTERNAL_SYNC_BATCH_NORM_H_
#define TESSERA_WORKER_ENGINE_INTERNAL_SYNC_BATCH_NORM_H_

#include <vector>

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "worker/engine/cross_device_sum.h"

namespace tessera::engine::internal {

// Host copies reused from step to step.
struct SyncBatchNormBuffers {
  std::vector<float> x, y, gamma, beta, mean, var, moving_mean, moving_var, dgamma, dbeta;
  std::vector<double> sums;
};

// Normalises x into y with the group's batch mean and (biased) variance, which go to save_mean
// and save_var ([c] floats, for SyncBatchNormBackward), and moves the moving statistics as
// BatchNormForwardTraining does, with the group's count for the unbiased variance.
absl::Status SyncBatchNormForward(kernels::Backend* backend, const kernels::BatchNormGeometry& g,
                                  const kernels::Tensor& x, const kernels::Tensor& gamma,
                                  const kernels::Tensor& beta, const kernels::Tensor& y,
                                  const kernels::Tensor& moving_mean,
                                  const kernels::Tensor& moving_var,
                                  const kernels::Tensor& save_mean, const kernels::Tensor& save_var,
                                  CrossDeviceSum* sum, SyncBatchNormBuffers* host);

// dx with the group's correction terms; dgamma and dbeta this device's sums.
absl::Status SyncBatchNormBackward(kernels::Backend* backend, const kernels::BatchNormGeometry& g,
                                   const kernels::Tensor& x, const kernels::Tensor& gamma,
                                   const kernels::Tensor& save_mean,
                                   const kernels::Tensor& save_var, const kernels::Tensor& dy,
                                   const kernels::Tensor& dx, const kernels::Tensor& dgamma,
                                   const kernels::Tensor& dbeta, CrossDeviceSum* sum,
                                   SyncBatchNormBuffers* host);

}  // namespace tessera::engine::internal

#endif  // TESSERA_WORKER_ENGINE_INTERNAL_SYNC_BATCH_NORM_H_
