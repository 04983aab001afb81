#!/usr/bin/python3
"""PyTorch parameter-server reference for the end-to-end benchmark (bench/e2e_bench.sh).

The pattern of PyTorch's "Implementing Batch RPC Processing Using Asynchronous Executions"
tutorial (the batch-updating parameter server): `--trainers` trainer processes each compute the
gradient of one batch, send it to one parameter-server process with torch.distributed.rpc, and
block; once every trainer's gradient has arrived the server averages them, steps Adam and returns
the fresh model to all of them. Same MLP as examples/fashion_mlp.textproto (784-256-128-100-10,
ReLU; with --model cnn the CNN of examples/fashion_cnn.textproto), batch 64 per trainer, Adam 1e-3, inputs divided by 255, each trainer on its own half of
the training split, reshuffled every epoch. Everything on 127.0.0.1 (TensorPipe over libuv, port
picked at run time). The server scores the test split at every epoch end.

  /usr/bin/python3 bench/pytorch_rpc_ps.py --epochs 2 --trainers 2

prints one JSON line: samples_per_second (all trainers, training time only), time_to_target
(wall seconds from the first step to the first epoch-end evaluation at or above --target, or
null), per-epoch test accuracy, and each trainer's mean seconds per step in compute (forward and
backward) and in the RPC (push, wait for the other trainers, pull).

Benchmark reference only: nothing in Tessera depends on PyTorch.
"""
import argparse
import gzip
import json
import os
import socket
import threading
import time

import numpy as np
import torch
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
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
    return torch.from_numpy(images.reshape(len(labels), -1)), torch.from_numpy(labels)


def make_model(kind="mlp"):
    """The MLP of examples/fashion_mlp.textproto, or the CNN of examples/fashion_cnn.textproto."""
    if kind == "cnn":
        return nn.Sequential(nn.Unflatten(1, (1, 28, 28)),
                             nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(3136, 1024), nn.ReLU(), nn.Dropout(0.4),
                             nn.Linear(1024, 10))
    return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                         nn.Linear(128, 100), nn.ReLU(), nn.Linear(100, 10))


class BatchUpdateParameterServer:
    def __init__(self, trainers, steps_per_epoch, lr, target, kind):
        self.model = make_model(kind)
        self.lock = threading.Lock()
        self.future_model = torch.futures.Future()
        self.trainers = trainers
        self.pending = 0
        self.updates = 0
        self.steps_per_epoch = steps_per_epoch
        self.target = target
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)
        self.test_x, self.test_y = load("t10k")
        self.start = None
        self.history = []
        self.time_to_target = None

    def get_model(self):
        if self.start is None:
            self.start = time.perf_counter()
        return self.model

    def evaluate(self):
        self.model.eval()
        with torch.no_grad():
            out = self.model(self.test_x)
        self.model.train()
        with torch.no_grad():
            loss = nn.functional.cross_entropy(out, self.test_y).item()
            acc = (out.argmax(1) == self.test_y).float().mean().item()
        return acc, loss

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref, grads):
        self = ps_rref.local_value()
        with self.lock:
            self.pending += 1
            for p, g in zip(self.model.parameters(), grads):
                p.grad += g
            fut = self.future_model
            if self.pending >= self.trainers:
                for p in self.model.parameters():
                    p.grad /= self.trainers
                self.pending = 0
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                self.updates += 1
                if self.updates % self.steps_per_epoch == 0:
                    acc, loss = self.evaluate()
                    elapsed = time.perf_counter() - self.start
                    self.history.append({"epoch": self.updates // self.steps_per_epoch,
                                         "test_accuracy": acc, "test_loss": loss,
                                         "elapsed_seconds": elapsed})
                    if self.time_to_target is None and self.target > 0 and acc >= self.target:
                        self.time_to_target = elapsed
                fut.set_result(self.model)
                self.future_model = torch.futures.Future()
        return fut

    def report(self):
        acc, loss = self.evaluate()
        return {"history": self.history, "time_to_target": self.time_to_target,
                "test_accuracy": acc, "test_loss": loss, "updates": self.updates}


def run_trainer(ps_rref, rank, trainers, epochs, steps_per_epoch, batch, seed, max_steps):
    torch.manual_seed(seed + rank)
    train_x, train_y = load("train")
    shard = torch.arange(rank, len(train_y), trainers)
    x, y = train_x[shard], train_y[shard]
    model = ps_rref.rpc_sync().get_model()
    compute = comm = 0.0
    steps = 0
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    for _ in range(epochs):
        if max_steps and steps == max_steps:
            break
        order = torch.randperm(len(y), generator=generator)
        for s in range(steps_per_epoch):
            if max_steps and steps == max_steps:
                break
            idx = order[s * batch:(s + 1) * batch]
            t0 = time.perf_counter()
            model.zero_grad(set_to_none=False)
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            t1 = time.perf_counter()
            model = rpc.rpc_sync(ps_rref.owner(),
                                 BatchUpdateParameterServer.update_and_fetch_model,
                                 args=(ps_rref, [p.grad for p in model.parameters()]))
            t2 = time.perf_counter()
            compute += t1 - t0
            comm += t2 - t1
            steps += 1
    seconds = time.perf_counter() - start
    return {"rank": rank, "steps": steps, "samples": steps * batch, "seconds": seconds,
            "compute_per_step": compute / steps, "rpc_per_step": comm / steps}


def run(rank, world, args, port, out_path):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(args.threads)
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=600,
                                              _transports=["uv"], _channels=["basic"])
    name = "ps" if rank == 0 else f"trainer{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=options)
    if rank == 0:
        trainers = world - 1
        n_train = 60000
        steps_per_epoch = (n_train // trainers) // args.batch_size
        ps_rref = rpc.RRef(BatchUpdateParameterServer(trainers, steps_per_epoch, args.lr,
                                                      args.target, args.model))
        futs = [rpc.rpc_async(f"trainer{r}", run_trainer,
                              args=(ps_rref, r - 1, trainers, args.epochs, steps_per_epoch,
                                    args.batch_size, args.seed, args.max_steps))
                for r in range(1, world)]
        results = [f.wait() for f in futs]
        report = ps_rref.local_value().report()
        samples = sum(r["samples"] for r in results)
        seconds = max(r["seconds"] for r in results)
        report.update({
            "system": "pytorch-rpc-ps", "model": args.model, "trainers": trainers,
            "epochs": args.epochs,
            "batch_size": args.batch_size, "steps_per_trainer": results[0]["steps"],
            "samples_per_second": samples / seconds, "train_seconds": seconds,
            "compute_per_step": sum(r["compute_per_step"] for r in results) / trainers,
            "rpc_per_step": sum(r["rpc_per_step"] for r in results) / trainers,
            "torch": torch.__version__})
        with open(out_path, "w") as f:
            json.dump(report, f)
    rpc.shutdown()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def arguments(description=None):
    """The options both PyTorch references take (this one and bench/pytorch_ddp.py)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--target", type=float, default=0.85)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp",
                   help="examples/fashion_mlp.textproto's MLP or examples/fashion_cnn.textproto's CNN")
    p.add_argument("--max-steps", type=int, default=0,
                   help="stop each trainer after this many steps (0: every step of --epochs)")
    return p


def main():
    args = arguments().parse_args()
    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    out_path = f"/tmp/pytorch_rpc_ps.{os.getpid()}.json"
    world = args.trainers + 1
    mp.spawn(run, args=(world, args, free_port(), out_path), nprocs=world, join=True)
    with open(out_path) as f:
        print(f.read())
    os.unlink(out_path)


if __name__ == "__main__":
    main()
