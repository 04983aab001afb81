// tessera_fuzz_job_spec: job specs from bytes through the coordinator's validation
// (ValidateJobSpec, spec/job_spec.h), then, for a spec that validates, through what the
// coordinator does with it next: MakeJobConfig and the shard's CreateJobState of that config
// (scripts/fuzz.sh; docs/reliability.md).
//
// The first input byte picks the form, the rest is the spec:
//   even  a binary JobSpec (what CreateJob receives);
//   odd   textproto or JSON text, through ParseJobSpec (what `tessera submit` reads).
// Invariants beyond "no crash and no sanitizer report": validation answers OK or INVALID_ARGUMENT
// (parsing: INVALID_ARGUMENT), and a spec that validates for a distributed run yields a JobConfig
// that a shard accepts, so a job the coordinator admits never fails at its start on the shards.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "server/parameter_store.h"
#include "spec/job_spec.h"
#include "spec/job_spec_reader.h"
#include "tessera/v1/job_spec.pb.h"

namespace {

[[noreturn]] void Fail(const char* what, const absl::Status& status) {
  std::fprintf(stderr, "tessera_fuzz_job_spec: invariant broken: %s: %s\n", what,
               status.ToString().c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const bool text = (data[0] & 1) != 0;
  const char* body = reinterpret_cast<const char*>(data + 1);
  const size_t n = size - 1;
  tessera::v1::JobSpec spec;
  if (text) {
    absl::StatusOr<tessera::v1::JobSpec> parsed =
        tessera::spec::ParseJobSpec(absl::string_view(body, n), "fuzz.textproto");
    if (!parsed.ok()) {
      if (parsed.status().code() != absl::StatusCode::kInvalidArgument) {
        Fail("ParseJobSpec answered other than INVALID_ARGUMENT", parsed.status());
      }
      return 0;
    }
    spec = std::move(*parsed);
  } else if (!spec.ParseFromArray(body, static_cast<int>(n))) {
    return 0;
  }
  for (const bool distributed : {false, true}) {
    tessera::spec::ValidateOptions options;
    options.check_files = false;  // file checks are access(2); paths are not what is fuzzed
    options.distributed = distributed;
    const absl::Status valid = tessera::spec::ValidateJobSpec(spec, options);
    if (!valid.ok() && valid.code() != absl::StatusCode::kInvalidArgument) {
      Fail("ValidateJobSpec answered other than INVALID_ARGUMENT", valid);
    }
    if (!valid.ok() || !distributed) continue;
    tessera::server::ParameterStore store;
    tessera::v1::CreateJobStateRequest request;
    request.set_job_id("fuzz");
    *request.mutable_config() = tessera::spec::MakeJobConfig(spec);
    const absl::Status created = store.CreateJobState(request).status();
    if (!created.ok()) Fail("a spec that validates gives a JobConfig the shard refuses", created);
    (void)tessera::spec::PushEncoding(spec);
    (void)tessera::spec::PullEncoding(spec);
    (void)tessera::spec::PartitionBytes(spec);
  }
  return 0;
}
