// The PushPull codec against protobuf's generated code, both ways: what the codec writes protobuf
// reads field for field, and what protobuf writes the codec reads, whatever the slice boundaries;
// malformed input is refused.
#include "common/push_pull_codec.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/encoding.h"
#include "common/testing/push_pull_requests.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/v1/parameter.pb.h"

namespace tessera {
namespace {

using ::tessera::push_pull_requests::GradSlice;
using ::tessera::push_pull_requests::PullKey;
using ::tessera::push_pull_requests::Request;
using ::tessera::push_pull_requests::RowsSlice;
using ::testing::HasSubstr;

// ---- Builders -----------------------------------------------------------------------------------

// `n` bytes of a pattern that differs at every offset and between seeds.
std::string Pattern(size_t n, int seed) {
  std::string out(n, '\0');
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<char>((i * 131 + i / 251 + seed * 17) & 0xff);
  return out;
}

// ---- Slicing ------------------------------------------------------------------------------------

std::vector<grpc::Slice> Cut(const std::string& bytes, std::vector<size_t> cuts) {
  std::sort(cuts.begin(), cuts.end());
  std::vector<grpc::Slice> out;
  size_t at = 0;
  for (size_t c : cuts) {
    c = std::min(c, bytes.size());
    if (c <= at) continue;
    out.emplace_back(bytes.data() + at, c - at);
    at = c;
  }
  if (at < bytes.size()) out.emplace_back(bytes.data() + at, bytes.size() - at);
  return out;
}

std::vector<grpc::Slice> RandomCut(const std::string& bytes, std::mt19937* rng, int pieces) {
  std::uniform_int_distribution<size_t> at(0, bytes.size());
  std::vector<size_t> cuts;
  for (int i = 0; i < pieces; ++i) cuts.push_back(at(*rng));
  return Cut(bytes, cuts);
}

// Cut without copying: the slices point into `bytes`, which must outlive them.
std::vector<grpc::Slice> CutInPlace(const std::string& bytes, std::vector<size_t> cuts) {
  std::sort(cuts.begin(), cuts.end());
  std::vector<grpc::Slice> out;
  size_t at = 0;
  cuts.push_back(bytes.size());
  for (size_t c : cuts) {
    c = std::min(c, bytes.size());
    if (c <= at) continue;
    out.emplace_back(bytes.data() + at, c - at, grpc::Slice::STATIC_SLICE);
    at = c;
  }
  return out;
}

// Slices of `chunk` bytes each (the last may be shorter), pointing into `bytes`.
std::vector<grpc::Slice> Chunks(const std::string& bytes, size_t chunk) {
  std::vector<size_t> cuts;
  for (size_t at = chunk; at < bytes.size(); at += chunk) cuts.push_back(at);
  return CutInPlace(bytes, cuts);
}

// Single cuts: at every offset of a small message; else at every offset of its first and last
// 96 bytes (tags and lengths) and at 64 offsets in between.
std::vector<size_t> CutPoints(size_t size) {
  std::vector<size_t> at;
  for (size_t i = 0; i <= size; ++i) {
    if (size <= 2048 || i < 96 || i + 96 > size || i % (size / 64) == 0) at.push_back(i);
  }
  return at;
}

std::string Flat(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string flat;
  for (const grpc::Slice& s : slices) {
    flat.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  return flat;
}

// The codec's encoders, into a buffer of their own.
absl::StatusOr<grpc::ByteBuffer> EncodeRequest(
    const std::shared_ptr<const v1::PushPullRequest>& request, const ExternalSliceData* lent,
    bool zero_copy) {
  grpc::ByteBuffer out;
  const absl::Status status = EncodePushPullRequest(request, lent, zero_copy, &out);
  if (!status.ok()) return status;
  return out;
}
absl::StatusOr<grpc::ByteBuffer> EncodeResponse(v1::PushPullResponse* response,
                                                const ExternalSliceData* external,
                                                const std::shared_ptr<BufferPool>& pool,
                                                size_t* bytes) {
  grpc::ByteBuffer out;
  const absl::Status status = EncodePushPullResponse(response, external, pool, &out, bytes);
  if (!status.ok()) return status;
  return out;
}

absl::Status Parse(std::vector<grpc::Slice> slices, DecodedPushPullRequest* out) {
  out->received = std::move(slices);
  return DecodePushPullRequest(out);
}

// ---- Field-by-field equality
// ---------------------------------------------------------------------

// The data of a decoded slice, joined from its pieces when it spans received slices.
std::string Joined(const DecodedSlice& s) {
  if (s.pieces.empty()) return std::string(s.data);
  EXPECT_TRUE(s.data.empty());
  std::string out;
  for (absl::string_view piece : s.pieces) out.append(piece.data(), piece.size());
  return out;
}

void ExpectSameSlice(const DecodedSlice& got, const v1::Slice& want) {
  EXPECT_EQ(got.tensor, want.key().tensor());
  EXPECT_EQ(got.index, want.key().index());
  EXPECT_EQ(got.encoding, static_cast<int32_t>(want.encoding()));
  EXPECT_EQ(Joined(got), want.data());
  EXPECT_EQ(got.row_ids, std::vector<int64_t>(want.row_ids().begin(), want.row_ids().end()));
  EXPECT_EQ(got.want_weights, want.want_weights());
  EXPECT_EQ(got.version, want.version());
}

void ExpectSame(const DecodedPushPullRequest& got, const v1::PushPullRequest& want) {
  EXPECT_EQ(got.job_id, want.job_id());
  EXPECT_EQ(got.worker_id, want.worker_id());
  EXPECT_EQ(got.incarnation, want.incarnation());
  EXPECT_EQ(got.step, want.step());
  EXPECT_EQ(got.seq, want.seq());
  EXPECT_EQ(got.pull_encoding, static_cast<int32_t>(want.pull_encoding()));
  ASSERT_EQ(got.push.size(), static_cast<size_t>(want.push_size()));
  for (int i = 0; i < want.push_size(); ++i) ExpectSameSlice(got.push[i], want.push(i));
  ASSERT_EQ(got.pull.size(), static_cast<size_t>(want.pull_size()));
  for (int i = 0; i < want.pull_size(); ++i) {
    // Pull slices carry no data the store reads; the rest must match.
    v1::Slice without_data = want.pull(i);
    without_data.clear_data();
    DecodedSlice got_slice = got.pull[i];
    got_slice.data = absl::string_view();
    got_slice.pieces.clear();
    ExpectSameSlice(got_slice, without_data);
  }
}

void ExpectSameProtoSlice(const v1::Slice& got, const v1::Slice& want) {
  EXPECT_EQ(got.key().tensor(), want.key().tensor());
  EXPECT_EQ(got.key().index(), want.key().index());
  EXPECT_EQ(got.encoding(), want.encoding());
  EXPECT_TRUE(got.data() == want.data()) << got.data().size() << " vs " << want.data().size();
  EXPECT_EQ(std::vector<int64_t>(got.row_ids().begin(), got.row_ids().end()),
            std::vector<int64_t>(want.row_ids().begin(), want.row_ids().end()));
  EXPECT_EQ(got.want_weights(), want.want_weights());
  EXPECT_EQ(got.version(), want.version());
}

void ExpectSameRequest(const v1::PushPullRequest& got, const v1::PushPullRequest& want) {
  EXPECT_EQ(got.job_id(), want.job_id());
  EXPECT_EQ(got.worker_id(), want.worker_id());
  EXPECT_EQ(got.incarnation(), want.incarnation());
  EXPECT_EQ(got.step(), want.step());
  EXPECT_EQ(got.seq(), want.seq());
  EXPECT_EQ(got.pull_encoding(), want.pull_encoding());
  ASSERT_EQ(got.push_size(), want.push_size());
  for (int i = 0; i < want.push_size(); ++i) ExpectSameProtoSlice(got.push(i), want.push(i));
  ASSERT_EQ(got.pull_size(), want.pull_size());
  for (int i = 0; i < want.pull_size(); ++i) ExpectSameProtoSlice(got.pull(i), want.pull(i));
}

void ExpectSameResponse(const v1::PushPullResponse& got, const v1::PushPullResponse& want) {
  EXPECT_EQ(got.seq(), want.seq());
  EXPECT_EQ(got.status().code(), want.status().code());
  EXPECT_EQ(got.status().message(), want.status().message());
  EXPECT_EQ(got.duplicates(), want.duplicates());
  EXPECT_EQ(got.skipped_non_finite(), want.skipped_non_finite());
  EXPECT_EQ(got.gate_wait_us(), want.gate_wait_us());
  ASSERT_EQ(got.weights_size(), want.weights_size());
  for (int i = 0; i < want.weights_size(); ++i) {
    ExpectSameProtoSlice(got.weights(i), want.weights(i));
  }
}

// ---- External data ------------------------------------------------------------------------------

// External bytes held as shared strings; counts the slices gRPC still holds over them.
class ExternalStrings final : public ExternalSliceData {
 public:
  void Add(int index, std::string bytes) {
    entries_.push_back(Entry{index, std::make_shared<const std::string>(std::move(bytes))});
  }
  size_t size() const override { return entries_.size(); }
  int index(size_t k) const override { return entries_[k].index; }
  absl::string_view bytes(size_t k) const override { return *entries_[k].bytes; }
  grpc::Slice SliceOver(size_t k) const override {
    held_->fetch_add(1);
    made_->fetch_add(1);
    auto* keep = new Keep{entries_[k].bytes, held_};
    return grpc::Slice(
        const_cast<char*>(keep->bytes->data()), keep->bytes->size(),
        [](void* p) {
          auto* keep = static_cast<Keep*>(p);
          keep->held->fetch_sub(1);
          delete keep;
        },
        keep);
  }

  int held() const { return held_->load(); }
  int made() const { return made_->load(); }
  const char* data(size_t k) const { return entries_[k].bytes->data(); }

 private:
  struct Entry {
    int index;
    std::shared_ptr<const std::string> bytes;
  };
  struct Keep {
    std::shared_ptr<const std::string> bytes;
    std::shared_ptr<std::atomic<int>> held;
  };
  std::vector<Entry> entries_;
  std::shared_ptr<std::atomic<int>> held_ = std::make_shared<std::atomic<int>>(0);
  std::shared_ptr<std::atomic<int>> made_ = std::make_shared<std::atomic<int>>(0);
};

// True when one of the buffer's slices begins at `p` (the bytes there were not copied).
bool SendsInPlace(const grpc::ByteBuffer& buffer, const char* p) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  for (const grpc::Slice& s : slices) {
    if (reinterpret_cast<const char*>(s.begin()) == p) return true;
  }
  return false;
}

// ---- Moved from server/grpc_parameter_service_test.cc (the shard's parser, now the codec) -------

// A request with every field set: a large gradient (its own slice on the wire), a small one, a
// sparse push with row ids, pulls and unicode names.
v1::PushPullRequest FullRequest() {
  std::vector<float> big(20000);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>(i) * 0.25f - 7.0f;
  v1::PushPullRequest r = Request("j\u00f6b", 3, 1ull << 40, 12345, 987654321ull,
                                  {GradSlice("layer/w\u4e2d", 7, big, true),
                                   GradSlice("b", 0, {1.5f, -2.5f}, false, v1::ENCODING_BF16),
                                   RowsSlice("emb", {5, -1, 1ll << 50}, {1, 2, 3, 4, 5, 6}, true)},
                                  {PullKey("b", 0), PullKey("emb", 0, {9, 8})});
  r.set_pull_encoding(v1::ENCODING_FP16);
  r.mutable_push(0)->set_version(-3);
  return r;
}

TEST(PushPullWireTest, ParsesEveryFieldWhateverTheSliceBoundaries) {
  const v1::PushPullRequest want = FullRequest();
  const std::string bytes = want.SerializeAsString();
  {
    // One slice: every gradient is one view into it.
    DecodedPushPullRequest got;
    ASSERT_TRUE(Parse(Cut(bytes, {}), &got).ok());
    ExpectSame(got, want);
    EXPECT_EQ(got.pieced_bytes, 0u);
    EXPECT_GE(got.push[0].data.data(), reinterpret_cast<const char*>(got.received[0].begin()));
  }
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    DecodedPushPullRequest got;
    absl::Status status = Parse(RandomCut(bytes, &rng, 1 + trial % 40), &got);
    ASSERT_TRUE(status.ok()) << status;
    ExpectSame(got, want);
    if (::testing::Test::HasFailure()) return;
  }
  // Every byte its own slice: all data in pieces of one byte, nothing copied.
  {
    std::vector<size_t> cuts(bytes.size());
    for (size_t i = 0; i < cuts.size(); ++i) cuts[i] = i;
    DecodedPushPullRequest got;
    ASSERT_TRUE(Parse(Cut(bytes, cuts), &got).ok());
    ExpectSame(got, want);
    EXPECT_EQ(got.pieced_bytes,
              want.push(0).data().size() + want.push(1).data().size() + want.push(2).data().size());
    EXPECT_EQ(got.push[0].pieces.size(), want.push(0).data().size());
  }
}

TEST(PushPullWireTest, UnpackedRowIdsUnknownFieldsAndRepeatedScalarsParseAsProtobufDoes) {
  v1::PushPullRequest want = Request("job", 1, 2, 3, 4, {RowsSlice("emb", {7, 8}, {1, 2, 3, 4})});
  std::string bytes = want.SerializeAsString();
  // A second seq (the last one wins), unknown varint, fixed32, fixed64 and length fields.
  bytes += std::string("\x28\x09", 2);                           // seq = 9
  bytes += std::string("\xf8\x01\x05", 3);                       // field 31 varint
  bytes += std::string("\x85\x02\x01\x02\x03\x04", 6);           // field 32 fixed32
  bytes += std::string("\x89\x02", 2) + std::string(8, '\x07');  // field 33 fixed64
  bytes += std::string("\x8a\x02\x02\x61\x62", 5);               // field 33 length-delimited
  // A push slice with unpacked row ids (tag 0x20) and an empty key message.
  v1::Slice unpacked;
  unpacked.mutable_key()->set_tensor("t");
  std::string slice = unpacked.SerializeAsString();
  slice += std::string("\x20\x05\x20\x06", 4);
  bytes += std::string("\x32", 1) + static_cast<char>(slice.size()) + slice;
  v1::PushPullRequest reference;
  ASSERT_TRUE(reference.ParseFromString(bytes));
  ASSERT_EQ(reference.seq(), 9u);
  ASSERT_EQ(reference.push(1).row_ids_size(), 2);
  DecodedPushPullRequest got;
  absl::Status status = Parse(Cut(bytes, {3, 10, 11}), &got);
  ASSERT_TRUE(status.ok()) << status;
  ExpectSame(got, reference);
}

struct MalformedCase {
  std::string name;
  std::string bytes;
  std::string mentions;
  bool seq_readable;
};

TEST(PushPullWireTest, MalformedMessagesAreInvalidArgument) {
  const std::string seq7("\x28\x07", 2);
  const std::vector<MalformedCase> cases = {
      {"varint of 11 bytes", seq7 + std::string("\x10") + std::string(10, '\xff') + "\x01",
       "varint", true},
      {"truncated varint", seq7 + std::string("\x10\xff", 2), "varint", true},
      {"seq with a fixed32 wire type", std::string("\x2d\x01\x02\x03\x04", 5), "seq", false},
      {"job_id as a varint", seq7 + std::string("\x08\x01", 2), "job_id", true},
      {"length past the end",
       seq7 + std::string("\x0a\x05"
                          "ab",
                          4),
       "past the end", true},
      {"push slice length past the end", std::string("\x32\x7f\x0a", 3) + seq7, "push", false},
      {"data longer than its slice",
       seq7 + std::string("\x32\x04\x1a\x09"
                          "ab",
                          6),
       "past the end", true},
      {"group wire type", seq7 + std::string("\x0b", 1), "wire type 3", true},
      {"field number 0", seq7 + std::string("\x00\x01", 2), "field number", true},
      // Found by tessera_fuzz_pushpull: a fixed32 field whose tag takes 6 bytes (protobuf reads
      // tags of at most 5).
      {"tag of 6 bytes", seq7 + std::string("\xf5\x9e\xfc\xf8\x8c\x00\x8f\xef\x00\x73", 10),
       "field tag", true},
      {"job_id not UTF-8", seq7 + std::string("\x0a\x02\xc3\x28", 4), "UTF-8", true},
      {"overlong UTF-8", seq7 + std::string("\x0a\x02\xc0\x80", 4), "UTF-8", true},
      {"bad varint inside a push key", std::string("\x32\x04\x0a\x02\x10\xff", 6) + seq7, "index",
       true},
  };
  for (const MalformedCase& c : cases) {
    SCOPED_TRACE(c.name);
    v1::PushPullRequest reference;
    EXPECT_FALSE(reference.ParseFromString(c.bytes) && c.name != "seq with a fixed32 wire type" &&
                 c.name != "job_id as a varint" && c.name != "group wire type")
        << "protobuf parses it, so the case tests nothing";
    DecodedPushPullRequest got;
    absl::Status status = Parse(Cut(c.bytes, {1, 2}), &got);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(c.mentions));
    uint64_t seq = 0;
    EXPECT_EQ(FindPushPullSeq(got.received, &seq), c.seq_readable);
    if (c.seq_readable) {
      EXPECT_EQ(seq, 7u);
    }
  }
}

// Differential fuzzing against protobuf: on truncations and bit flips of a valid request, the
// parser never reads out of bounds (run under ASan to check that too), and whenever it accepts a
// message, protobuf accepts it too and reads the same fields.
TEST(PushPullWireTest, TruncationsAndBitFlipsNeverMisparse) {
  v1::PushPullRequest full = FullRequest();
  // Keep the big gradient small enough to try every truncation.
  full.mutable_push(0)->mutable_data()->resize(64);
  const std::string bytes = full.SerializeAsString();
  std::mt19937 rng(11);
  int accepted = 0;
  int refused = 0;
  auto check = [&](const std::string& input) {
    DecodedPushPullRequest got;
    absl::Status status = Parse(RandomCut(input, &rng, 3), &got);
    v1::PushPullRequest reference;
    if (status.ok()) {
      ++accepted;
      ASSERT_TRUE(reference.ParseFromString(input)) << "accepted what protobuf refuses";
      ExpectSame(got, reference);
    } else {
      ++refused;
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    }
  };
  for (size_t n = 0; n < bytes.size(); ++n) {
    check(bytes.substr(0, n));
    if (::testing::Test::HasFatalFailure()) return;
  }
  std::uniform_int_distribution<size_t> pos(0, bytes.size() - 1);
  std::uniform_int_distribution<int> bit(0, 7);
  for (int trial = 0; trial < 5000; ++trial) {
    std::string flipped = bytes;
    const int flips = 1 + trial % 3;
    for (int f = 0; f < flips; ++f) flipped[pos(rng)] ^= static_cast<char>(1 << bit(rng));
    check(flipped);
    if (::testing::Test::HasFatalFailure()) return;
  }
  // Both outcomes occur, so both branches were exercised.
  EXPECT_GT(accepted, 100);
  EXPECT_GT(refused, 100);
}

TEST(PushPullWireTest, ResponseSerialisesAsProtobufWithWeightsInPooledSlices) {
  auto pool = std::make_shared<BufferPool>(4, 64 << 20);
  v1::PushPullResponse response;
  response.set_seq(42);
  response.set_duplicates(2);
  response.set_skipped_non_finite(1);
  response.set_gate_wait_us(123456789);
  response.mutable_status()->set_message("ok");
  std::vector<float> big(100000);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>(i);
  *response.add_weights() = GradSlice("w", 3, big);
  response.mutable_weights(0)->set_version(17);
  *response.add_weights() = RowsSlice("emb", {4, 5}, {1, 2});
  *response.add_weights() = PullKey("empty", 1);
  const v1::PushPullResponse want = response;
  size_t bytes = 0;
  {
    grpc::ByteBuffer buffer;
    EncodePushPullResponse(&response, pool, &buffer, &bytes);
    EXPECT_EQ(bytes, want.ByteSizeLong());
    EXPECT_EQ(buffer.Length(), want.ByteSizeLong());
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(buffer.Dump(&slices).ok());
    EXPECT_GE(slices.size(), 3u);  // header, the big data, the rest
    std::string flat;
    for (const grpc::Slice& s : slices) {
      flat.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
    v1::PushPullResponse got;
    ASSERT_TRUE(got.ParseFromString(flat));
    EXPECT_EQ(got.SerializeAsString(), want.SerializeAsString());
    EXPECT_EQ(pool->held_bytes(), 0u);  // the big data is still in the buffer
  }
  // Released by gRPC (here: the buffer and slices above), the big string is back for reuse.
  EXPECT_GE(pool->held_bytes(), big.size() * 4);
  EXPECT_GE(pool->Take().capacity(), big.size() * 4);
}

// ---- Round trips, table-driven ------------------------------------------------------------------

// Data sizes around the own-slice threshold and the varint length boundaries, and a large one.
const std::vector<size_t>& DataSizes() {
  static const std::vector<size_t> sizes = {0,
                                            1,
                                            4,
                                            127,
                                            128,
                                            kOwnSliceMinBytes - 1,
                                            kOwnSliceMinBytes,
                                            kOwnSliceMinBytes + 1,
                                            16383 * 2,
                                            size_t{1} << 20};
  return sizes;
}

struct RequestCase {
  std::string name;
  v1::PushPullRequest request;
  // Per push slice: lend its data (the request's own data field is then empty).
  std::vector<bool> lend;
};

// Every field, every encoding, dense and sparse, empty and large data, lent or not.
std::vector<RequestCase> RequestCases() {
  std::vector<RequestCase> cases;
  cases.push_back({"empty request", v1::PushPullRequest(), {}});
  {
    v1::PushPullRequest r = FullRequest();
    r.mutable_pull(0)->set_version(5);
    r.mutable_pull(1)->set_want_weights(true);
    cases.push_back({"every field", r, {}});
    cases.push_back({"every field, big gradient lent", r, {true, false, false}});
    cases.push_back({"every field, all lent", r, {true, true, true}});
  }
  {
    v1::PushPullRequest r = Request("j", 0xffffffffu, ~uint64_t{0}, -1, ~uint64_t{0}, {});
    r.set_pull_encoding(static_cast<v1::Encoding>(-1));  // sign-extended to 10 bytes
    v1::Slice s = PullKey("", 0, {-1, 0, 1, INT64_MIN, INT64_MAX});
    s.set_version(INT64_MIN);
    *r.add_push() = s;
    *r.add_push() = v1::Slice();  // no key at all
    cases.push_back({"extreme values", r, {}});
  }
  for (v1::Encoding e :
       {v1::ENCODING_UNSPECIFIED, v1::ENCODING_FP32, v1::ENCODING_BF16, v1::ENCODING_FP16}) {
    for (size_t n : DataSizes()) {
      for (bool lend : {false, true}) {
        for (bool sparse : {false, true}) {
          v1::PushPullRequest r = Request("job", 2, 3, 4, 5, {});
          v1::Slice* s = r.add_push();
          s->mutable_key()->set_tensor(sparse ? "emb" : "w");
          s->mutable_key()->set_index(sparse ? 0 : 9);
          s->set_encoding(e);
          s->set_data(Pattern(n, static_cast<int>(e)));
          s->set_want_weights(true);
          if (sparse) {
            for (int64_t row : {int64_t{3}, int64_t{-7}, int64_t{1} << 40}) s->add_row_ids(row);
          }
          *r.add_pull() = PullKey("other", 1);
          cases.push_back({absl::StrCat("encoding ", e, ", ", n, " bytes, ",
                                        sparse ? "sparse" : "dense", lend ? ", lent" : ""),
                           r,
                           {lend}});
        }
      }
    }
  }
  return cases;
}

// The request as the codec sends it for a case: lent slices without their data, and the lent
// bytes as external data (kept by `lent`).
std::shared_ptr<v1::PushPullRequest> WithoutLentData(const RequestCase& c, ExternalStrings* lent) {
  auto sent = std::make_shared<v1::PushPullRequest>(c.request);
  for (size_t i = 0; i < c.lend.size(); ++i) {
    if (!c.lend[i]) continue;
    v1::Slice* s = sent->mutable_push(static_cast<int>(i));
    lent->Add(static_cast<int>(i), s->data());
    s->clear_data();
  }
  return sent;
}

// Encode with the codec, parse with protobuf: the same request, of the size protobuf computes,
// with large data (own or lent) sent in place when zero-copy.
TEST(PushPullCodecTest, EncodedRequestsParseAsProtobufWhateverTheDataAndItsOwner) {
  for (const RequestCase& c : RequestCases()) {
    for (bool zero_copy : {true, false}) {
      SCOPED_TRACE(absl::StrCat(c.name, zero_copy ? ", zero-copy" : ", copied"));
      ExternalStrings lent;
      std::shared_ptr<const v1::PushPullRequest> sent = WithoutLentData(c, &lent);
      absl::StatusOr<grpc::ByteBuffer> buffer = EncodeRequest(sent, &lent, zero_copy);
      ASSERT_TRUE(buffer.ok()) << buffer.status();
      EXPECT_EQ(buffer->Length(), c.request.ByteSizeLong());
      v1::PushPullRequest got;
      ASSERT_TRUE(got.ParseFromString(Flat(*buffer)));
      ExpectSameRequest(got, c.request);
      size_t entry = 0;  // of `lent`, for the next lent slice
      for (int i = 0; i < sent->push_size(); ++i) {
        const bool lends = static_cast<size_t>(i) < c.lend.size() && c.lend[i];
        const size_t n = c.request.push(i).data().size();
        const char* where = lends ? lent.data(entry++) : sent->push(i).data().data();
        EXPECT_EQ(SendsInPlace(*buffer, where), zero_copy && n >= kOwnSliceMinBytes) << i;
      }
      // The slices over lent bytes are counted until released with the buffer.
      EXPECT_EQ(lent.held(), lent.made());
      buffer = absl::UnknownError("released");
      EXPECT_EQ(lent.held(), 0);
      if (::testing::Test::HasFailure()) return;
    }
  }
}

// The request slices hold the request: it outlives its last owner until gRPC lets go of them.
TEST(PushPullCodecTest, SlicesOverTheRequestKeepItAlive) {
  auto request = std::make_shared<v1::PushPullRequest>(
      Request("j", 0, 0, 0, 1, {GradSlice("w", 0, std::vector<float>(10000, 2.0f))}));
  const std::string want = request->SerializeAsString();
  std::weak_ptr<v1::PushPullRequest> alive = request;
  absl::StatusOr<grpc::ByteBuffer> buffer = EncodeRequest(request, nullptr, true);
  ASSERT_TRUE(buffer.ok());
  request.reset();
  EXPECT_FALSE(alive.expired());
  v1::PushPullRequest got;
  ASSERT_TRUE(got.ParseFromString(Flat(*buffer)));
  EXPECT_EQ(got.SerializeAsString(), want);
  buffer = absl::UnknownError("released");
  EXPECT_TRUE(alive.expired());
}

// Encode with protobuf, decode with the codec, the message cut at every offset and into chunks of
// many sizes: the same request, with the data in place (one view, or pieces that join to it).
TEST(PushPullCodecTest, ProtobufRequestsDecodeAtEverySliceBoundary) {
  for (const RequestCase& c : RequestCases()) {
    const std::string bytes = c.request.SerializeAsString();
    SCOPED_TRACE(c.name);
    std::vector<std::vector<grpc::Slice>> cuts;
    for (size_t at : CutPoints(bytes.size())) cuts.push_back(CutInPlace(bytes, {at}));
    for (size_t chunk :
         {size_t{1}, size_t{2}, size_t{3}, size_t{7}, size_t{64}, size_t{8192}, size_t{65536}}) {
      if (chunk < 64 && bytes.size() > 70000) continue;
      cuts.push_back(Chunks(bytes, chunk));
    }
    for (std::vector<grpc::Slice>& slices : cuts) {
      const size_t count = slices.size();
      DecodedPushPullRequest got;
      absl::Status status = Parse(std::move(slices), &got);
      ASSERT_TRUE(status.ok()) << status << " in " << count << " slices";
      ExpectSame(got, c.request);
      size_t pieced = 0;
      for (const DecodedSlice& s : got.push) {
        for (absl::string_view p : s.pieces) pieced += p.size();
      }
      EXPECT_EQ(got.pieced_bytes, pieced);
      if (::testing::Test::HasFailure()) return;
    }
  }
}

// The codec's own encoder and decoder agree, lent data included, and the view the store takes
// reads the same request.
TEST(PushPullCodecTest, EncodedRequestsDecodeToTheSameView) {
  for (const RequestCase& c : RequestCases()) {
    SCOPED_TRACE(c.name);
    ExternalStrings lent;
    absl::StatusOr<grpc::ByteBuffer> buffer = EncodeRequest(WithoutLentData(c, &lent), &lent, true);
    ASSERT_TRUE(buffer.ok());
    DecodedPushPullRequest got;
    ASSERT_TRUE(buffer->Dump(&got.received).ok());
    ASSERT_TRUE(DecodePushPullRequest(&got).ok());
    ExpectSame(got, c.request);
    const PushPullView view = got.View();
    const PushPullView want = ViewOf(c.request);
    EXPECT_EQ(view.job_id, want.job_id);
    EXPECT_EQ(view.worker_id, want.worker_id);
    EXPECT_EQ(view.incarnation, want.incarnation);
    EXPECT_EQ(view.step, want.step);
    EXPECT_EQ(view.seq, want.seq);
    EXPECT_EQ(view.pull_encoding, want.pull_encoding);
    ASSERT_EQ(view.push.size(), want.push.size());
    for (size_t i = 0; i < view.push.size(); ++i) {
      std::string data(view.push[i].data);
      for (absl::string_view p : view.push[i].pieces) data.append(p.data(), p.size());
      EXPECT_TRUE(data == want.push[i].data);
      EXPECT_EQ(view.push[i].tensor, want.push[i].tensor);
      EXPECT_EQ(view.push[i].index, want.push[i].index);
      EXPECT_EQ(view.push[i].encoding, want.push[i].encoding);
      EXPECT_EQ(std::vector<int64_t>(view.push[i].row_ids.begin(), view.push[i].row_ids.end()),
                std::vector<int64_t>(want.push[i].row_ids.begin(), want.push[i].row_ids.end()));
      EXPECT_EQ(view.push[i].want_weights, want.push[i].want_weights);
    }
    ASSERT_EQ(view.pull.size(), want.pull.size());
    for (size_t i = 0; i < view.pull.size(); ++i) {
      EXPECT_EQ(view.pull[i].tensor, want.pull[i].tensor);
      EXPECT_EQ(view.pull[i].index, want.pull[i].index);
    }
    if (::testing::Test::HasFailure()) return;
  }
}

// Lent data that does not fit the request is INTERNAL: an index out of range or twice, or a slice
// that has data of its own. Empty lent bytes are ignored.
TEST(PushPullCodecTest, LentDataThatDoesNotFitTheRequestIsInternal) {
  auto request = std::make_shared<const v1::PushPullRequest>(
      Request("j", 0, 0, 0, 1, {PullKey("a", 0), GradSlice("b", 0, {1, 2})}));
  struct Case {
    std::vector<std::pair<int, std::string>> entries;
    absl::StatusCode code;
  };
  const std::vector<Case> cases = {
      {{{2, "x"}}, absl::StatusCode::kInternal},
      {{{-1, "x"}}, absl::StatusCode::kInternal},
      {{{0, "x"}, {0, "y"}}, absl::StatusCode::kInternal},
      {{{1, "x"}}, absl::StatusCode::kInternal},
      {{{1, ""}, {7, ""}}, absl::StatusCode::kOk},
      {{{0, "x"}}, absl::StatusCode::kOk},
  };
  for (const Case& c : cases) {
    ExternalStrings lent;
    for (const auto& [index, bytes] : c.entries) lent.Add(index, bytes);
    EXPECT_EQ(EncodeRequest(request, &lent, true).status().code(), c.code)
        << c.entries.size() << " entries, first " << c.entries[0].first;
  }
}

struct ResponseCase {
  std::string name;
  v1::PushPullResponse response;
  // Per weight slice: its data is external (the response's own data field is then empty).
  std::vector<bool> external;
};

std::vector<ResponseCase> ResponseCases() {
  std::vector<ResponseCase> cases;
  cases.push_back({"empty response", v1::PushPullResponse(), {}});
  {
    v1::PushPullResponse r;
    r.set_seq(~uint64_t{0});
    r.mutable_status()->set_code(-5);
    r.mutable_status()->set_message("n\u00e4me");
    r.set_duplicates(0xffffffffu);
    r.set_skipped_non_finite(3);
    r.set_gate_wait_us(~uint64_t{0});
    cases.push_back({"status only", r, {}});
    r.mutable_status()->clear_message();
    r.mutable_status()->set_code(0);  // an empty status message is still present
    cases.push_back({"empty status", r, {}});
  }
  for (v1::Encoding e :
       {v1::ENCODING_UNSPECIFIED, v1::ENCODING_FP32, v1::ENCODING_BF16, v1::ENCODING_FP16}) {
    for (size_t n : DataSizes()) {
      for (bool external : {false, true}) {
        v1::PushPullResponse r;
        r.set_seq(77);
        r.set_duplicates(1);
        v1::Slice* w = r.add_weights();
        w->mutable_key()->set_tensor("w\u4e2d");
        w->mutable_key()->set_index(3);
        w->set_encoding(e);
        w->set_version(-2);
        w->set_data(Pattern(n, 5));
        *r.add_weights() = RowsSlice("emb", {1, -1}, {0.5f, -0.5f});
        r.mutable_weights(1)->set_version(1ll << 40);
        *r.add_weights() = PullKey("none", 0);
        cases.push_back(
            {absl::StrCat("encoding ", e, ", ", n, " bytes", external ? ", external" : ""),
             r,
             {external, false, false}});
      }
    }
  }
  return cases;
}

// Encode with the codec (pooled and external data), parse with protobuf: the same response, of
// the size PushPullResponseSize announced; large data in place.
TEST(PushPullCodecTest, EncodedResponsesParseAsProtobufWithPooledAndExternalData) {
  for (const ResponseCase& c : ResponseCases()) {
    SCOPED_TRACE(c.name);
    auto pool = std::make_shared<BufferPool>(4, 64 << 20);
    v1::PushPullResponse response = c.response;
    ExternalStrings external;
    for (size_t i = 0; i < c.external.size(); ++i) {
      if (!c.external[i]) continue;
      external.Add(static_cast<int>(i), response.weights(static_cast<int>(i)).data());
      response.mutable_weights(static_cast<int>(i))->clear_data();
    }
    absl::StatusOr<size_t> size = PushPullResponseSize(response, &external);
    ASSERT_TRUE(size.ok()) << size.status();
    EXPECT_EQ(*size, c.response.ByteSizeLong());
    const char* own = response.weights_size() > 0 ? response.weights(0).data().data() : nullptr;
    const size_t n = response.weights_size() > 0 ? c.response.weights(0).data().size() : 0;
    size_t bytes = 0;
    absl::StatusOr<grpc::ByteBuffer> buffer = EncodeResponse(&response, &external, pool, &bytes);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    EXPECT_EQ(bytes, c.response.ByteSizeLong());
    EXPECT_EQ(buffer->Length(), c.response.ByteSizeLong());
    v1::PushPullResponse got;
    ASSERT_TRUE(got.ParseFromString(Flat(*buffer)));
    ExpectSameResponse(got, c.response);
    if (n > 0) {
      const char* where = external.size() > 0 ? external.data(0) : own;
      EXPECT_EQ(SendsInPlace(*buffer, where), n >= kOwnSliceMinBytes);
    }
    buffer = absl::UnknownError("released");
    EXPECT_EQ(external.held(), 0);
    if (::testing::Test::HasFailure()) return;
  }
}

// Decodes `slices` as a response and takes it with `target`.
absl::StatusOr<v1::PushPullResponse> DecodeResponse(std::vector<grpc::Slice> slices,
                                                    const Fp32WeightsTarget& target = {},
                                                    bool* written = nullptr) {
  DecodedPushPullResponse decoded;
  decoded.received = std::move(slices);
  absl::Status status = DecodePushPullResponse(&decoded);
  if (!status.ok()) return status;
  bool ignored = false;
  return TakePushPullResponse(&decoded, target, written != nullptr ? written : &ignored);
}

// Encode with protobuf, decode with the codec at every slice boundary: the same response.
TEST(PushPullCodecTest, ProtobufResponsesDecodeAtEverySliceBoundary) {
  for (const ResponseCase& c : ResponseCases()) {
    SCOPED_TRACE(c.name);
    const std::string bytes = c.response.SerializeAsString();
    std::vector<std::vector<grpc::Slice>> cuts;
    for (size_t at : CutPoints(bytes.size())) cuts.push_back(CutInPlace(bytes, {at}));
    for (size_t chunk : {size_t{1}, size_t{5}, size_t{64}, size_t{8192}, size_t{65536}}) {
      if (chunk < 64 && bytes.size() > 70000) continue;
      cuts.push_back(Chunks(bytes, chunk));
    }
    for (std::vector<grpc::Slice>& slices : cuts) {
      absl::StatusOr<v1::PushPullResponse> got = DecodeResponse(std::move(slices));
      ASSERT_TRUE(got.ok()) << got.status();
      ExpectSameResponse(*got, c.response);
      if (::testing::Test::HasFailure()) return;
    }
  }
}

// Large fp32 (or unspecified) weights go straight into a target of the same key and size, in
// however many pieces they arrive; anything else stays in the response.
TEST(PushPullCodecTest, LargeFp32WeightsDecodeIntoAMatchingTarget) {
  std::vector<float> values(kOwnSliceMinBytes / 4 + 3);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.25f * static_cast<float>(i) - 9.0f;
  struct Case {
    std::string name;
    v1::Encoding encoding;
    size_t count;  // values in the weights
    std::string tensor;
    uint32_t index;
    size_t target_count;
    bool written;
  };
  const size_t n = values.size();
  const std::vector<Case> cases = {
      {"fp32 match", v1::ENCODING_FP32, n, "w", 2, n, true},
      {"unspecified match", v1::ENCODING_UNSPECIFIED, n, "w", 2, n, true},
      {"bf16", v1::ENCODING_BF16, n, "w", 2, n / 2, false},
      {"other tensor", v1::ENCODING_FP32, n, "v", 2, n, false},
      {"other index", v1::ENCODING_FP32, n, "w", 3, n, false},
      {"target larger", v1::ENCODING_FP32, n, "w", 2, n + 1, false},
      {"target smaller", v1::ENCODING_FP32, n, "w", 2, n - 1, false},
      {"small", v1::ENCODING_FP32, 10, "w", 2, 10, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    v1::PushPullResponse response;
    response.set_seq(4);
    v1::Slice* w = response.add_weights();
    w->mutable_key()->set_tensor("w");
    w->mutable_key()->set_index(2);
    w->set_encoding(c.encoding);
    w->set_version(12);
    w->set_data(std::string(reinterpret_cast<const char*>(values.data()), c.count * 4));
    const std::string bytes = response.SerializeAsString();
    for (size_t chunk : {bytes.size(), size_t{4096}, size_t{4097}}) {
      std::vector<float> out(c.target_count + 1, -1.0f);
      Fp32WeightsTarget target;
      target.tensor = c.tensor;
      target.index = c.index;
      target.out = out.data();
      target.count = c.target_count;
      bool written = false;
      absl::StatusOr<v1::PushPullResponse> got =
          DecodeResponse(Chunks(bytes, chunk), target, &written);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(written, c.written);
      ASSERT_EQ(got->weights_size(), 1);
      EXPECT_EQ(got->weights(0).version(), 12);
      EXPECT_EQ(got->weights(0).key().tensor(), "w");
      if (c.written) {
        EXPECT_TRUE(got->weights(0).data().empty());
        EXPECT_TRUE(std::equal(values.begin(), values.end(), out.begin()));
        EXPECT_EQ(out.back(), -1.0f);  // nothing past the target
      } else {
        EXPECT_TRUE(got->weights(0).data() == response.weights(0).data());
        EXPECT_EQ(out[0], -1.0f);
      }
    }
  }
}

// ---- Malformed input ----------------------------------------------------------------------------

// Every truncation of a valid message: the codec accepts it exactly when protobuf does (a cut at a
// field boundary is a valid, shorter message), and then reads the same fields.
TEST(PushPullCodecTest, TruncationsAtEveryByteAreRefusedAsProtobufRefusesThem) {
  v1::PushPullRequest request = FullRequest();
  request.mutable_push(0)->mutable_data()->resize(40);
  const std::string request_bytes = request.SerializeAsString();
  int refused = 0;
  for (size_t n = 0; n < request_bytes.size(); ++n) {
    const std::string cut = request_bytes.substr(0, n);
    v1::PushPullRequest reference;
    const bool proto_ok = reference.ParseFromString(cut);
    DecodedPushPullRequest got;
    absl::Status status = Parse(Chunks(cut, 3), &got);
    ASSERT_EQ(status.ok(), proto_ok) << "truncated to " << n << ": " << status;
    if (proto_ok) {
      ExpectSame(got, reference);
    } else {
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
      ++refused;
    }
  }
  EXPECT_GT(refused, static_cast<int>(request_bytes.size()) / 2);

  const std::vector<ResponseCase> responses = ResponseCases();
  const auto with_data =
      std::find_if(responses.begin(), responses.end(),
                   [](const ResponseCase& c) { return c.name == "encoding 1, 127 bytes"; });
  ASSERT_NE(with_data, responses.end());
  const std::string response_bytes = with_data->response.SerializeAsString();
  refused = 0;
  for (size_t n = 0; n < response_bytes.size(); ++n) {
    const std::string cut = response_bytes.substr(0, n);
    v1::PushPullResponse reference;
    const bool proto_ok = reference.ParseFromString(cut);
    absl::StatusOr<v1::PushPullResponse> got = DecodeResponse(Chunks(cut, 5));
    ASSERT_EQ(got.ok(), proto_ok) << "truncated to " << n << ": " << got.status();
    if (proto_ok) {
      ExpectSameResponse(*got, reference);
    } else {
      EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
      ++refused;
    }
  }
  EXPECT_GT(refused, static_cast<int>(response_bytes.size()) / 2);
}

// One field of every known number with each wrong wire type (protobuf would skip it as unknown):
// refused, naming the field. Bytes for a field of `wire_type` after its tag.
std::string FieldBody(uint32_t wire_type) {
  switch (wire_type) {
    case 0:
      return std::string("\x01", 1);
    case 1:
      return std::string(8, '\x02');
    case 2:
      return std::string("\x01\x61", 2);
    default:
      return std::string(4, '\x03');
  }
}

std::string Tagged(uint32_t field, uint32_t wire_type) {
  std::string out;
  uint64_t tag = (uint64_t{field} << 3) | wire_type;
  while (tag >= 0x80) {
    out.push_back(static_cast<char>((tag & 0x7f) | 0x80));
    tag >>= 7;
  }
  out.push_back(static_cast<char>(tag));
  return out + FieldBody(wire_type);
}

// Wraps `inner` as the length-delimited field `field`.
std::string Nested(uint32_t field, const std::string& inner) {
  std::string out = Tagged(field, 2).substr(0, 1);
  out.push_back(static_cast<char>(inner.size()));
  return out + inner;
}

struct WireTypeCase {
  std::string name;
  bool response;  // else a request
  // The field inside its enclosing messages (outer numbers first), and its wire type.
  std::vector<uint32_t> path;
  uint32_t want;
};

TEST(PushPullCodecTest, KnownFieldsWithTheWrongWireTypeAreRefused) {
  using Rq = v1::PushPullRequest;
  using Rs = v1::PushPullResponse;
  using S = v1::Slice;
  using K = v1::PartitionKey;
  const uint32_t push = Rq::kPushFieldNumber;
  const uint32_t weights = Rs::kWeightsFieldNumber;
  const std::vector<WireTypeCase> cases = {
      {"job_id", false, {Rq::kJobIdFieldNumber}, 2},
      {"worker_id", false, {Rq::kWorkerIdFieldNumber}, 0},
      {"incarnation", false, {Rq::kIncarnationFieldNumber}, 0},
      {"step", false, {Rq::kStepFieldNumber}, 0},
      {"seq", false, {Rq::kSeqFieldNumber}, 0},
      {"push", false, {push}, 2},
      {"pull", false, {Rq::kPullFieldNumber}, 2},
      {"pull_encoding", false, {Rq::kPullEncodingFieldNumber}, 0},
      {"key", false, {push, S::kKeyFieldNumber}, 2},
      {"key.tensor", false, {push, S::kKeyFieldNumber, K::kTensorFieldNumber}, 2},
      {"key.index", false, {push, S::kKeyFieldNumber, K::kIndexFieldNumber}, 0},
      {"encoding", false, {push, S::kEncodingFieldNumber}, 0},
      {"data", false, {push, S::kDataFieldNumber}, 2},
      {"want_weights", false, {push, S::kWantWeightsFieldNumber}, 0},
      {"version", false, {push, S::kVersionFieldNumber}, 0},
      {"seq", true, {Rs::kSeqFieldNumber}, 0},
      {"status", true, {Rs::kStatusFieldNumber}, 2},
      {"status.code", true, {Rs::kStatusFieldNumber, v1::RpcStatus::kCodeFieldNumber}, 0},
      {"status.message", true, {Rs::kStatusFieldNumber, v1::RpcStatus::kMessageFieldNumber}, 2},
      {"weights", true, {weights}, 2},
      {"duplicates", true, {Rs::kDuplicatesFieldNumber}, 0},
      {"skipped_non_finite", true, {Rs::kSkippedNonFiniteFieldNumber}, 0},
      {"key", true, {weights, S::kKeyFieldNumber}, 2},
      {"data", true, {weights, S::kDataFieldNumber}, 2},
      {"version", true, {weights, S::kVersionFieldNumber}, 0},
  };
  int tried = 0;
  for (const WireTypeCase& c : cases) {
    for (uint32_t wire_type : {0u, 1u, 2u, 5u}) {
      if (wire_type == c.want) continue;
      SCOPED_TRACE(
          absl::StrCat(c.response ? "response " : "request ", c.name, " as wire type ", wire_type));
      std::string bytes = Tagged(c.path.back(), wire_type);
      for (size_t i = c.path.size() - 1; i-- > 0;) bytes = Nested(c.path[i], bytes);
      absl::Status status;
      if (c.response) {
        status = DecodeResponse(Cut(bytes, {1})).status();
      } else {
        DecodedPushPullRequest got;
        status = Parse(Cut(bytes, {1}), &got);
      }
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
      EXPECT_THAT(std::string(status.message()),
                  HasSubstr(absl::StrCat("field ", c.name, " (", c.path.back(), ") has wire type ",
                                         wire_type)));
      ++tried;
    }
  }
  EXPECT_EQ(tried, 3 * static_cast<int>(cases.size()));
}

// Tags padded to 5 bytes are read; 6 bytes are refused, as protobuf refuses them.
TEST(PushPullCodecTest, TagsOfSixBytesAreRefused) {
  const std::string five("\xa8\x80\x80\x80\x00\x07", 6);  // seq (field 5, varint) = 7
  const std::string six("\xa8\x80\x80\x80\x80\x00\x07", 7);
  v1::PushPullRequest request;
  ASSERT_TRUE(request.ParseFromString(five));
  EXPECT_EQ(request.seq(), 7u);
  EXPECT_FALSE(request.ParseFromString(six));
  {
    DecodedPushPullRequest got;
    ASSERT_TRUE(Parse(Cut(five, {2}), &got).ok());
    EXPECT_EQ(got.seq, 7u);
  }
  {
    DecodedPushPullRequest got;
    absl::Status status = Parse(Cut(six, {2}), &got);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(status.message()), HasSubstr("field tag"));
  }
  // PushPullResponse.seq is field 1: the same tag bytes with field 1.
  const std::string five_r("\x88\x80\x80\x80\x00\x07", 6);
  const std::string six_r("\x88\x80\x80\x80\x80\x00\x07", 7);
  absl::StatusOr<v1::PushPullResponse> got = DecodeResponse(Cut(five_r, {3}));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->seq(), 7u);
  got = DecodeResponse(Cut(six_r, {3}));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(got.status().message()), HasSubstr("field tag"));
}

// A length one byte past what is left, for every length-delimited field: refused, never read.
TEST(PushPullCodecTest, LengthsPastTheEndAreRefused) {
  struct Case {
    std::string name;
    bool response;
    std::vector<uint32_t> path;  // length-delimited fields, outer first
  };
  using Rq = v1::PushPullRequest;
  using Rs = v1::PushPullResponse;
  using S = v1::Slice;
  const std::vector<Case> cases = {
      {"job_id", false, {Rq::kJobIdFieldNumber}},
      {"push", false, {Rq::kPushFieldNumber}},
      {"pull", false, {Rq::kPullFieldNumber}},
      {"key", false, {Rq::kPushFieldNumber, S::kKeyFieldNumber}},
      {"key.tensor",
       false,
       {Rq::kPushFieldNumber, S::kKeyFieldNumber, v1::PartitionKey::kTensorFieldNumber}},
      {"data", false, {Rq::kPushFieldNumber, S::kDataFieldNumber}},
      {"row_ids", false, {Rq::kPushFieldNumber, S::kRowIdsFieldNumber}},
      {"status", true, {Rs::kStatusFieldNumber}},
      {"status.message", true, {Rs::kStatusFieldNumber, v1::RpcStatus::kMessageFieldNumber}},
      {"weights", true, {Rs::kWeightsFieldNumber}},
      {"data", true, {Rs::kWeightsFieldNumber, S::kDataFieldNumber}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    // The innermost field announces 2 bytes and has 1; its enclosing fields are consistent.
    std::string bytes = Tagged(c.path.back(), 2).substr(0, 1) + std::string("\x02\x01", 2);
    for (size_t i = c.path.size() - 1; i-- > 0;) bytes = Nested(c.path[i], bytes);
    absl::Status status;
    if (c.response) {
      v1::PushPullResponse reference;
      EXPECT_FALSE(reference.ParseFromString(bytes));
      status = DecodeResponse(Cut(bytes, {1})).status();
    } else {
      v1::PushPullRequest reference;
      EXPECT_FALSE(reference.ParseFromString(bytes));
      DecodedPushPullRequest got;
      status = Parse(Cut(bytes, {1}), &got);
    }
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr("past the end"));
  }
}

TEST(PushPullCodecTest, ResponseStringsMustBeUtf8) {
  v1::PushPullResponse response;
  response.mutable_status()->set_message("ok");
  std::string bytes = response.SerializeAsString();
  bytes.back() = '\xc0';  // "o\xc0": a lead byte without its continuation
  v1::PushPullResponse reference;
  EXPECT_FALSE(reference.ParseFromString(bytes));
  absl::StatusOr<v1::PushPullResponse> got = DecodeResponse(Cut(bytes, {}));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(got.status().message()), HasSubstr("UTF-8"));
}

}  // namespace
}  // namespace tessera
