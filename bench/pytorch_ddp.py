#!/usr/bin/python3
"""PyTorch DistributedDataParallel reference for the end-to-end benchmark (bench/e2e_bench.sh).

What a user would pick instead of a parameter server on one host: `--trainers` processes with
torch.nn.parallel.DistributedDataParallel over gloo (127.0.0.1, port picked at run time), each
computing the gradient of its own batch; DDP all-reduces (averages) the gradients in buckets
during backward and every process steps its own Adam. Same model (--model), batch, optimizer,
learning rate, data split, shuffling and thread count as bench/pytorch_rpc_ps.py (whose `load`
and `make_model` it uses). Rank 0 scores the test split at every epoch end, outside the timed training.

  /usr/bin/python3 bench/pytorch_ddp.py --epochs 2 --trainers 2

prints one JSON line: samples_per_second (all trainers, training time only), time_to_target
(training seconds to the first epoch-end evaluation at or above --target, or null), per-epoch
test accuracy, and rank 0's mean seconds per step in compute (forward and backward, the
all-reduce included, since DDP overlaps it with backward) and in the optimizer step.

Benchmark reference only: nothing in Tessera depends on PyTorch.
"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_rpc_ps import arguments, free_port, load, make_model  # noqa: E402


def run(rank, world, args, port, out_path):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(args.seed)  # the same initial model on every rank (DDP broadcasts rank 0's)
    model = DistributedDataParallel(make_model(args.model))
    torch.manual_seed(args.seed + rank)  # dropout masks of their own, as the RPC trainers draw
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    train_x, train_y = load("train")
    shard = torch.arange(rank, len(train_y), world)
    x, y = train_x[shard], train_y[shard]
    steps_per_epoch = (len(train_y) // world) // args.batch_size
    test_x, test_y = load("t10k") if rank == 0 else (None, None)
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
    compute = step_time = train_seconds = 0.0
    steps = 0
    history = []
    time_to_target = None
    for epoch in range(args.epochs):
        order = torch.randperm(len(y), generator=generator)
        dist.barrier()
        start = time.perf_counter()
        for s in range(steps_per_epoch):
            if args.max_steps and steps == args.max_steps:
                break
            idx = order[s * args.batch_size:(s + 1) * args.batch_size]
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=False)
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            t1 = time.perf_counter()
            optimizer.step()
            t2 = time.perf_counter()
            compute += t1 - t0
            step_time += t2 - t1
            steps += 1
        dist.barrier()
        train_seconds += time.perf_counter() - start
        if rank == 0:
            model.eval()
            with torch.no_grad():
                out = model.module(test_x)
                acc = (out.argmax(1) == test_y).float().mean().item()
                test_loss = nn.functional.cross_entropy(out, test_y).item()
            model.train()
            history.append({"epoch": epoch + 1, "test_accuracy": acc, "test_loss": test_loss,
                            "elapsed_seconds": train_seconds})
            if time_to_target is None and args.target > 0 and acc >= args.target:
                time_to_target = train_seconds
        if args.max_steps and steps == args.max_steps:
            break
    if rank == 0:
        report = {
            "system": "pytorch-ddp", "model": args.model, "trainers": world,
            "epochs": args.epochs,
            "batch_size": args.batch_size, "steps_per_trainer": steps,
            "samples_per_second": world * steps * args.batch_size / train_seconds,
            "train_seconds": train_seconds, "history": history, "time_to_target": time_to_target,
            "test_accuracy": history[-1]["test_accuracy"], "test_loss": history[-1]["test_loss"],
            "compute_per_step": compute / steps, "optimizer_per_step": step_time / steps,
            "torch": torch.__version__}
        with open(out_path, "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


def main():
    p = arguments(__doc__.split("\n")[0])
    args = p.parse_args()
    if args.trainers < 1 or args.epochs < 1 or args.batch_size < 1 or args.threads < 1:
        p.error("--trainers, --epochs, --batch-size and --threads must be at least 1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    out_path = f"/tmp/pytorch_ddp.{os.getpid()}.json"
    mp.spawn(run, args=(args.trainers, args, free_port(), out_path), nprocs=args.trainers,
             join=True)
    with open(out_path) as f:
        print(f.read())
    os.unlink(out_path)


if __name__ == "__main__":
    main()
