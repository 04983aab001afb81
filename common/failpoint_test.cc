#include "common/failpoint.h"

#include <stdlib.h>

#include <atomic>

#include "gtest/gtest.h"

namespace tessera::failpoint {
namespace {

// TESSERA_FAILPOINTS is read at the first hit, so it is set here before any.
TEST(FailpointTest, HangsOnlyAtItsValueUntilCancelledAndIgnoresWhatDoesNotParse) {
  ASSERT_EQ(::setenv("TESSERA_FAILPOINTS", "x.step=hang@3, bad ,y.step=hang@zz", 1), 0);
  int polls = 0;
  const auto never = [&] {
    ++polls;
    return false;
  };
  MaybeHang("x.step", 2, never);
  MaybeHang("x.step", 4, never);
  MaybeHang("y.step", 3, never);
  MaybeHang("other", 3, never);
  EXPECT_EQ(polls, 0);
  // At its value it blocks until cancelled: here after the third poll.
  int left = 3;
  MaybeHang("x.step", 3, [&] { return --left < 0; });
  EXPECT_EQ(left, -1);
}

}  // namespace
}  // namespace tessera::failpoint
