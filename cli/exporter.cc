#include "cli/exporter.h"

#include <algorithm>
#include <map>
#include <memory>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/types/span.h"
#include "common/status_macros.h"
#include "google/protobuf/util/json_util.h"
#include "kernels/backend.h"
#include "spec/job_spec.h"
#include "worker/client/parameter_client.h"
#include "worker/engine/model.h"

namespace tessera::cli {
namespace {

// A shard that lost the job answers NOT_FOUND (the job was dropped, or the shard restarted
// without it); say so in words rather than as a missing partition.
absl::Status Explain(const absl::Status& status, const v1::Job& job, const std::string& tensor) {
  if (status.code() == absl::StatusCode::kNotFound) {
    return absl::FailedPreconditionError(absl::StrCat(
        "a shard no longer holds job '", job.id(), "' (state ", v1::JobState_Name(job.state()),
        "), so its weights cannot be exported: ", "pulling ", tensor, ": ", status.message()));
  }
  return absl::Status(status.code(), absl::StrCat("pulling ", tensor, ": ", status.message()));
}

}  // namespace

absl::StatusOr<std::vector<NamedTensor>> PullJobWeights(const v1::Job& job,
                                                        const ExportOptions& options) {
  if (job.shard_addresses().empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("job '", job.id(), "' has no weights to export: it never started (state ",
                     v1::JobState_Name(job.state()), ")"));
  }
  kernels::BackendOptions backend_options;
  backend_options.device = kernels::DeviceChoice::kCpu;
  backend_options.num_threads = 1;
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Backend> backend,
                           kernels::CreateCpuBackend(backend_options));
  absl::StatusOr<std::unique_ptr<engine::Model>> model =
      engine::Model::Create(job.spec().model(), backend.get(), job.spec().seed());
  if (!model.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("job '", job.id(), "': model: ", model.status().message()));
  }

  client::ParameterClient::Options client_options;
  client_options.shard_addresses.assign(job.shard_addresses().begin(), job.shard_addresses().end());
  client_options.job_id = job.id();
  client_options.worker_id = 0;
  client_options.partition_bytes = spec::PartitionBytes(job.spec());
  // Export reads the exact fp32 weights whatever the job's wire encoding.
  client_options.push_encoding = v1::ENCODING_FP32;
  client_options.pull_encoding = v1::ENCODING_FP32;
  client_options.call_timeout = options.call_timeout;
  client_options.credentials = options.credentials;
  // A replicated job's down shards are read from their copies.
  client_options.replicas = spec::Replicas(job.spec());
  if (client_options.replicas > 1) {
    client_options.down_shards.assign(job.down_shards().begin(), job.down_shards().end());
  }
  TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<client::ParameterClient> client,
                           client::ParameterClient::Create(client_options));

  std::vector<client::DenseTensorSpec> dense;
  std::vector<v1::SparseTableDecl> tables;
  for (const engine::Parameter& p : (*model)->parameters()) {
    if (p.sparse) {
      v1::SparseTableDecl table;
      table.set_name(p.name);
      table.set_dim(static_cast<uint32_t>(p.shape[1]));
      tables.push_back(std::move(table));
      continue;
    }
    dense.push_back({p.name, std::vector<int64_t>(p.shape.begin(), p.shape.end()), {}});
  }
  TESSERA_RETURN_IF_ERROR(client->AttachJob(dense, tables));

  std::vector<NamedTensor> out;
  for (const engine::Parameter& p : (*model)->parameters()) {
    if (p.sparse) {
      // A table: the rows the shards hold, as "<name>.ids" (int64 [n]) and "<name>" ([n, dim]).
      NamedTensor ids;
      ids.name = absl::StrCat(p.name, ".ids");
      ids.int64 = true;
      NamedTensor rows;
      rows.name = p.name;
      absl::Status pulled = client->PullAllRows(p.name, &ids.ids, &rows.values);
      if (!pulled.ok()) return Explain(pulled, job, p.name);
      ids.shape = {static_cast<int64_t>(ids.ids.size())};
      rows.shape = {static_cast<int64_t>(ids.ids.size()), p.shape[1]};
      out.push_back(std::move(ids));
      out.push_back(std::move(rows));
      continue;
    }
    NamedTensor t;
    t.name = p.name;
    t.shape.assign(p.shape.begin(), p.shape.end());
    const int64_t elements =
        std::accumulate(t.shape.begin(), t.shape.end(), int64_t{1}, std::multiplies<int64_t>());
    t.values.resize(static_cast<size_t>(elements));
    absl::Status pulled = client->Pull(p.name, /*step=*/-1, absl::MakeSpan(t.values));
    if (!pulled.ok()) return Explain(pulled, job, p.name);
    out.push_back(std::move(t));
  }
  return out;
}

absl::StatusOr<int64_t> ExportJob(const v1::Job& job, const std::string& out_path,
                                  const ExportOptions& options) {
  TESSERA_ASSIGN_OR_RETURN(std::vector<NamedTensor> tensors, PullJobWeights(job, options));
  int64_t values = 0;
  std::vector<std::string> names;
  for (const NamedTensor& t : tensors) {
    values += static_cast<int64_t>(t.values.size());
    names.push_back(t.name);
  }
  std::map<std::string, std::string> metadata = {
      {"format", "tessera"},
      {"job_id", job.id()},
      {"job_name", job.spec().name()},
      {"state", v1::JobState_Name(job.state())},
      {"step", absl::StrCat(job.step())},
      {"shards", absl::StrCat(job.shard_addresses_size())},
  };
  if (job.evaluated()) metadata["test_accuracy"] = absl::StrCat(job.test_accuracy());
  if (job.has_test_auc()) metadata["test_auc"] = absl::StrCat(job.test_auc());
  // The model spec, so that a reader can rebuild the network the tensors belong to (the tensor
  // names say which layer or table each is; the spec says how they connect).
  std::string model_json;
  google::protobuf::util::JsonPrintOptions json_options;
  json_options.preserve_proto_field_names = true;
  if (google::protobuf::util::MessageToJsonString(job.spec().model(), &model_json, json_options)
          .ok()) {
    metadata["model"] = model_json;
  }
  TESSERA_RETURN_IF_ERROR(WriteSafetensorsFile(out_path, tensors, metadata));
  return values;
}

}  // namespace tessera::cli
