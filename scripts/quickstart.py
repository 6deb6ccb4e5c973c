"""Register a model 4x larger than a simulated GPU, access every param, print memory stats.

python scripts/quickstart.py
"""

import json

import torch
from torch import nn

import hybridps


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(16)])  # 1.05 M params
    config = hybridps.Config(devices={"cuda:0": "2MiB"}, precision="fp32", grad_reuse=False)
    with hybridps.Client(config) as client:
        client.register_module(model)
        for p in list(model.parameters()) + list(model.parameters())[::-1]:
            client.access(p)
            client.release(p, hybridps.TensorState.HOLD)
        print(json.dumps(client.memory_stats(), indent=2))


if __name__ == "__main__":
    main()
