"""What drawing a user's batch_sampler's epoch up front costs, next to Accelerate's BatchSamplerShard.

Both iterate the whole batch sampler once per epoch on every rank; ours also keeps the epoch's batches (the
position is a step in that list) and deals them for all ranks. Run side by side in one process:

    python benchmarks/bench_batch_sampler.py [--samples 1000000] [--batch-size 32] [--world 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import torch
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler, RandomSampler

from accelerate_stateful.position._deal import deal, rank_batches
from accelerate_stateful.loaders.batchsampler import draw_batches


def best_of(rounds: int, fn) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sampler = BatchSampler(RandomSampler(range(args.samples), generator=torch.Generator().manual_seed(0)),
                           args.batch_size, drop_last=False)

    def accelerate_epoch() -> None:
        for _ in BatchSamplerShard(sampler, args.world, 0):
            pass

    def ours_epoch() -> None:
        steps = deal(draw_batches(sampler, 0, 1), world_size=args.world, split_batches=False, even_batches=True,
                     drop_last=False, batch_size=args.batch_size)
        for _ in rank_batches(steps, 0):
            pass

    base = best_of(args.rounds, accelerate_epoch)
    ours = best_of(args.rounds, ours_epoch)
    tracemalloc.start()
    kept = deal(draw_batches(sampler, 0, 1), world_size=args.world, split_batches=False, even_batches=True,
                drop_last=False, batch_size=args.batch_size)
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    print(f"| samples | world | BatchSamplerShard, one epoch | ours: draw + deal + iterate | ratio | kept |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(f"| {args.samples:,} | {args.world} | {base * 1e3:.0f} ms | {ours * 1e3:.0f} ms | {ours / base:.2f}x | "
          f"{memory / 2**20:.0f} MiB ({len(kept)} steps) |")


if __name__ == "__main__":
    main()
