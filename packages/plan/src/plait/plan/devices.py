"""The devices a plan is read against: peak dense bf16 and float8 throughput, memory and link bandwidth.

Vendor figures, stated with every plan as assumptions (a real step reaches a fraction of them):
H100 SXM and H200 SXM both peak at 989 TFLOP/s dense bf16 and 1979 dense float8, have NVLink 4 at 450 GB/s per direction
inside an 8-GPU node and, typically, one 400 Gb/s InfiniBand NIC (50 GB/s) per GPU between nodes.
"""

from dataclasses import dataclass

GB = 10**9
GIB = 2**30


@dataclass(frozen=True)
class Device:
    name: str
    bf16_tflops: float  # dense, no sparsity
    memory_gb: float  # decimal GB as sold
    nvlink_gb_s: float  # per GPU per direction, inside a node
    ib_gb_s: float  # per GPU per direction, between nodes
    fp8_tflops: float = 0.0  # dense float8 (training.float8's matmuls)
    gpus_per_node: int = 8

    @property
    def memory_gib(self) -> float:
        return self.memory_gb * GB / GIB

    def assumptions(self) -> str:
        return (f"{self.name}: {self.bf16_tflops:g} TFLOP/s dense bf16 ({self.fp8_tflops:g} float8), "
                f"{self.memory_gb:g} GB, NVLink "
                f"{self.nvlink_gb_s:g} GB/s per direction within {self.gpus_per_node} GPUs, InfiniBand "
                f"{self.ib_gb_s:g} GB/s per GPU between nodes; ring collectives, no latency, perfect overlap "
                "for the ideal time")


DEVICES = {
    "h100": Device("H100 SXM", 989.0, 80.0, 450.0, 50.0, fp8_tflops=1979.0),
    "h200": Device("H200 SXM", 989.0, 141.0, 450.0, 50.0, fp8_tflops=1979.0),
}


def link_gb_s(device: Device, rank_span: int) -> float:
    """Bandwidth of a group whose ranks span `rank_span` consecutive global ranks: NVLink when it
    stays inside one node (ranks are numbered node by node), InfiniBand otherwise."""
    return device.nvlink_gb_s if rank_span <= device.gpus_per_node else device.ib_gb_s
