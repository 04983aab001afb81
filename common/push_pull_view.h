// A v1::PushPullRequest by reference: the form in which a shard's store takes a request, so that
// a transport can hand it gradients that still lie in its receive buffers (the PushPull codec's
// decoded form, common/push_pull_codec.h) as well as a parsed protobuf (ViewOf).
#ifndef TESSERA_COMMON_PUSH_PULL_VIEW_H_
#define TESSERA_COMMON_PUSH_PULL_VIEW_H_

#include <cstdint>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera {

// One slice of a request by reference: the fields of v1::Slice that a push or pull uses, with the
// key's tensor name, the data and the row ids owned by the caller. The data is `data`, or, when
// `pieces` is not empty, the concatenation of the pieces (then `data` is empty): a transport's
// receive buffers, read in place. Any alignment; a value may straddle two pieces.
struct SliceView {
  absl::string_view tensor;
  uint32_t index = 0;
  v1::Encoding encoding = v1::ENCODING_UNSPECIFIED;
  absl::string_view data;
  absl::Span<const absl::string_view> pieces;
  absl::Span<const int64_t> row_ids;
  bool want_weights = false;
  bool all_rows = false;    // Pull only (v1::Slice.all_rows)
  uint64_t weights_id = 0;  // the weights the puller holds (weight-delta pulls, v1::Slice)
};

// A v1::PushPullRequest by reference (see SliceView). Valid only while what it points into lives
// and is not changed; a store reads it only for the duration of the call it is passed to.
struct PushPullView {
  absl::string_view job_id;
  uint32_t worker_id = 0;
  uint64_t incarnation = 0;
  int64_t step = 0;
  uint64_t seq = 0;
  std::vector<SliceView> push;
  std::vector<SliceView> pull;
  v1::Encoding pull_encoding = v1::ENCODING_UNSPECIFIED;
};

// The view of `request`; it points into `request`, which must outlive it.
PushPullView ViewOf(const v1::PushPullRequest& request);

}  // namespace tessera

#endif  // TESSERA_COMMON_PUSH_PULL_VIEW_H_
