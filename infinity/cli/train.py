"""`infinity train`: the default job trains the small GPT on the bundled corpus with ZeRO-3 and offload."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

DEFAULT_CONFIG = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
    "scheduler": {
        "type": "WarmupCosineLR",
        "params": {"total_num_steps": 300, "warmup_num_steps": 30, "warmup_type": "linear", "cos_min_ratio": 0.1},
    },
    "zero_optimization": {
        "stage": 3,
        "block_classes": ["Block"],
        "offload_param": {"device": "cpu"},
        "offload_optimizer": {"device": "cpu"},
    },
    "steps_per_print": 10,
}


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="a DeepSpeed-style JSON config (default: the built-in one)")
    parser.add_argument("--model", default="small", help="GPT preset: tiny, small, 110m, 1b, 3b, 7b, 13b")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--save-dir", default="runs/default", help="where the final weights are written")
    parser.add_argument("--seed", type=int, default=1234)


def run_train(args: argparse.Namespace) -> int:
    import infinity
    from infinity.data.corpus import ByteBatches, load_corpus
    from infinity.models.gpt import GPT, gpt_preset

    torch.set_flush_denormal(True)
    if args.config:
        config = json.loads(Path(args.config).read_text())
    else:
        config = json.loads(json.dumps(DEFAULT_CONFIG))
        config["scheduler"]["params"].update(total_num_steps=args.steps, warmup_num_steps=max(1, args.steps // 10))
    torch.manual_seed(args.seed)
    model = GPT(gpt_preset(args.model, block_size=args.seq))
    engine, _, _, _ = infinity.initialize(model=model, config=config)
    rank, world = engine.comm.rank, engine.comm.world_size
    micro = engine.config.train_micro_batch_size_per_gpu
    data = ByteBatches(load_corpus("train"), micro, args.seq, seed=args.seed, rank=rank, world_size=world)
    n_params = sum(f.numel for f in engine.flats)
    if rank == 0:
        print(
            f"infinity: GPT '{args.model}' {n_params / 1e6:.2f}M parameters, {world} rank(s), "
            f"{engine.config.zero_optimization.offload_param.device} params / "
            f"{engine.config.zero_optimization.offload_optimizer.device} optimizer, {args.steps} steps"
        )
    tokens_per_step = engine.config.train_batch_size * args.seq
    first_loss = last_loss = None
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        for _ in range(engine.gradient_accumulation_steps):
            x, y = next(data)
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        last_loss = loss.item()
        first_loss = last_loss if first_loss is None else first_loss
        if rank == 0 and (step % engine.config.steps_per_print == 0 or step == args.steps):
            elapsed = time.perf_counter() - start
            print(
                f"step {step:5d}/{args.steps}  loss {last_loss:.4f}  lr {engine.get_lr()[0]:.2e}  "
                f"{step * tokens_per_step / elapsed:,.0f} tokens/s",
                flush=True,
            )
    state = engine.full_state_dict()
    if rank == 0:
        out = Path(args.save_dir)
        out.mkdir(parents=True, exist_ok=True)
        torch.save(state, out / "model.pt")
        print(f"loss {first_loss:.4f} -> {last_loss:.4f}; weights written to {out / 'model.pt'}")
    return 0
