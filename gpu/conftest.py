"""The GPU suite's fixtures: the device under test, the GPU count, and the `cuda_only` marker.

`python gpu/run.py` runs on CUDA. `python gpu/run.py --dry-run-cpu` runs the same tests on the CPU
(the reference paths, with every `cuda_only` test skipped) so the suite's own code is exercised by
machines without a GPU; it proves nothing about the CUDA kernels.
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist


def pytest_addoption(parser):
    parser.addoption("--dry-run-cpu", action="store_true", help="run on the CPU, skipping cuda_only tests")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda_only: needs a real CUDA device (skipped in the CPU dry run)")


def _dry_run(config) -> bool:
    return config.getoption("--dry-run-cpu")


def pytest_collection_modifyitems(config, items):
    if not _dry_run(config):
        return
    skip = pytest.mark.skip(reason="CPU dry run: needs CUDA")
    for item in items:
        if "cuda_only" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device(request) -> torch.device:
    if _dry_run(request.config):
        return torch.device("cpu")
    assert torch.cuda.is_available(), "the GPU suite needs CUDA (or --dry-run-cpu)"
    return torch.device("cuda")


@pytest.fixture(scope="session")
def n_gpus(request) -> int:
    return 0 if _dry_run(request.config) else torch.cuda.device_count()


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
    yield
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode(0)  # a failed test must not leave "error" on for the next


@pytest.fixture(scope="session")
def one_rank_mesh(device):
    """A 1-rank process group and its 1-D device mesh on the suite's backend (NCCL on CUDA, gloo on
    the dry run): the collectives' CUDA code paths without a second GPU."""
    from torch.distributed.device_mesh import init_device_mesh

    backend = "nccl" if device.type == "cuda" else "gloo"
    if dist.is_initialized():
        if dist.get_world_size() != 1 or dist.get_backend() != backend:
            pytest.skip(f"a {dist.get_backend()} group of {dist.get_world_size()} is already initialised")
        yield init_device_mesh(device.type, (1,))
        return
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        kwargs = {"device_id": torch.device("cuda", torch.cuda.current_device())} if backend == "nccl" else {}
        dist.init_process_group(backend, store=store, rank=0, world_size=1, **kwargs)
        try:
            yield init_device_mesh(device.type, (1,))
        finally:
            dist.destroy_process_group()
