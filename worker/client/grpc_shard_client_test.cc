#include "worker/client/grpc_shard_client.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <future>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "tessera/v1/parameter.grpc.pb.h"
#include "worker/client/parameter_client.h"

namespace tessera {
namespace client {
namespace {

// A scripted shard on loopback. The first stream breaks (UNAVAILABLE) after reading one request
// when break_first_stream is set; seq `held_seq` is answered only after the next request; seq
// `never_seq` is never answered. While `hold_reads` is set and not yet notified, the first stream
// reads nothing (a stalled shard: the client's writes back up). Answers echo the pushed data as
// weights.
class ScriptedService final : public v1::ParameterService::Service {
 public:
  bool break_first_stream = false;
  uint64_t held_seq = 0;
  uint64_t never_seq = 0;
  absl::Notification* hold_reads = nullptr;

  grpc::Status PushPull(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<v1::PushPullResponse, v1::PushPullRequest>* stream) override {
    int index;
    {
      absl::MutexLock lock(&mu_);
      index = streams_++;
    }
    if (index == 0 && hold_reads != nullptr) {
      hold_reads->WaitForNotificationWithTimeout(absl::Seconds(20));
    }
    v1::PushPullRequest request;
    std::vector<v1::PushPullResponse> held;
    while (stream->Read(&request)) {
      {
        absl::MutexLock lock(&mu_);
        seen_.emplace_back(index, request.seq());
        last_request_ = request;
      }
      if (index == 0 && break_first_stream) {
        return grpc::Status(grpc::StatusCode::UNAVAILABLE, "scripted break");
      }
      if (request.seq() == never_seq) continue;
      v1::PushPullResponse response;
      response.set_seq(request.seq());
      for (const v1::Slice& s : request.push()) {
        v1::Slice* w = response.add_weights();
        *w->mutable_key() = s.key();
        w->set_data(s.data());
        w->set_version(static_cast<int64_t>(request.seq()));
      }
      if (request.seq() == held_seq) {
        held.push_back(std::move(response));
        continue;
      }
      stream->Write(response);
      for (auto& h : held) stream->Write(h);
      held.clear();
    }
    return grpc::Status::OK;
  }

  grpc::Status CreateJobState(grpc::ServerContext*, const v1::CreateJobStateRequest* request,
                              v1::CreateJobStateResponse* response) override {
    if (request->job_id().empty()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "job_id is empty");
    }
    response->set_partitions(static_cast<uint32_t>(request->partitions_size()));
    return grpc::Status::OK;
  }

  grpc::Status Pull(grpc::ServerContext*, const v1::PullRequest* request,
                    grpc::ServerWriter<v1::PullResponse>* writer) override {
    for (const v1::Slice& k : request->keys()) {
      v1::PullResponse r;
      *r.add_weights()->mutable_key() = k.key();
      writer->Write(r);
    }
    return grpc::Status::OK;
  }

  std::vector<std::pair<int, uint64_t>> seen() {
    absl::MutexLock lock(&mu_);
    return seen_;
  }
  v1::PushPullRequest last_request() {
    absl::MutexLock lock(&mu_);
    return last_request_;
  }

 private:
  absl::Mutex mu_;
  int streams_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::pair<int, uint64_t>> seen_ ABSL_GUARDED_BY(mu_);
  v1::PushPullRequest last_request_ ABSL_GUARDED_BY(mu_);
};

class GrpcShardClientTest : public ::testing::Test {
 protected:
  void Start(int streams = 1, bool zero_copy_push = true, ClientCredentials credentials = {}) {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port, 0);
    GrpcShardClient::Options o;
    o.address = absl::StrCat("127.0.0.1:", port);
    o.streams = streams;
    o.zero_copy_push = zero_copy_push;
    o.credentials = std::move(credentials);
    auto c = GrpcShardClient::Create(o);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = *std::move(c);
  }
  void TearDown() override {
    client_.reset();
    if (server_) server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  }

  static std::shared_ptr<const v1::PushPullRequest> Request(uint64_t seq, const std::string& data) {
    auto r = std::make_shared<v1::PushPullRequest>();
    r->set_job_id("job");
    r->set_seq(seq);
    v1::Slice* s = r->add_push();
    s->mutable_key()->set_tensor("w");
    s->set_data(data);
    return r;
  }

  // Sends and waits for the callback.
  absl::StatusOr<v1::PushPullResponse> Call(std::shared_ptr<const v1::PushPullRequest> r,
                                            absl::Duration timeout = absl::Seconds(10)) {
    absl::Notification done;
    absl::StatusOr<v1::PushPullResponse> result;
    client_->PushPull({std::move(r)}, absl::Now() + timeout,
                      [&](absl::StatusOr<v1::PushPullResponse> response) {
                        result = std::move(response);
                        done.Notify();
                      });
    done.WaitForNotification();
    return result;
  }

  ScriptedService service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<GrpcShardClient> client_;
};

TEST_F(GrpcShardClientTest, MatchesOutOfOrderResponsesBySeq) {
  service_.held_seq = 1;
  Start();
  absl::Notification first_done;
  absl::StatusOr<v1::PushPullResponse> first;
  client_->PushPull({Request(1, "one")}, absl::Now() + absl::Seconds(10),
                    [&](absl::StatusOr<v1::PushPullResponse> r) {
                      first = std::move(r);
                      first_done.Notify();
                    });
  auto second = Call(Request(2, "two"));
  first_done.WaitForNotification();
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(first->seq(), 1u);
  EXPECT_EQ(first->weights(0).data(), "one");
  EXPECT_EQ(second->seq(), 2u);
  EXPECT_EQ(second->weights(0).data(), "two");
}

// Large weights (over the in-place threshold) go straight into a matching target's buffer: the
// response slice keeps its key and version but no bytes.
TEST_F(GrpcShardClientTest, DecodesLargeWeightsIntoMatchingTarget) {
  Start();
  std::vector<float> values(20000);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.5f * static_cast<float>(i) - 7.0f;
  const std::string bytes(reinterpret_cast<const char*>(values.data()),
                          values.size() * sizeof(float));
  std::vector<float> out(values.size(), -1.0f);
  bool written = false;
  ShardClient::WeightsTarget target;
  target.tensor = "w";
  target.index = 0;
  target.out = out.data();
  target.count = out.size();
  target.written = &written;
  absl::Notification done;
  absl::StatusOr<v1::PushPullResponse> result;
  client_->PushPull({Request(3, bytes), {}, target}, absl::Now() + absl::Seconds(10),
                    [&](absl::StatusOr<v1::PushPullResponse> r) {
                      result = std::move(r);
                      done.Notify();
                    });
  done.WaitForNotification();
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_TRUE(written);
  EXPECT_EQ(result->seq(), 3u);
  ASSERT_EQ(result->weights_size(), 1);
  EXPECT_EQ(result->weights(0).key().tensor(), "w");
  EXPECT_EQ(result->weights(0).version(), 3);
  EXPECT_TRUE(result->weights(0).data().empty());
  EXPECT_EQ(out, values);
}

// Without a target, or with one that does not match (wrong size or key), large weights come back
// as the slice's bytes and the target's buffer is left alone.
TEST_F(GrpcShardClientTest, KeepsLargeWeightsInResponseWithoutMatchingTarget) {
  Start();
  std::string bytes(100000, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 7 + 1);
  auto plain = Call(Request(4, bytes));
  ASSERT_TRUE(plain.ok()) << plain.status();
  ASSERT_EQ(plain->weights_size(), 1);
  EXPECT_EQ(plain->weights(0).data(), bytes);

  for (int mismatch = 0; mismatch < 2; ++mismatch) {
    std::vector<float> out(bytes.size() / sizeof(float) + (mismatch == 0 ? 1 : 0), -1.0f);
    bool written = false;
    ShardClient::WeightsTarget target;
    target.tensor = mismatch == 1 ? "other" : "w";
    target.out = out.data();
    target.count = out.size();
    target.written = &written;
    absl::Notification done;
    absl::StatusOr<v1::PushPullResponse> result;
    client_->PushPull({Request(5 + mismatch, bytes), {}, target}, absl::Now() + absl::Seconds(10),
                      [&](absl::StatusOr<v1::PushPullResponse> r) {
                        result = std::move(r);
                        done.Notify();
                      });
    done.WaitForNotification();
    ASSERT_TRUE(result.ok()) << result.status();
    EXPECT_FALSE(written) << mismatch;
    ASSERT_EQ(result->weights_size(), 1);
    EXPECT_EQ(result->weights(0).data(), bytes) << mismatch;
    EXPECT_EQ(out[0], -1.0f) << mismatch;
  }
}

// A broken stream fails the request on it with UNAVAILABLE (the transport resends nothing); the
// caller's resend of the same request (same seq) goes out on a new stream, which keeps serving.
// ParameterClientOverABrokenStreamTest below is the same scenario with ParameterClient's retries.
TEST_F(GrpcShardClientTest, BrokenStreamIsReopenedAndTheRequestResentWithTheSameSeq) {
  service_.break_first_stream = true;
  Start();
  auto broken = Call(Request(7, "seven"));
  ASSERT_FALSE(broken.ok());
  EXPECT_EQ(broken.status().code(), absl::StatusCode::kUnavailable) << broken.status();
  EXPECT_NE(broken.status().message().find(client_->address()), absl::string_view::npos);
  auto r = Call(Request(7, "seven"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->seq(), 7u);
  EXPECT_EQ(r->weights(0).data(), "seven");
  EXPECT_EQ(service_.seen(), (std::vector<std::pair<int, uint64_t>>{{0, 7}, {1, 7}}));
  // The new stream keeps serving.
  auto again = Call(Request(8, "eight"));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->weights(0).data(), "eight");
}

// A stream that breaks once under a request in flight does not fail the caller's call with the
// default RetryPolicy: ParameterClient, the one retry layer, sends the same seq again on a new
// stream, and the weights still land in place.
TEST_F(GrpcShardClientTest, ParameterClientOverABrokenStreamRetriesTheSameSeq) {
  service_.break_first_stream = true;
  Start();
  ParameterClient::Options o;
  o.shard_addresses = {client_->address()};
  o.job_id = "job";
  std::vector<std::unique_ptr<ShardClient>> shards;
  shards.push_back(std::move(client_));
  auto pc = ParameterClient::CreateWithShards(o, std::move(shards));
  ASSERT_TRUE(pc.ok()) << pc.status();
  constexpr int64_t kValues = 5000;  // 20000 bytes: lent, and decoded in place
  ASSERT_TRUE((*pc)->AttachJob({{"w", {kValues}, {}}}, {}).ok());
  std::vector<float> grad(kValues);
  for (int64_t i = 0; i < kValues; ++i) grad[i] = 0.5f * static_cast<float>(i) - 3.0f;
  std::vector<float> weights(kValues, 0.0f);
  auto r = (*pc)->PushPull("w", 0, grad, absl::MakeSpan(weights)).get();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->requests, 1u);
  EXPECT_EQ(r->retries, 1u);
  EXPECT_EQ(r->min_version, 1);  // the scripted shard answers version = seq
  EXPECT_EQ(weights, grad);      // it echoes the pushed data as weights
  EXPECT_EQ(service_.seen(), (std::vector<std::pair<int, uint64_t>>{{0, 1}, {1, 1}}));
  // The new stream keeps serving.
  auto again = (*pc)->PushPull("w", 1, grad, absl::MakeSpan(weights)).get();
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->retries, 0u);
}

class GrpcShardClientWireTest : public GrpcShardClientTest,
                                public ::testing::WithParamInterface<bool> {};

// Large push values travel as their own slices (zero-copy) or inside one serialised message; the
// shard must parse the very same request either way.
TEST_P(GrpcShardClientWireTest, LargeAndSmallPushSlicesArriveIntact) {
  Start(/*streams=*/1, /*zero_copy_push=*/GetParam());
  auto r = std::make_shared<v1::PushPullRequest>();
  r->set_job_id("job");
  r->set_worker_id(3);
  r->set_step(17);
  r->set_seq(5);
  r->set_pull_encoding(v1::ENCODING_BF16);
  std::vector<std::string> values;
  for (size_t size : {size_t{100}, size_t{300} << 10, size_t{0}, size_t{16} << 10}) {
    std::string v(size, '\0');
    for (size_t i = 0; i < size; ++i) v[i] = static_cast<char>((i * 131 + size) & 0xff);
    v1::Slice* s = r->add_push();
    s->mutable_key()->set_tensor(absl::StrCat("t", size));
    s->mutable_key()->set_index(static_cast<uint32_t>(size % 7));
    s->set_encoding(v1::ENCODING_FP32);
    s->add_row_ids(-1);
    s->add_row_ids(static_cast<int64_t>(size));
    s->set_want_weights(true);
    s->set_data(v);
    values.push_back(v);
  }
  r->add_pull()->mutable_key()->set_tensor("pulled");
  auto response = Call(r);
  ASSERT_TRUE(response.ok()) << response.status();
  ASSERT_EQ(response->weights_size(), 4);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(response->weights(i).key().tensor(), r->push(i).key().tensor());
    EXPECT_EQ(response->weights(i).key().index(), r->push(i).key().index());
    EXPECT_TRUE(response->weights(i).data() == values[i]) << "slice " << i;
  }
  const v1::PushPullRequest& seen = service_.last_request();
  EXPECT_EQ(seen.SerializeAsString().size(), r->SerializeAsString().size());
  EXPECT_EQ(seen.worker_id(), 3u);
  EXPECT_EQ(seen.step(), 17);
  EXPECT_EQ(seen.pull_encoding(), v1::ENCODING_BF16);
  ASSERT_EQ(seen.pull_size(), 1);
  ASSERT_EQ(seen.push_size(), 4);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(seen.push(i).row_ids_size(), 2);
    EXPECT_TRUE(seen.push(i).want_weights());
    EXPECT_EQ(seen.push(i).encoding(), v1::ENCODING_FP32);
  }
}

// Push data lent from the caller's memory arrives as if it were in the request, next to data that
// is in it; the callback runs with nothing left pointing into the lent memory.
TEST_P(GrpcShardClientWireTest, BorrowedPushDataArrivesIntact) {
  Start(/*streams=*/1, /*zero_copy_push=*/GetParam());
  std::vector<float> big(300000);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>(i) * 0.25f - 3.0f;
  const std::string small = "small bytes in the request";
  std::vector<float> tiny = {1.5f, -2.5f};  // lent, under the own-slice threshold
  auto r = std::make_shared<v1::PushPullRequest>();
  r->set_job_id("job");
  r->set_seq(9);
  for (const char* name : {"big", "small", "tiny"}) {
    v1::Slice* s = r->add_push();
    s->mutable_key()->set_tensor(name);
    s->set_encoding(v1::ENCODING_FP32);
  }
  r->mutable_push(1)->set_data(small);
  const absl::string_view big_bytes(reinterpret_cast<const char*>(big.data()),
                                    big.size() * sizeof(float));
  const absl::string_view tiny_bytes(reinterpret_cast<const char*>(tiny.data()),
                                     tiny.size() * sizeof(float));
  absl::Notification done;
  absl::StatusOr<v1::PushPullResponse> result;
  int64_t references_at_callback = -1;
  client_->PushPull({r, {big_bytes, absl::string_view(), tiny_bytes}},
                    absl::Now() + absl::Seconds(10),
                    [&](absl::StatusOr<v1::PushPullResponse> response) {
                      references_at_callback = client_->borrowed_references();
                      result = std::move(response);
                      done.Notify();
                    });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(references_at_callback, 0);
  ASSERT_EQ(result->weights_size(), 3);
  EXPECT_TRUE(result->weights(0).data() == big_bytes);
  EXPECT_EQ(result->weights(1).data(), small);
  EXPECT_TRUE(result->weights(2).data() == tiny_bytes);
  const v1::PushPullRequest seen = service_.last_request();
  ASSERT_EQ(seen.push_size(), 3);
  EXPECT_EQ(seen.push(0).key().tensor(), "big");
  EXPECT_EQ(seen.push(0).encoding(), v1::ENCODING_FP32);
  EXPECT_EQ(seen.push(2).key().tensor(), "tiny");
}

INSTANTIATE_TEST_SUITE_P(Serialisation, GrpcShardClientWireTest, ::testing::Bool(),
                         [](const auto& info) {
                           return info.param ? std::string("ZeroCopy") : std::string("Copy");
                         });

TEST_F(GrpcShardClientTest, SpreadsRequestsOverStreamsBySeq) {
  Start(/*streams=*/3);
  for (uint64_t seq = 1; seq <= 6; ++seq) {
    auto r = Call(Request(seq, absl::StrCat("v", seq)));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->weights(0).data(), absl::StrCat("v", seq));
  }
  // seq % 3 picks the stream: 1 and 4, 2 and 5, 3 and 6 share one each.
  std::map<uint64_t, int> stream_of;
  for (const auto& [stream, seq] : service_.seen()) stream_of[seq] = stream;
  ASSERT_EQ(stream_of.size(), 6u);
  EXPECT_EQ(stream_of[1], stream_of[4]);
  EXPECT_EQ(stream_of[2], stream_of[5]);
  EXPECT_EQ(stream_of[3], stream_of[6]);
  EXPECT_NE(stream_of[1], stream_of[2]);
  EXPECT_NE(stream_of[2], stream_of[3]);
  EXPECT_NE(stream_of[1], stream_of[3]);
  GrpcShardClient::Options bad;
  bad.address = "127.0.0.1:1";
  bad.streams = 0;
  EXPECT_EQ(GrpcShardClient::Create(bad).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(GrpcShardClientTest, UnansweredRequestFailsAtItsDeadlineWithTheAddress) {
  service_.never_seq = 3;
  Start();
  auto r = Call(Request(3, "x"), absl::Milliseconds(200));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(r.status().message().find(client_->address()), absl::string_view::npos) << r.status();
  // The stream is still usable after a deadline.
  auto next = Call(Request(4, "y"));
  ASSERT_TRUE(next.ok()) << next.status();
}

// Sends seq with `values` lent as its one push slice's data; the outcome records the status and
// borrowed_references() when the callback ran.
struct LentOutcome {
  absl::Notification done;
  absl::Status status;
  int64_t references = -1;
};
void SendLent(GrpcShardClient* client, uint64_t seq, const std::vector<float>& values,
              LentOutcome* out, absl::Duration timeout = absl::Seconds(60)) {
  auto r = std::make_shared<v1::PushPullRequest>();
  r->set_job_id("job");
  r->set_seq(seq);
  r->add_push()->mutable_key()->set_tensor("w");
  const absl::string_view lent(reinterpret_cast<const char*>(values.data()),
                               values.size() * sizeof(float));
  client->PushPull({r, {lent}}, absl::Now() + timeout,
                   [out, client](absl::StatusOr<v1::PushPullResponse> response) {
                     out->references = client->borrowed_references();
                     out->status = response.status();
                     out->done.Notify();
                   });
}

// A request whose lent bytes are stuck behind a shard that reads nothing: at its deadline the
// client ends the stalled stream so that gRPC lets go of the bytes, and the callback (after which
// the caller may free them) runs only then. The client then works on a new stream.
TEST_F(GrpcShardClientTest, DeadlineOnAStalledStreamRunsTheCallbackAfterTheLentBytesAreReleased) {
  absl::Notification hold;
  service_.hold_reads = &hold;
  Start();
  // Far over any flow-control window, so most of it cannot leave the client.
  std::vector<float> big(8 << 20, 1.0f);
  LentOutcome expired;
  SendLent(client_.get(), 11, big, &expired, absl::Milliseconds(300));
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_GT(client_->borrowed_references(), 0);
  // The shard holds its reads for 20 s: the callback must come well before that.
  ASSERT_TRUE(expired.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(expired.references, 0);
  EXPECT_EQ(expired.status.code(), absl::StatusCode::kDeadlineExceeded) << expired.status;
  // The caller may now reuse the memory; nothing reads it any more.
  std::fill(big.begin(), big.end(), -1.0f);
  hold.Notify();
  auto next = Call(Request(12, "after"));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->weights(0).data(), "after");
}

// An urgent request takes a stream of its own: it is answered while a bulk request's bytes are
// stuck on the stream the shard does not read, where a second bulk request waits too.
TEST_F(GrpcShardClientTest, UrgentRequestIsNotQueuedBehindABulkOneOnAStalledStream) {
  absl::Notification hold;
  service_.hold_reads = &hold;
  Start();
  // Over any flow-control window, under the scripted server's 4 MiB receive limit.
  std::vector<float> big(3 << 18, 1.0f);
  LentOutcome bulk;
  SendLent(client_.get(), 31, big, &bulk, absl::Seconds(30));
  absl::SleepFor(absl::Milliseconds(100));

  absl::Notification second_done;
  client_->PushPull({Request(32, "second")}, absl::Now() + absl::Seconds(30),
                    [&](absl::StatusOr<v1::PushPullResponse>) { second_done.Notify(); });
  ShardClient::PushPullCall urgent(Request(33, "urgent"));
  urgent.urgent = true;
  absl::Notification urgent_done;
  absl::StatusOr<v1::PushPullResponse> answer;
  client_->PushPull(std::move(urgent), absl::Now() + absl::Seconds(10),
                    [&](absl::StatusOr<v1::PushPullResponse> r) {
                      answer = std::move(r);
                      urgent_done.Notify();
                    });
  ASSERT_TRUE(urgent_done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(answer.ok()) << answer.status();
  EXPECT_EQ(answer->weights(0).data(), "urgent");
  EXPECT_FALSE(bulk.done.HasBeenNotified()) << "the bulk stream is still stalled";
  EXPECT_FALSE(second_done.HasBeenNotified()) << "a bulk request queues behind the stuck one";

  hold.Notify();
  ASSERT_TRUE(bulk.done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  EXPECT_TRUE(bulk.status.ok()) << bulk.status;
  ASSERT_TRUE(second_done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  std::map<uint64_t, int> stream_of;
  for (const auto& [stream, seq] : service_.seen()) stream_of[seq] = stream;
  EXPECT_EQ(stream_of[31], stream_of[32]);
  EXPECT_NE(stream_of[31], stream_of[33]);
}

// CancelPending gives lent bytes stuck on a stalled stream back before it runs the callback, and
// returns only after the callback ran.
TEST_F(GrpcShardClientTest, CancelPendingReleasesLentBytesOfAStalledStreamFirst) {
  absl::Notification hold;
  service_.hold_reads = &hold;
  Start();
  std::vector<float> big(8 << 20, 2.0f);
  LentOutcome cancelled;
  SendLent(client_.get(), 2, big, &cancelled);
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_GT(client_->borrowed_references(), 0);
  EXPECT_FALSE(cancelled.done.HasBeenNotified());
  const absl::Time start = absl::Now();
  client_->CancelPending();
  // Not by waiting out the shard's 20 s hold.
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  ASSERT_TRUE(cancelled.done.HasBeenNotified());
  EXPECT_EQ(cancelled.status.code(), absl::StatusCode::kCancelled) << cancelled.status;
  EXPECT_EQ(cancelled.references, 0);
  hold.Notify();
  auto next = Call(Request(3, "after"));
  ASSERT_TRUE(next.ok()) << next.status();
}

// The destructor does the same for a request in flight on a stalled stream.
TEST_F(GrpcShardClientTest, ShutdownReleasesLentBytesOfAStalledStreamBeforeTheCallback) {
  absl::Notification hold;
  service_.hold_reads = &hold;
  Start();
  std::vector<float> big(8 << 20, 3.0f);
  LentOutcome shut;
  SendLent(client_.get(), 5, big, &shut);
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_GT(client_->borrowed_references(), 0);
  const absl::Time start = absl::Now();
  client_.reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));  // not by waiting out the shard's hold
  ASSERT_TRUE(shut.done.HasBeenNotified());
  EXPECT_EQ(shut.status.code(), absl::StatusCode::kCancelled) << shut.status;
  EXPECT_EQ(shut.references, 0);
  hold.Notify();
}

TEST_F(GrpcShardClientTest, CancelPendingFailsHeldRequestsAtOnce) {
  service_.never_seq = 5;
  Start();
  absl::Notification done;
  absl::StatusOr<v1::PushPullResponse> result;
  client_->PushPull({Request(5, "held")}, absl::Now() + absl::Seconds(30),
                    [&](absl::StatusOr<v1::PushPullResponse> r) {
                      result = std::move(r);
                      done.Notify();
                    });
  // Let the request reach the shard, which never answers it.
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(done.HasBeenNotified());
  client_->CancelPending();
  ASSERT_TRUE(done.HasBeenNotified());
  EXPECT_EQ(result.status().code(), absl::StatusCode::kCancelled) << result.status();
  EXPECT_NE(result.status().message().find(client_->address()), absl::string_view::npos);
  // The client keeps working.
  auto next = Call(Request(6, "next"));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->seq(), 6u);
}

TEST_F(GrpcShardClientTest, DialsWithTheGivenCredentials) {
  // TLS credentials against this plaintext shard: the handshake fails, on the stream and on
  // unary calls alike, so the channel was made with them.
  ClientCredentials tls;
  tls.channel = grpc::SslCredentials(grpc::SslCredentialsOptions());
  Start(/*streams=*/1, /*zero_copy_push=*/true, tls);
  auto r = Call(Request(1, "x"), absl::Seconds(5));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
  EXPECT_TRUE(service_.seen().empty());
}

TEST_F(GrpcShardClientTest, UnreachableShardFailsUnavailableWithTheAddress) {
  GrpcShardClient::Options o;
  o.address = "127.0.0.1:1";  // nothing listens on port 1
  auto c = GrpcShardClient::Create(o);
  ASSERT_TRUE(c.ok());
  client_ = *std::move(c);
  auto r = Call(Request(1, "x"));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(r.status().message().find("127.0.0.1:1"), absl::string_view::npos) << r.status();
  auto created =
      client_->CreateJobState(v1::CreateJobStateRequest(), absl::Now() + absl::Seconds(5));
  EXPECT_EQ(created.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(created.status().message().find("127.0.0.1:1"), absl::string_view::npos);
}

// CheckHealth tells a shard that answers from one whose process is gone or stopped.
TEST_F(GrpcShardClientTest, HealthCheckAnswersOnlyForAServingProcess) {
  grpc::EnableDefaultHealthCheckService(true);
  Start();
  EXPECT_TRUE(client_->CheckHealth(absl::Now() + absl::Seconds(5)).ok());

  // A listener that accepts connections and never speaks: a stopped process (the kernel still
  // completes the handshake).
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(fd, 8), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  GrpcShardClient::Options o;
  o.address = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));
  auto silent = GrpcShardClient::Create(o);
  ASSERT_TRUE(silent.ok());
  const absl::Time asked = absl::Now();
  const absl::Status stopped = (*silent)->CheckHealth(asked + absl::Milliseconds(300));
  // A new connection fails its handshake (UNAVAILABLE); one already open waits (DEADLINE_EXCEEDED).
  EXPECT_TRUE(stopped.code() == absl::StatusCode::kDeadlineExceeded ||
              stopped.code() == absl::StatusCode::kUnavailable)
      << stopped;
  EXPECT_LT(absl::Now() - asked, absl::Seconds(2));  // by its deadline, not gRPC's own timeouts
  EXPECT_NE(stopped.message().find(o.address), absl::string_view::npos) << stopped;
  silent->reset();
  ::close(fd);

  o.address = "127.0.0.1:1";  // nothing listens on port 1
  auto gone = GrpcShardClient::Create(o);
  ASSERT_TRUE(gone.ok());
  EXPECT_EQ((*gone)->CheckHealth(absl::Now() + absl::Seconds(5)).code(),
            absl::StatusCode::kUnavailable);
}

TEST_F(GrpcShardClientTest, UnaryAndServerStreamingCalls) {
  Start();
  v1::CreateJobStateRequest create;
  create.set_job_id("job");
  create.add_partitions();
  create.add_partitions();
  auto created = client_->CreateJobState(create, absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->partitions(), 2u);
  auto bad = client_->CreateJobState(v1::CreateJobStateRequest(), absl::Now() + absl::Seconds(5));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find(client_->address()), absl::string_view::npos);
  v1::PullRequest pull;
  for (uint32_t i = 0; i < 3; ++i) pull.add_keys()->mutable_key()->set_index(i);
  auto slices = client_->Pull(pull, absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(slices.ok()) << slices.status();
  ASSERT_EQ(slices->size(), 3u);
  EXPECT_EQ((*slices)[2].key().index(), 2u);
}

}  // namespace
}  // namespace client
}  // namespace tessera
