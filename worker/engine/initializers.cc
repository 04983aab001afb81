#include "worker/engine/initializers.h"

#include <cmath>
#include <random>

namespace tessera::engine {
namespace {

// FNV-1a over the name, mixed with the seed, so each parameter gets its own stream.
uint64_t StreamSeed(uint64_t seed, const std::string& name) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : name) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  uint64_t z = seed ^ (h + 0x9E3779B97F4A7C15ULL + (seed << 6) + (seed >> 2));
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Uniform in [0, 1) from the top 53 bits; defined here (not std::uniform_real_distribution) so the
// values do not depend on the standard library.
double Uniform01(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

double StandardNormal(std::mt19937_64& rng) {
  // Box-Muller; 1 - u keeps the logarithm finite.
  const double u1 = 1.0 - Uniform01(rng);
  const double u2 = Uniform01(rng);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

}  // namespace

void InitializeValues(const v1::WeightInitializer& init, int64_t fan_in, int64_t fan_out,
                      uint64_t seed, const std::string& name, std::vector<float>* out) {
  std::mt19937_64 rng(StreamSeed(seed, name));
  const double in = static_cast<double>(fan_in > 0 ? fan_in : 1);
  const double outs = static_cast<double>(fan_out > 0 ? fan_out : 1);
  switch (init.kind()) {
    case v1::WeightInitializer::KIND_GLOROT_UNIFORM: {
      const double a = std::sqrt(6.0 / (in + outs));
      for (float& v : *out) v = static_cast<float>((2.0 * Uniform01(rng) - 1.0) * a);
      break;
    }
    case v1::WeightInitializer::KIND_HE_NORMAL: {
      const double s = std::sqrt(2.0 / in);
      for (float& v : *out) v = static_cast<float>(StandardNormal(rng) * s);
      break;
    }
    case v1::WeightInitializer::KIND_NORMAL: {
      const double s = init.stddev() > 0 ? init.stddev() : 0.01;
      for (float& v : *out) v = static_cast<float>(StandardNormal(rng) * s);
      break;
    }
    case v1::WeightInitializer::KIND_CONSTANT:
      for (float& v : *out) v = init.value();
      break;
    default:
      for (float& v : *out) v = 0.0f;
      break;
  }
}

}  // namespace tessera::engine
