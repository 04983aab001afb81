#!/usr/bin/env python3
"""Scores an exported Tessera model on an IDX test set, independently of Tessera's own code.

Reads the safetensors file by hand (8-byte little-endian header length, JSON header, raw
little-endian data), reads the gzip IDX images and labels, and runs the network forward with
numpy in evaluation mode, layer by layer as the model spec in the file's metadata lists them:
dense (y = x @ kernel.T + bias; Tessera's Dense kernel is [out, in]), conv2d (NCHW
cross-correlation, kernel [filters, in_channels, kh, kw]), max_pool2d and avg_pool2d (average
excludes padding), batch_norm with the exported moving statistics
((x - moving_mean) / sqrt(moving_variance + epsilon) * gamma + beta), relu, tanh, sigmoid,
dropout (the identity) and flatten; then argmax. A file without a model spec is read as an MLP:
its dense layers in order with ReLU between them. Prints one JSON line
{"accuracy": ..., "examples": ..., "tensors": [layers with parameters], "metadata": {...}}.

With --expect A it exits 1 unless |accuracy - A| <= --tolerance (0.001 by default).
Needs only Python 3 and numpy (Debian: python3-numpy).
"""
import argparse
import gzip
import json
import re
import struct
import sys

import numpy as np


def read_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError(f"{path}: too short for a safetensors file")
    (n,) = struct.unpack("<Q", raw[:8])
    if n % 8 != 0 or 8 + n > len(raw):
        raise ValueError(f"{path}: bad header length {n}")
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    data = raw[8 + n:]
    metadata = header.pop("__metadata__", {})
    tensors = {}
    for name, info in header.items():
        if info["dtype"] != "F32":
            raise ValueError(f"{name}: dtype {info['dtype']}, expected F32")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        count = int(np.prod(shape)) if shape else 1
        if end - begin != 4 * count or end > len(data):
            raise ValueError(f"{name}: data_offsets {begin},{end} do not fit shape {shape}")
        tensors[name] = np.frombuffer(data, dtype="<f4", count=count, offset=begin).reshape(shape)
    return tensors, metadata


def read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    zero, dtype, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file")
    dims = struct.unpack(">" + "I" * ndim, raw[4:4 + 4 * ndim])
    values = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    return values.reshape(dims)


KINDS = ("dense", "conv2d", "max_pool2d", "avg_pool2d", "relu", "tanh", "sigmoid", "dropout",
         "flatten", "batch_norm")


def layer_order(name):
    m = re.search(r"(\d+)$", name)
    return (int(m.group(1)) if m else 0, name)


def spec_layers(metadata, tensors):
    """[(name, kind, fields)] from the metadata's model spec, names as Tessera gives them."""
    if "model" not in metadata:
        # An MLP written without a spec: dense_1, dense_2, ... by their number, ReLU between.
        dense = sorted({n.split("/")[0] for n in tensors}, key=layer_order)
        layers = []
        for i, name in enumerate(dense):
            layers.append((name, "dense", {}))
            if i + 1 < len(dense):
                layers.append((f"relu_{i + 1}", "relu", {}))
        return layers
    model = json.loads(metadata["model"])
    if model.get("tables") or model.get("bottom_layers"):
        raise ValueError("a multi-input model: score it with score_criteo.py")
    counts = {}
    layers = []
    for layer in model.get("layers", []):
        kinds = [k for k in layer if k != "name"]
        if len(kinds) != 1 or kinds[0] not in KINDS:
            raise ValueError(f"layer {layer}: this scorer handles {', '.join(KINDS)}")
        kind = kinds[0]
        counts[kind] = counts.get(kind, 0) + 1
        layers.append((layer.get("name") or f"{kind}_{counts[kind]}", kind, layer[kind] or {}))
    return layers


def field(fields, key, default):
    """A proto3 JSON field: int64 values come as strings, zero values are left out."""
    value = fields.get(key)
    return default if value in (None, 0, "0") else type(default)(value)


def windows(x, kh, kw, sh, sw, ph, pw, pad_value):
    """[N, C, OH, OW, kh, kw] views of x [N, C, H, W] padded with pad_value."""
    if ph or pw:
        x = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=pad_value)
    v = np.lib.stride_tricks.sliding_window_view(x, (kh, kw), axis=(2, 3))
    return v[:, :, ::sh, ::sw]


def conv2d(x, kernel, bias, f):
    kh, kw = kernel.shape[2], kernel.shape[3]
    v = windows(x, kh, kw, field(f, "stride_h", 1), field(f, "stride_w", 1),
                field(f, "padding_h", 0), field(f, "padding_w", 0), 0.0)
    return np.einsum("nchwij,fcij->nfhw", v, kernel, optimize=True) + bias[None, :, None, None]


def pool2d(x, f, average):
    kh, kw = field(f, "pool_h", 2), field(f, "pool_w", 2)
    sh, sw = field(f, "stride_h", kh), field(f, "stride_w", kw)
    ph, pw = field(f, "padding_h", 0), field(f, "padding_w", 0)
    if not average:
        return windows(x, kh, kw, sh, sw, ph, pw, -np.inf).max(axis=(4, 5))
    total = windows(x, kh, kw, sh, sw, ph, pw, 0.0).sum(axis=(4, 5))
    ones = np.ones((1, 1) + x.shape[2:], dtype=x.dtype)
    count = windows(ones, kh, kw, sh, sw, ph, pw, 0.0).sum(axis=(4, 5))
    return total / count


def forward(layers, tensors, x):
    for name, kind, f in layers:
        if kind == "dense":
            x = x.reshape(x.shape[0], -1)
            kernel, bias = tensors[f"{name}/kernel"], tensors[f"{name}/bias"]
            if x.shape[1] != kernel.shape[1]:
                raise ValueError(f"{name}: kernel {kernel.shape} does not take {x.shape[1]} inputs")
            x = x @ kernel.T + bias
        elif kind == "conv2d":
            x = conv2d(x, tensors[f"{name}/kernel"], tensors[f"{name}/bias"], f)
        elif kind in ("max_pool2d", "avg_pool2d"):
            x = pool2d(x, f, kind == "avg_pool2d")
        elif kind == "batch_norm":
            shape = (1, -1) + (1,) * (x.ndim - 2)
            epsilon = np.float32(f.get("epsilon") or 1e-5)
            inv = 1 / np.sqrt(tensors[f"{name}/moving_variance"] + epsilon)
            x = ((x - tensors[f"{name}/moving_mean"].reshape(shape)) * inv.reshape(shape) *
                 tensors[f"{name}/gamma"].reshape(shape) + tensors[f"{name}/beta"].reshape(shape))
        elif kind == "relu":
            x = np.maximum(x, 0)
        elif kind == "tanh":
            x = np.tanh(x)
        elif kind == "sigmoid":
            x = 1 / (1 + np.exp(-x))
        elif kind == "flatten":
            x = x.reshape(x.shape[0], -1)
        # dropout: the identity in evaluation
    return x


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="the .safetensors file from tessera export")
    p.add_argument("--images", required=True, help="IDX test images (.gz or plain)")
    p.add_argument("--labels", required=True, help="IDX test labels (.gz or plain)")
    p.add_argument("--divide_by", type=float, default=255.0)
    p.add_argument("--mean", type=float, default=0.0)
    p.add_argument("--stddev", type=float, default=1.0)
    p.add_argument("--expect", type=float, help="the accuracy Tessera reported")
    p.add_argument("--tolerance", type=float, default=0.001)
    args = p.parse_args()

    tensors, metadata = read_safetensors(args.model)
    layers = spec_layers(metadata, tensors)
    images = read_idx(args.images).astype(np.float32)
    labels = read_idx(args.labels).astype(np.int64)
    shape = json.loads(metadata["model"]).get("input_shape") if "model" in metadata else None
    shape = [int(d) for d in shape] if shape else [int(np.prod(images.shape[1:]))]
    x = images.reshape([images.shape[0]] + shape)
    x = (x / np.float32(args.divide_by) - np.float32(args.mean)) / np.float32(args.stddev)
    predictions = np.concatenate([np.argmax(forward(layers, tensors, x[i:i + 500]), axis=1)
                                  for i in range(0, x.shape[0], 500)])
    accuracy = float(np.mean(predictions == labels))
    with_parameters = [name for name, kind, _ in layers
                       if kind in ("dense", "conv2d", "batch_norm")]
    print(json.dumps({"accuracy": accuracy, "examples": int(labels.shape[0]),
                      "tensors": with_parameters, "metadata": metadata}))
    if args.expect is not None and abs(accuracy - args.expect) > args.tolerance:
        print(f"accuracy {accuracy:.6f} differs from the reported {args.expect:.6f} by more than "
              f"{args.tolerance}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
