"""Step time of training.loss = chunked against full on the CPU, both compiled (issue 54).

    python benchmarks/bench_chunked_loss.py                       # Llama 3 debug dims, vocab 32768
    python benchmarks/bench_chunked_loss.py --vocab 2048 --seq 256

plait-train's own step (Trainer.train_step, one process, training.compile = true: the blocks and the
loss compiled; under chunked the head's chunked loss) on the Llama 3 debug model with a vocabulary
large enough for the loss to matter. The two settings alternate in rounds (this CPU is shared),
each round timing `--steps` steps after warm-up; the median step of each is reported, and their
ratio (the target: chunked <= 1.05 x full).
"""

import argparse
import statistics
import tempfile
import time

import torch

from plait.trainer.config import build_config, load_toml
from plait.trainer.train import Trainer


def _trainer(dump: str, loss: str, args) -> Trainer:
    toml = load_toml("llama3_debugmodel.toml")
    toml["job"] = {"dump_folder": dump}
    toml["model"] = {**toml["model"], "vocab_size": args.vocab, "n_layers": args.layers}
    toml["training"] = {**toml["training"], "seq_len": args.seq, "local_batch_size": args.batch, "compile": True,
                        "loss": loss, "loss_chunk_tokens": args.chunk}  # fmt: skip
    toml["metrics"] = {"cpu_peak_tflops": 0.1}
    return Trainer(build_config(toml))


def _batch(args):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    return [(tokens[:, :-1], tokens[:, 1:])]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--chunk", type=int, default=0, help="training.loss_chunk_tokens (0: auto)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    batch = _batch(args)
    times = {"full": [], "chunked": []}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {loss: _trainer(f"{tmp}/{loss}", loss, args) for loss in times}
        for trainer in trainers.values():
            for _ in range(2):  # compile, then one warm step
                trainer.train_step(batch)
        for _ in range(args.rounds):
            for loss, trainer in trainers.items():
                for _ in range(args.steps):
                    start = time.perf_counter()
                    trainer.train_step(batch)
                    times[loss].append(time.perf_counter() - start)
    median = {loss: statistics.median(t) for loss, t in times.items()}
    tokens = args.batch * args.seq
    print(f"Llama 3 debug, {args.layers} layers, vocab {args.vocab}, {args.batch} x {args.seq} tokens, "
          f"chunk {args.chunk or 'auto'}, compiled, {torch.get_num_threads()} threads")
    for loss, m in median.items():
        print(f"  {loss:8s} median step {m * 1e3:8.1f} ms  ({tokens / m:8.0f} tokens/s, {len(times[loss])} steps)")
    print(f"  chunked / full = {median['chunked'] / median['full']:.3f}")


if __name__ == "__main__":
    main()
