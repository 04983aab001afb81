#include "tests/hostile/requests.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "tessera/v1/job.grpc.pb.h"
#include "tessera/v1/parameter.grpc.pb.h"

namespace tessera::hostile {

v1::JobSpec BaseSpec(const Targets& t, const std::string& name, int workers) {
  v1::JobSpec spec;
  spec.set_name(name);
  v1::ModelSpec* model = spec.mutable_model();
  model->add_input_shape(784);
  model->add_layers()->mutable_dense()->set_units(16);
  model->add_layers()->mutable_relu();
  model->add_layers()->mutable_dense()->set_units(10);
  model->set_loss(v1::LOSS_SOFTMAX_CROSS_ENTROPY);
  v1::DatasetSpec* d = spec.mutable_dataset();
  d->set_format(v1::DatasetSpec::FORMAT_IDX);
  d->set_train_images(t.dataset_dir + "/train-images-idx3-ubyte.gz");
  d->set_train_labels(t.dataset_dir + "/train-labels-idx1-ubyte.gz");
  d->set_test_images(t.dataset_dir + "/t10k-images-idx3-ubyte.gz");
  d->set_test_labels(t.dataset_dir + "/t10k-labels-idx1-ubyte.gz");
  d->mutable_normalization()->set_divide_by(255);
  d->set_num_classes(10);
  spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_KIND_SGD);
  spec.mutable_optimizer()->set_learning_rate(0.1f);
  spec.set_batch_size(32);
  spec.set_epochs(1);
  spec.set_seed(7);
  spec.set_num_workers(workers);
  spec.set_consistency("bsp");
  spec.set_device("cpu");
  return spec;
}

namespace {

std::string Floats(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

std::vector<float> FiniteValues(Rng& rng, size_t n) {
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(static_cast<int64_t>(rng.Uniform(2001)) - 1000) / 1e4f;
  return v;
}

std::string HostileId(Rng& rng, const char* prefix) {
  return absl::StrCat(prefix, "-", rng.Uniform(1000000));
}

}  // namespace

namespace {

// --- Templates: a valid request of each method ---------------------------------------------------

void FillSlice(Rng& rng, const std::string& tensor, uint32_t index, size_t elements, v1::Slice* s) {
  s->mutable_key()->set_tensor(tensor);
  s->mutable_key()->set_index(index);
  s->set_encoding(v1::ENCODING_FP32);
  s->set_data(Floats(FiniteValues(rng, elements)));
}

// A valid push (and, for PushPull, pull) on a target job.
void PushTemplate(Rng& rng, const std::string& job, bool with_pulls, v1::PushPullRequest* r) {
  const bool asp = job != "hx-bsp";
  r->set_job_id(job);
  r->set_worker_id(
      static_cast<uint32_t>(rng.Uniform(asp ? Targets::kAspWorkers : Targets::kBspWorkers)));
  r->set_incarnation(1 + rng.Uniform(3));
  r->set_step(static_cast<int64_t>(rng.Uniform(asp ? 1000 : 2)));
  r->set_seq(1 + rng.Uniform(uint64_t{1} << 40));
  FillSlice(rng, "w", 0, 64, r->add_push());
  if (asp && rng.OneIn(2)) FillSlice(rng, "b", 0, 8, r->add_push());
  if (asp && rng.OneIn(2)) {
    v1::Slice* s = r->add_push();
    s->mutable_key()->set_tensor("emb");
    const int rows = 1 + static_cast<int>(rng.Uniform(4));
    for (int i = 0; i < rows; ++i) s->add_row_ids(static_cast<int64_t>(rng.Uniform(100000)));
    s->set_data(Floats(FiniteValues(rng, rows * 4)));
  }
  if (with_pulls) {
    if (rng.OneIn(2)) r->mutable_push(0)->set_want_weights(true);
    if (asp && rng.OneIn(2)) {
      v1::Slice* p = r->add_pull();
      p->mutable_key()->set_tensor("b");
    }
  }
}

void PullTemplate(Rng& rng, const std::string& job, v1::PullRequest* r) {
  const bool asp = job != "hx-bsp";
  r->set_job_id(job);
  r->set_worker_id(static_cast<uint32_t>(rng.Uniform(asp ? Targets::kAspWorkers : 1)));
  r->set_step(asp ? static_cast<int64_t>(rng.Uniform(100)) - 1 : -1);
  r->add_keys()->mutable_key()->set_tensor("w");
  if (asp && rng.OneIn(2)) r->add_keys()->mutable_key()->set_tensor("b");
  if (asp && rng.OneIn(2)) {
    v1::Slice* s = r->add_keys();
    s->mutable_key()->set_tensor("emb");
    s->add_row_ids(static_cast<int64_t>(rng.Uniform(1000)));
  }
}

void JobStateTemplate(Rng& rng, v1::CreateJobStateRequest* r) {
  r->set_job_id(HostileId(rng, "hx-cjs"));
  v1::JobConfig* c = r->mutable_config();
  c->set_consistency(rng.OneIn(2) ? v1::CONSISTENCY_ASP : v1::CONSISTENCY_BSP);
  c->set_num_workers(1 + static_cast<uint32_t>(rng.Uniform(3)));
  c->mutable_optimizer()->set_kind(v1::OPTIMIZER_KIND_SGD);
  c->mutable_optimizer()->set_learning_rate(0.1f);
  v1::DensePartitionDecl* p = r->add_partitions();
  p->mutable_key()->set_tensor("x");
  p->set_num_elements(16);
  if (rng.OneIn(2)) p->set_initial_values(Floats(FiniteValues(rng, 16)));
  if (rng.OneIn(2)) {
    v1::SparseTableDecl* t = r->add_tables();
    t->set_name("t");
    t->set_dim(4);
  }
}

}  // namespace

// The valid request of method `m` that the edits start from.
std::unique_ptr<pb::Message> Template(int m, Rng& rng, const Targets& t,
                                      const Prototypes& prototypes) {
  std::unique_ptr<pb::Message> msg(prototypes.Get(m)->New());
  const std::string name = kMethods[m].name;
  const std::string target = rng.OneIn(4) ? "hx-bsp" : "hx-asp";
  if (name == "PushPull" || name == "Push") {
    PushTemplate(rng, target, name == "PushPull", static_cast<v1::PushPullRequest*>(msg.get()));
  } else if (name == "Pull") {
    PullTemplate(rng, target, static_cast<v1::PullRequest*>(msg.get()));
  } else if (name == "CreateJobState") {
    JobStateTemplate(rng, static_cast<v1::CreateJobStateRequest*>(msg.get()));
  } else if (name == "UpdateMembership") {
    auto* r = static_cast<v1::UpdateMembershipRequest*>(msg.get());
    r->set_job_id(rng.OneIn(2) ? "hx-asp" : HostileId(rng, "hx-um"));
    for (int w = 0; w < Targets::kAspWorkers; ++w) r->add_live_workers(w);
    r->set_effective_step(static_cast<int64_t>(rng.Uniform(1000)));
  } else if (name == "DropJob") {
    static_cast<v1::DropJobRequest*>(msg.get())->set_job_id(HostileId(rng, "hx-drop"));
  } else if (name == "Checkpoint") {
    auto* r = static_cast<v1::CheckpointRequest*>(msg.get());
    r->set_job_id(HostileId(rng, "hx-ckpt"));
    r->set_step(1 + static_cast<int64_t>(rng.Uniform(100)));
  } else if (name == "Restore") {
    auto* r = static_cast<v1::RestoreRequest*>(msg.get());
    r->set_job_id(HostileId(rng, "hx-restore"));
    r->set_step(1 + static_cast<int64_t>(rng.Uniform(100)));
    r->set_min_incarnation(rng.Next());
  } else if (name == "ReadCheckpoint") {
    auto* r = static_cast<v1::ReadCheckpointRequest*>(msg.get());
    r->set_job_id(rng.OneIn(2) ? target : HostileId(rng, "hx-read"));
    r->set_step(1 + static_cast<int64_t>(rng.Uniform(100)));
    r->set_offset(rng.Uniform(4096));
    r->set_max_bytes(1 + static_cast<uint32_t>(rng.Uniform(1 << 20)));
  } else if (name == "Fill") {
    // A first page of a fill: random bytes, so a whole file never verifies.
    auto* r = static_cast<v1::FillRequest*>(msg.get());
    r->set_job_id(HostileId(rng, "hx-fill"));
    r->set_step(1 + static_cast<int64_t>(rng.Uniform(100)));
    r->set_num_sources(1 + static_cast<uint32_t>(rng.Uniform(2)));
    const size_t bytes = 1 + rng.Uniform(2048);
    std::string data(bytes, '\0');
    for (char& c : data) c = static_cast<char>(rng.Next());
    r->set_data(data);
    r->set_file_bytes(bytes + (rng.OneIn(2) ? 0 : rng.Uniform(1 << 20)));
    r->set_num_shards(3);
    r->set_replicas(2);
  } else if (name == "CreateJob") {
    *static_cast<v1::CreateJobRequest*>(msg.get())->mutable_spec() =
        BaseSpec(t, "hx", 1 + static_cast<int>(rng.Uniform(2)));
  } else if (name == "GetJob") {
    static_cast<v1::GetJobRequest*>(msg.get())->set_job_id(rng.OneIn(2) ? t.valid_job_id
                                                                        : HostileId(rng, "hx"));
  } else if (name == "ListJobs") {
    auto* r = static_cast<v1::ListJobsRequest*>(msg.get());
    if (rng.OneIn(2)) r->add_states(v1::JOB_STATE_PENDING);
  } else if (name == "CancelJob") {
    static_cast<v1::CancelJobRequest*>(msg.get())->set_job_id(HostileId(rng, "hx"));
  } else if (name == "WatchJob") {
    auto* r = static_cast<v1::WatchJobRequest*>(msg.get());
    r->set_job_id(rng.OneIn(2) ? t.valid_job_id : HostileId(rng, "hx"));
  } else if (name == "CheckpointJob") {
    static_cast<v1::CheckpointJobRequest*>(msg.get())->set_job_id(HostileId(rng, "hx"));
  } else if (name == "Register") {
    auto* r = static_cast<v1::RegisterRequest*>(msg.get());
    r->set_role(v1::MEMBER_ROLE_WORKER);
    r->set_hostname("hostile");
    r->set_pid(static_cast<int64_t>(rng.Uniform(100000)));
    r->set_device("cpu");
  } else if (name == "Heartbeat") {
    static_cast<v1::HeartbeatRequest*>(msg.get())->set_member_id(HostileId(rng, "w"));
  } else if (name == "Deregister") {
    static_cast<v1::DeregisterRequest*>(msg.get())->set_member_id(HostileId(rng, "w"));
  } else if (name == "WatchTasks") {
    static_cast<v1::WatchTasksRequest*>(msg.get())->set_member_id(HostileId(rng, "w"));
  } else if (name == "ReportProgress") {
    auto* r = static_cast<v1::ProgressReport*>(msg.get());
    r->set_member_id(HostileId(rng, "w"));
    r->set_job_id(rng.OneIn(2) ? HostileId(rng, "hx") : t.valid_job_id);
    r->set_phase(v1::TASK_PHASE_TRAINING);
    r->set_step(static_cast<int64_t>(rng.Uniform(100)));
    r->set_total_steps(100);
    r->set_samples_per_second(10);
  } else if (name == "Check" || name == "Watch") {
    const pb::FieldDescriptor* f = msg->GetDescriptor()->FindFieldByName("service");
    if (rng.OneIn(3)) msg->GetReflection()->SetString(msg.get(), f, "tessera.v1.ParameterService");
  } else if (name == "ServerReflectionInfo") {
    const pb::Descriptor* d = msg->GetDescriptor();
    const char* choices[] = {"list_services", "file_containing_symbol", "file_by_filename"};
    const pb::FieldDescriptor* f = d->FindFieldByName(choices[rng.Uniform(3)]);
    const char* values[] = {"", "tessera.v1.ParameterService", "tessera/v1/job.proto",
                            "grpc.health.v1.Health"};
    msg->GetReflection()->SetString(msg.get(), f, values[rng.Uniform(4)]);
  }
  return msg;
}

namespace {

// --- Invalid edits: each makes the template surely invalid ---------------------------------------

std::string NonFiniteData(Rng& rng, size_t elements) {
  std::vector<float> v = FiniteValues(rng, elements);
  const float bad[] = {std::numeric_limits<float>::quiet_NaN(),
                       std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity()};
  v[rng.Uniform(v.size())] = bad[rng.Uniform(3)];
  return Floats(v);
}

}  // namespace

// Applies one invalid edit to `msg` (a template of method `m`); returns what it did, or "" when
// the method has none (the caller then sends a random request instead).
std::string InvalidEdit(int m, Rng& rng, const Targets& t, pb::Message* msg) {
  const std::string name = kMethods[m].name;
  if (name == "PushPull" || name == "Push") {
    auto* r = static_cast<v1::PushPullRequest*>(msg);
    // REJECT jobs only (hx-asp, valid-job), so NaN is an error; nothing here is ever applied.
    const bool valid_job = rng.OneIn(3);
    r->Clear();
    PushTemplate(rng, "hx-asp", name == "PushPull", r);
    if (valid_job) {
      r->set_job_id(t.valid_shard_job);
      r->set_worker_id(0);
      r->mutable_push(0)->mutable_key()->set_tensor("v");
      r->mutable_push(0)->set_data(Floats(FiniteValues(rng, 256)));
      r->mutable_push()->DeleteSubrange(1, r->push_size() - 1);
      r->clear_pull();
    }
    v1::Slice* s = r->mutable_push(0);
    switch (rng.Uniform(name == "PushPull" ? 11 : 9)) {
      case 0:
        r->set_job_id(HostileId(rng, "hx-nojob"));
        return "unknown job";
      case 1:
        r->set_job_id("");
        return "empty job_id";
      case 2:
        s->mutable_key()->set_tensor("no-such-tensor");
        return "unknown tensor";
      case 3:
        s->mutable_key()->set_index(7 + static_cast<uint32_t>(rng.Uniform(1000)));
        return "unknown partition index";
      case 4: {
        std::string data = s->data();
        if (rng.OneIn(2)) {
          data.resize(data.size() - 1 - rng.Uniform(4));
        } else {
          data += data;
        }
        s->set_data(data);
        return "wrong data size";
      }
      case 5:
        s->set_data(NonFiniteData(rng, s->data().size() / 4));
        return "NaN/Inf gradient";
      case 6:
        s->set_encoding(static_cast<v1::Encoding>(4 + rng.Uniform(1000)));
        return "unknown encoding";
      case 7:
        r->set_worker_id(valid_job
                             ? 1 + static_cast<uint32_t>(rng.Uniform(100))
                             : Targets::kAspWorkers + static_cast<uint32_t>(rng.Uniform(1u << 31)));
        return "worker_id out of range";
      case 8:
        s->set_encoding(v1::ENCODING_FP16);
        s->set_data(s->data() + "x");
        return "odd fp16 byte count";
      case 9: {
        v1::Slice* p1 = r->add_pull();
        p1->mutable_key()->set_tensor(valid_job ? "v" : "w");
        *r->add_pull() = *p1;
        return "duplicate pull key";
      }
      default:
        // SIGN1 (4) or past the last encoding; TOPK (5) and INT8 (6) pull weight deltas.
        {
          const uint32_t e = rng.Uniform(100);
          r->set_pull_encoding(static_cast<v1::Encoding>(e == 0 ? 4 : 6 + e));
        }
        if (r->pull_size() == 0) r->add_pull()->mutable_key()->set_tensor(valid_job ? "v" : "w");
        return "unknown pull_encoding";
    }
  }
  if (name == "Pull") {
    auto* r = static_cast<v1::PullRequest*>(msg);
    r->Clear();
    PullTemplate(rng, "hx-asp", r);
    switch (rng.Uniform(6)) {
      case 0:
        r->set_job_id(HostileId(rng, "hx-nojob"));
        return "unknown job";
      case 1:
        r->mutable_keys(0)->mutable_key()->set_tensor("nope");
        return "unknown key";
      case 2:
        *r->add_keys() = r->keys(0);
        return "duplicate key";
      case 3: {  // SIGN1 (4) or past the last encoding; TOPK (5) and INT8 (6) pull deltas.
        const uint32_t e = rng.Uniform(100);
        r->set_encoding(static_cast<v1::Encoding>(e == 0 ? 4 : 6 + e));
      }
        return "unknown encoding";
      case 4:
        r->set_worker_id(Targets::kAspWorkers + static_cast<uint32_t>(rng.Uniform(1000)));
        return "worker_id out of range";
      default:
        r->set_job_id("");
        return "empty job_id";
    }
  }
  if (name == "CreateJobState") {
    auto* r = static_cast<v1::CreateJobStateRequest*>(msg);
    switch (rng.Uniform(10)) {
      case 0:
        r->set_job_id("");
        return "empty job_id";
      case 1:
        r->mutable_partitions(0)->set_num_elements(-1 - static_cast<int64_t>(rng.Uniform(5)));
        return "negative num_elements";
      case 2:
        r->mutable_partitions(0)->set_initial_values(Floats(FiniteValues(rng, 15)));
        return "initial_values of the wrong size";
      case 3:
        r->mutable_config()->set_num_workers(0);
        return "num_workers 0";
      case 4:
        r->mutable_config()->mutable_optimizer()->set_kind(
            static_cast<v1::OptimizerKind>(50 + rng.Uniform(100)));
        return "unknown optimizer kind";
      case 5:
        r->mutable_config()->mutable_optimizer()->set_learning_rate(
            std::numeric_limits<float>::quiet_NaN());
        return "NaN learning rate";
      case 6: {
        v1::SparseTableDecl* tab = r->add_tables();
        tab->set_name("t0");
        tab->set_dim(0);
        return "table dim 0";
      }
      case 7:
        r->mutable_partitions(0)->mutable_key()->set_tensor("");
        return "empty tensor name";
      case 8:
        r->mutable_config()->set_non_finite_policy(
            static_cast<v1::NonFinitePolicy>(2 + rng.Uniform(100)));
        return "unknown non_finite_policy";
      default:
        // The target job exists with 4 workers: another config is FAILED_PRECONDITION.
        r->set_job_id("hx-asp");
        r->mutable_config()->set_num_workers(1);
        return "existing job, other config";
    }
  }
  if (name == "UpdateMembership") {
    auto* r = static_cast<v1::UpdateMembershipRequest*>(msg);
    switch (rng.Uniform(3)) {
      case 0:
        r->set_job_id(HostileId(rng, "hx-nojob"));
        return "unknown job";
      case 1:
        r->set_job_id("hx-asp");
        r->add_live_workers(Targets::kAspWorkers + static_cast<uint32_t>(rng.Uniform(1000000)));
        return "live worker out of range";
      default:
        r->set_job_id("");
        return "empty job_id";
    }
  }
  if (name == "Fill") {
    // A fill may name any job (it creates it): each edit breaks the page itself.
    auto* r = static_cast<v1::FillRequest*>(msg);
    switch (rng.Uniform(5)) {
      case 0:
        r->set_step(-static_cast<int64_t>(rng.Uniform(1000)));
        return "step < 1";
      case 1:
        r->set_job_id("");
        return "empty job_id";
      case 2:
        r->set_offset(1 + rng.Uniform(1000));
        return "a page of no fill in progress";
      case 3:
        r->set_source(r->num_sources() + static_cast<uint32_t>(rng.Uniform(5)));
        return "source >= num_sources";
      default:
        r->set_replicas(r->num_shards() + 1 + static_cast<uint32_t>(rng.Uniform(5)));
        return "replicas > num_shards";
    }
  }
  if (name == "DropJob" || name == "Checkpoint" || name == "Restore" || name == "GetJob" ||
      name == "CancelJob" || name == "CheckpointJob" || name == "WatchJob" ||
      name == "ReadCheckpoint") {
    const pb::FieldDescriptor* f = msg->GetDescriptor()->FindFieldByName("job_id");
    const pb::FieldDescriptor* step = msg->GetDescriptor()->FindFieldByName("step");
    const pb::FieldDescriptor* after = msg->GetDescriptor()->FindFieldByName("after_seq");
    const uint64_t pick = rng.Uniform(3);
    if (pick == 1 && step != nullptr) {
      msg->GetReflection()->SetString(msg, f, "hx-asp");
      msg->GetReflection()->SetInt64(msg, step, -static_cast<int64_t>(rng.Uniform(1000)));
      return "step < 1";
    }
    if (pick == 1 && after != nullptr) {
      msg->GetReflection()->SetInt64(msg, after, -1 - static_cast<int64_t>(rng.Uniform(1000)));
      return "negative after_seq";
    }
    if (pick == 2) {
      msg->GetReflection()->SetString(msg, f, "");
      return "empty job_id";
    }
    msg->GetReflection()->SetString(msg, f, HostileId(rng, "hx-nojob"));
    return "unknown job";
  }
  if (name == "CreateJob") {
    v1::JobSpec* s = static_cast<v1::CreateJobRequest*>(msg)->mutable_spec();
    switch (rng.Uniform(12)) {
      case 0:
        s->set_batch_size(rng.OneIn(2) ? 0 : -5);
        return "batch_size <= 0";
      case 1:
        s->set_num_workers(rng.OneIn(2) ? -1 : 5000);
        return "num_workers out of range";
      case 2:
        s->mutable_optimizer()->set_learning_rate(std::numeric_limits<float>::quiet_NaN());
        return "NaN learning_rate";
      case 3:
        s->set_epochs(-1 - static_cast<int>(rng.Uniform(10)));
        return "negative epochs";
      case 4:
        s->mutable_dataset()->set_train_images("/nonexistent/hostile/train.gz");
        return "missing dataset file";
      case 5:
        s->mutable_model()->clear_layers();
        return "no layers";
      case 6:
        s->set_consistency("bogus");
        return "unknown consistency";
      case 7:
        s->set_wire_encoding("fp8");
        return "unknown wire_encoding";
      case 8:
        s->set_keep_checkpoints(1001 + static_cast<int>(rng.Uniform(100000)));
        return "keep_checkpoints over 1000";
      case 9:
        s->mutable_model()->mutable_layers(0)->mutable_dense()->set_units(0);
        return "dense units 0";
      case 10:
        s->mutable_model()->clear_input_shape();
        return "no input_shape";
      default:
        s->mutable_optimizer()->set_kind(static_cast<v1::OptimizerKind>(77));
        return "unknown optimizer kind";
    }
  }
  if (name == "ListJobs") {
    static_cast<v1::ListJobsRequest*>(msg)->add_states(
        static_cast<v1::JobState>(6 + rng.Uniform(1000)));
    return "unknown job state";
  }
  if (name == "Register") {
    auto* r = static_cast<v1::RegisterRequest*>(msg);
    switch (rng.Uniform(6)) {
      case 0:
        r->set_role(v1::MEMBER_ROLE_UNSPECIFIED);
        return "role unspecified";
      case 1:
        r->set_role(static_cast<v1::MemberRole>(3 + rng.Uniform(100)));
        return "unknown role";
      case 2:
        r->set_role(v1::MEMBER_ROLE_SERVER);
        r->clear_address();
        return "shard without address";
      case 3:
        r->set_role(v1::MEMBER_ROLE_SERVER);
        r->set_address("127.0.0.1:1");
        r->set_shard_index(rng.OneIn(2) ? -1 : 2 + static_cast<int32_t>(rng.Uniform(1000)));
        return "shard_index out of range";
      case 4:
        r->set_role(v1::MEMBER_ROLE_SERVER);
        r->set_address("127.0.0.1:1");
        r->set_shard_index(static_cast<int32_t>(rng.Uniform(2)));
        return "shard_index already served";
      default:
        r->set_pid(-1 - static_cast<int64_t>(rng.Uniform(1000)));
        return "negative pid";
    }
  }
  if (name == "Heartbeat" || name == "Deregister" || name == "WatchTasks") {
    const pb::FieldDescriptor* f = msg->GetDescriptor()->FindFieldByName("member_id");
    if (rng.OneIn(2)) {
      msg->GetReflection()->SetString(msg, f, "");
      return "empty member_id";
    }
    msg->GetReflection()->SetString(msg, f, HostileId(rng, "hx-member"));
    return "unknown member";
  }
  if (name == "ReportProgress") {
    auto* r = static_cast<v1::ProgressReport*>(msg);
    switch (rng.Uniform(7)) {
      case 0:
        r->set_job_id("");
        return "empty job_id";
      case 1:
        r->set_member_id("");
        return "empty member_id";
      case 2:
        r->set_phase(static_cast<v1::TaskPhase>(rng.OneIn(2) ? 0 : 5 + rng.Uniform(100)));
        return "unknown phase";
      case 3:
        r->set_rank(-1 - static_cast<int32_t>(rng.Uniform(100)));
        return "negative rank";
      case 4:
        r->set_step(-1 - static_cast<int64_t>(rng.Uniform(100)));
        return "negative step";
      case 5:
        r->set_samples_per_second(rng.OneIn(2) ? std::nan("") : -1.0);
        return "NaN or negative samples_per_second";
      default:
        r->set_job_id(HostileId(rng, "hx-nojob"));
        return "unknown job";
    }
  }
  if (name == "Check") {
    msg->GetReflection()->SetString(msg, msg->GetDescriptor()->FindFieldByName("service"),
                                    HostileId(rng, "no.such.Service"));
    return "unknown service";
  }
  return "";
}

namespace {

// --- Random edits through reflection -------------------------------------------------------------

int64_t InterestingInt(Rng& rng) {
  const int64_t values[] = {0,
                            1,
                            -1,
                            2,
                            7,
                            255,
                            1000,
                            65536,
                            std::numeric_limits<int32_t>::max(),
                            std::numeric_limits<int32_t>::min(),
                            std::numeric_limits<int64_t>::max(),
                            std::numeric_limits<int64_t>::min(),
                            static_cast<int64_t>(std::numeric_limits<uint32_t>::max())};
  if (rng.OneIn(4)) return static_cast<int64_t>(rng.Next());
  return values[rng.Uniform(sizeof(values) / sizeof(values[0]))];
}

double InterestingDouble(Rng& rng) {
  const double values[] = {0.0,
                           -0.0,
                           1.0,
                           -1.0,
                           1e-3,
                           1e38,
                           -1e38,
                           1e300,
                           1e-45,
                           std::numeric_limits<double>::quiet_NaN(),
                           std::numeric_limits<double>::infinity(),
                           -std::numeric_limits<double>::infinity()};
  return values[rng.Uniform(sizeof(values) / sizeof(values[0]))];
}

std::string InterestingString(Rng& rng, const Targets& t) {
  switch (rng.Uniform(14)) {
    case 0:
      return "";
    case 1:
      return "hx-asp";
    case 2:
      return "hx-bsp";
    case 3:
      return t.valid_shard_job;
    case 4:
      return t.valid_job_id;
    case 5:
      return std::string(1 + rng.Uniform(70000), 'A');
    case 6:
      return "\xc3\xa9\xe2\x9c\x93\xf0\x9f\x94\xa5";  // valid UTF-8
    case 7:
      return "../../../../etc/passwd";
    case 8:
      return "%s%n%x\t\n\r";
    case 9:
      return t.dataset_dir + "/train-images-idx3-ubyte.gz";
    case 10:
      return "127.0.0.1:1";
    case 11:
      return rng.OneIn(2) ? "w" : (rng.OneIn(2) ? "emb" : "b");
    case 12:
      return std::string(1, static_cast<char>(rng.Uniform(32)));
    default: {
      std::string s(rng.Uniform(40), ' ');
      for (char& c : s) c = static_cast<char>(' ' + rng.Uniform(95));
      return s;
    }
  }
}

std::string InterestingBytes(Rng& rng) {
  const size_t sizes[] = {0,  1,  2,  3,   4,   5,   7,    8,     31,
                          32, 63, 64, 255, 256, 257, 4096, 65536, 1 << 20};
  const size_t n = sizes[rng.Uniform(sizeof(sizes) / sizeof(sizes[0]))];
  std::string s(n, '\0');
  if (rng.OneIn(2)) {
    for (char& c : s) c = static_cast<char>(rng.Uniform(256));
  } else {
    for (size_t i = 0; i + 4 <= n; i += 4) {
      const float f = static_cast<float>(rng.OneIn(8) ? InterestingDouble(rng)
                                                      : static_cast<double>(rng.Uniform(100)));
      std::memcpy(&s[i], &f, 4);
    }
  }
  return s;
}

void SetRandomScalar(pb::Message* m, const pb::FieldDescriptor* f, Rng& rng, const Targets& t) {
  const pb::Reflection* r = m->GetReflection();
  const bool rep = f->is_repeated();
  switch (f->cpp_type()) {
    case pb::FieldDescriptor::CPPTYPE_INT32: {
      const auto v = static_cast<int32_t>(InterestingInt(rng));
      rep ? r->AddInt32(m, f, v) : r->SetInt32(m, f, v);
      break;
    }
    case pb::FieldDescriptor::CPPTYPE_INT64: {
      const int64_t v = InterestingInt(rng);
      rep ? r->AddInt64(m, f, v) : r->SetInt64(m, f, v);
      break;
    }
    case pb::FieldDescriptor::CPPTYPE_UINT32: {
      const auto v = static_cast<uint32_t>(InterestingInt(rng));
      rep ? r->AddUInt32(m, f, v) : r->SetUInt32(m, f, v);
      break;
    }
    case pb::FieldDescriptor::CPPTYPE_UINT64: {
      const auto v = static_cast<uint64_t>(InterestingInt(rng));
      rep ? r->AddUInt64(m, f, v) : r->SetUInt64(m, f, v);
      break;
    }
    case pb::FieldDescriptor::CPPTYPE_FLOAT: {
      const auto v = static_cast<float>(InterestingDouble(rng));
      rep ? r->AddFloat(m, f, v) : r->SetFloat(m, f, v);
      break;
    }
    case pb::FieldDescriptor::CPPTYPE_DOUBLE: {
      const double v = InterestingDouble(rng);
      rep ? r->AddDouble(m, f, v) : r->SetDouble(m, f, v);
      break;
    }
    case pb::FieldDescriptor::CPPTYPE_BOOL: {
      const bool v = rng.OneIn(2);
      rep ? r->AddBool(m, f, v) : r->SetBool(m, f, v);
      break;
    }
    case pb::FieldDescriptor::CPPTYPE_ENUM: {
      // proto3 enums are open: unknown numbers parse and must be refused by validation.
      const int v = static_cast<int>(rng.Uniform(12)) - 2 +
                    (rng.OneIn(8) ? static_cast<int>(rng.Uniform(100000)) : 0);
      rep ? r->AddEnumValue(m, f, v) : r->SetEnumValue(m, f, v);
      break;
    }
    case pb::FieldDescriptor::CPPTYPE_STRING: {
      const std::string v = f->type() == pb::FieldDescriptor::TYPE_BYTES
                                ? InterestingBytes(rng)
                                : InterestingString(rng, t);
      rep ? r->AddString(m, f, v) : r->SetString(m, f, v);
      break;
    }
    case pb::FieldDescriptor::CPPTYPE_MESSAGE: {
      pb::Message* sub = rep ? r->AddMessage(m, f) : r->MutableMessage(m, f);
      MutateMessage(sub, rng, t, 1);
      break;
    }
  }
}

// The most bytes one giant repeated field adds (see MutateMessage).
constexpr size_t kGiantFieldBytes = 1u << 20;

// About the bytes element `i` of the repeated field `f` takes on the wire.
size_t RepeatedElementBytes(const pb::Message& m, const pb::FieldDescriptor* f, int i) {
  const pb::Reflection* r = m.GetReflection();
  if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_STRING) {
    std::string scratch;
    return r->GetRepeatedStringReference(m, f, i, &scratch).size() + 2;
  }
  if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) {
    return r->GetRepeatedMessage(m, f, i).ByteSizeLong() + 2;
  }
  return 10;
}

}  // namespace

// One random edit of `m` or of a message inside it.
void MutateMessage(pb::Message* m, Rng& rng, const Targets& t, int depth) {
  const pb::Descriptor* d = m->GetDescriptor();
  if (d->field_count() == 0 || depth > 6) return;
  const pb::Reflection* r = m->GetReflection();
  const pb::FieldDescriptor* f = d->field(static_cast<int>(rng.Uniform(d->field_count())));
  if (f->is_repeated()) {
    const int size = r->FieldSize(*m, f);
    switch (rng.Uniform(5)) {
      case 0:
        r->ClearField(m, f);
        return;
      case 1:
        if (size > 0 && f->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) {
          // Descend into an element (the common case for slices and layers).
          MutateMessage(r->MutableRepeatedMessage(m, f, static_cast<int>(rng.Uniform(size))), rng,
                        t, depth + 1);
          return;
        }
        [[fallthrough]];
      case 2:
        SetRandomScalar(m, f, rng, t);
        return;
      case 3:
        if (size > 0 && f->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) {
          // Duplicate an element (duplicate keys, layers, partitions).
          const int n = 1 + static_cast<int>(rng.Uniform(3));
          for (int i = 0; i < n; ++i) {
            r->AddMessage(m, f)->CopyFrom(r->GetRepeatedMessage(*m, f, 0));
          }
          return;
        }
        [[fallthrough]];
      default: {
        // A giant repeated field: up to 20,000 elements, as many as fit in kGiantFieldBytes.
        // Random requests over 2 MiB are replaced by a fresh template before they are sent
        // (SendOne), so elements past that would only cost the time to make them: 20,000 random
        // byte strings of up to 1 MiB each once took most of the run's CPU.
        const int n = rng.OneIn(4) ? 20000 : 1 + static_cast<int>(rng.Uniform(64));
        size_t added = 0;
        if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE && size > 0) {
          const size_t each = r->GetRepeatedMessage(*m, f, 0).ByteSizeLong() + 4;
          for (int i = 0; i < std::min(n, 2000) && added + each <= kGiantFieldBytes; ++i) {
            r->AddMessage(m, f)->CopyFrom(r->GetRepeatedMessage(*m, f, 0));
            added += each;
          }
        } else {
          for (int i = 0; i < n && added <= kGiantFieldBytes; ++i) {
            SetRandomScalar(m, f, rng, t);
            added += RepeatedElementBytes(*m, f, r->FieldSize(*m, f) - 1);
          }
        }
        return;
      }
    }
  }
  if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) {
    if (rng.OneIn(4)) {
      r->ClearField(m, f);
    } else {
      MutateMessage(r->MutableMessage(m, f), rng, t, depth + 1);
    }
    return;
  }
  if (rng.OneIn(8)) {
    r->ClearField(m, f);
  } else {
    SetRandomScalar(m, f, rng, t);
  }
}

namespace {

// --- Keeping control calls off the valid traffic -------------------------------------------------

bool IsControl(const std::string& name) {
  static const std::set<std::string> kControl = {
      "CreateJobState", "UpdateMembership", "DropJob",    "Checkpoint", "Restore",
      "CancelJob",      "CheckpointJob",    "Deregister", "Heartbeat",  "WatchTasks",
      "ReportProgress", "ReadCheckpoint",   "Fill"};
  return kControl.count(name) > 0;
}

}  // namespace

// Replaces the valid jobs and the real members in the request's top-level job_id and member_id
// (see the file comment). Pushes of random requests never name the valid job either: one could
// be valid and change its weights or its exactly-once table.
void Protect(int m, Rng& rng, const Targets& t, pb::Message* msg) {
  const std::string name = kMethods[m].name;
  const pb::Descriptor* d = msg->GetDescriptor();
  const pb::Reflection* r = msg->GetReflection();
  const pb::FieldDescriptor* job = d->FindFieldByName("job_id");
  const pb::FieldDescriptor* member = d->FindFieldByName("member_id");
  const bool data_plane = name == "PushPull" || name == "Push" || name == "Pull";
  if (job != nullptr && (IsControl(name) || data_plane)) {
    const std::string id = r->GetString(*msg, job);
    const bool hit = data_plane ? id == t.valid_shard_job : t.protected_jobs.count(id) > 0;
    if (hit) r->SetString(msg, job, data_plane ? "hx-asp" : HostileId(rng, "hx-prot"));
  }
  if (member != nullptr && IsControl(name) &&
      t.protected_members.count(r->GetString(*msg, member)) > 0) {
    r->SetString(msg, member, HostileId(rng, "hx-prot-member"));
  }
}

}  // namespace tessera::hostile
