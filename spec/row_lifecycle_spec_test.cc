#include "spec/row_lifecycle_spec.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::spec {
namespace {

using ::testing::HasSubstr;

TEST(RowLifecycleSpecTest, BoundsAreCheckedByFieldName) {
  v1::RowLifecycle l;
  EXPECT_TRUE(ValidateRowLifecycle(l, "tables[0].lifecycle").ok());
  l.set_admit_after(kMaxAdmitAfter);
  l.set_evict_after(kMaxEvictAfter);
  EXPECT_TRUE(ValidateRowLifecycle(l, "tables[0].lifecycle").ok());
  l.set_admit_after(kMaxAdmitAfter + 1);
  absl::Status s = ValidateRowLifecycle(l, "tables[2].lifecycle");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("tables[2].lifecycle.admit_after: must be at most"));
  l.set_admit_after(5);
  l.set_evict_after(-1);
  s = ValidateRowLifecycle(l, "embedding_bag.lifecycle");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("embedding_bag.lifecycle.evict_after: must be in [0, "));
  EXPECT_THAT(s.message(), HasSubstr("got -1"));
}

}  // namespace
}  // namespace tessera::spec
