#include "cli/job_format.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "google/protobuf/util/json_util.h"
#include "tessera/v1/job.pb.h"
#include "worker/trainer/progress.h"

namespace tessera::cli {
namespace {

// `tessera get` tells a running rank's time without a step from this long on.
constexpr absl::Duration kShowNoProgressAfter = absl::Seconds(10);

std::string ToJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string out;
  google::protobuf::util::Status status =
      google::protobuf::util::MessageToJsonString(message, &out, options);
  if (!status.ok()) {
    // Only invalid UTF-8 in a string field can fail; say so rather than print half a record.
    return absl::StrCat("{\"error\":\"cannot print as JSON: ",
                        absl::StrReplaceAll(std::string(status.message()), {{"\"", "'"}}), "\"}");
  }
  return out;
}

// Inserts `,extra` before the closing brace of a JSON object.
std::string WithExtra(std::string json, const std::string& extra) {
  if (!json.empty() && json.back() == '}') {
    json.pop_back();
    if (json.size() > 1) json += ",";
    json += extra;
    json += "}";
  }
  return json;
}

std::string JobExtras(const v1::Job& job) {
  return absl::StrCat("\"steps\":", job.step(), ",\"state_name\":\"", StateName(job.state()), "\"");
}

std::string Percent(const v1::Job& job) {
  if (job.total_steps() <= 0) return "-";
  return absl::StrFormat(
      "%.0f%%", 100.0 * static_cast<double>(job.step()) / static_cast<double>(job.total_steps()));
}

std::string Pad(const std::string& s, size_t width) {
  return s.size() >= width ? s + " " : s + std::string(width - s.size(), ' ');
}

double Seconds(int64_t from_ms, int64_t to_ms) {
  return static_cast<double>(to_ms - from_ms) / 1000.0;
}

}  // namespace

std::string StateName(v1::JobState state) {
  return std::string(absl::StripPrefix(v1::JobState_Name(state), "JOB_STATE_"));
}

std::string MemberStateName(v1::MemberState state) {
  return std::string(absl::StripPrefix(v1::MemberState_Name(state), "MEMBER_STATE_"));
}

std::string RoleName(v1::MemberRole role) {
  switch (role) {
    case v1::MEMBER_ROLE_SERVER:
      return "server";
    case v1::MEMBER_ROLE_WORKER:
      return "worker";
    default:
      return "?";
  }
}

std::string JobRecordJson(const v1::Job& job) { return WithExtra(ToJson(job), JobExtras(job)); }

std::string JobEventJson(const v1::JobEvent& event) {
  return absl::StrCat("{\"event\":", ToJson(event), "}");
}

std::string JobListJson(const std::vector<v1::Job>& jobs) {
  std::vector<std::string> items;
  for (const v1::Job& job : jobs) items.push_back(JobRecordJson(job));
  return absl::StrCat("{\"jobs\":[", absl::StrJoin(items, ","), "]}");
}

std::string MemberListJson(const std::vector<v1::Member>& members) {
  v1::ListMembersResponse response;
  for (const v1::Member& m : members) *response.add_members() = m;
  if (members.empty()) return "{\"members\":[]}";
  return ToJson(response);
}

std::string HumanBytes(uint64_t bytes) {
  if (bytes < 1024) return absl::StrCat(bytes, " bytes");
  const char* units[] = {"KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes) / 1024;
  size_t unit = 0;
  while (value >= 1024 && unit + 1 < sizeof(units) / sizeof(units[0])) {
    value /= 1024;
    ++unit;
  }
  return absl::StrFormat("%.1f %s", value, units[unit]);
}

std::string CheckpointLine(const v1::CheckpointRecord& record) {
  uint64_t bytes = 0;
  for (const v1::ShardCheckpoint& shard : record.shards()) bytes += shard.bytes();
  return absl::StrCat("checkpoint ", record.step(), " of ", record.job_id(), " committed (",
                      record.shards_size(), record.shards_size() == 1 ? " shard, " : " shards, ",
                      HumanBytes(bytes), ")");
}

std::string CheckpointJson(const v1::CheckpointRecord& record) {
  return absl::StrCat("{\"checkpoint\":", ToJson(record), "}");
}

std::string Ago(int64_t time_ms, absl::Time now) {
  if (time_ms <= 0) return "never";
  const double s = std::max(0.0, absl::ToDoubleSeconds(now - absl::FromUnixMillis(time_ms)));
  if (s < 60) return absl::StrFormat("%.0fs ago", std::floor(s));
  if (s < 3600) return absl::StrFormat("%.0fm ago", std::floor(s / 60));
  if (s < 86400) return absl::StrFormat("%.0fh ago", std::floor(s / 3600));
  return absl::StrFormat("%.0fd ago", std::floor(s / 86400));
}

std::string JobTable(const std::vector<v1::Job>& jobs, absl::Time now) {
  if (jobs.empty()) return "no jobs\n";
  std::string out = absl::StrCat(Pad("ID", 28), Pad("STATE", 11), Pad("PROGRESS", 18),
                                 Pad("TEST ACC", 10), "CREATED\n");
  for (const v1::Job& job : jobs) {
    const std::string progress =
        job.total_steps() > 0 ? absl::StrCat(job.step(), "/", job.total_steps(), " ", Percent(job))
                              : "-";
    const std::string accuracy =
        job.evaluated() ? absl::StrFormat("%.4f", job.test_accuracy()) : "-";
    absl::StrAppend(&out, Pad(job.id(), 28), Pad(StateName(job.state()), 11), Pad(progress, 18),
                    Pad(accuracy, 10), Ago(job.create_time_ms(), now), "\n");
  }
  return out;
}

std::string JobDetails(const v1::Job& job, absl::Time now) {
  std::string out;
  absl::StrAppend(&out, "job:        ", job.id(), "\n");
  absl::StrAppend(&out, "state:      ", StateName(job.state()), "\n");
  if (!job.reason().empty()) absl::StrAppend(&out, "reason:     ", job.reason(), "\n");
  const v1::JobSpec& spec = job.spec();
  std::string mode = spec.consistency().empty() ? "bsp" : spec.consistency();
  if (absl::EqualsIgnoreCase(mode, "ssp") || absl::EqualsIgnoreCase(mode, "hybrid")) {
    absl::StrAppend(&mode, "(", spec.staleness(), ")");
  }
  absl::StrAppend(&out, "spec:       ", spec.name(), ", ", spec.num_workers(), " workers, ", mode,
                  ", batch ", spec.batch_size(), ", ",
                  spec.epochs() > 0 ? absl::StrCat(spec.epochs(), " epochs")
                                    : absl::StrCat(spec.max_steps(), " steps"),
                  "\n");
  absl::StrAppend(&out, "created:    ", Ago(job.create_time_ms(), now), "\n");
  if (job.start_time_ms() > 0) {
    const int64_t end = job.end_time_ms() > 0 ? job.end_time_ms() : absl::ToUnixMillis(now);
    absl::StrAppend(&out, "started:    ", Ago(job.start_time_ms(), now), ", ran ",
                    trainer::FormatDuration(Seconds(job.start_time_ms(), end)), "\n");
  }
  if (job.total_steps() > 0) {
    absl::StrAppend(&out, "progress:   step ", job.step(), "/", job.total_steps(), " (",
                    Percent(job), "), epoch ", job.epoch(), ", ", job.epochs(), " epochs done\n");
    absl::StrAppend(&out, "training:   loss ", absl::StrFormat("%.4f", job.loss()), ", accuracy ",
                    absl::StrFormat("%.4f", job.train_accuracy()), ", ",
                    absl::StrFormat("%.0f", job.samples_per_second()), " samples/s");
    if (job.state() == v1::JOB_STATE_RUNNING && job.eta_seconds() > 0) {
      absl::StrAppend(&out, ", ETA ", trainer::FormatDuration(job.eta_seconds()));
    }
    absl::StrAppend(&out, "\n");
  }
  if (job.evaluated()) {
    absl::StrAppend(&out, "test:       accuracy ", absl::StrFormat("%.4f", job.test_accuracy()),
                    ", loss ", absl::StrFormat("%.4f", job.test_loss()),
                    job.has_test_auc() ? absl::StrFormat(", AUC %.4f", job.test_auc()) : "", "\n");
  }
  if (job.has_step_times()) {
    const v1::StepTimes& t = job.step_times();
    absl::StrAppend(&out, absl::StrFormat("step time:  compute %.2f ms, exchange %.2f ms, install "
                                          "%.2f ms, data %.2f ms (rank 0)\n",
                                          t.compute() * 1e3, t.exchange() * 1e3, t.install() * 1e3,
                                          t.data() * 1e3));
    if (t.round_trip() > 0) {
      absl::StrAppend(&out,
                      absl::StrFormat("            last request of a step: %.2f ms round trip, "
                                      "%.2f ms of it at the shards' gate\n",
                                      t.round_trip() * 1e3, t.gate_wait() * 1e3));
    }
  }
  if (!job.recovery().empty()) absl::StrAppend(&out, "recovery:   ", job.recovery(), "\n");
  if (!job.stall().empty()) absl::StrAppend(&out, "stall:      ", job.stall(), "\n");
  if (job.last_checkpoint_step() > 0 || job.recoveries() > 0) {
    absl::StrAppend(&out, "checkpoint: ",
                    job.last_checkpoint_step() > 0
                        ? absl::StrCat("last committed at step ", job.last_checkpoint_step())
                        : std::string("none committed"),
                    "; ", job.recoveries(), job.recoveries() == 1 ? " recovery" : " recoveries",
                    " so far\n");
  }
  if (!job.shard_addresses().empty()) {
    // A replicated job's down shards are marked: their copies serve their partitions.
    std::vector<std::string> shards(job.shard_addresses().begin(), job.shard_addresses().end());
    for (int index : job.down_shards()) {
      if (index >= 0 && index < static_cast<int>(shards.size())) shards[index] += " (DOWN)";
    }
    absl::StrAppend(&out, "shards:     ", absl::StrJoin(shards, " "));
    if (job.spec().replication() >= 2) absl::StrAppend(&out, "; 2 copies of every partition");
    absl::StrAppend(&out, "\n");
  }
  for (const v1::JobWorker& w : job.workers()) {
    // A lost rank counts as done: say which it was.
    std::string standing = w.lost()   ? ", LOST (out of the job until a worker takes the rank)"
                           : w.done() ? ", done"
                                      : "";
    if (job.state() == v1::JOB_STATE_RUNNING && !w.lost() && !w.done()) {
      // The stall inspector's view of the rank, and its progress lease once it is worth telling.
      if (w.stalled_seconds() > 0) {
        absl::StrAppend(&standing, absl::StrFormat(", STALLED: the step has waited %.0f s for it",
                                                   w.stalled_seconds()));
      }
      const absl::Duration idle = now - absl::FromUnixMillis(w.progress_ms());
      if (w.progress_ms() > 0 && idle >= kShowNoProgressAfter) {
        absl::StrAppend(&standing, absl::StrFormat(", no step progress for %.0f s",
                                                   absl::ToDoubleSeconds(idle)));
      }
    }
    absl::StrAppend(&out, "worker ", w.rank(), ":   ", w.member_id(),
                    w.hostname().empty() ? "" : absl::StrCat(" on ", w.hostname()), ", step ",
                    w.step(), absl::StrFormat(", %.0f samples/s", w.samples_per_second()), standing,
                    "\n");
  }
  return out;
}

std::string MemberTable(const std::vector<v1::Member>& members, absl::Time now) {
  if (members.empty()) return "no members\n";
  std::string out = absl::StrCat(Pad("ID", 8), Pad("ROLE", 8), Pad("STATE", 7), Pad("ADDRESS", 22),
                                 Pad("HOST", 16), Pad("DEVICE", 8), Pad("JOB", 24), "LAST SEEN\n");
  for (const v1::Member& m : members) {
    std::string address = m.address();
    if (m.role() == v1::MEMBER_ROLE_SERVER) absl::StrAppend(&address, " #", m.shard_index());
    std::string job = m.job_id();
    if (!job.empty()) absl::StrAppend(&job, " rank ", m.rank());
    absl::StrAppend(&out, Pad(m.id(), 8), Pad(RoleName(m.role()), 8),
                    Pad(MemberStateName(m.state()), 7), Pad(address.empty() ? "-" : address, 22),
                    Pad(m.hostname().empty() ? "-" : m.hostname(), 16),
                    Pad(m.device().empty() ? "-" : m.device(), 8), Pad(job.empty() ? "-" : job, 24),
                    Ago(m.last_seen_ms(), now), "\n");
  }
  return out;
}

std::string JobResultLine(const v1::Job& job) {
  std::string out = absl::StrCat("job ", job.id(), " ", StateName(job.state()));
  std::vector<std::string> parts;
  if (job.step() > 0) parts.push_back(absl::StrCat(job.step(), " steps"));
  if (job.epochs() > 0) parts.push_back(absl::StrCat(job.epochs(), " epochs"));
  if (job.evaluated()) {
    parts.push_back(absl::StrFormat("test accuracy %.4f", job.test_accuracy()));
    parts.push_back(absl::StrFormat("test loss %.4f", job.test_loss()));
    if (job.has_test_auc()) parts.push_back(absl::StrFormat("test AUC %.4f", job.test_auc()));
  }
  if (job.samples_per_second() > 0) {
    parts.push_back(absl::StrFormat("%.0f samples/s", job.samples_per_second()));
  }
  if (job.start_time_ms() > 0 && job.end_time_ms() >= job.start_time_ms()) {
    parts.push_back(trainer::FormatDuration(Seconds(job.start_time_ms(), job.end_time_ms())));
  }
  if (!parts.empty()) absl::StrAppend(&out, ": ", absl::StrJoin(parts, ", "));
  if (!job.reason().empty() && job.state() != v1::JOB_STATE_SUCCEEDED) {
    absl::StrAppend(&out, " (", job.reason(), ")");
  }
  return out;
}

bool ShownAsLine(v1::JobEventKind kind) {
  switch (kind) {
    case v1::JOB_EVENT_KIND_CHECKPOINT:
    case v1::JOB_EVENT_KIND_RECOVERY:
    case v1::JOB_EVENT_KIND_MEMBERSHIP:
    case v1::JOB_EVENT_KIND_MODEL:
    case v1::JOB_EVENT_KIND_STALL:
      return true;
    default:  // state changes and evaluations once each; progress as the bar or the tenths
      return false;
  }
}

void JobProgressPrinter::Line(const std::string& text) {
  if (bar_on_screen_) {
    std::fputs("\r\x1b[K", out_);
    bar_on_screen_ = false;
  }
  std::fprintf(out_, "%s\n", text.c_str());
  std::fflush(out_);
}

void JobProgressPrinter::DrawBar(const v1::Job& job) {
  constexpr int kWidth = 30;
  const double fraction =
      job.total_steps() > 0
          ? std::min(1.0, static_cast<double>(job.step()) / static_cast<double>(job.total_steps()))
          : 0.0;
  const int filled = static_cast<int>(fraction * kWidth);
  std::string bar = std::string(filled, '=');
  if (filled < kWidth) bar += '>' + std::string(kWidth - filled - 1, ' ');
  std::string text = absl::StrFormat("\r[%s] %3.0f%% step %d/%d epoch %d loss %.4f %.0f samples/s",
                                     bar, fraction * 100, job.step(), job.total_steps(),
                                     job.epoch(), job.loss(), job.samples_per_second());
  if (job.eta_seconds() > 0)
    absl::StrAppend(&text, " ETA ", trainer::FormatDuration(job.eta_seconds()));
  std::fputs(text.c_str(), out_);
  std::fputs("\x1b[K", out_);
  std::fflush(out_);
  bar_on_screen_ = true;
}

void JobProgressPrinter::Update(const v1::WatchJobResponse& update) {
  const v1::Job& job = update.job();
  if (!update.has_event()) {
    // The stream's first message: the record as it stands (again after a reconnect).
    if (!seen_record_ || job.state() != last_state_) {
      std::string text = absl::StrCat("job ", job.id(), ": ", StateName(job.state()));
      if (!job.reason().empty()) absl::StrAppend(&text, " (", job.reason(), ")");
      if (job.total_steps() > 0) {
        absl::StrAppend(&text, ", step ", job.step(), "/", job.total_steps());
      }
      Line(text);
    }
    seen_record_ = true;
    last_state_ = job.state();
    return;
  }
  const v1::JobEvent& event = update.event();
  const bool state_changed = event.state() != last_state_;
  last_state_ = event.state();
  // Events carry the latest evaluation once there is one: show each evaluation once.
  const bool new_evaluation =
      event.evaluated() && (!shown_evaluation_ || event.test_accuracy() != shown_accuracy_ ||
                            event.test_loss() != shown_loss_);
  if (new_evaluation) {
    shown_evaluation_ = true;
    shown_accuracy_ = event.test_accuracy();
    shown_loss_ = event.test_loss();
  }
  if (state_changed || new_evaluation || ShownAsLine(event.kind())) {
    std::string text = event.message();
    if (text.empty()) {
      text = new_evaluation
                 ? absl::StrFormat("epoch %d: test accuracy %.4f, test loss %.4f", event.epoch(),
                                   event.test_accuracy(), event.test_loss())
                 : StateName(event.state());
    }
    Line(absl::StrCat(StateName(event.state()), ": ", text));
  }
  if (event.state() != v1::JOB_STATE_RUNNING || job.total_steps() <= 0) return;
  if (terminal_) {
    const absl::Time now = absl::Now();
    if (now - last_draw_ < absl::Milliseconds(100) && job.step() < job.total_steps()) return;
    last_draw_ = now;
    DrawBar(job);
    return;
  }
  const int tenth = static_cast<int>(10 * job.step() / job.total_steps());
  if (tenth <= last_tenth_) return;
  last_tenth_ = tenth;
  std::string text =
      absl::StrFormat("step %d/%d (%s) epoch %d: loss %.4f, train accuracy %.4f, %.0f samples/s",
                      job.step(), job.total_steps(), Percent(job), job.epoch(), job.loss(),
                      job.train_accuracy(), job.samples_per_second());
  if (job.eta_seconds() > 0) {
    absl::StrAppend(&text, ", ETA ", trainer::FormatDuration(job.eta_seconds()));
  }
  Line(text);
}

void JobProgressPrinter::Finish() {
  if (bar_on_screen_) {
    std::fputs("\n", out_);
    std::fflush(out_);
    bar_on_screen_ = false;
  }
}

}  // namespace tessera::cli
