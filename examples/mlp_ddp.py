"""Demo: train a small MLP with DDP on 2 CPU processes, from one decorated function.

    make demo            # or: PYTHONPATH=src python examples/mlp_ddp.py

Every rank trains on its shard of a synthetic regression problem; DDP averages gradients
over gloo; each rank logs its loss to the call's MLflow run and returns its final loss and a
checksum of its parameters (equal on every rank: that is what DDP guarantees).
"""

from __future__ import annotations

import os

from gangrun import distributed


@distributed(processes=2, timeout=600)
def train(epochs: int = 5, lr: float = 0.05, hidden: int = 64) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gangrun

    dist.init_process_group(gangrun.backend())
    rank, world = dist.get_rank(), dist.get_world_size()
    device = gangrun.device()
    torch.manual_seed(0)  # same init everywhere (DDP also broadcasts rank 0's weights)

    # synthetic data: y = sin(x0) + x1^2, sharded by rank
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(4096, 8, generator=g)
    y = (torch.sin(x[:, 0]) + x[:, 1] ** 2).unsqueeze(1)
    x, y = x[rank::world].to(device), y[rank::world].to(device)

    model = DDP(nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 1)).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    track = "MLFLOW_RUN_ID" in os.environ
    if track:
        import mlflow

    loss = torch.tensor(0.0)
    for epoch in range(epochs):
        for i in range(0, len(x), 128):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x[i : i + 128]), y[i : i + 128])
            loss.backward()
            opt.step()
        print(f"epoch {epoch}: loss {loss.item():.4f}")
        if track:
            mlflow.log_metric(f"loss_rank{rank}", loss.item(), step=epoch)
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    dist.destroy_process_group()
    return {"rank": rank, "final_loss": round(loss.item(), 4), "param_checksum": checksum}


def main() -> None:
    handle = train.submit(epochs=5)
    results = handle.result()
    print("\nResults, one per rank:")
    for r in results:
        print(f"  {r}")
    assert len({round(r["param_checksum"], 6) for r in results}) == 1, "ranks disagree"
    run_id = handle.mlflow_run_id
    if run_id:
        from mlflow.tracking import MlflowClient

        client = MlflowClient()
        run = client.get_run(run_id)
        print(f"\nMLflow run {run_id}: status {run.info.status}")
        for key in sorted(run.data.metrics):
            hist = client.get_metric_history(run_id, key)
            print(f"  {key}: " + ", ".join(f"{m.value:.4f}" for m in hist))
        print(f"  params: {dict(sorted(run.data.params.items()))}")


if __name__ == "__main__":
    main()
