#!/usr/bin/env python3
"""Scores an exported Tessera MLP on an IDX test set, independently of Tessera's own code.

Reads the safetensors file by hand (8-byte little-endian header length, JSON header, raw
little-endian data), reads the gzip IDX images and labels, and runs the multi-layer perceptron
forward with numpy: for each dense layer in order, y = x @ kernel.T + bias (Tessera's Dense
kernel is [out, in]), with ReLU between layers, then argmax. Prints one JSON line
{"accuracy": ..., "examples": ..., "tensors": [...]}.

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


def dense_layers(tensors):
    """[(kernel, bias)] in layer order: dense_1, dense_2, ... by their number."""
    names = {}
    for name in tensors:
        m = re.fullmatch(r"(.+)/(kernel|bias)", name)
        if not m:
            raise ValueError(f"unexpected tensor {name}: this scorer handles dense MLPs only")
        names.setdefault(m.group(1), {})[m.group(2)] = tensors[name]

    def order(layer):
        m = re.search(r"(\d+)$", layer)
        return (int(m.group(1)) if m else 0, layer)

    layers = []
    for layer in sorted(names, key=order):
        parts = names[layer]
        if set(parts) != {"kernel", "bias"} or parts["kernel"].ndim != 2:
            raise ValueError(f"{layer}: expected a 2-D kernel and a bias")
        layers.append((layer, parts["kernel"], parts["bias"]))
    return layers


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
    layers = dense_layers(tensors)
    images = read_idx(args.images)
    labels = read_idx(args.labels).astype(np.int64)
    x = images.reshape(images.shape[0], -1).astype(np.float32)
    x = (x / np.float32(args.divide_by) - np.float32(args.mean)) / np.float32(args.stddev)
    for i, (name, kernel, bias) in enumerate(layers):
        if x.shape[1] != kernel.shape[1]:
            raise ValueError(f"{name}: kernel {kernel.shape} does not take {x.shape[1]} inputs")
        x = x @ kernel.T + bias
        if i + 1 < len(layers):
            x = np.maximum(x, 0)
    predictions = np.argmax(x, axis=1)
    accuracy = float(np.mean(predictions == labels))
    print(json.dumps({"accuracy": accuracy, "examples": int(labels.shape[0]),
                      "tensors": [name for name, _, _ in layers], "metadata": metadata}))
    if args.expect is not None and abs(accuracy - args.expect) > args.tolerance:
        print(f"accuracy {accuracy:.6f} differs from the reported {args.expect:.6f} by more than "
              f"{args.tolerance}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
