#!/usr/bin/python3
"""PyTorch reference for the standalone training benchmark (bench/train_bench.sh).

Trains the same models as examples/fashion_mlp.textproto and examples/fashion_cnn.textproto
(same layers, batch size, optimizer and learning rate, inputs divided by 255) on Fashion-MNIST and
prints one JSON line. Uses Debian's python3-torch (CPU); run it with /usr/bin/python3.

  pytorch_reference.py --model mlp --threads 1 --steps 600       # throughput
  pytorch_reference.py --model mlp --threads 1 --epochs 15 --target-accuracy 0.883

This is a benchmark reference only; nothing in Tessera depends on PyTorch.
"""
import argparse
import gzip
import json
import time

import numpy as np
import torch
from torch import nn

DATA = "/usr/share/datasets/fashion-mnist/"


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load(split):
    images = read_idx(DATA + f"{split}-images-idx3-ubyte.gz").astype(np.float32) / 255.0
    labels = read_idx(DATA + f"{split}-labels-idx1-ubyte.gz").astype(np.int64)
    return torch.from_numpy(images).reshape(-1, 1, 28, 28), torch.from_numpy(labels)


def make_model(kind):
    if kind == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128),
                             nn.ReLU(), nn.Linear(128, 100), nn.ReLU(), nn.Linear(100, 10))
    return nn.Sequential(nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(7 * 7 * 64, 1024), nn.ReLU(), nn.Dropout(0.4),
                         nn.Linear(1024, 10))


def evaluate(model, images, labels, batch=1000):
    model.eval()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for i in range(0, len(labels), batch):
            out = model(images[i:i + batch])
            loss += nn.functional.cross_entropy(out, labels[i:i + batch], reduction="sum").item()
            correct += (out.argmax(1) == labels[i:i + batch]).sum().item()
    model.train()
    return correct / len(labels), loss / len(labels)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=0, help="time this many steps (throughput)")
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--epochs", type=int, default=0, help="train whole epochs with evaluation")
    p.add_argument("--target-accuracy", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    train_x, train_y = load("train")
    test_x, test_y = load("t10k")
    dev = torch.device(args.device)
    train_x, train_y, test_x, test_y = (t.to(dev) for t in (train_x, train_y, test_x, test_y))
    model = make_model(args.model).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    n = len(train_y)
    gen = torch.Generator().manual_seed(args.seed)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def step(idx):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(train_x[idx]), train_y[idx])
        loss.backward()
        opt.step()
        return loss

    result = {"framework": "pytorch", "version": torch.__version__, "model": args.model,
              "device": args.device,
              "threads": args.threads, "batch_size": args.batch_size}
    if args.steps > 0:
        order = torch.randperm(n, generator=gen).to(dev)
        bs = args.batch_size
        batches = [order[(i * bs) % (n - bs):(i * bs) % (n - bs) + bs]
                   for i in range(args.warmup_steps + args.steps)]
        for idx in batches[:args.warmup_steps]:
            step(idx)
        sync()
        start = time.perf_counter()
        for idx in batches[args.warmup_steps:]:
            step(idx)
        sync()
        seconds = time.perf_counter() - start
        result.update(steps=args.steps, seconds=seconds,
                      samples_per_second=args.steps * bs / seconds)
    if args.epochs > 0:
        history, train_seconds = [], 0.0
        start_all = time.perf_counter()
        for epoch in range(args.epochs):
            order = torch.randperm(n, generator=gen).to(dev)
            start = time.perf_counter()
            for i in range(0, n, args.batch_size):
                step(order[i:i + args.batch_size])
            sync()
            train_seconds += time.perf_counter() - start
            acc, loss = evaluate(model, test_x, test_y)
            history.append({"epoch": epoch + 1, "test_accuracy": acc, "test_loss": loss,
                            "train_seconds": train_seconds,
                            "elapsed_seconds": time.perf_counter() - start_all})
            if args.target_accuracy > 0 and acc >= args.target_accuracy:
                break
        result.update(epochs=len(history), history=history,
                      test_accuracy=history[-1]["test_accuracy"],
                      samples_per_second=len(history) * n / train_seconds)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
