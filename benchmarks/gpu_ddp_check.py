"""GPU check of the DDP timing boundary (one GPU, NCCL world of one, no Horovod).

On CUDA the host reaches the last gradient bucket long before the device has computed
it, so a host-only timer measures launch time. DDPOmniLearnCallback's hook waits for
the compute stream at the last bucket; its local time must therefore follow the
device work. For two workloads (the same MLP at batch b and 4b) this script compares
the ratio of the times omnihvd measures with the ratio CUDA events measure on the
compute stream, and with a host-only timer (perf_counter, no synchronisation), and
checks that SyncBatchNorm is refused (the error names the layer's class). Passes when
omnihvd's ratio is within 10% of the events' ratio and the layer is refused. The
host-only ratio is printed for comparison only: once omnihvd's hook waits for the
compute stream at the last bucket, ``backward()`` itself returns after the device
work, so a timer around it follows the device too (it did on an H200, 2026-12-04).
About a minute on one GPU::

    .venv/bin/python benchmarks/gpu_ddp_check.py     # prints GPU-DDP-CHECK {json}

Exit status: 0 PASS, 1 FAIL, 2 no CUDA device (nothing was checked).
"""
import json
import os
import sys
import time

sys.modules["horovod"] = None  # the DDP path must not need Horovod

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import omnihvd  # noqa: E402

STEPS, WIDTH = 40, 4096


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(6) for m in (torch.nn.Linear(WIDTH, WIDTH),
                                                               torch.nn.ReLU())]).cuda()


def measure(batch):
    model = torch.nn.parallel.DistributedDataParallel(net(), device_ids=[0])
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    cb = omnihvd.DDPOmniLearnCallback(model, global_batch_size=batch, adjust_every=10 ** 9,
                                      settle_steps=0)
    x = torch.randn(batch, WIDTH, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host, device, local = [], [], []
    cb.on_train_begin()
    for step in range(STEPS):
        torch.cuda.synchronize()  # a clean start per step, outside every timed interval
        cb.on_batch_begin()
        t0 = time.perf_counter()
        start.record()
        opt.zero_grad()
        model(x).square().mean().backward()
        end.record()
        host.append(time.perf_counter() - t0)  # launch time only: no synchronisation
        opt.step()
        cb.on_batch_end()
        end.synchronize()
        device.append(start.elapsed_time(end) / 1000.0)
        local.append(float("nan") if cb.last_step_time is None else cb.last_step_time)
    cb.on_train_end()
    skip = 5  # warm-up: allocator, cuBLAS heuristics, DDP's bucket rebuild
    med = lambda v: sorted(v[skip:])[len(v[skip:]) // 2]  # noqa: E731
    return {"host_s": med(host), "device_s": med(device), "omnihvd_s": med(local)}


def main():
    if not torch.cuda.is_available():
        print("gpu_ddp_check: no CUDA device is available here; this check needs one GPU "
              "(nothing was checked)")
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29731")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    small, large = measure(512), measure(2048)
    ratio = {k: large[k] / small[k] for k in small}
    refused = False
    try:
        bn = torch.nn.SyncBatchNorm.convert_sync_batchnorm(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))).cuda()
        omnihvd.DDPOmniLearnCallback(torch.nn.parallel.DistributedDataParallel(bn, device_ids=[0]),
                                     global_batch_size=8)
    except omnihvd.ConfigError as exc:
        refused = "SyncBatchNorm" in str(exc)
    ok = abs(ratio["omnihvd_s"] / ratio["device_s"] - 1) <= 0.10 and refused
    print("GPU-DDP-CHECK " + json.dumps({"small": small, "large": large, "ratio": ratio,
                                         "syncbn_refused": refused, "ok": ok,
                                         "gpu": torch.cuda.get_device_name(0)}), flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
