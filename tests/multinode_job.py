"""One rank of the several-node tests, launched by torchrun (one agent per "node" on this
machine, each node with its own hybridps-manager). Writes ``<out>/<rank>.json``: losses,
what the node daemon booked, the chunks this rank owns, the state at the save; or the error
this rank ended with."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import hybridps  # noqa: E402
from hybridps.client.remote import query_status  # noqa: E402
from tests.training import SMALL_GPT, gpt_pair, model_data_bytes, tokens  # noqa: E402

GLOBAL_BATCH = 4


def state_digest(engine) -> str:
    """A digest of the whole model's weights (every rank computes it, rank 0's is kept)."""
    h = hashlib.sha256()
    for key, value in sorted(engine.state_dict().items()):
        h.update(key.encode())
        h.update(value.detach().cpu().float().numpy().tobytes())
    return h.hexdigest()


def train(engine, rank: int, world: int, start: int, steps: int) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        x, y = tokens(step, batch=GLOBAL_BATCH)
        _, loss = engine(x[rank::world], y[rank::world])
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        engine.step()
        engine.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--mode", choices=("train", "resume", "kill"), required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--timeout-s", type=float, default=60.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rank, local_rank, world = hybridps.init_distributed("gloo", timeout_s=args.timeout_s)
    out = Path(args.out) / f"{rank}.json"
    result: dict = {"rank": rank, "local_rank": local_rank, "world": world}
    try:
        model, _ = gpt_pair()
        config = hybridps.Config(
            manager=args.endpoint or None,
            devices={"cuda:local": int(model_data_bytes(SMALL_GPT) * 0.3), "cpu": "1GiB"},
            collective_timeout_s=args.timeout_s,
        )
        engine = hybridps.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), config)
        client = engine.client
        result.update(
            shard_size=client.shard_size,
            owned=[i for i in range(client.store.num_chunks) if client.owns(i)],
            endpoint=args.endpoint,
        )
        if args.mode == "resume":
            engine.load_checkpoint(args.ckpt)
            result["digest"] = state_digest(engine)
        else:
            result["losses"] = train(engine, rank, world, 0, args.steps)
            if args.mode == "kill":
                if rank == world - 1:
                    os._exit(17)  # this rank dies between two steps; the others are in the next one
                time.sleep(0.5)
                result["losses"] += train(engine, rank, world, args.steps, 2)
            else:
                torch.distributed.barrier()
                if local_rank == 0:  # this node's daemon, while every rank holds its chunks
                    result["status"] = query_status(args.endpoint)
                torch.distributed.barrier()
                result["holdings"] = {k: v for k, v in client.connection.holdings.items() if v}
                engine.save_checkpoint(args.ckpt)
                result["digest"] = state_digest(engine)
        engine.close()
        result["ok"] = True
    except BaseException as exc:  # the test reads what each rank ended with
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
        out.write_text(json.dumps(result))
        return 1
    out.write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
