#include "common/grpc_status.h"

#include <string>

#include "gtest/gtest.h"

namespace tessera {
namespace {

TEST(GrpcStatusTest, KeepsCodeAndShortMessage) {
  const grpc::Status s = ToGrpcStatus(absl::NotFoundError("job_id: no job j-1"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(s.error_message(), "job_id: no job j-1");
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
}

TEST(GrpcStatusTest, CutsAMessageThatQuotesAHugeField) {
  const std::string id(70000, 'A');
  const grpc::Status s = ToGrpcStatus(absl::NotFoundError("job_id: no job " + id));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  const std::string expected_tail =
      "... (" + std::to_string(15 + id.size() - kMaxStatusMessageBytes) + " more bytes)";
  ASSERT_EQ(s.error_message().size(), kMaxStatusMessageBytes + expected_tail.size());
  EXPECT_EQ(s.error_message().substr(0, 15), "job_id: no job ");
  EXPECT_EQ(s.error_message().substr(kMaxStatusMessageBytes), expected_tail);
}

TEST(GrpcStatusTest, RoundTripsCodesAndNamesThePeer) {
  const absl::Status s =
      FromGrpcStatus(grpc::Status(grpc::StatusCode::UNAVAILABLE, "down"), "127.0.0.1:7000");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(s.message(), "127.0.0.1:7000: down");
  EXPECT_EQ(StatusFromCode(99, "x").code(), absl::StatusCode::kUnknown);
}

}  // namespace
}  // namespace tessera
