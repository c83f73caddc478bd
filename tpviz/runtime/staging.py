"""Reads into GPU tensors through pinned host buffers, double-buffered.

A staged read is cut into chunks (`reads.staged_chunks`); each chunk is read from the page
cache into the next of two pinned buffers, then copied to the device on a side stream with
`non_blocking=True`, so the read of chunk i+1 runs on the CPU while the DMA engine copies
chunk i. `reads.StagingRing` decides which buffer a chunk takes and when the copy out of it
must have ended (its CUDA event); the forecast runs the same ring over byte counts, so the
ledger sees the chunks in flight exactly as forecast.
"""

from __future__ import annotations

import torch

from ..checkpoint import BlockReader, TensorInfo
from ..strategies import Ledger
from ..strategies.reads import STAGING_CHUNK_BYTES, STAGING_SLOTS, Read, StagingRing, staged_chunks


class PinnedStager:
    """Double-buffered host-to-device staging for one rank's load on a CUDA device."""

    def __init__(self, device: torch.device, ledger: Ledger, reader: BlockReader) -> None:
        self.device = device
        self.ledger = ledger
        self.reader = reader
        self.stream = torch.cuda.Stream(device)
        self._buffers: list[torch.Tensor | None] = [None] * STAGING_SLOTS
        self._ring: StagingRing[tuple[torch.cuda.Event, int]] = StagingRing(self._retire)

    def stage(self, dest: torch.Tensor, read: Read, info: TensorInfo) -> None:
        """Fill `dest[read.target]` (on the device) from the checkpoint, chunk by chunk."""
        itemsize = info.torch_dtype.itemsize
        for chunk in staged_chunks(read, itemsize):
            nbytes = chunk.numel * itemsize
            buffer = self._buffer(self._ring.slot(), nbytes)
            offset, shape = chunk.saved_box
            staged = buffer[:nbytes].view(info.torch_dtype).view(shape)
            self.ledger.alloc(nbytes)
            self.reader.read_block(info, offset, shape, staged)
            # the destination was allocated on the current stream: order the copy after it
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                dest[chunk.target].copy_(chunk.placed(staged), non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.stream)
            self._ring.hold((done, nbytes))

    def finish(self) -> None:
        """Wait for every copy, and make the current stream see the loaded tensors."""
        self._ring.drain()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self._buffers = [None] * STAGING_SLOTS

    def _retire(self, held: tuple[torch.cuda.Event, int]) -> None:
        done, nbytes = held
        done.synchronize()
        self.ledger.free(nbytes)

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        """Slot `slot`'s pinned buffer, made (or grown, for a row over the chunk size) on
        first need; its previous chunk is retired already."""
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < nbytes:
            size = max(nbytes, STAGING_CHUNK_BYTES)
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            self._buffers[slot] = buffer
        return buffer
