"""CudaRegion: GPU memory of this process shared with a server on the same host by its CUDA IPC
handle, for tensors passed by reference with no host copy at all (RegisterCudaRegion):

    region = CudaRegion.create("gpu-io", 1 << 20, device=0)       # torch memory on cuda:0
    client.register_cuda_region(region.name, region.raw_handle, region.device,
                                region.byte_size, region.offset)
    queries = region.write(q_bf16_cuda_tensor, offset=0)             # a TensorRef
    outputs = region.output_refs(4096, n, h, topk, pages_per_block)  # all three outputs
    selection = client.select_blocks("s1", queries, outputs=outputs).read(region)

Needs torch with CUDA. What the server requires of tensors in CUDA regions: bf16 keys and
queries at offsets that are multiples of 16, the three output references together, and the
sequence on the region's GPU (the GPU's server ordinal: with CUDA_VISIBLE_DEVICES the two
processes may number GPUs differently). Keep the region (and so its tensor) alive until the
server has unregistered it. Not thread-safe.
"""
import numpy as np

from indexer_client.refs import ITEM_DTYPES, OutputRefs, RegionRef, TensorRef

_INPUT_ALIGNMENT = 16
_INT32 = ITEM_DTYPES["int32"].itemsize
_IPC_HANDLE_BYTES = 64


def _cuda_ipc_handle(shared: bytes) -> bytes:
    """cudaIpcMemHandle_t's 64 bytes out of torch's shared handle: the bare handle, or (recent
    torch) a version byte, a kind byte and the handle; "c" is cudaMalloc memory, "e" an
    expandable segment, which is not shared by a CUDA IPC handle."""
    if len(shared) == _IPC_HANDLE_BYTES:
        return shared
    if len(shared) == _IPC_HANDLE_BYTES + 2 and shared[1:2] == b"c":
        return shared[2:]
    if len(shared) >= 2 and shared[1:2] == b"e":
        raise ValueError("the tensor is in an expandable segment, which has no CUDA IPC handle: "
                         "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False")
    raise ValueError(f"torch's shared handle has {len(shared)} bytes, not a CUDA IPC handle")


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("CudaRegion needs torch with CUDA") from e
    return torch


class CudaRegion:
    """A contiguous uint8 CUDA tensor, shared by its IPC handle, and `name`, the caller's name
    for it on servers. raw_handle, device, offset and byte_size are what register_cuda_region
    takes: torch's caching allocator hands out parts of larger allocations, so the region is
    `byte_size` bytes at `offset` of the allocation the handle names."""

    def __init__(self, name: str, tensor):
        torch = _torch()
        if not tensor.is_cuda or tensor.dtype != torch.uint8 or not tensor.is_contiguous():
            raise ValueError("a CudaRegion is a contiguous torch.uint8 tensor on a CUDA device")
        self.name = name
        self.tensor = tensor
        storage = tensor.untyped_storage()
        shared = storage._share_cuda_()
        self.device = int(shared[0])
        self.raw_handle = _cuda_ipc_handle(bytes(shared[1]))
        self.offset = int(shared[3]) + tensor.storage_offset()
        self.byte_size = tensor.numel()

    @classmethod
    def create(cls, name: str, byte_size: int, device: int = 0) -> "CudaRegion":
        """byte_size zeroed bytes of fresh memory on cuda:`device`."""
        torch = _torch()
        return cls(name, torch.zeros(byte_size, dtype=torch.uint8, device=f"cuda:{device}"))

    def ref(self, offset: int, byte_size: int) -> RegionRef:
        """A reference to byte_size bytes at `offset`; ValueError past the region's end."""
        self._check_range(offset, byte_size)
        return RegionRef(self.name, offset, byte_size)

    def write(self, tensor, offset: int = 0) -> TensorRef:
        """Stores `tensor` (a torch tensor on any device, or what numpy takes) at `offset` (a
        multiple of 16) as bf16, row-major: a copy on the GPU for a CUDA tensor. Returns the
        TensorRef to pass instead of the tensor."""
        torch = _torch()
        if offset % _INPUT_ALIGNMENT:
            raise ValueError(f"offset {offset} is not a multiple of {_INPUT_ALIGNMENT}; keys and "
                             "queries in a CUDA region must be")
        if not isinstance(tensor, torch.Tensor):
            tensor = torch.from_numpy(np.ascontiguousarray(tensor, dtype=np.float32))
        values = tensor.to(device=self.tensor.device, dtype=torch.bfloat16).contiguous()
        size = values.numel() * 2
        self._check_range(offset, size)
        self.tensor[offset:offset + size].copy_(values.view(-1).view(torch.uint8))
        return TensorRef(self.name, offset, tuple(values.shape), "bf16")

    def read(self, ref: TensorRef) -> np.ndarray:
        """A host copy of the tensor `ref` names: int32 as int32, bf16 as float32."""
        torch = _torch()
        if ref.region != self.name:
            raise ValueError(f"the reference names region {ref.region!r}; this is {self.name!r}")
        self._check_range(ref.offset, ref.byte_size)
        raw = self.tensor[ref.offset:ref.offset + ref.byte_size]
        if ref.dtype == "int32":
            return raw.view(torch.int32).cpu().numpy().reshape(ref.shape)
        if ref.dtype == "bf16":
            return raw.view(torch.bfloat16).float().cpu().numpy().reshape(ref.shape)
        return raw.view(torch.float32).cpu().numpy().reshape(ref.shape)

    def output_refs(self, offset: int, num_tokens: int, num_heads: int, topk: int,
                    pages_per_block: int) -> OutputRefs:
        """OutputRefs for a selection of num_tokens x num_heads x topk, laid out from `offset`
        (4-byte aligned): block_ids, page_table (pages_per_block: the server's), context_lens.
        A CUDA region takes all three, even for sequences without attention pages (whose
        page_table and context_lens are left untouched)."""
        if offset % _INT32:
            raise ValueError(f"offset {offset} is not 4-byte aligned; outputs are int32")
        rows = num_tokens * num_heads
        block_ids = self.ref(offset, rows * topk * _INT32)
        page_table = self.ref(block_ids.end, rows * topk * max(pages_per_block, 1) * _INT32)
        return OutputRefs(block_ids, page_table, self.ref(page_table.end, rows * _INT32))

    def _check_range(self, offset: int, size: int) -> None:
        if offset < 0 or size < 0 or offset + size > self.byte_size:
            raise ValueError(f"{size} bytes at offset {offset} do not fit region {self.name!r} "
                             f"of {self.byte_size} bytes")
