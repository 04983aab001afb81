#include "worker/engine/internal/sync_batch_norm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common/status_macros.h"

namespace tessera::engine::internal {

using kernels::Tensor;

namespace {

absl::Status ToHost(kernels::Backend* backend, const Tensor& t, std::vector<float>* out) {
  out->resize(static_cast<size_t>(kernels::NumElements(t.shape())));
  return backend->CopyToHost(t, out->data());
}

}  // namespace

absl::Status SyncBatchNormForward(kernels::Backend* backend, const kernels::BatchNormGeometry& g,
                                  const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                  const Tensor& y, const Tensor& moving_mean,
                                  const Tensor& moving_var, const Tensor& save_mean,
                                  const Tensor& save_var, CrossDeviceSum* sum,
                                  SyncBatchNormBuffers* host) {
  const int64_t c = g.c;
  const int64_t sp = g.spatial;
  TESSERA_RETURN_IF_ERROR(ToHost(backend, x, &host->x));
  std::vector<double>& s = host->sums;
  s.assign(static_cast<size_t>(2 * c + 1), 0.0);
  for (int64_t b = 0; b < g.n; ++b) {
    for (int64_t ch = 0; ch < c; ++ch) {
      const float* v = host->x.data() + (b * c + ch) * sp;
      double total = 0, squares = 0;
      for (int64_t i = 0; i < sp; ++i) {
        total += v[i];
        squares += static_cast<double>(v[i]) * v[i];
      }
      s[ch] += total;
      s[c + ch] += squares;
    }
  }
  s[2 * c] = static_cast<double>(g.n * sp);
  TESSERA_RETURN_IF_ERROR(sum->Sum(absl::MakeSpan(s)));
  const double count = s[2 * c];
  TESSERA_RETURN_IF_ERROR(ToHost(backend, gamma, &host->gamma));
  TESSERA_RETURN_IF_ERROR(ToHost(backend, beta, &host->beta));
  TESSERA_RETURN_IF_ERROR(ToHost(backend, moving_mean, &host->moving_mean));
  TESSERA_RETURN_IF_ERROR(ToHost(backend, moving_var, &host->moving_var));
  host->mean.resize(static_cast<size_t>(c));
  host->var.resize(static_cast<size_t>(c));
  const double unbias = count > 1 ? count / (count - 1) : 1.0;
  for (int64_t ch = 0; ch < c; ++ch) {
    const double mean = s[ch] / count;
    const double var = std::max(0.0, s[c + ch] / count - mean * mean);
    host->mean[ch] = static_cast<float>(mean);
    host->var[ch] = static_cast<float>(var);
    host->moving_mean[ch] =
        static_cast<float>((1.0 - g.momentum) * host->moving_mean[ch] + g.momentum * mean);
    host->moving_var[ch] =
        static_cast<float>((1.0 - g.momentum) * host->moving_var[ch] + g.momentum * var * unbias);
  }
  host->y.resize(host->x.size());
  for (int64_t b = 0; b < g.n; ++b) {
    for (int64_t ch = 0; ch < c; ++ch) {
      const int64_t base = (b * c + ch) * sp;
      const double scale =
          host->gamma[ch] / std::sqrt(static_cast<double>(host->var[ch]) + g.epsilon);
      const double mean = host->mean[ch];
      for (int64_t i = 0; i < sp; ++i) {
        host->y[base + i] = static_cast<float>((host->x[base + i] - mean) * scale + host->beta[ch]);
      }
    }
  }
  TESSERA_RETURN_IF_ERROR(backend->CopyToDevice(host->y.data(), y));
  TESSERA_RETURN_IF_ERROR(backend->CopyToDevice(host->mean.data(), save_mean));
  TESSERA_RETURN_IF_ERROR(backend->CopyToDevice(host->var.data(), save_var));
  TESSERA_RETURN_IF_ERROR(backend->CopyToDevice(host->moving_mean.data(), moving_mean));
  return backend->CopyToDevice(host->moving_var.data(), moving_var);
}

absl::Status SyncBatchNormBackward(kernels::Backend* backend, const kernels::BatchNormGeometry& g,
                                   const Tensor& x, const Tensor& gamma, const Tensor& save_mean,
                                   const Tensor& save_var, const Tensor& dy, const Tensor& dx,
                                   const Tensor& dgamma, const Tensor& dbeta, CrossDeviceSum* sum,
                                   SyncBatchNormBuffers* host) {
  const int64_t c = g.c;
  const int64_t sp = g.spatial;
  TESSERA_RETURN_IF_ERROR(ToHost(backend, x, &host->x));
  TESSERA_RETURN_IF_ERROR(ToHost(backend, dy, &host->y));  // host->y holds dy, then dx
  TESSERA_RETURN_IF_ERROR(ToHost(backend, gamma, &host->gamma));
  TESSERA_RETURN_IF_ERROR(ToHost(backend, save_mean, &host->mean));
  TESSERA_RETURN_IF_ERROR(ToHost(backend, save_var, &host->var));
  std::vector<double>& s = host->sums;
  s.assign(static_cast<size_t>(2 * c + 1), 0.0);
  std::vector<double> invstd(static_cast<size_t>(c));
  for (int64_t ch = 0; ch < c; ++ch) {
    invstd[ch] = 1.0 / std::sqrt(static_cast<double>(host->var[ch]) + g.epsilon);
  }
  for (int64_t b = 0; b < g.n; ++b) {
    for (int64_t ch = 0; ch < c; ++ch) {
      const int64_t base = (b * c + ch) * sp;
      double sdy = 0, sdyx = 0;
      for (int64_t i = 0; i < sp; ++i) {
        const double xhat = (host->x[base + i] - host->mean[ch]) * invstd[ch];
        sdy += host->y[base + i];
        sdyx += host->y[base + i] * xhat;
      }
      s[ch] += sdy;
      s[c + ch] += sdyx;
    }
  }
  s[2 * c] = static_cast<double>(g.n * sp);
  // This device's parameter gradients, before the sums become the group's.
  host->dbeta.resize(static_cast<size_t>(c));
  host->dgamma.resize(static_cast<size_t>(c));
  for (int64_t ch = 0; ch < c; ++ch) {
    host->dbeta[ch] = static_cast<float>(s[ch]);
    host->dgamma[ch] = static_cast<float>(s[c + ch]);
  }
  TESSERA_RETURN_IF_ERROR(backend->CopyToDevice(host->dgamma.data(), dgamma));
  TESSERA_RETURN_IF_ERROR(backend->CopyToDevice(host->dbeta.data(), dbeta));
  TESSERA_RETURN_IF_ERROR(sum->Sum(absl::MakeSpan(s)));
  const double count = s[2 * c];
  for (int64_t b = 0; b < g.n; ++b) {
    for (int64_t ch = 0; ch < c; ++ch) {
      const int64_t base = (b * c + ch) * sp;
      const double scale = host->gamma[ch] * invstd[ch];
      const double mean_dy = s[ch] / count;
      const double mean_dyx = s[c + ch] / count;
      for (int64_t i = 0; i < sp; ++i) {
        const double xhat = (host->x[base + i] - host->mean[ch]) * invstd[ch];
        host->y[base + i] =
            static_cast<float>(scale * (host->y[base + i] - mean_dy - xhat * mean_dyx));
      }
    }
  }
  return backend->CopyToDevice(host->y.data(), dx);
}

}  // namespace tessera::engine::internal
