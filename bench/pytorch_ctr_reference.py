#!/usr/bin/python3
"""PyTorch reference for the click-through benchmarks: the models of the Criteo examples.

--model hashed (the default) is examples/criteo_hashed.textproto:

Reads a Criteo TSV file as Tessera's reader does (every feature a hashed id: SplitMix64 of the
field and the value; log(1 + x) for counts > 0, weight 1 for categories), maps the ids to rows of
one nn.EmbeddingBag(mode="sum", sparse=True) holding exactly the training file's distinct ids,
then nn.Linear(16, 64), ReLU, nn.Linear(64, 1), BCEWithLogitsLoss, torch.optim.Adagrad (sparse
gradients for the table, as Tessera's shards update only the touched rows) at lr 0.1, batch 256,
shuffled each epoch. Times the training loop alone (not the parsing) and prints one JSON line
with samples_per_second, and the test AUC and log loss when --test is given.

--model dlrm is examples/criteo_dlrm.textproto: the 13 counts (log(1 + x), 0 when empty) through
Linear(13, 64) ReLU Linear(64, 16) ReLU; each of the 26 categorical fields one row of one
nn.EmbeddingBag(16, sparse=True) over the training file's distinct ids (a bag per field and
example, empty when the field is); DLRM's dot interaction (the 351 pairs of the 27 vectors after
the bottom output, torch.bmm and the strict lower triangle, row by row as Tessera orders them);
Linear(367, 128) ReLU Linear(128, 64) ReLU Linear(64, 1); Adagrad (sparse for the table) at
lr 0.05, accumulators from 0 with eps 1e-10 (Tessera's initial_accumulator 1e-10).

  pytorch_ctr_reference.py --train /var/tmp/tessera-criteo/train.tsv --threads 1
  pytorch_ctr_reference.py --model dlrm --train /var/tmp/tessera-criteo/train.tsv --threads 1

Uses Debian's python3-torch (CPU); run it with /usr/bin/python3. A benchmark reference only.
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch
from torch import nn

# The hashing and the AUC are the independent numpy scorer's, so both read the data one way.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "e2e"))
from score_criteo import feature_ids, read_criteo_fields, roc_auc  # noqa: E402


def read_criteo(path):
    labels, offsets, fields, raw, weights = [], [0], [], [], []
    with open(path) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            labels.append(float(parts[0]))
            for i in range(13):
                if parts[1 + i] and int(parts[1 + i]) > 0:
                    fields.append(i)
                    raw.append(0)
                    weights.append(np.log1p(float(parts[1 + i])))
            for c in range(26):
                if parts[14 + c]:
                    fields.append(13 + c)
                    raw.append(int(parts[14 + c], 16))
                    weights.append(1.0)
            offsets.append(len(fields))
    ids = feature_ids(np.array(fields, dtype=np.uint64), np.array(raw, dtype=np.uint64))
    return (np.array(labels, dtype=np.float32), np.array(offsets, dtype=np.int64), ids,
            np.array(weights, dtype=np.float32))


class Dlrm(nn.Module):
    def __init__(self, rows):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, 16), nn.ReLU())
        self.table = nn.EmbeddingBag(rows, 16, mode="sum", sparse=True)
        nn.init.normal_(self.table.weight, 0.0, 0.01)
        self.top = nn.Sequential(nn.Linear(16 + 27 * 26 // 2, 128), nn.ReLU(), nn.Linear(128, 64),
                                 nn.ReLU(), nn.Linear(64, 1))
        self.i, self.j = torch.tril_indices(27, 27, -1)

    def forward(self, dense, rows, offsets):
        u = self.bottom(dense)
        e = self.table(rows, offsets).view(dense.shape[0], 26, 16)
        v = torch.cat([u.unsqueeze(1), e], dim=1)
        dots = torch.bmm(v, v.transpose(1, 2))[:, self.i, self.j]
        return self.top(torch.cat([u, dots], dim=1)).squeeze(1)


def train_step(loss, *optimizers):
    for opt in optimizers:
        opt.zero_grad()
    loss.backward()
    for opt in optimizers:
        opt.step()


def score(logits, labels, out):
    """Adds the test AUC and log loss of logits against labels to `out`."""
    p = np.clip(1 / (1 + np.exp(-logits)), 1e-7, 1 - 1e-7)
    out["test_auc"] = round(roc_auc(logits, labels), 4)
    loss = -np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p))
    out["test_log_loss"] = round(float(loss), 4)


def bags(ids_rows):
    """The flat rows and the bag offsets of [n, 26] rows (-1: an empty bag)."""
    present = ids_rows.reshape(-1) >= 0
    counts = present.astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return torch.from_numpy(ids_rows.reshape(-1)[present]), torch.from_numpy(offsets)


def main_dlrm(args):
    labels, dense, ids = read_criteo_fields(args.train)
    labels, dense = labels.astype(np.float32), dense.astype(np.float32)
    vocab, inverse = np.unique(ids[ids >= 0], return_inverse=True)
    rows = np.full(ids.shape, -1, dtype=np.int64)
    rows[ids >= 0] = inverse
    model = Dlrm(len(vocab) + 1)  # test ids not in training map to one extra zero row
    unseen = len(vocab)
    with torch.no_grad():
        model.table.weight[unseen].zero_()
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("table")]
    opt_sparse = torch.optim.Adagrad([model.table.weight], lr=args.lr, eps=1e-10)
    opt_dense = torch.optim.Adagrad(dense_params, lr=args.lr, eps=1e-10)
    loss_fn = nn.BCEWithLogitsLoss()
    dense_t, labels_t = torch.from_numpy(dense), torch.from_numpy(labels)
    n = len(labels)
    rng = np.random.default_rng(1)
    seconds, steps = 0.0, 0
    for _ in range(args.epochs):
        order = rng.permutation(n)
        start = time.perf_counter()
        for b in range(0, n, args.batch):
            idx = order[b:b + args.batch]
            r, off = bags(rows[idx])
            it = torch.from_numpy(idx)
            train_step(loss_fn(model(dense_t[it], r, off), labels_t[it]), opt_sparse, opt_dense)
            steps += 1
        seconds += time.perf_counter() - start
    out = {"framework": "pytorch", "model": "dlrm", "torch": torch.__version__,
           "threads": args.threads, "examples": n, "epochs": args.epochs, "steps": steps,
           "train_seconds": round(seconds, 3),
           "samples_per_second": round(n * args.epochs / seconds, 1), "table_rows": len(vocab)}
    if args.test:
        tl, tdense, tids = read_criteo_fields(args.test)
        tdense = tdense.astype(np.float32)
        at = np.clip(np.searchsorted(vocab, tids), 0, len(vocab) - 1)
        trows = np.where(tids < 0, -1, np.where(vocab[at] == tids, at, unseen))
        with torch.no_grad():
            r, off = bags(trows)
            logits = model(torch.from_numpy(tdense), r, off).numpy()
        score(logits, tl, out)
    print(json.dumps(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["hashed", "dlrm"], default="hashed")
    ap.add_argument("--train", required=True)
    ap.add_argument("--test")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    if args.model == "dlrm":
        args.lr = 0.05 if args.lr is None else args.lr
        return main_dlrm(args)
    args.lr = 0.1 if args.lr is None else args.lr

    labels, offsets, ids, weights = read_criteo(args.train)
    vocab, rows = np.unique(ids, return_inverse=True)
    unseen = len(vocab)  # test ids not in training map to one extra zero row
    bag = nn.EmbeddingBag(len(vocab) + 1, 16, mode="sum", sparse=True)
    nn.init.normal_(bag.weight, 0.0, 0.01)
    with torch.no_grad():
        bag.weight[unseen].zero_()
    mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    opt_sparse = torch.optim.Adagrad(bag.parameters(), lr=args.lr)
    opt_dense = torch.optim.Adagrad(mlp.parameters(), lr=args.lr)
    loss_fn = nn.BCEWithLogitsLoss()
    rows_t = torch.from_numpy(rows.astype(np.int64))
    weights_t = torch.from_numpy(weights)
    labels_t = torch.from_numpy(labels)
    n = len(labels)
    rng = np.random.default_rng(1)
    seconds = 0.0
    steps = 0
    for _ in range(args.epochs):
        order = rng.permutation(n)
        start = time.perf_counter()
        for b in range(0, n, args.batch):
            idx = order[b:b + args.batch]
            lo, hi = offsets[idx], offsets[idx + 1]
            lens = hi - lo
            ends = np.cumsum(lens)
            # Every feature position of the batch's examples, without a Python loop.
            take = np.repeat(lo - (ends - lens), lens) + np.arange(ends[-1])
            off = torch.from_numpy(ends - lens)
            t = torch.from_numpy(take)
            x = bag(rows_t[t], off, per_sample_weights=weights_t[t])
            train_step(loss_fn(mlp(x).squeeze(1), labels_t[torch.from_numpy(idx)]), opt_sparse,
                       opt_dense)
            steps += 1
        seconds += time.perf_counter() - start
    out = {"framework": "pytorch", "torch": torch.__version__, "threads": args.threads,
           "examples": n, "epochs": args.epochs, "steps": steps, "train_seconds": round(seconds, 3),
           "samples_per_second": round(n * args.epochs / seconds, 1), "table_rows": len(vocab)}
    if args.test:
        tl, toff, tids, tw = read_criteo(args.test)
        at = np.searchsorted(vocab, tids)
        at = np.clip(at, 0, len(vocab) - 1)
        trow = np.where(vocab[at] == tids, at, unseen)
        with torch.no_grad():
            logits = mlp(bag(torch.from_numpy(trow), torch.from_numpy(toff[:-1]),
                             per_sample_weights=torch.from_numpy(tw))).squeeze(1).numpy()
        score(logits, tl, out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
