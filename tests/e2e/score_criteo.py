#!/usr/bin/env python3
"""Scores an exported Tessera click-through model on a Criteo TSV file, independently of Tessera.

A multi-input model (DLRM, Wide & Deep: examples/criteo_dlrm.textproto and
examples/criteo_wide_deep.textproto) is rebuilt from the model spec the export carries in its
metadata ("model", JSON): the 13 counts as dense features (log(1 + x), 0 when empty or <= 0),
each categorical field's id looked up in its table, the bottom layers, the interaction (the
concatenation, or DLRM's pairwise dot products after the bottom output), the top layers and the
wide table's sum, as proto/tessera/v1/model.proto defines them.

Otherwise the model is the one examples/criteo_hashed.textproto describes: every feature of a row is a
hashed id into one sparse table (summed, each id weighted by its value), then dense layers with
ReLU between them and a sigmoid. Reads the safetensors file by hand (F32 and I64 tensors), hashes
the features as Tessera's Criteo reader documents (worker/data/dataset.h: SplitMix64 of the field
and the value; log(1 + x) for the counts), looks each id up in the exported table (an id without
a row never received a gradient, and counts as zeros here), and computes the ROC AUC (ties count
one half) and the log loss. Prints one JSON line.

With --expect_auc A it exits 1 unless |auc - A| <= --tolerance (0.001 by default).
Needs only Python 3 and numpy (Debian: python3-numpy).
"""
import argparse
import json
import re
import struct
import sys

import numpy as np

MASK64 = (1 << 64) - 1


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    data = raw[8 + n:]
    metadata = header.pop("__metadata__", {})
    tensors = {}
    for name, info in header.items():
        dtype = {"F32": "<f4", "I64": "<i8"}[info["dtype"]]
        begin, end = info["data_offsets"]
        tensors[name] = np.frombuffer(data[begin:end], dtype=dtype).reshape(info["shape"])
    return tensors, metadata


def feature_ids(fields, values):
    """CriteoFeatureId(field, value) for numpy uint64 arrays of equal shape."""
    with np.errstate(over="ignore"):
        z = values.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15) * (fields.astype(np.uint64) + np.uint64(1))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z & np.uint64(0x7FFFFFFFFFFFFFFF)).astype(np.int64)


def read_criteo(path):
    """Returns (labels, example index per feature, field per feature, raw value, weight)."""
    labels, rows, fields, raw, weights = [], [], [], [], []
    with open(path) as f:
        for r, line in enumerate(f):
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 40:
                raise ValueError(f"{path}:{r + 1}: {len(parts)} fields, expected 40")
            labels.append(float(parts[0]))
            for i in range(13):
                if parts[1 + i] and int(parts[1 + i]) > 0:
                    rows.append(r)
                    fields.append(i)
                    raw.append(0)
                    weights.append(np.log1p(float(parts[1 + i])))
            for c in range(26):
                v = parts[14 + c]
                if v:
                    rows.append(r)
                    fields.append(13 + c)
                    raw.append(int(v, 16))
                    weights.append(1.0)
    return (np.array(labels, dtype=np.float64), np.array(rows, dtype=np.int64),
            np.array(fields, dtype=np.uint64), np.array(raw, dtype=np.uint64),
            np.array(weights, dtype=np.float32))


def read_criteo_fields(path):
    """Returns (labels [n], dense [n, 13], ids [n, 26] with -1 where a field is empty)."""
    labels, dense, ids = [], [], []
    with open(path) as f:
        for r, line in enumerate(f):
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 40:
                raise ValueError(f"{path}:{r + 1}: {len(parts)} fields, expected 40")
            labels.append(float(parts[0]))
            dense.append([np.log1p(float(v)) if v and int(v) > 0 else 0.0 for v in parts[1:14]])
            ids.append([int(v, 16) if v else -1 for v in parts[14:40]])
    raw = np.array(ids, dtype=np.int64)
    fields = np.broadcast_to(np.arange(13, 39, dtype=np.uint64), raw.shape)
    hashed = feature_ids(fields, np.where(raw < 0, 0, raw).astype(np.uint64))
    return (np.array(labels, dtype=np.float64), np.array(dense, dtype=np.float64),
            np.where(raw < 0, -1, hashed))


def layer_names(layers, prefix, taken):
    """model.proto's names: the spec's, or "<prefix><type>_<k>" counting that type from 1."""
    counts, names = {}, []
    for layer in layers:
        if layer.get("name"):
            names.append(layer["name"])
            continue
        kind = prefix + next(k for k in layer if k != "name")
        while True:
            counts[kind] = counts.get(kind, 0) + 1
            name = f"{kind}_{counts[kind]}"
            if name not in taken:
                break
        taken.add(name)
        names.append(name)
    return names


def run_layers(x, layers, names, tensors):
    for layer, name in zip(layers, names):
        if "dense" in layer:
            x = x @ tensors[name + "/kernel"].astype(np.float64).T + tensors[name + "/bias"]
        elif "relu" in layer:
            x = np.maximum(x, 0.0)
        elif "tanh" in layer:
            x = np.tanh(x)
        elif "sigmoid" in layer:
            x = 1.0 / (1.0 + np.exp(-x))
        elif "dropout" in layer:
            pass  # the identity in evaluation
        else:
            raise SystemExit(f"layer {name}: {list(layer)} is not supported by this scorer")
    return x


def lookup(tensors, table, ids):
    """The rows of `table` for ids [n] (-1: no id; an id without a row counts as zeros)."""
    keys = tensors[table + "/embeddings.ids"]
    rows = tensors[table + "/embeddings"].astype(np.float64)
    order = np.argsort(keys)
    keys, rows = keys[order], rows[order]
    at = np.clip(np.searchsorted(keys, ids), 0, max(len(keys) - 1, 0))
    found = (ids >= 0) & (len(keys) > 0)
    if len(keys) > 0:
        found &= keys[at] == ids
    return np.where(found[:, None], rows[at] if len(keys) > 0 else 0.0, 0.0)


def multi_input_logits(model, tensors, dense, ids):
    taken = {l["name"] for l in model.get("layers", []) + model.get("bottom_layers", [])
             if l.get("name")} | {t["name"] for t in model["tables"]}
    bottom = model.get("bottom_layers", [])
    top = model["layers"]
    bottom_names = layer_names(bottom, "bottom_", taken)
    top_names = layer_names(top, "", taken)
    vectors = []
    if int(model.get("dense_features", 0)) > 0:
        vectors.append(run_layers(dense, bottom, bottom_names, tensors))
    for f, feature in enumerate(model["sparse_features"]):
        vectors.append(lookup(tensors, feature["table"], ids[:, f]))
    if model.get("interaction", {}).get("kind") == "KIND_DOT":
        v = np.stack(vectors, axis=1)  # [n, m, d]
        dots = np.einsum("nid,njd->nij", v, v)
        i, j = np.tril_indices(v.shape[1], -1)  # row by row: (1, 0), (2, 0), (2, 1), ...
        z = dots[:, i, j]
        if int(model.get("dense_features", 0)) > 0:
            z = np.concatenate([vectors[0], z], axis=1)
    else:
        z = np.concatenate(vectors, axis=1)
    x = run_layers(z, top, top_names, tensors)
    if model.get("wide_table"):
        for f in range(ids.shape[1]):
            x = x + lookup(tensors, model["wide_table"], ids[:, f])
    return x[:, 0]


def roc_auc(scores, labels):
    order = np.argsort(scores, kind="mergesort")
    s = scores[order]
    ranks = np.empty(len(s), dtype=np.float64)
    i = 0
    while i < len(s):
        j = i
        while j < len(s) and s[j] == s[i]:
            j += 1
        ranks[i:j] = 0.5 * (i + 1 + j)
        i = j
    positive = labels[order] > 0.5
    p = positive.sum()
    n = len(s) - p
    return (ranks[positive].sum() - p * (p + 1) / 2) / (p * n)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the exported .safetensors file")
    ap.add_argument("--data", required=True, help="a Criteo TSV file (the test split)")
    ap.add_argument("--expect_auc", type=float)
    ap.add_argument("--tolerance", type=float, default=0.001)
    args = ap.parse_args()

    tensors, metadata = read_safetensors(args.model)
    model = json.loads(metadata["model"]) if "model" in metadata else {}
    if model.get("tables"):
        labels, dense, ids = read_criteo_fields(args.data)
        logits = multi_input_logits(model, tensors, dense, ids)
        return report(args, logits, labels, metadata,
                      {"tables": [t["name"] for t in model["tables"]],
                       "table_rows": int(sum(len(tensors[t["name"] + "/embeddings.ids"])
                                             for t in model["tables"]))})
    tables = [n for n in tensors if n.endswith(".ids")]
    if len(tables) != 1:
        raise SystemExit(f"{args.model}: expected one sparse table, got {tables}")
    table = tables[0][: -len(".ids")]
    ids = tensors[tables[0]]
    rows = tensors[table]
    order = np.argsort(ids)
    ids, rows = ids[order], rows[order]

    labels, example, fields, raw, weights = read_criteo(args.data)
    fid = feature_ids(fields, raw)
    at = np.clip(np.searchsorted(ids, fid), 0, len(ids) - 1)
    found = ids[at] == fid
    vectors = np.where(found[:, None], rows[at], 0.0) * weights[:, None]
    x = np.zeros((len(labels), rows.shape[1]), dtype=np.float64)
    np.add.at(x, example, vectors)

    dense = sorted((n[: -len("/kernel")] for n in tensors if n.endswith("/kernel")),
                   key=lambda n: int(re.search(r"(\d+)$", n).group(1)))
    for k, name in enumerate(dense):
        x = x @ tensors[name + "/kernel"].astype(np.float64).T + tensors[name + "/bias"]
        if k + 1 < len(dense):
            x = np.maximum(x, 0.0)
    return report(args, x[:, 0], labels, metadata,
                  {"table_rows": int(len(ids)), "features_without_row": int((~found).sum()),
                   "tensors": dense})


def report(args, logits, labels, metadata, extra):
    p = np.clip(1.0 / (1.0 + np.exp(-logits)), 1e-7, 1 - 1e-7)
    log_loss = float(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))
    auc = float(roc_auc(logits, labels))
    print(json.dumps({"auc": round(auc, 6), "log_loss": round(log_loss, 6),
                      "examples": int(len(labels)), **extra,
                      "reported_auc": metadata.get("test_auc")}))
    if args.expect_auc is not None and abs(auc - args.expect_auc) > args.tolerance:
        print(f"AUC {auc:.6f} differs from the expected {args.expect_auc:.6f} by more than "
              f"{args.tolerance}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
