// Seeded parameter initialisation (model.proto's WeightInitializer). The values depend only on the
// model seed, the parameter's name and its shape, so every backend and every worker starts from
// the same weights.
#ifndef TESSERA_WORKER_ENGINE_INITIALIZERS_H_
#define TESSERA_WORKER_ENGINE_INITIALIZERS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "tessera/v1/model.pb.h"

namespace tessera::engine {

// Fills `out` (its size is the parameter's element count) with values drawn for `init`, where
// `fan_in` and `fan_out` size Glorot and He. `init.kind() == KIND_UNSPECIFIED` must be resolved
// by the caller to the parameter's default.
void InitializeValues(const v1::WeightInitializer& init, int64_t fan_in, int64_t fan_out,
                      uint64_t seed, const std::string& name, std::vector<float>* out);

}  // namespace tessera::engine

#endif  // TESSERA_WORKER_ENGINE_INITIALIZERS_H_
