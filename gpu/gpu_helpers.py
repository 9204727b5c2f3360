"""What several GPU-suite files share: CUDA's own host-sync detector, counted per entry."""

import warnings

import torch


class CudaSyncs:
    """`torch.cuda.set_sync_debug_mode(mode)` around each entry on CUDA ("error": raise at the first
    synchronizing call, naming it; "warn": count them); a no-op on the CPU dry run. It also serves as
    a trainer's `step_sentinel` (`step_counts()`), e.g. around compiled steps, which the sentinel's
    function wrappers would not survive."""

    def __init__(self, device: torch.device | str = "cuda", mode: str = "warn"):
        self.device, self.mode = torch.device(device), mode
        self.syncs: list[int] = []  # per entry
        self.messages: list[str] = []

    @property
    def count(self) -> int:
        return self.syncs[-1] if self.syncs else 0

    def step_counts(self) -> list[tuple[int, int]]:
        return [(n, 0) for n in self.syncs]

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self._catch = warnings.catch_warnings(record=True)
            self._caught = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(self.mode)
        return self

    def __exit__(self, *exc):
        messages = []
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
            messages = [str(w.message) for w in self._caught if "synchroniz" in str(w.message)]
            self._catch.__exit__(*exc)
        self.syncs.append(len(messages))
        self.messages += messages
