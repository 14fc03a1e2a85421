"""CUDA-graph capture and replay of whole engine steps, one graph per shape.

A step launches about a hundred kernels; replaying a captured graph removes
their launch cost, which otherwise makes every step host-bound. A graph reads
and writes fixed addresses, so the caller keeps its inputs in static buffers
and pads each step up to a captured shape (ridge/engine/graphs.py decides the
shapes and the padding; this module only captures and replays).

Rules:
  - Capture needs the Triton kernels: the torch references plan on host lists
    and copy them to the device, which a graph cannot record.
  - Each shape is warmed up eagerly first (lazy initialisation, kernel
    tuning), then captured; all graphs share one memory pool, largest first,
    so they cost about one step's activations in all.
  - The output of a replay is a view of the pool, overwritten by the next
    replay: consume it (in stream order) before replaying again."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True, order=True)
class GraphShape:
    kind: str  # "decode": every sequence adds one token; "mixed": any step
    size: int  # sequences (decode) or tokens (mixed)


def ladder(limit: int, dense: tuple[int, ...], step: int) -> list[int]:
    """Sizes to capture: the dense small ones, then every multiple of `step`, then limit."""
    sizes = [s for s in dense if s <= limit] + list(range(step, limit + 1, step))
    return sorted(set(sizes + [limit]))


class GraphPool:
    def __init__(self, device: torch.device):
        self.device = device
        self.graphs: dict[GraphShape, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphShape, torch.Tensor] = {}

    @torch.inference_mode()
    def capture(self, shapes: list[GraphShape], warm: Callable[[GraphShape], None],
                step: Callable[[GraphShape], torch.Tensor]) -> None:
        """warm(shape) fills the static inputs with valid values for an eager warm-up;
        step(shape) runs the step on the static inputs and returns its output."""
        pool = torch.cuda.graph_pool_handle()
        for shape in sorted(shapes, key=lambda s: (s.kind != "mixed", -s.size)):
            warm(shape)
            step(shape)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[shape] = step(shape)
            self.graphs[shape] = graph
        torch.cuda.synchronize(self.device)

    def replay(self, shape: GraphShape) -> torch.Tensor:
        self.graphs[shape].replay()
        return self.outputs[shape]
