#include "common/push_pull_view.h"

namespace tessera {

PushPullView ViewOf(const v1::PushPullRequest& request) {
  PushPullView view;
  view.job_id = request.job_id();
  view.worker_id = request.worker_id();
  view.incarnation = request.incarnation();
  view.step = request.step();
  view.seq = request.seq();
  view.pull_encoding = request.pull_encoding();
  auto slice_view = [](const v1::Slice& s) {
    SliceView v;
    v.tensor = s.key().tensor();
    v.index = s.key().index();
    v.encoding = s.encoding();
    v.data = s.data();
    v.row_ids = absl::MakeConstSpan(s.row_ids().data(), s.row_ids().size());
    v.want_weights = s.want_weights();
    v.weights_id = s.weights_id();
    return v;
  };
  view.push.reserve(request.push_size());
  for (const v1::Slice& s : request.push()) view.push.push_back(slice_view(s));
  view.pull.reserve(request.pull_size());
  for (const v1::Slice& s : request.pull()) view.pull.push_back(slice_view(s));
  return view;
}

}  // namespace tessera
