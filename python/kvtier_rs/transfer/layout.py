"""Where an engine keeps its KV blocks, described by data rather than code.

A block's bytes on the device are one or more *regions*: each region is a tensor whose dim 0 is
the block id, and one block's chunk in it starts at `offset_bytes` into the row and is
`bytes_per_block` long; rows are `block_stride_bytes` apart. In a host slot, the regions' chunks
are laid end to end in region order. This covers per-layer tensors (one region per layer, or
two per layer when K and V are separate), a single pool tensor (one region, or one per layer
with a layer offset), and packed rows whose stride exceeds the chunk (vLLM's canonical caches).

A host slot may also hold several device blocks (`blocks_per_slot` > 1, e.g. vLLM's
`blocks_per_chunk`): sub-block j of a slot puts region r's chunk at
`host_offsets[r] + j * sub_block_strides[r]`. Both default so that each region gets an area of
`blocks_per_slot` chunks end to end, areas in region order; with one block per slot that is the
plain end-to-end layout above. Explicit `host_offsets` also describe padded host layouts (an
engine whose slot reserves more bytes per region than it copies).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier_rs.checks import integer, invalid_argument
from kvtier_rs.tiers.keys import index_list


def _refuse_repeats(values: Sequence, arg: str, what: str) -> None:
    """Two copies to one destination would leave one of them silently lost (the last wins)."""
    if len(set(values)) != len(values):
        twice = sorted(v for v, n in Counter(values).items() if n > 1)
        raise invalid_argument(arg, f"{what} {twice[:5]} named more than once")


@dataclass(frozen=True)
class Region:
    tensor: torch.Tensor
    bytes_per_block: int
    block_stride_bytes: int
    offset_bytes: int = 0

    def __post_init__(self) -> None:
        # Checked (and stored as plain ints) at construction, so every consumer (BlockLayout's
        # bounds checks, both engines' address arithmetic) sees exact integers. offset_bytes
        # first: `rows_of` derives bytes_per_block from it, and the error should name the
        # argument the caller actually got wrong.
        for name in ("offset_bytes", "block_stride_bytes", "bytes_per_block"):
            object.__setattr__(self, name, integer(getattr(self, name), name))

    @staticmethod
    def rows_of(tensor: torch.Tensor, *, offset_bytes: int = 0, bytes_per_block: int | None = None) -> Region:
        """A region over whole rows of `tensor` (dim 0 = block id; each row contiguous)."""
        if tensor.dim() < 1:
            raise invalid_argument("tensor", "needs a block dimension (dim 0)")
        offset_bytes = integer(offset_bytes, "offset_bytes")
        elem = tensor.element_size()
        row = tensor[0] if tensor.shape[0] else tensor.new_empty(tensor.shape[1:])
        if tensor.shape[0] and not row.is_contiguous():
            raise invalid_argument("tensor", "each block row (tensor[i]) must be contiguous")
        row_bytes = row.numel() * elem
        return Region(
            tensor=tensor,
            bytes_per_block=row_bytes - offset_bytes if bytes_per_block is None else bytes_per_block,
            block_stride_bytes=tensor.stride(0) * elem,
            offset_bytes=offset_bytes,
        )

    def storage_bytes(self) -> tuple[torch.Tensor, int]:
        """The tensor's whole storage as a flat uint8 tensor (no copy), and the byte offset of
        block 0's chunk in it; block b's chunk starts `b * block_stride_bytes` further on."""
        t = self.tensor
        base = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        return base, int(t.storage_offset()) * t.element_size() + self.offset_bytes

    def byte_rows(self) -> torch.Tensor:
        """A uint8 view (num_blocks, bytes_per_block) over this region's chunks (no copy)."""
        base, start = self.storage_bytes()
        return base.as_strided((self.tensor.shape[0], self.bytes_per_block), (self.block_stride_bytes, 1), start)

    def data_ptr(self) -> int:
        """Address of block 0's chunk."""
        return self.tensor.data_ptr() + self.offset_bytes


def _check_region(i: int, r: Region) -> None:
    """Region `i`'s chunks: non-empty, not overlapping the next row, inside the tensor's storage."""
    if r.bytes_per_block <= 0:
        raise invalid_argument(f"regions[{i}]", "bytes_per_block must be positive")
    if r.offset_bytes < 0 or r.block_stride_bytes < r.offset_bytes + r.bytes_per_block and r.tensor.shape[0] > 1:
        raise invalid_argument(
            f"regions[{i}]",
            f"chunk [{r.offset_bytes}, +{r.bytes_per_block}) overlaps the next row (stride {r.block_stride_bytes})",
        )
    end = r.tensor.storage_offset() * r.tensor.element_size() + r.offset_bytes
    end += (r.tensor.shape[0] - 1) * r.block_stride_bytes + r.bytes_per_block
    if r.tensor.shape[0] and end > r.tensor.untyped_storage().nbytes():
        raise invalid_argument(f"regions[{i}]", "chunks run past the tensor's storage")


class BlockLayout:
    """The device-side layout of KV blocks: ordered regions and where each lands in a host slot."""

    def __init__(
        self,
        regions: Sequence[Region],
        *,
        blocks_per_slot: int = 1,
        host_offsets: Sequence[int] | None = None,
        sub_block_strides: Sequence[int] | None = None,
    ) -> None:
        if not regions:
            raise invalid_argument("regions", "at least one region is needed")
        devices = {r.tensor.device for r in regions}
        if len(devices) != 1:
            raise invalid_argument("regions", f"all on one device, got {sorted(map(str, devices))}")
        counts = {r.tensor.shape[0] for r in regions}
        if len(counts) != 1:
            raise invalid_argument("regions", f"block counts differ: {sorted(counts)}")
        for i, r in enumerate(regions):
            _check_region(i, r)
        self.regions = tuple(regions)
        self.num_blocks = counts.pop()
        self.device = devices.pop()
        blocks_per_slot = integer(blocks_per_slot, "blocks_per_slot")
        if blocks_per_slot < 1:
            raise invalid_argument("blocks_per_slot", f"must be a positive int, got {blocks_per_slot!r}")
        self.blocks_per_slot = blocks_per_slot
        #: Bytes moved per device block (all regions' chunks).
        self.bytes_per_block = sum(r.bytes_per_block for r in self.regions)
        strides = (
            [r.bytes_per_block for r in self.regions]
            if sub_block_strides is None
            else index_list(sub_block_strides, "sub_block_strides", "sub-block stride")
        )
        if len(strides) != len(self.regions):
            raise invalid_argument("sub_block_strides", f"{len(strides)} values for {len(self.regions)} regions")
        if host_offsets is None:
            offs, acc = [], 0
            for r, st in zip(self.regions, strides, strict=True):
                offs.append(acc)
                acc += st * (blocks_per_slot - 1) + r.bytes_per_block
        else:
            offs = index_list(host_offsets, "host_offsets", "host offset")
            if len(offs) != len(self.regions):
                raise invalid_argument("host_offsets", f"{len(offs)} values for {len(self.regions)} regions")
        for i, (r, off, st) in enumerate(zip(self.regions, offs, strides, strict=True)):
            if off < 0:
                raise invalid_argument(f"host_offsets[{i}]", f"must not be negative, got {off}")
            if blocks_per_slot > 1 and st < r.bytes_per_block:
                raise invalid_argument(
                    f"sub_block_strides[{i}]",
                    f"{st} is less than the region's {r.bytes_per_block} bytes per block (sub-blocks would overlap)",
                )
        self.host_offsets = tuple(offs)
        self.sub_block_strides = tuple(strides)
        #: Bytes a host slot must have to hold every region's chunks of every sub-block.
        self.slot_extent = max(
            off + st * (blocks_per_slot - 1) + r.bytes_per_block
            for r, off, st in zip(self.regions, offs, strides, strict=True)
        )
        self._check_host_overlap()

    def _check_host_overlap(self) -> None:
        """Two (region, sub-block) chunks may not share host bytes: a store would mix them."""
        spans = sorted(
            (off + j * st, off + j * st + r.bytes_per_block, i)
            for i, (r, off, st) in enumerate(zip(self.regions, self.host_offsets, self.sub_block_strides, strict=True))
            for j in range(self.blocks_per_slot)
        )
        for (_, end, i), (start, _, k) in zip(spans, spans[1:], strict=False):
            if start < end:
                raise invalid_argument("host_offsets", f"the host chunks of regions {i} and {k} overlap")

    def host_address(self, region: int, slot_base: int, sub_block: int = 0) -> int:
        """Where region `region`'s chunk of sub-block `sub_block` starts, given its slot's address."""
        return slot_base + self.host_offsets[region] + sub_block * self.sub_block_strides[region]

    def check_sub_blocks(self, sub_blocks: Sequence[int]) -> None:
        bad = [j for j in sub_blocks if not 0 <= j < self.blocks_per_slot]
        if bad:
            raise invalid_argument("sub_blocks", f"{bad[:5]} outside 0..{self.blocks_per_slot} (blocks_per_slot)")

    @classmethod
    def per_layer(cls, tensors: Sequence[torch.Tensor]) -> BlockLayout:
        """One region per tensor, whole rows (e.g. vLLM CPU caches [blocks, heads, tokens, 2*dim])."""
        return cls([Region.rows_of(t) for t in tensors])

    @classmethod
    def kv_split(cls, tensors: Sequence[torch.Tensor]) -> BlockLayout:
        """Per-layer tensors shaped [2, blocks, ...] (K and V apart): two regions per layer."""
        regions = []
        for t in tensors:
            if t.dim() < 2 or t.shape[0] != 2:
                raise invalid_argument("tensors", f"expected [2, blocks, ...], got {tuple(t.shape)}")
            regions += [Region.rows_of(t[0]), Region.rows_of(t[1])]
        return cls(regions)

    def check_regions(self, regions) -> list[int]:
        """Validate a subset of region indices (sorted, unique, in range); returns it as a list."""
        picked = index_list(regions, "regions", "region")
        if not picked or picked != sorted(set(picked)) or not 0 <= picked[0] <= picked[-1] < len(self.regions):
            raise invalid_argument(
                "regions", f"{picked[:8]} must be sorted, unique indices in 0..{len(self.regions) - 1}"
            )
        return picked

    def region_bytes(self, regions=None) -> int:
        """Bytes per block of the given regions (all when None)."""
        if regions is None:
            return self.bytes_per_block
        return sum(self.regions[r].bytes_per_block for r in regions)

    def check_block_ids(self, block_ids: Sequence[int], arg: str = "block_ids", *, distinct: bool = False) -> None:
        """Refuse ids outside the layout and, with `distinct` (a load), ids named twice: two
        blocks copied to one destination would leave one of them silently lost."""
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise invalid_argument(arg, f"{bad[:5]} outside 0..{self.num_blocks - 1}")
        if distinct:
            _refuse_repeats(block_ids, arg, "device blocks")

    def check_host_destinations(
        self, slots: Sequence[int], sub_blocks: Sequence[int] | None = None, arg: str = "slots"
    ) -> None:
        """Refuse a store that names one host position twice, for the reason `check_block_ids`
        refuses a load naming one device block twice. A position is a slot, or a (slot,
        sub-block) pair when a slot holds several blocks: different sub-blocks of one slot are
        different bytes (`_check_host_overlap`), and so are different slots (an engine refuses a
        pool whose slots are smaller than `slot_extent`), so equal positions are exactly the
        copies that would land on the same bytes. `sub_blocks` None means sub-block 0 for all."""
        if self.blocks_per_slot == 1:
            _refuse_repeats(slots, arg, "host slots")
        else:
            positions = list(zip(slots, sub_blocks or [0] * len(slots), strict=True))
            _refuse_repeats(positions, f"{arg}` / `sub_blocks", "host (slot, sub-block) positions")

    def __repr__(self) -> str:
        return (
            f"BlockLayout(regions={len(self.regions)}, num_blocks={self.num_blocks}, "
            f"bytes_per_block={self.bytes_per_block}, blocks_per_slot={self.blocks_per_slot}, device={self.device})"
        )
